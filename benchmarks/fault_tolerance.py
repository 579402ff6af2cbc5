"""What fault tolerance costs and saves: a ~50M-parameter GPT on 2 ranks (CPU, gloo).

    python benchmarks/fault_tolerance.py [--steps 30] [--every 10]

Four runs of the same training, one after the other: synchronous checkpoints, asynchronous checkpoints
(``checkpoint.async_save=true``), and twice a run whose rank 1 is killed by SIGKILL after step ``--kill-at``
with ``fault_tolerance.max_restarts=1``, its ranks forked from the fork server (the default) and started as
new interpreters (``trainer.rank_start=interpreter``). Prints the time training waited per save (sync,
async and their ratio), the share of training wall time lost to checkpointing at one save every ``--every``
steps, and the time from the SIGKILL to the first step trained after the restart, both ways.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import cpu_model

ROOT = Path(__file__).resolve().parent.parent


def run(args: list[str], run_dir: Path, steps: int, every: int) -> dict:
    """``train.py`` on 2 ranks with the benchmark's model; its results.json."""
    overrides = [
        "model=gpt", "model.n_layer=10", "model.n_head=10", "model.n_embd=640", "data=pydocs", "data.block_size=64",
        "batch.global_size=8", f"trainer.max_steps={steps}", "trainer.limit_val_batches=0", "trainer.run_test=false",
        "trainer.log_every_n_steps=1000", "logger=none", "callbacks=none", "parallel=ddp", "trainer.devices=2",
        f"checkpoint.every_n_train_steps={every}", "checkpoint.save_top_k=0",
        "+callbacks.clock._target_=tests.crash.StepClock", *args, f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads((run_dir / "results.json").read_text())


def recovery_seconds(run_dir: Path) -> float:
    """From the SIGKILL to the end of the first step of the restarted ranks."""
    sent = float((run_dir / "signal-sent").read_text())
    restarted = [line.split() for line in (run_dir / "steps.txt").read_text().splitlines() if line.startswith("1 ")]
    return float(restarted[0][2]) - sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10, help="optimiser steps between checkpoints")
    parser.add_argument("--kill-at", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        sync = run([], base / "sync", args.steps, args.every)
        background = run(["checkpoint.async_save=true"], base / "async", args.steps, args.every)
        kill = ["fault_tolerance.max_restarts=1", "+callbacks.kill._target_=tests.crash.SignalAtStep",
                f"+callbacks.kill.step={args.kill_at}", "+callbacks.kill.rank=1",
                f"+callbacks.kill.signum={int(signal.SIGKILL)}"]
        recovery, restarts = {}, {}
        for way in ("fork_server", "interpreter"):
            killed = run([*kill, f"trainer.rank_start={way}"], base / f"killed-{way}", args.steps, args.every)
            recovery[way] = recovery_seconds(base / f"killed-{way}")
            restarts[way] = killed["fault_tolerance"]["restarts"]
    per_save = {name: r["checkpoints"]["blocking_s"] / max(1, r["checkpoints"]["saves"])
                for name, r in (("sync", sync), ("async", background))}
    print(f"CPU: {cpu_model()}; GPT 10 layers x 640 wide (~50M parameters), 2 ranks (gloo), "
          f"{args.steps} steps, a checkpoint every {args.every} steps\n")
    print("| measure | sync | async | ratio |")
    print("|---|---|---|---|")
    print(f"| training blocked per save (s) | {per_save['sync']:.3f} | {per_save['async']:.3f} | "
          f"{per_save['async'] / per_save['sync']:.2f}x |")
    print(f"| share of fit wall time in checkpoints | {sync['checkpoints']['share_of_wall_time']:.1%} | "
          f"{background['checkpoints']['share_of_wall_time']:.1%} | |")
    print(f"| samples/s | {sync['samples_per_sec']} | {background['samples_per_sec']} | "
          f"{background['samples_per_sec'] / sync['samples_per_sec']:.2f}x |")
    print(f"\nSIGKILL of rank 1 after step {args.kill_at} to the first step after the restart: "
          f"{recovery['fork_server']:.1f} s with ranks forked from the fork server, {recovery['interpreter']:.1f} s "
          f"with new interpreters ({recovery['fork_server'] / recovery['interpreter']:.2f}x; restarts recorded: "
          f"{restarts['fork_server']} and {restarts['interpreter']})")


if __name__ == "__main__":
    main()
