"""The ``eval`` node: which lm-evaluation-harness tasks a run scores and when, checked before any rank starts."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disttrain.errors import ConfigError

METRIC_PREFIX = "eval/"
"""Logged task scores are named ``eval/<task>/<metric>`` (``/<filter>`` added for a filter other than none)."""
SCORED_MODELS = ("hf",)
"""The models whose tasks are scored: ``transformers`` models, which the harness's model class wraps."""
DEFAULT_FEWSHOT_SEED = 1234
"""lm-evaluation-harness's own default seed of the few-shot sampler (``lm_eval.defaults.DEFAULT_OTHER_SEED``)."""


@dataclass
class EvalConfig:
    """Tasks of lm-evaluation-harness scored on the model as it trains (``model=hf`` with a ``data.tokenizer``)."""

    tasks: list[str] = field(default_factory=list)
    """Task (or group) names of lm-evaluation-harness, its own or those of the YAML files under ``include_path``;
    empty: no task is scored."""
    every_n_steps: int | None = None
    """Score at the validations whose optimiser step is a multiple of n (validation runs as
    ``trainer.val_check_interval`` says); null: at every validation. The tasks are also scored at the end of
    training (where its last step was not) and, with ``trainer.validate_before_training``, before the first step."""
    include_path: str | None = None
    """A folder (or one file) of task YAML files to add to the harness's tasks, e.g. tasks over local JSONL data
    (``dataset_path: json`` with ``dataset_kwargs.data_files``)."""
    include_defaults: bool = True
    """Also index the harness's own tasks (thousands of YAML files: indexing them takes seconds on every rank; their
    data sets must already be in the ``datasets`` cache, since a run downloads nothing of its own accord)."""
    limit: float | None = None
    """Score only the first ``limit`` documents of each task (a number of them, or a fraction below 1); null: all."""
    num_fewshot: int | None = None
    """Few-shot examples put before each document; null: each task's own number (0 where it sets none)."""
    fewshot_seed: int = DEFAULT_FEWSHOT_SEED
    """Seed of the sampler that draws the few-shot examples (the harness's ``--seed`` fourth value)."""
    batch_size: int = 8
    """Requests per forward on each data-parallel rank."""
    write_samples: bool = False
    """Also write each scored document (its prompt, the model's responses, its metrics) to
    ``RUN/eval/step<N>-<task>.jsonl``."""

    @property
    def enabled(self) -> bool:
        """Whether any task is scored."""
        return bool(self.tasks)


def metric_name(task: str, key: str) -> str | None:
    """The logged name of the harness's result ``key`` (``acc,none``) of ``task``; None for what is no score (the
    standard errors, the alias)."""
    if "," not in key:
        return None
    metric, filtered = key.split(",", 1)
    if metric.endswith("_stderr"):
        return None
    return f"{METRIC_PREFIX}{task}/{metric}" + ("" if filtered == "none" else f"/{filtered}")


def check_eval(cfg: EvalConfig, model_name: str, tokenizer: str | None, layout: Any, kind: str,
               monitor: str | None) -> None:
    """ConfigError for an ``eval`` node that cannot be scored: tasks the harness does not know or whose data files
    are missing, a model or data without the harness's text interface, a layout whose forward is not the model's
    own, or a checkpoint monitor that names a score not measured at every validation."""
    if not cfg.enabled:
        if monitor and monitor.startswith(METRIC_PREFIX):
            raise ConfigError("checkpoint.monitor", monitor, "a metric the run logs: eval.tasks is empty, so no "
                              f"{METRIC_PREFIX}* score is measured")
        return
    check_scorable(cfg, model_name, tokenizer)
    if layout.pp > 1 or layout.cp > 1 or kind != "synchronous":
        raise ConfigError("eval.tasks", cfg.tasks, "[] under pipeline or context parallelism and kinds of run other "
                          "than synchronous (tasks are scored by the model's own forward on every rank); "
                          f"this run has pp={layout.pp}, cp={layout.cp}, kind {kind}")
    if monitor and monitor.startswith(METRIC_PREFIX):
        task = monitor[len(METRIC_PREFIX):].split("/", 1)[0]
        if task not in cfg.tasks:
            raise ConfigError("checkpoint.monitor", monitor, f"a score of a task in eval.tasks {cfg.tasks}")
        if cfg.every_n_steps is not None:
            raise ConfigError("checkpoint.monitor", monitor, "a score measured at every validation, which ranks "
                              f"checkpoints: eval.every_n_steps=null (it is {cfg.every_n_steps})")


def check_scorable(cfg: EvalConfig, model_name: str, tokenizer: str | None) -> None:
    """ConfigError for tasks that cannot be scored on this model and data: values out of range, a model other than
    ``model=hf`` or data without a tokenizer, tasks the harness does not
    know or whose data files are missing."""
    check_values(cfg)
    if model_name not in SCORED_MODELS:
        raise ConfigError("eval.tasks", cfg.tasks, f"[] unless the model is one of {list(SCORED_MODELS)} (the harness "
                          f"scores a transformers model; this run's model is {model_name})")
    if tokenizer is None:
        raise ConfigError("eval.tasks", cfg.tasks, "[] unless the data has a data.tokenizer folder (the harness "
                          "gives the model text)")
    check_tasks(cfg)


def check_values(cfg: EvalConfig) -> None:
    """The numbers of ``cfg`` are in range."""
    for key, value, least in (("every_n_steps", cfg.every_n_steps, 1), ("num_fewshot", cfg.num_fewshot, 0),
                              ("batch_size", cfg.batch_size, 1)):
        if value is not None and value < least:
            raise ConfigError(f"eval.{key}", value, f"{least} or more" + (", or null" if key != "batch_size" else ""))
    if cfg.limit is not None and (cfg.limit <= 0 or (cfg.limit > 1 and cfg.limit != int(cfg.limit))):
        raise ConfigError("eval.limit", cfg.limit, "a number of documents (1 or more), a fraction in (0, 1), or null")


def task_manager(cfg: EvalConfig) -> Any:
    """The harness's index of tasks that ``cfg`` asks for (its own where ``include_defaults``, and those under
    ``include_path``)."""
    from lm_eval.tasks import TaskManager

    path = None if cfg.include_path is None else str(Path(cfg.include_path).expanduser())
    return TaskManager(include_path=path, include_defaults=cfg.include_defaults)


def check_tasks(cfg: EvalConfig) -> None:
    """Every task of ``cfg.tasks`` is one the harness indexes, and the local data files its YAML names exist."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError("eval.tasks", cfg.tasks, "[] unless lm-evaluation-harness is installed (pip install "
                          "'disttrain[finetune]')") from None
    if cfg.include_path is not None and not Path(cfg.include_path).expanduser().exists():
        raise ConfigError("eval.include_path", cfg.include_path, "a folder or file of task YAML files (there is "
                          "nothing there)")
    if not cfg.include_path and not cfg.include_defaults:
        raise ConfigError("eval.include_defaults", False, "true unless eval.include_path names task YAML files")
    index = task_manager(cfg).task_index
    for name in cfg.tasks:
        entry = index.get(name)
        if entry is None:
            raise ConfigError("eval.tasks", name,
                              f"a task of lm-evaluation-harness{_where(cfg)}; {_close(name, index)}")
        missing = missing_data_file(entry.cfg or {})
        if missing is not None:
            raise ConfigError("eval.tasks", name, f"a task whose data files exist: {missing} does not (the "
                              f"dataset_kwargs.data_files of {entry.yaml_path})")


def _where(cfg: EvalConfig) -> str:
    here = f" under eval.include_path={cfg.include_path}" if cfg.include_path else ""
    return ("" if not here else f" or one{here}") if cfg.include_defaults else here


def _close(name: str, index: dict[str, Any]) -> str:
    """The few indexed names spelled like ``name``, and how many there are."""
    from difflib import get_close_matches

    close = get_close_matches(name, list(index), n=4)
    return (f"close to it: {', '.join(close)}" if close else "none is close to it") + f" ({len(index)} indexed)"


def missing_data_file(task: dict[str, Any]) -> str | None:
    """The first local data file a task's YAML names (``dataset_kwargs.data_files``: a path, a list or a split
    mapping, glob patterns allowed) that matches nothing; None where all exist or it names none."""
    files = (task.get("dataset_kwargs") or {}).get("data_files")
    if files is None:
        return None
    groups = files.values() if isinstance(files, dict) else [files]
    for group in groups:
        for path in [group] if isinstance(group, str) else list(group):
            expanded = os.path.expanduser(str(path))
            if not (os.path.exists(expanded) or glob.glob(expanded)):
                return str(path)
    return None
