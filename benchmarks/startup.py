"""How long the command takes to its first training step, with ranks forked from the fork server against ranks
started as new interpreters (``trainer.rank_start``), and how long a three-job sweep takes either way.

    python benchmarks/startup.py [--repeats 3]

Every figure comes from ``python train.py ...`` as a user runs it: the default digits CNN, 2 optimiser steps,
no validation, checkpoints, test or logger. ``first step`` is the run's own ``time_to_first_step_s`` (from the
command's start, in ``results.json``), ``command`` the process's wall time, measured here; the two ways
alternate and the best of the repeats is kept (single runs vary on a shared machine). Prints a markdown
table with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from machine import cpu_model  # noqa: E402

SHORT = ["trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.check_val_every_n_epoch=null",
         "trainer.limit_val_batches=0", "trainer.run_test=false", "logger=none", "checkpoint.save_last=false",
         "checkpoint.save_top_k=0", "plots=false", "energy=false"]
CASES = {"1 rank (single)": ["parallel=single"], "2 ranks (ddp)": ["parallel=ddp", "trainer.devices=2"],
         "4 ranks (hsdp)": ["parallel=hsdp", "trainer.devices=4"]}


def run_once(args: list[str], rank_start: str, work: Path) -> tuple[float, float | None]:
    """(the command's wall time, the run's time to its first step or None for a sweep)."""
    run_dir = Path(tempfile.mkdtemp(dir=work))
    sweep = "-m" in args
    where = f"hydra.sweep.dir={run_dir}" if sweep else f"hydra.run.dir={run_dir}"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, *SHORT, f"trainer.rank_start={rank_start}",
                           where], cwd=work, capture_output=True, text=True, env={**os.environ})
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{args} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    if sweep:
        return wall, None
    return wall, json.loads((run_dir / "results.json").read_text())["throughput"]["time_to_first_step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each way; the best is kept")
    opts = parser.parse_args()
    cases = {**CASES, "sweep of 3 jobs x 2 ranks (ddp)": ["-m", "parallel=ddp", "trainer.devices=2",
                                                          "seed=1,2,3"]}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in cases.items():
            best: dict[str, tuple[float, float | None]] = {}
            for _ in range(opts.repeats):
                for way in ("interpreter", "fork_server"):
                    wall, first = run_once(args, way, Path(tmp))
                    if way not in best or wall < best[way][0]:
                        best[way] = (wall, first)
            rows.append((name, best["interpreter"], best["fork_server"]))
            print(f"done: {name}", file=sys.stderr, flush=True)
    print(f"\n{cpu_model()}, {os.cpu_count()} cores; best of {opts.repeats} alternating runs each\n")
    print("| run | first step, interpreter (s) | first step, fork server (s) | command, interpreter (s) "
          "| command, fork server (s) | command: fork server / interpreter |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (wall_i, first_i), (wall_f, first_f) in rows:
        first = (f"{first_i:.2f}", f"{first_f:.2f}") if first_i is not None else ("-", "-")
        print(f"| {name} | {first[0]} | {first[1]} | {wall_i:.2f} | {wall_f:.2f} | {wall_f / wall_i:.2f}x |")


if __name__ == "__main__":
    main()
