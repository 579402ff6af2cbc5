"""A finished run's model, rebuilt from its ``config.yaml`` and loaded with a checkpoint's consolidated weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from disttrain.data.spec import DataSpec
from disttrain.errors import ConfigError
from disttrain.generate.codec import Codec, codec_for

LAST = "last"
"""``--checkpoint`` for the newest save: ``RUN_DIR/checkpoints/last.ckpt``."""
BEST = "best"
"""``--checkpoint`` for the best save by the validation metric, as ``results.json`` records it."""


@dataclass
class LoadedRun:
    """A run's model with its weights, ready to generate."""

    model: nn.Module
    """The bare model in eval mode, its weights from ``checkpoint``."""
    spec: DataSpec
    """The data's shape: its vocabulary and block size (the model's context)."""
    codec: Codec
    """Text to the data's tokens and back."""
    checkpoint: Path
    """The checkpoint folder the weights came from."""


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a sharded checkpoint folder."""
    return (path / ".metadata").is_file()


def _best(run_dir: Path) -> Path | None:
    """The best checkpoint ``results.json`` names, looked up in this run directory's ``checkpoints`` first (the
    directory may have moved since), None where the run ranked none."""
    results = run_dir / "results.json"
    if not results.is_file():
        return None
    recorded = json.loads(results.read_text()).get("best_checkpoint")
    if not recorded:
        return None
    here = run_dir / "checkpoints" / Path(recorded).name
    return here if is_checkpoint(here) else Path(recorded)


def choose_checkpoint(run_dir: Path, choice: str | None) -> Path:
    """The checkpoint folder that ``choice`` (best, last, a path; None: best where ranked, else last) names in
    ``run_dir``; ConfigError where there is none."""
    if choice is None:
        choice = BEST if _best(run_dir) is not None else LAST
    if choice == BEST:
        path = _best(run_dir)
        if path is None:
            raise ConfigError("--checkpoint", choice, f"last or a path: {run_dir / 'results.json'} names no best "
                              "checkpoint")
    elif choice == LAST:
        path = run_dir / "checkpoints" / "last.ckpt"
    else:
        path = Path(choice).expanduser()
    if not is_checkpoint(path):
        raise ConfigError("--checkpoint", choice, f"a checkpoint folder (there is none at {path})")
    return path


def load_run(run_dir: Path, checkpoint: str | None = None, device: str = "cpu") -> LoadedRun:
    """Validate ``run_dir``'s ``config.yaml``, build its model for its data and load the weights of
    ``checkpoint`` (see :func:`choose_checkpoint`) onto ``device``; ConfigError on anything missing."""
    from omegaconf import OmegaConf

    from disttrain.checkpoint.export import consolidated_weights
    from disttrain.config import validate
    from disttrain.models import build_model

    if not run_dir.is_dir():
        raise ConfigError("RUN_DIR", str(run_dir), "a run directory (there is no such directory)")
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise ConfigError("RUN_DIR", str(run_dir), "a run directory holding the config.yaml its run wrote")
    cfg = OmegaConf.load(config)
    run = validate(cfg, world_size=cfg.trainer.devices)
    spec = run.datamodule.spec
    codec = codec_for(run.data, spec)  # before building: data with no text is refused without a model's cost
    path = choose_checkpoint(run_dir, checkpoint)
    model = build_model(run.model, spec)
    if any(p.is_meta for p in model.parameters()):  # built to be filled from its starting weights: allocate it
        model.materialize(torch.device(device))
    try:
        model.load_state_dict(consolidated_weights(path), strict=True)
    except RuntimeError as err:
        raise ConfigError("--checkpoint", str(path), "a checkpoint of this run's model ("
                          f"{str(err).splitlines()[0]})") from None
    return LoadedRun(model.to(device).eval(), spec, codec, path)
