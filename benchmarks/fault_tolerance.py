"""What fault tolerance costs and saves: a ~50M-parameter GPT on 2 ranks (CPU, gloo).

    python benchmarks/fault_tolerance.py [--steps 30] [--every 10]

Four runs of the same training, one after the other: synchronous checkpoints, asynchronous checkpoints
(``checkpoint.async_save=true``), and twice a run whose rank 1 is killed by SIGKILL after step ``--kill-at``
with ``fault_tolerance.max_restarts=1``, its ranks forked from the fork server (the default) and started as
new interpreters (``trainer.rank_start=interpreter``). Prints the time training waited per save (sync,
async and their ratio), the share of training wall time lost to checkpointing at one save every ``--every``
steps, and the time from the SIGKILL to the first step trained after the restart, both ways.

``--part engines`` (or ``all``) compares the two ``fault_tolerance.engine`` values on GPT nano with 3
data-parallel replicas (3 ranks; under torchft 3 replica groups of one rank): a SIGKILL of replica 1 after step
``--kill-at``, the steps lost (restart: steps trained again since the last checkpoint; torchft: steps the
survivors did not commit, and steps trained with fewer groups) and the time until every replica trains again;
then (also ``--part overhead`` alone) the time per step of both with nothing failing, ``--repeats`` interleaved
pairs of runs, and the quorum's share.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import cpu_model

ROOT = Path(__file__).resolve().parent.parent


CHECKPOINT_MODEL = ["model=gpt", "model.n_layer=10", "model.n_head=10", "model.n_embd=640", "data=pydocs",
                    "data.block_size=64", "batch.global_size=8", "parallel=ddp", "trainer.devices=2"]
"""The checkpoint part's run: a ~50M-parameter GPT on 2 ranks."""
NANO = ["model=gpt", "model.flavour=nano", "data=pydocs", "batch.global_size=24", "parallel=ddp", "trainer.devices=3"]
"""The engines part's run: GPT nano, 3 data-parallel replicas of 8 samples each per step."""
TORCHFT = ["fault_tolerance.engine=torchft", "fault_tolerance.min_groups=2", "fault_tolerance.heartbeat_timeout_s=1",
           "fault_tolerance.timeout_s=10", "fault_tolerance.hang_timeout_s=5", "parallel.timeout_s=60"]
"""torchft with a 1 s heartbeat timeout (torchft's default, 5 s, makes survivors wait 5 s per failure)."""


def run(args: list[str], run_dir: Path, steps: int, every: int, model: list[str] = CHECKPOINT_MODEL) -> dict:
    """``train.py`` with the benchmark's ``model`` run and ``args``; its results.json."""
    overrides = [
        *model, f"trainer.max_steps={steps}", "trainer.limit_val_batches=0", "trainer.run_test=false",
        "trainer.log_every_n_steps=1000", "logger=none", "callbacks=none",
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


def restart_figures(run_dir: Path, kill_at: int) -> dict:
    """Restart engine: the steps trained again (from the checkpoint resumed to the kill) and the time from the
    SIGKILL to the first step after the restart."""
    rows = [line.split() for line in (run_dir / "steps.txt").read_text().splitlines()]
    resumed_at = min(int(step) for attempt, step, _ in rows if attempt == "1") - 1
    return {"steps_lost": kill_at - resumed_at, "fewer_groups": 0, "back_s": recovery_seconds(run_dir)}


def torchft_figures(run_dir: Path, results: dict) -> dict:
    """torchft: the steps the survivors did not commit, the steps with fewer groups, the time from the SIGKILL to
    the restarted group's first committed step, and the survivors' longest pause between two steps."""
    section = results["fault_tolerance"]
    rows = [json.loads(line) for line in (run_dir / "logs" / "digests.jsonl").read_text().splitlines()]
    pauses = []
    for group in (0, 2):
        own = [row["time"] for row in rows if row["group"] == group]
        pauses += [b - a for a, b in zip(own, own[1:], strict=False)]
    restart = section["group_restarts"][0]
    return {"steps_lost": section["steps_not_committed"], "fewer_groups": section["steps_with_fewer_groups"],
            "back_s": restart["rejoin_s"], "survivor_pause_s": max(pauses)}


def engines(args: argparse.Namespace, base: Path) -> None:
    """Print the engines table: a SIGKILL under each engine, then the cost per step when nothing fails."""
    kill_restart = ["fault_tolerance.max_restarts=1", "+callbacks.kill._target_=tests.crash.SignalAtStep",
                    f"+callbacks.kill.step={args.kill_at}", "+callbacks.kill.rank=1",
                    f"+callbacks.kill.signum={int(signal.SIGKILL)}"]
    kill_torchft = ["fault_tolerance.max_restarts=1", "+callbacks.digests._target_=tests.replica_probe.StepDigests",
                    "+callbacks.digests.group=1", f"+callbacks.digests.step={args.kill_at}",
                    f"+callbacks.digests.signum={int(signal.SIGKILL)}"]
    failures = {}
    for way in ("fork_server", "interpreter"):
        start = f"trainer.rank_start={way}"
        run([*kill_restart, start], base / f"restart-{way}", args.engine_steps, args.every, NANO)
        failures[("restart", way)] = restart_figures(base / f"restart-{way}", args.kill_at)
        ft = run([*TORCHFT, *kill_torchft, start], base / f"torchft-{way}", args.engine_steps, args.every, NANO)
        failures[("torchft", way)] = torchft_figures(base / f"torchft-{way}", ft)
    print(f"\nCPU: {cpu_model()} ({os.cpu_count()} cores); GPT nano, 3 data-parallel replicas of 1 rank (gloo), "
          f"{args.engine_steps} steps, SIGKILL of replica 1 after step {args.kill_at}, restart engine checkpoint "
          f"every {args.every} steps, torchft heartbeat timeout 1 s\n")
    print("| engine | rank start | steps lost | steps with fewer replicas | SIGKILL to all replicas training (s) | "
          "survivors' longest pause (s) |")
    print("|---|---|---|---|---|---|")
    for (engine, way), f in failures.items():
        pause = f"{f['survivor_pause_s']:.2f}" if "survivor_pause_s" in f else "all stopped"
        back = f"{f['back_s']:.2f}" if f["back_s"] is not None else "not back before the end"
        print(f"| {engine} | {way} | {f['steps_lost']} | {f['fewer_groups']} | {back} | {pause} |")


def overhead(args: argparse.Namespace, base: Path) -> None:
    """Print the cost per step when nothing fails: ``--repeats`` pairs of runs (restart engine, then torchft),
    interleaved so that a change in the machine's load falls on both; medians over the pairs."""
    pairs = []
    for i in range(args.repeats):
        plain = run([], base / f"plain{i}", args.overhead_steps, args.overhead_steps, NANO)
        quorum = run(TORCHFT, base / f"quorum{i}", args.overhead_steps, args.overhead_steps, NANO)
        pairs.append((1e3 * 24 / plain["samples_per_sec"], 1e3 * 24 / quorum["samples_per_sec"],
                      quorum["fault_tolerance"]["quorum_ms_median"]))
    print(f"\nCPU: {cpu_model()} ({os.cpu_count()} cores); GPT nano, 3 replicas of 1 rank, no failure, "
          f"{args.overhead_steps} steps per run, {args.repeats} pairs of runs\n")
    print("| pair | restart engine (ms per step) | torchft (ms per step) | difference (ms) | quorum, median (ms) |")
    print("|---|---|---|---|---|")
    for i, (plain_ms, ft_ms, quorum_ms) in enumerate(pairs):
        print(f"| {i + 1} | {plain_ms:.1f} | {ft_ms:.1f} | {ft_ms - plain_ms:+.1f} | {quorum_ms} |")
    plain_ms, ft_ms = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
    quorum_ms = statistics.median(p[2] for p in pairs)
    print(f"\ntorchft per-step cost on GPT nano, 3 replicas (medians): {ft_ms - plain_ms:+.1f} ms per step "
          f"({ft_ms / plain_ms - 1:+.1%}), of which the quorum {quorum_ms:.1f} ms ({quorum_ms / plain_ms:.1%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("checkpoints", "engines", "overhead", "all"), default="all")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10, help="optimiser steps between checkpoints")
    parser.add_argument("--kill-at", type=int, default=15)
    parser.add_argument("--engine-steps", type=int, default=400,
                        help="steps of each engines run with a failure (a restarted interpreter must rejoin before the "
                        "end)")
    parser.add_argument("--overhead-steps", type=int, default=100, help="steps of each run without a failure")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs without a failure")
    args = parser.parse_args()
    if args.part in ("engines", "all"):
        with tempfile.TemporaryDirectory() as tmp:
            engines(args, Path(tmp))
    if args.part in ("overhead", "engines", "all"):
        with tempfile.TemporaryDirectory() as tmp:
            overhead(args, Path(tmp))
    if args.part in ("engines", "overhead"):
        return
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
