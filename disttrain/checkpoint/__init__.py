"""Checkpoints: sharded folders written and read safely, the optimiser state they hold under every layout,
which folder a run resumes from, and export to one consolidated file or a Hugging Face model folder."""
