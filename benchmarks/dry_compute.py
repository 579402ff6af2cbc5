"""A dry run's measured compute per step against the plan priced on this CPU two ways, side by side in one run:
at the planner's quick calibration's matrix-multiply rate (one 1024 x 1024 product, measured once per process)
and at the rate of the rank's own products replayed between its timed steps (what ``mode=dryrun`` prints).

    python benchmarks/dry_compute.py [--steps 7]

Each layout is one rank of a ZeRO-3, DDP or HSDP layout under torch's fake process group; a width-32 Llama (the
dry run's memory tests' model) beside the width-256 one shows what the comparison measures where per-operator
costs rule the step.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from machine import cpu_features, cpu_model  # noqa: E402

from disttrain.config.validation import validate  # noqa: E402
from disttrain.plan.dry_compute import (  # noqa: E402
    base_machine_profile,
    cpu_plan_inputs,
    matmul_dtype,
    profile_now,
)
from disttrain.plan.dryrun import dry_run  # noqa: E402
from disttrain.plan.planner import plan_of_run  # noqa: E402

MODELS = {
    "llama width 256, 512 tokens": ["model.n_embd=256", "model.n_head=4", "model.n_kv_head=4", "data.block_size=64"],
    "llama width 32, 256 tokens": ["data.block_size=32"],
}
"""The models: a micro Llama (2 layers, 512-token vocabulary) at width 256 or its own 32, micro-batches of 8."""
LAYOUTS = {
    "zero3 on 64": ["parallel=zero3", "trainer.devices=8", "trainer.num_nodes=8", "batch.global_size=512"],
    "ddp on 512": ["parallel=ddp", "trainer.devices=8", "trainer.num_nodes=64", "batch.global_size=4096"],
    "hsdp 2x16": ["parallel=hsdp", "trainer.devices=8", "trainer.num_nodes=4", "batch.global_size=256"],
}
"""The layouts, one rank each."""


def composed(overrides: list[str], run_dir: str) -> object:
    """``conf/train.yaml`` with ``overrides``, validated as a job validates it."""
    from hydra import compose, initialize_config_dir

    from disttrain.config import register

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return validate(compose("train", overrides=[*overrides, f"run_dir={run_dir}", "plots=false"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=7, help="dry-run steps (the first two counted, not timed)")
    args = parser.parse_args()
    base = base_machine_profile()
    threads = torch.get_num_threads()
    print(f"CPU: {cpu_model()} ({cpu_features()}); {threads} thread(s); torch {torch.__version__}; "
          f"calibration: {base.source}, {base.flops['fp32'] / 1e9:.3g} GFLOP/s per core\n")
    print("| model | layout | measured ms | planned ms, calibration's rate | measured / planned | replay GFLOP/s "
          "| planned ms, replay's rate | measured / planned | matrix products, share of plan |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for model, model_args in MODELS.items():
        for layout, layout_args in LAYOUTS.items():
            with tempfile.TemporaryDirectory() as run_dir:
                run = composed(["model=llama", "model.flavour=micro", "data=synthetic_tokens", "data.vocab_size=512",
                                "plan.profile=h100_sxm", f"dryrun.steps={args.steps}", "mode=dryrun", *model_args,
                                *layout_args], run_dir)
                with contextlib.redirect_stdout(io.StringIO()):  # the table only
                    result = dry_run(run)
            lay = plan_of_run(run)[0].layout
            dtype = matmul_dtype(run, base)
            square = profile_now(base, base.flops[dtype] * threads, base.memory_bandwidth, base.op_overhead, dtype,
                                 threads, lay.world_size)
            planned_square = cpu_plan_inputs(run, square).estimate(lay).compute_s
            measured = result["measured_step_s"]
            print(f"| {model} | {layout} | {measured * 1e3:.1f} | {planned_square * 1e3:.1f} | "
                  f"{measured / planned_square:.2f} | {result['matmul_flops_per_s'] / 1e9:.1f} | "
                  f"{result['planned_compute_s'] * 1e3:.1f} | {result['compute_ratio']:.2f} | "
                  f"{result['matmul_share']:.0%} |", flush=True)


if __name__ == "__main__":
    main()
