"""Data-parallel gradient exchange: what goes on the wire (``comm`` config group) and how many bytes it takes."""
