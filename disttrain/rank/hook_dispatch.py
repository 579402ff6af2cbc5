"""Cheaper bookkeeping around Lightning's hook calls, which run dozens of times per training step.

Lightning wraps every hook call (of the module, the strategy and each callback, whether or not it overrides the
hook) in its profiler's context and records the hook's name on the LightningModule before and after. With a
one-layer model those two costs were 0.12 ms of a 1.31 ms step (sampled with a profiler), more than its
optimiser step. It also calls every callback's per-batch hooks, the empty ones of Lightning's base class too.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.profilers import PassThroughProfiler

_NO_PROFILING = nullcontext()

TRAIN_STEP_HOOKS = ("on_train_batch_start", "on_before_zero_grad", "on_before_backward", "on_after_backward",
                    "on_before_optimizer_step", "on_train_batch_end")
"""The hooks Lightning calls once or more per training batch, on every callback and on the LightningModule."""
EVAL_BATCH_HOOKS = ("on_validation_batch_start", "on_validation_batch_end", "on_test_batch_start",
                    "on_test_batch_end")
"""The hooks it calls per evaluation batch; it also reads the signature of the LightningModule's own."""


class NoProfiler(PassThroughProfiler):
    """Lightning's default profiler (records nothing), without building a generator context per hook call."""

    def profile(self, action_name: str) -> Any:  # noqa: ARG002 - Lightning's signature
        """One shared null context: nothing to start or stop."""
        return _NO_PROFILING


class LeanHookBookkeeping:
    """Mixin for a LightningModule. Lightning sets ``_current_fx_name`` twice around every hook call, and
    ``nn.Module.__setattr__`` checks parameters, buffers and submodules each time; a string needs none of it.
    Lightning also inspects ``training_step``'s signature on every ``self.log`` during training (does it take the
    batch iterator?): derived afresh by ``inspect`` that took 35 us of a log's 154 (three logs at every epoch's end,
    six on a logged step), read from the ``__signature__`` that each class here declares, 14."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "training_step" in cls.__dict__:
            cls.training_step.__signature__ = inspect.signature(cls.training_step)  # type: ignore[attr-defined]

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_current_fx_name":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)


def skip_step_hooks_left_alone(callbacks: list[pl.Callback], task: pl.LightningModule) -> None:
    """Hide from Lightning each per-batch hook that a callback or the task inherits unchanged from Lightning's
    base class, where it does nothing.

    Lightning calls a hook only where the attribute is callable, so a hook set to None on the instance is skipped
    outright. A called empty hook still costs Lightning a profiler context, the callback's ``state_key`` (a
    checkpoint callback's formats its settings), the hook's name set twice and the call: ``overhead.py``'s run has
    ten callbacks, which took 60 hook calls per training step, of which nine did anything. A hook given on the
    instance (Lightning's ``LambdaCallback``) or overridden anywhere below the base class is left as it is.
    """
    for callback in callbacks:
        _hide_inherited(callback, pl.Callback, TRAIN_STEP_HOOKS + EVAL_BATCH_HOOKS)
    _hide_inherited(task, pl.LightningModule, TRAIN_STEP_HOOKS)


def _hide_inherited(holder: object, base: type, hooks: tuple[str, ...]) -> None:
    for hook in hooks:
        if getattr(getattr(holder, hook, None), "__func__", None) is getattr(base, hook):
            object.__setattr__(holder, hook, None)
