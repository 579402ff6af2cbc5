"""What each gradient exchange sends and what it costs: every ``comm`` option and Local SGD / DiLoCo on 2 and 4
ranks (CPU, gloo), the default digits CNN trained to the end.

    python benchmarks/communication.py [--ranks 2 4] [--options none,fp16,...]
    python benchmarks/communication.py --curves [--codecs fp16,bf16,...] [--steps 300]

``--curves`` instead trains GPT nano on pydocs on 2 ranks, uncompressed and with each codec with and without
its fp32 warm-up (``comm.warmup_steps`` of conf/comm/<codec>.yaml, and 0), and prints the validation loss at
the last step with its gap to the uncompressed run, the training loss at a few steps, the bytes sent per step
relative to an fp32 all-reduce, and writes the loss curves as a plot.

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


def train(overrides: list[str], world: int, run_dir: Path, logger: str = "none") -> dict:
    """The default digits run on ``world`` ranks with ``overrides``; its results.json."""
    args = [*overrides, f"trainer.devices={world}", f"logger={logger}", "callbacks=none", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(overrides)} on {world} ranks failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads((run_dir / "results.json").read_text())


CURVE_CODECS = ("fp16", "bf16", "powersgd", "int8", "onebit")
CURVE_RUN = ["model=gpt", "model.flavour=nano", "data=pydocs", "parallel=ddp", "trainer.limit_val_batches=8",
             "trainer.check_val_every_n_epoch=null", "trainer.run_test=false", "plots=false", "energy=false",
             "checkpoint.save_last=false", "checkpoint.save_top_k=0"]
CURVE_WORLD = 2


def codec_warmup(codec: str) -> int:
    """The ``comm.warmup_steps`` that conf/comm/<codec>.yaml sets (0 where it sets none)."""
    import yaml

    return int((yaml.safe_load((ROOT / "conf" / "comm" / f"{codec}.yaml").read_text()) or {}).get("warmup_steps", 0))


def curve_runs(codecs: list[str], steps: int) -> list[tuple[str, str, int, list[str]]]:
    """(label, codec, warm-up steps, overrides) of every curve run: uncompressed, then each codec without and
    with a warm-up: its default, or a third of the steps where its default is none."""
    runs = [("none", "none", 0, ["comm=none"])]
    for codec in codecs:
        default = codec_warmup(codec)
        warmups = sorted({0, default or steps // 3})
        runs += [(f"{codec}, warm-up {warmup}{' (default)' if warmup == default else ''}", codec, warmup,
                  [f"comm={codec}", f"comm.warmup_steps={warmup}"]) for warmup in warmups]
    return runs


def write_curves_plot(curves: dict[str, dict[str, list[tuple[float, float]]]], path: Path) -> Path | None:
    """Training (lines) and validation (dots) loss of every run against steps, or None without matplotlib."""
    from disttrain.report.plots import pyplot, save

    plt = pyplot()
    if plt is None:
        return None
    figure, axes = plt.subplots(figsize=(8, 5))
    colours = plt.get_cmap("tab20").colors  # more runs than the default cycle's 10 colours
    for (label, series), colour in zip(curves.items(), colours, strict=False):
        axes.plot(*zip(*series["train/loss"], strict=True), "-", label=label, linewidth=1, color=colour)
        if series["val/loss"]:
            axes.plot(*zip(*series["val/loss"], strict=True), "o", color=colour, markersize=4)
    axes.set_xlabel("optimiser step")
    axes.set_ylabel("cross-entropy (nats): training (lines), validation (dots)")
    axes.set_ylim(top=3.5)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7)
    return save(figure, plt, path)


def curves(codecs: list[str], steps: int, plot: Path) -> None:
    """The loss-curve comparison of ``--curves``."""
    from disttrain.report.plots import logged_series

    overrides = [*CURVE_RUN, f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps // 3}"]
    marks = [steps // 10, steps // 3, 2 * steps // 3, steps]
    rows, series = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, codec, warmup, extra in curve_runs(codecs, steps):
            run_dir = Path(tmp) / re.sub(r"\W+", "_", label)
            started = time.perf_counter()
            results = train([*overrides, *extra], CURVE_WORLD, run_dir, logger="csv")
            logged = logged_series(run_dir / "csv" / "metrics.csv", ("train/loss", "val/loss"))
            series[label] = logged
            # the last training loss logged at or before each mark (it is logged every log_every_n_steps)
            train_at = [max(((step, loss) for step, loss in logged["train/loss"] if step <= mark),
                            default=(0, None))[1] for mark in marks]
            rows.append((label, codec, warmup, logged["val/loss"][-1][1], train_at,
                         results["comm"]["compression_ratio"]))
            print(f"  {label}: val/loss {rows[-1][3]:.4f} ({time.perf_counter() - started:.0f} s)", flush=True)
    base = rows[0][3]
    print(f"\nCPU: {cpu_model()}; GPT nano on pydocs, {CURVE_WORLD} DDP ranks (gloo, one thread each), global batch "
          f"64 x 64 tokens, AdamW, {steps} steps, validation loss on 8 batches\n")
    print("| option | warm-up steps | val loss at step " + str(steps) + " | gap vs none | "
          + " | ".join(f"train loss at {mark}" for mark in marks) + " | fp32 bytes / bytes sent |")
    print("|---|---|---|---|" + "---|" * len(marks) + "---|")
    for label, _, warmup, val, train_losses, ratio in rows:
        gap = f"{(val / base - 1) * 100:+.1f}%" if label != "none" else ""
        print(f"| {label} | {warmup} | {val:.4f} | {gap} | "
              + " | ".join(f"{loss:.4f}" if loss is not None else "" for loss in train_losses)
              + f" | {ratio:.2f}x |")
    written = write_curves_plot(series, plot)
    print(f"\nplot: {written}" if written else "\nplot: not drawn (matplotlib is not installed)")
    defaults = [row for row in rows[1:] if "(default)" in row[0]]
    worst = max(defaults, key=lambda row: row[3])
    outside = [row[0] for row in defaults if row[3] > base * 1.03]
    verdict = f"not within 3%: {', '.join(outside)}" if outside else "every codec within 3%"
    print(f"Headline: at their defaults, {verdict} of the uncompressed validation loss {base:.4f} after {steps} "
          f"steps (worst: {worst[0]}, {(worst[3] / base - 1) * 100:+.1f}%, {worst[5]:.1f}x fewer bytes than fp32)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--options", default=",".join(OPTIONS), help="comma-separated names of " + ", ".join(OPTIONS))
    parser.add_argument("--curves", action="store_true", help="GPT nano loss curves per codec, with and without "
                        "its warm-up, instead of the bytes table")
    parser.add_argument("--codecs", default=",".join(CURVE_CODECS), help="--curves: comma-separated codecs")
    parser.add_argument("--steps", type=int, default=300, help="--curves: optimiser steps per run")
    parser.add_argument("--plot", type=Path, default=ROOT / "outputs" / "communication_curves.png",
                        help="--curves: where the plot goes")
    args = parser.parse_args()
    if args.curves:
        curves(args.codecs.split(","), args.steps, args.plot)
        return
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
