"""The planner's predicted compute time per step against the measured one, on this machine.

For each model and micro-batch: one process on one thread (what a rank gets on a 2-core machine with 2 ranks)
runs forward, backward and fused AdamW steps for a second; the plan of the same layout (``plan.profile=machine``:
the stored calibration, else a quick one) predicts its compute time. Communication is not in either figure.

    python -m disttrain.plan --calibrate   # first, for the machine's profile
    python benchmarks/plan_step_time.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disttrain.config.typed import model_typed  # noqa: E402
from disttrain.data.spec import DataSpec, example_batch  # noqa: E402
from disttrain.models import MODELS, build_model  # noqa: E402
from disttrain.parallel.config import ParallelConfig  # noqa: E402
from disttrain.plan.calibrate import cpu_model, seconds_per_call  # noqa: E402
from disttrain.plan.hardware import resolve_profile  # noqa: E402
from disttrain.plan.layout import Layout  # noqa: E402
from disttrain.plan.planner import plan_inputs  # noqa: E402

TEXT = DataSpec("text", vocab_size=96, block_size=64)
CASES = [("gpt micro", {"name": "gpt", "flavour": "micro"}, TEXT),
         ("gpt nano", {"name": "gpt", "flavour": "nano"}, TEXT),
         ("llama micro", {"name": "llama", "flavour": "micro"}, TEXT),
         ("cnn", {"name": "cnn"}, DataSpec("image", num_classes=10, in_channels=1, image_size=8)),
         ("gpt mini (context 128)", {"name": "gpt", "flavour": "mini", "block_size": 128},
          DataSpec("text", vocab_size=96, block_size=128))]


def measured_step(net: torch.nn.Module, spec: DataSpec, micro: int, seconds: float = 1.0) -> float:
    """Mean seconds of forward, backward and a fused AdamW step on one thread."""
    inputs, targets = example_batch(spec, micro)
    opt = torch.optim.AdamW(net.parameters(), fused=True)

    def step() -> None:
        out = net(inputs)
        F.cross_entropy(out.reshape(-1, out.size(-1)), targets.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()

    return seconds_per_call(step, seconds)


def main() -> None:
    torch.set_num_threads(1)
    profile = resolve_profile("machine")
    print(f"CPU: {cpu_model()}; profile: {profile.source}; one thread per rank\n")
    print("| model | micro-batch | predicted ms | measured ms | predicted / measured |")
    print("|---|---|---|---|---|")
    ratios = []
    for label, cfg, spec in CASES:
        for micro in (8, 32):
            torch.manual_seed(0)
            net = build_model(model_typed(OmegaConf.create(cfg), MODELS), spec)
            inputs = plan_inputs(net, spec, micro, ParallelConfig(), OmegaConf.create({"name": "adamw"}), "32-true",
                                 profile)
            predicted = inputs.estimate(Layout(dp_replicate=2, micro_size=micro)).compute_s  # 1 thread per rank
            measured = measured_step(net, spec, micro)
            ratios.append(predicted / measured)
            print(f"| {label} | {micro} | {predicted * 1e3:.2f} | {measured * 1e3:.2f} | {predicted / measured:.2f} |",
                  flush=True)
    print(f"\npredicted / measured compute per step: {min(ratios):.2f} to {max(ratios):.2f}")


if __name__ == "__main__":
    main()
