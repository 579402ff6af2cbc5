"""Export a sharded checkpoint to one consolidated weights file for inference.

    python -m disttrain.checkpoint.export RUN_DIR/checkpoints/last.ckpt model.pt

The output holds only the model's tensors (names as in the bare model, e.g. ``embed.wte.weight``) and loads
with ``torch.load(path, weights_only=True)`` into a model built from the run's ``config.yaml``.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch

TASK_PREFIX = "net."


def consolidated_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Read every rank's shard of the model from a checkpoint folder, in one process, as full tensors."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from disttrain.checkpoint.io import SafeFileSystemReader, load_index, reading

    if not (checkpoint / ".metadata").is_file():
        raise FileNotFoundError(f"{checkpoint} is not a sharded checkpoint folder (no .metadata inside)")
    with warnings.catch_warnings(), reading(checkpoint):  # loading without a process group is the intent here
        warnings.simplefilter("ignore", UserWarning)
        # replicas that differ (Local SGD, DiLoCo, an asynchronous parameter server) are kept each: take the first
        keys = load_index(checkpoint).state_dict_metadata
        replica = "replica0" if any(key.startswith("replica0.") for key in keys) else None
        state = _load_state_dict_from_keys(keys={replica or "state_dict"}, checkpoint_id=str(checkpoint),
                                           storage_reader=SafeFileSystemReader(str(checkpoint)))
    state = (state[replica] if replica else state)["state_dict"]
    return {key.removeprefix(TASK_PREFIX): value.contiguous() for key, value in state.items()}


def export(checkpoint: Path, output: Path) -> Path:
    """Write the consolidated weights of ``checkpoint`` to ``output`` (written beside it, then renamed)."""
    weights = consolidated_weights(checkpoint)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.with_name(output.name + ".partial")
    torch.save(weights, staging)
    staging.replace(output)
    return output


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a checkpoint folder, e.g. RUN/checkpoints/last.ckpt")
    parser.add_argument("output", type=Path, help="the weights file to write")
    args = parser.parse_args()
    path = export(args.checkpoint, args.output)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
