"""One evaluation of lm-evaluation-harness tasks through the harness's own ``evaluate``: the tasks loaded from its
index, their few-shot settings applied as its ``simple_evaluate`` applies them, the seeds it sets, and the scores
named for the run's metrics."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from disttrain.config.evaluation import EvalConfig, metric_name


@contextmanager
def seeded_as_the_harness() -> Iterator[None]:
    """Seed Python, NumPy and torch as ``simple_evaluate`` does, and give the run back its own random states after:
    a score in the middle of training changes neither its dropout nor anything else it draws."""
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED

    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        random.seed(DEFAULT_RANDOM_SEED)
        np.random.seed(DEFAULT_OTHER_SEED)
        torch.manual_seed(DEFAULT_OTHER_SEED)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


@contextmanager
def quiet_harness() -> Iterator[None]:
    """The harness's and ``datasets``' per-task log lines and progress bars off for the evaluation (a run prints
    its scores itself)."""
    import datasets

    logger = logging.getLogger("lm_eval")
    level, bars = logger.level, datasets.is_progress_bar_enabled()
    logger.setLevel(logging.ERROR)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def load_tasks(cfg: EvalConfig, manager: Any) -> dict[str, Any]:
    """The harness's tasks of ``cfg.tasks`` with ``cfg``'s few-shot number and seed, set as ``simple_evaluate``
    sets them (a task whose YAML fixes 0 examples keeps 0; one that sets none gets 0)."""
    loaded = manager.load(list(cfg.tasks))
    for task in loaded["tasks"].values():
        if cfg.num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=cfg.num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=cfg.fewshot_seed)
    return loaded


def score(lm: Any, cfg: EvalConfig, manager: Any) -> tuple[dict[str, float], dict[str, list[dict[str, Any]]]]:
    """Score ``cfg.tasks`` with ``lm`` (every rank calls this alike): the scores by logged name, and each task's
    scored documents where ``cfg.write_samples`` (else empty)."""
    from lm_eval.evaluator import evaluate

    limit = None if cfg.limit is None else (int(cfg.limit) if cfg.limit >= 1 else cfg.limit)
    with quiet_harness(), seeded_as_the_harness():
        results = evaluate(lm=lm, task_dict=load_tasks(cfg, manager), limit=limit, bootstrap_iters=0,
                           log_samples=cfg.write_samples)
    return scores_of(results), (results.get("samples") or {}) if cfg.write_samples else {}


def scores_of(results: dict[str, Any]) -> dict[str, float]:
    """The numeric scores of the harness's ``results`` (tasks and groups), by logged name."""
    scores = {}
    for section in ("results", "groups"):
        for task, values in (results.get(section) or {}).items():
            for key, value in values.items():
                name = metric_name(task, key)
                if name is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
                    scores[name] = float(value)
    return scores


def write_samples(folder: Path, step: int, samples: dict[str, list[dict[str, Any]]]) -> None:
    """Each task's scored documents as ``folder/step<step>-<task>.jsonl``."""
    folder.mkdir(parents=True, exist_ok=True)
    for task, rows in samples.items():
        with open(folder / f"step{step}-{task}.jsonl", "w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, default=str, ensure_ascii=False) + "\n")
