"""Federated learning: simulated clients with their own data, rounds of local training and aggregation."""
