"""What each gradient exchange sends and what it costs: every ``comm`` option and Local SGD / DiLoCo on 2 and 4
ranks (CPU, gloo), the default digits CNN trained to the end.

    python benchmarks/communication.py [--ranks 2 4] [--options none,fp16,...]

For each option and world size: bytes each rank sends per step (counted by the run, relative to an fp32 ring
all-reduce of the gradients), messages per step, steps/s measured here, the steps/s the bandwidth model
(``disttrain/comm/bandwidth.py``) predicts at 1, 10 and 100 Gbit/s, and the final test accuracy; for the
parameter server also its busiest server's bytes (gradients in, parameters out) beside what a rank of a ring
all-reduce sends and receives. The model's
loopback link is fitted first from timed fp32 all-reduces on the same ranks; a prediction keeps the measured
compute and encoding time and replaces the modelled loopback transfer with the other link's. Loopback on one
machine cannot show a compression speed-up itself: the speed columns at other links are predictions.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import cpu_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from disttrain.comm.bandwidth import LINKS, Link, fit_link, predicted_step_s  # noqa: E402
from disttrain.comm.counter import ring_allreduce_bytes, ring_allreduce_messages  # noqa: E402

SLOW_LINK = Link("1 Gbit/s Ethernet", 1.0, 50.0)
OPTIONS = {
    "none": ["parallel=ddp", "comm=none"],
    "fp16": ["parallel=ddp", "comm=fp16"],
    "bf16": ["parallel=ddp", "comm=bf16"],
    "powersgd r4": ["parallel=ddp", "comm=powersgd", "comm.rank=4"],
    "powersgd r1": ["parallel=ddp", "comm=powersgd", "comm.rank=1"],
    "int8": ["parallel=ddp", "comm=int8"],
    "onebit": ["parallel=ddp", "comm=onebit"],
    "zero2 bf16": ["parallel=zero2", "comm=bf16"],
    "localsgd H=8": ["parallel=localsgd", "parallel.sync_every=8"],
    "diloco H=8": ["parallel=diloco", "parallel.sync_every=8"],
    "param_server S=1": ["parallel=param_server", "parallel.servers=1"],
    "param_server S=2": ["parallel=param_server", "parallel.servers=2"],
}


def _time_allreduces(sizes: list[int], repeats: int, back_to_back: int = 10) -> list[tuple[int, float]]:
    """(values, median seconds) of an fp32 all-reduce of each size on this group, timed over ``back_to_back``
    calls after a barrier (one call's time would mostly measure how unevenly the ranks left the barrier)."""
    import torch
    import torch.distributed as dist

    for numel in sizes:  # first calls set up connections and buffers
        dist.all_reduce(torch.ones(numel))
    timings = []
    for numel in sizes:
        tensor = torch.ones(numel)
        seconds = []
        for _ in range(repeats):
            dist.barrier()
            started = time.perf_counter()
            for _ in range(back_to_back):
                dist.all_reduce(tensor)
            seconds.append((time.perf_counter() - started) / back_to_back)
        timings.append((numel, statistics.median(seconds)))
    return timings


def loopback_link(world: int) -> Link:
    """The link that explains timed fp32 ring all-reduces among ``world`` local gloo ranks."""
    from tests.dist_utils import run_on_ranks

    timings = run_on_ranks(_time_allreduces, world, [1_000, 30_000, 300_000, 3_000_000], 7)[0]
    samples = [(ring_allreduce_bytes(numel, 4, world), ring_allreduce_messages(world), seconds)
               for numel, seconds in timings]
    return fit_link(f"loopback, {world} ranks", samples)


def train(overrides: list[str], world: int, run_dir: Path) -> dict:
    """The default digits run on ``world`` ranks with ``overrides``; its results.json."""
    args = [*overrides, f"trainer.devices={world}", "logger=none", "callbacks=none", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(overrides)} on {world} ranks failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads((run_dir / "results.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--options", default=",".join(OPTIONS), help="comma-separated names of " + ", ".join(OPTIONS))
    args = parser.parse_args()
    links = [SLOW_LINK, *LINKS]
    rows, headline = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.ranks:
            here = loopback_link(world)
            print(f"{here.name}: fitted {here.bandwidth_gbit_s:.2f} Gbit/s, {here.latency_us:.0f} us per message",
                  flush=True)
            for name in args.options.split(","):
                results = train(OPTIONS[name], world, Path(tmp) / re.sub(r"\W+", "_", f"{name}-{world}"))
                comm = results["comm"]
                step_s = results["batch"]["global"] / results["samples_per_sec"]
                predicted = [1 / predicted_step_s(step_s, here, link, comm["bytes_sent_per_step"],
                                                  comm["messages_per_step"]) for link in links]
                accuracy = results["metrics"]["test/acc"]
                server = (results.get("param_server") or {}).get("busiest_server_bytes_per_step")
                rows.append((name, world, comm, 1 / step_s, predicted, accuracy, server))
                headline[(name, world)] = (comm["compression_ratio"], accuracy)
                print(f"  {name}: done", flush=True)
    print(f"\nCPU: {cpu_model()}; digits CNN (77,290 parameters), global batch 64, default run (190 steps), gloo, "
          "one thread per rank\n")
    print("| option | ranks | bytes/rank/step (rank 0) | vs fp32 all-reduce | counted | messages/step | "
          "busiest server bytes/step | steps/s here | "
          + " | ".join(f"predicted steps/s at {link.name}" for link in links) + " | test acc |")
    print("|---|---|---|---|---|---|---|---|" + "---|" * len(links) + "---|")
    for name, world, comm, here_speed, predicted, accuracy, server in rows:
        ring = 2 * comm["fp32_allreduce_bytes_per_step"]  # a ring rank sends and receives as much
        busiest = f"{server:,} (ring rank: {ring:,})" if server else ""
        print(f"| {name} | {world} | {comm['bytes_sent_per_step']:,} | {comm['compression_ratio']:.2f}x fewer | "
              f"{'yes' if comm['counted'] else 'formula'} | {comm['messages_per_step']:g} | "
              f"{busiest} | "
              f"{here_speed:.1f} | " + " | ".join(f"{speed:.1f}" for speed in predicted) + f" | {accuracy:.4f} |")
    for world in args.ranks:
        base = headline.get(("none", world))
        for name in ("powersgd r4", "onebit"):
            if base and (name, world) in headline:
                ratio, accuracy = headline[(name, world)]
                print(f"{world} ranks, {name}: {ratio:.1f}x fewer bytes than fp32, test accuracy "
                      f"{(accuracy - base[1]) * 100:+.2f} points vs none")


if __name__ == "__main__":
    main()
