"""A callback that kills its process at a given optimiser step, as a power cut or an OOM killer would."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl


class CrashAtStep(pl.Callback):
    """``os._exit(1)`` on every rank once ``step`` optimiser steps are done: nothing is saved or flushed."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.global_step >= self.step:
            os._exit(1)


def restart_count() -> int:
    """The launcher's restart counter of this process's attempt."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class SignalAtStep(pl.Callback):
    """Send ``signum`` to this process on ``rank`` once ``step`` optimiser steps are done, in the first attempt."""

    def __init__(self, step: int, rank: int, signum: int) -> None:
        self.step, self.rank, self.signum = step, rank, signum

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank and restart_count() == 0:
            (Path(trainer.default_root_dir) / "signal-sent").write_text(repr(time.time()))
            os.kill(os.getpid(), self.signum)


class StepClock(pl.Callback):
    """Rank 0 appends ``attempt step unix-time`` after every optimiser step to ``steps.txt`` in the run."""

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.is_global_zero:
            with open(Path(trainer.default_root_dir) / "steps.txt", "a") as log:
                log.write(f"{restart_count()} {trainer.global_step} {time.time()!r}\n")


class SignalAtRandomMoments(pl.Callback):
    """In each of the first ``trials`` attempts, SIGTERM to one rank drawn at random, after a random delay
    (seeded by the attempt), wherever that rank happens to be: in a step, a collective or a checkpoint."""

    def __init__(self, trials: int, seed: int, max_delay_s: float) -> None:
        self.trials, self.seed, self.max_delay_s = trials, seed, max_delay_s
        self.timer: threading.Timer | None = None

    def on_train_start(self, trainer: pl.Trainer, *_: Any) -> None:
        attempt = restart_count()
        if attempt >= self.trials:
            return
        draw = random.Random(self.seed * 1000 + attempt)
        rank, delay = draw.randrange(trainer.world_size), draw.uniform(0.0, self.max_delay_s)
        if trainer.global_rank == rank:
            marker = Path(trainer.default_root_dir) / f"sigterm-{attempt}"
            self.timer = threading.Timer(delay, self._send, (marker,))
            self.timer.start()

    @staticmethod
    def _send(marker: Path) -> None:
        marker.write_text(str(time.time()))  # what the test counts: signals actually sent
        os.kill(os.getpid(), signal.SIGTERM)

    def on_train_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if self.timer is not None:
            self.timer.cancel()


class NonFiniteAtStep(pl.Callback):
    """Make ``rank``'s logits NaN in the step after ``step`` steps, as an overflow would."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank
        self.handle: Any = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank and self.handle is None:
            self.handle = pl_module.net.register_forward_hook(lambda _m, _i, output: output * float("nan"))

    def on_train_batch_end(self, *_: Any) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


class NonFiniteGradientAtStep(pl.Callback):
    """Make one gradient NaN on every rank (after the exchange) in the step after ``step`` steps; the loss stays
    finite, so only the gradient norm can tell."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if trainer.global_step == self.step:
            grad = next(p.grad for p in pl_module.parameters() if p.grad is not None)
            (grad.to_local() if hasattr(grad, "to_local") else grad).fill_(float("nan"))


class KillDuringSave(pl.Callback):
    """On ``rank``, in the first attempt, die right after writing its shards of the checkpoint at ``step``:
    the folder is complete on disk but was never renamed into place."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_start(self, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.global_rank != self.rank or restart_count():
            return
        import torch.distributed.checkpoint as dcp

        real_save = dcp.save

        def save_then_die(*args: Any, **kwargs: Any) -> Any:
            result = real_save(*args, **kwargs)
            if trainer.global_step == self.step:
                os._exit(1)
            return result

        dcp.save = save_then_die


class SleepAtStep(pl.Callback):
    """On ``rank``, after ``step`` steps in the first attempt, sleep for ever in the training loop (a deadlock:
    the process lives and its threads run, but it never reaches the next collective)."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank and restart_count() == 0:
            threading.Event().wait()


class SlowCheckpointState(pl.Callback):
    """Adds ``seconds`` to every checkpoint save (its state is gathered while the save blocks training)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_save_checkpoint(self, *_: Any) -> None:
        time.sleep(self.seconds)


class CountCollectives(pl.Callback):
    """Count the all-reduces and broadcasts that Python code (ours and Lightning's) issues inside each training
    step (DDP's gradient all-reduce runs in C++ and is not seen); each rank writes ``collectives-rank<r>.json``:
    a list, one count per step."""

    def __init__(self) -> None:
        self.counts: list[int] = []
        self.original: Any = None
        self.inside = False

    def on_train_start(self, trainer: pl.Trainer, *_: Any) -> None:
        import torch.distributed as dist

        self.original = {name: getattr(dist, name) for name in ("all_reduce", "broadcast")}

        def counting(name: str) -> Any:
            def counted(*args: Any, **kwargs: Any) -> Any:
                if self.inside:
                    self.counts[-1] += 1
                return self.original[name](*args, **kwargs)
            return counted

        for name in self.original:
            setattr(dist, name, counting(name))
        self.counts.append(0)
        self.inside = True

    # a step's count runs from the end of the step before it (Lightning's own per-step collectives come
    # before on_train_batch_start), validation left out
    def on_train_batch_end(self, *_: Any) -> None:
        self.counts.append(0)

    def on_validation_start(self, *_: Any) -> None:
        self.inside = False

    def on_validation_end(self, *_: Any) -> None:
        self.inside = True

    def on_train_end(self, trainer: pl.Trainer, *_: Any) -> None:
        import json

        import torch.distributed as dist

        for name, original in self.original.items():
            setattr(dist, name, original)
        self.counts.pop()  # opened after the last step
        out = Path(trainer.default_root_dir) / f"collectives-rank{trainer.global_rank}.json"
        out.write_text(json.dumps(self.counts))


class LoseNodeAtStep(pl.Callback):
    """After ``step`` steps in the first attempt, SIGKILL this rank's launcher (its parent process, torchrun's
    agent) and then the rank itself, as a node that loses power."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.global_step == self.step and restart_count() == 0:
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


class FillDiskAtStep(pl.Callback):
    """Rank ``rank`` fills the run directory's file system once ``step`` optimiser steps are done (a file of zeros
    written until the disk refuses more), as another job on the same disk would: the next save finds it full."""

    def __init__(self, step: int, rank: int = 0) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.global_step != self.step or trainer.global_rank != self.rank:
            return
        block = bytes(1 << 16)
        with open(Path(trainer.default_root_dir) / "filler", "wb", buffering=0) as filler:
            try:
                while True:
                    filler.write(block)
            except OSError:  # full: what is left is less than a block
                pass
