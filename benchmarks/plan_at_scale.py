"""Plans past this machine, on paper: what ``parallel=auto`` picks for GPT-2 124M, a 1.3B GPT and Llama 3 8B
on 8 to 1,024 H100s, with its predicted memory, step time, throughput and energy, beside published
measurements of the same model and layout where they exist.

Each model is measured by one forward and backward on the meta device (no memory, no GPU); the layouts are
predicted with the ``h100_sxm`` profile (datasheet peaks x 0.5, NVLink within a node of 8, 400 Gb/s between
nodes). Global batch: a fixed number of sequences per GPU, so every row is weak scaling.

    python benchmarks/plan_at_scale.py [--gpus 8 64 256 1024] [--models gpt2 gpt1.3b llama8b]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disttrain.config.typed import model_typed  # noqa: E402
from disttrain.data.spec import DataSpec  # noqa: E402
from disttrain.models import MODELS, build_model  # noqa: E402
from disttrain.parallel.config import ParallelConfig  # noqa: E402
from disttrain.plan.devices import HardwareProfile  # noqa: E402
from disttrain.plan.hardware import PROFILES  # noqa: E402
from disttrain.plan.layout import Layout  # noqa: E402
from disttrain.plan.planner import choose_parallel, plan_inputs  # noqa: E402
from disttrain.plan.units import human_bytes  # noqa: E402

MODELS_AT_SCALE = {
    # name: (model config, sequence length, vocabulary, sequences per GPU)
    "gpt2": ({"name": "gpt", "flavour": "gpt2"}, 1024, 50304, 16),
    "gpt1.3b": ({"name": "gpt", "n_layer": 24, "n_head": 16, "n_embd": 2048, "tie_weights": False}, 2048, 50304, 4),
    "llama8b": ({"name": "llama", "n_layer": 32, "n_head": 32, "n_kv_head": 8, "n_embd": 4096, "mlp_hidden": 14336,
                 "rope_theta": 500000.0}, 8192, 128256, 2),
}

# torchtitan docs/performance.md: Llama 3.1 8B, FSDP (1D), 8 H100 (96 GB HBM2e, 2.4 TB/s, 500 W power limit),
# local batch 2 x 8192 tokens, selective activation checkpointing, bf16, no torch.compile: 5,762 tokens/s per
# GPU and 82.4 GiB. The same page: 64 A100 80GB, local batch 1, selective layer AC: 2,904 tokens/s per GPU.
PUBLISHED = {("llama8b", 8): ("torchtitan, 8 H100 96GB 500W, FSDP, local batch 2, selective AC",
                              Layout(dp_shard=8, zero_stage=3, activation_checkpoint="selective", micro_size=2),
                              5762, 82.4 * 2**30)}
TORCHTITAN_H100 = replace(PROFILES["h100_sxm"], name="h100_96gb_500w", memory_bytes=96e9,
                          memory_bandwidth=2.4e12 * 0.8, watts=500.0,
                          source="torchtitan's Grand Teton H100: 96 GB HBM2e 2.4 TB/s, 500 W")


def build(name: str) -> tuple[torch.nn.Module, DataSpec, int]:
    """The model on the meta device, its data spec and sequences per GPU."""
    cfg, seq, vocab, per_gpu = MODELS_AT_SCALE[name]
    spec = DataSpec("text", vocab_size=vocab, block_size=seq)
    typed = model_typed(OmegaConf.create({**cfg, "block_size": seq, "vocab_size": vocab}), MODELS)
    with torch.device("meta"):
        return build_model(typed, spec), spec, per_gpu


def plan_row(name: str, gpus: int, profile: HardwareProfile, layout: Layout | None = None
             ) -> tuple[str, float, float]:
    """One table row for ``name`` on ``gpus`` GPUs (``layout``, else what ``parallel=auto`` picks); also the
    predicted tokens/s per GPU and peak bytes."""
    net, spec, per_gpu = build(name)
    optim = OmegaConf.create({"name": "adamw"})
    if layout is None:
        layout, _ = choose_parallel(net, spec, gpus, per_gpu * gpus, ParallelConfig(), optim, "bf16-mixed", profile)
    inputs = plan_inputs(net, spec, layout.micro_size // max(layout.microbatches, 1), ParallelConfig(), optim,
                         "bf16-mixed", profile)
    e = inputs.estimate(layout)
    params = inputs.stats.params
    per_gpu_tps = e.tokens_per_s / gpus
    model_flops = 6 * params * e.tokens_per_s / gpus  # the usual 6N per token, as MFU is reported
    peak = profile.flops["bf16"] / 0.5
    row = (f"| {name} ({params / 1e9:.2f}B) | {gpus} | {layout.describe()} | {human_bytes(e.total_bytes)} | "
           f"{e.step_s:.3g} s | {per_gpu_tps:,.0f} | {model_flops / peak:.0%} | "
           f"{e.joules_per_token * 1e3:.3g} mJ |")
    return row, per_gpu_tps, e.total_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--models", nargs="+", default=list(MODELS_AT_SCALE), choices=list(MODELS_AT_SCALE))
    args = parser.parse_args()
    started = time.perf_counter()
    profile = PROFILES["h100_sxm"]
    print(f"profile: {profile.name} ({profile.source}); bf16-mixed, fp32 AdamW state; weak scaling\n")
    print("| model | GPUs | parallel=auto picks | memory per GPU | step | tokens/s per GPU | MFU (6N) "
          "| energy per token |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models:
        for gpus in args.gpus:
            print(plan_row(name, gpus, profile)[0], flush=True)
    print("\nAgainst published measurements (same model, GPUs and batch; profile set to their hardware):\n")
    print("| model | GPUs | published | tokens/s per GPU: predicted / measured | memory: predicted / measured |")
    print("|---|---|---|---|---|")
    headline = ""
    for (name, gpus), (what, layout, tps, memory) in PUBLISHED.items():
        # torchtitan's selective policy recomputes every second matrix product, ours keeps them all: theirs
        # should keep less; their figure is the CUDA allocator's peak, which also holds its cached blocks
        rows = {policy: plan_row(name, gpus, TORCHTITAN_H100, replace(layout, activation_checkpoint=policy))
                for policy in ("full", "selective", "none")}
        print(f"| {name} | {gpus} | {what} | " + ", ".join(f"{row[1]:,.0f} ({policy})" for policy, row in rows.items())
              + f" / {tps:,} = " + " / ".join(f"{row[1] / tps:.2f}x" for row in rows.values()) + " | "
              + ", ".join(f"{human_bytes(row[2])} ({policy})" for policy, row in rows.items())
              + f" / {human_bytes(memory)} |")
        auto = plan_row(name, gpus, TORCHTITAN_H100)[0].split("|")
        print(f"\nparallel=auto on that hardware picks {auto[3].strip()}: {auto[6].strip()} tokens/s per GPU, "
              f"{auto[4].strip()} per GPU")
        full, selective = rows["full"], rows["selective"]
        headline = (f"{name} on {gpus} H100: predicted / torchtitan's measured tokens/s per GPU "
                    f"{full[1] / tps:.2f}x (full AC) to {selective[1] / tps:.2f}x (selective AC); memory "
                    f"{selective[2] / memory:.2f}x of the measured under selective AC")
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    print(headline)


if __name__ == "__main__":
    main()
