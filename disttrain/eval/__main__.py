"""``python -m disttrain.eval RUN_OR_CHECKPOINT eval.tasks=[...]``: lm-evaluation-harness's scores of a run's
checkpoint, as a run scores its tasks.

A run directory stands for its best checkpoint where it ranked one, else its ``last.ckpt``; a checkpoint folder for
itself. The ``eval`` node is the run's own (``config.yaml``) with the ``eval.KEY=VALUE`` arguments over it. The
checkpoint is exported to Hugging Face's format in a temporary folder inside the run directory and scored there by
the harness's own ``hf`` model in this one process, the scores printed as one JSON object by their logged names
(``eval/<task>/<metric>``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn

from disttrain.errors import ConfigError


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(prog="python -m disttrain.eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, metavar="RUN_OR_CHECKPOINT",
                        help="a finished run's directory, or a checkpoint folder such as RUN/checkpoints/last.ckpt")
    parser.add_argument("overrides", nargs="*", metavar="eval.KEY=VALUE",
                        help="settings of the eval node over the run's own, e.g. eval.tasks=[sums] eval.limit=10")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the model runs (default cpu)")
    return parser.parse_args(argv)


def eval_config(run_cfg: Any, overrides: list[str]) -> Any:
    """The run's ``eval`` node with ``overrides`` (``eval.KEY=VALUE``) over it, typed; ConfigError for an override
    outside the node or a value of the wrong type."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from disttrain.config.evaluation import EvalConfig

    for item in overrides:
        if not item.startswith("eval.") or "=" not in item:
            raise ConfigError("override", item, "eval.KEY=VALUE, a setting of the eval node")
    node = OmegaConf.structured(EvalConfig)
    try:
        node = OmegaConf.merge(node, run_cfg.get("eval") or {}, OmegaConf.from_dotlist(overrides).get("eval", {}))
    except OmegaConfBaseException as err:
        raise ConfigError(f"eval.{err.key}" if getattr(err, "key", None) else "eval", getattr(err, "value", None),
                          f"a value the eval node takes ({' '.join(str(err).split()[:12])})") from None
    return OmegaConf.to_object(node)


def checkpoint_of(source: Path) -> tuple[Path, Path]:
    """The checkpoint folder and run directory that ``source`` names; ConfigError where there is none."""
    from disttrain.checkpoint.export import checkpoint_and_run_dir
    from disttrain.generate.loading import choose_checkpoint, is_checkpoint

    if is_checkpoint(source):
        return checkpoint_and_run_dir(source)
    if not (source / "config.yaml").is_file():
        raise ConfigError("RUN_OR_CHECKPOINT", str(source), "a run directory holding its config.yaml, or a "
                          "checkpoint folder")
    return choose_checkpoint(source, None), source


def scores(args: argparse.Namespace) -> tuple[Path, dict[str, float]]:
    """The checkpoint scored and its scores."""
    from omegaconf import OmegaConf

    from disttrain.checkpoint.export import export_hf
    from disttrain.config.evaluation import check_scorable, task_manager

    checkpoint, run_dir = checkpoint_of(args.source)
    run_cfg = OmegaConf.load(run_dir / "config.yaml")
    cfg = eval_config(run_cfg, args.overrides)
    if not cfg.enabled:
        raise ConfigError("eval.tasks", [], "one task or more (eval.tasks=[NAME,...])")
    check_scorable(cfg, str(run_cfg.model.get("name")), run_cfg.data.get("tokenizer"))
    import torch
    from lm_eval.models.huggingface import HFLM

    from disttrain.eval.scoring import score

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device", args.device, "cpu: no CUDA device is available here")
    with tempfile.TemporaryDirectory(dir=run_dir, prefix=".eval-") as folder:
        exported = export_hf(checkpoint, Path(folder) / "hf")
        lm = HFLM(pretrained=str(exported), device=args.device, dtype="float32", batch_size=cfg.batch_size)
        found, _ = score(lm, cfg, task_manager(cfg))
    return checkpoint, found


def main(argv: list[str] | None = None) -> None:
    """Print the scores; a bad input is one ``Error:`` line and exit status 2."""
    from disttrain.checkpoint.io import CheckpointReadError

    args = parse(argv)
    try:
        checkpoint, found = scores(args)
    except (ConfigError, CheckpointReadError, FileNotFoundError) as err:
        refuse(err)
    print(f"scores of {checkpoint}:", flush=True)
    print(json.dumps(found, indent=2))


def refuse(err: Exception) -> NoReturn:
    """Print ``err`` as one ``Error:`` line and exit with status 2."""
    print(f"Error: {err}", file=sys.stderr, flush=True)
    sys.exit(2)


if __name__ == "__main__":
    main()
