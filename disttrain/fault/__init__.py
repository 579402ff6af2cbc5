"""Fault tolerance: restarts, hang detection, preemption, non-finite steps and crash-consistent checkpoints."""
