"""One measurement in a Python process of its own."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def in_fresh_process(measure: Callable[..., float], *args: Any, **kwargs: Any) -> float:
    """``measure(*args, **kwargs)`` in a new Python process: each side starts from a fresh allocator and fresh
    caches (the first run in a process measured up to 10% slower than the next), and a setting one side makes
    (disttrain's host-memory thresholds) stays out of the other side's process."""
    context = mp.get_context("spawn")
    answers = context.SimpleQueue()
    child = context.Process(target=_answer, args=(answers, measure, args, kwargs))
    child.start()
    child.join()
    if child.exitcode != 0 or answers.empty():
        raise RuntimeError(f"{measure.__name__} failed in its process (exit code {child.exitcode})")
    return answers.get()


def _answer(answers: Any, measure: Callable[..., float], args: tuple, kwargs: dict) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    answers.put(measure(*args, **kwargs))
