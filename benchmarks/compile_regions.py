"""What ``trainer.compile`` compiles: the whole model as one graph, or each transformer block on its own.

    python benchmarks/compile_regions.py [--models gpt,llama] [--layers 4,12] [--width 256] [--seq 128]
        [--batch 8] [--steps 20] [--repeats 1] [--threads 1] [--device cpu|cuda]

For a GPT and a Llama of ``--layers`` blocks (width ``--width``, byte vocabulary, fp32; bf16 autocast with
``--device cuda``), one training step (forward, the task's cross-entropy, backward, AdamW) under each way of
compiling, every one in a fresh process with an empty inductor cache of its own (a first run's compile, as a
user's first run pays it):

- ``eager``: nothing compiled (the loss neither);
- ``whole``: the model as one graph, as ``trainer.compile_scope=model`` compiles it;
- ``blocks``: each block compiled on its own, embedding, final norm and head eager, as ``trainer.compile_scope=blocks``
  (the default) compiles it;
- ``blocks+rest``: each block on its own and each other top-level module (embedding, final norm, head) compiled
  on its own too.

The compiled sides compile the loss as ``trainer.compile`` does. Columns: first step (compile included), steady
step (median of ``--steps`` after 2 more warm-up steps), peak resident memory of the process (ru_maxrss: the
compiler's own memory and the tensors; on a GPU also the peak of allocated GPU memory), and dynamo's counters
over the whole run: frames compiled (``frames.ok``), graphs (``unique_graphs``), operators traced into graphs
(``calls_captured``) and recompilations. With ``--repeats`` the sides take turns and each keeps its fastest
steady step and first step. The last line is the headline: blocks / whole for compile time and steady step.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fresh_process import in_fresh_process  # noqa: E402
from machine import cpu_features, cpu_model  # noqa: E402

from disttrain.parallel.compile import COMPILE_MODES  # noqa: E402

SIDES = ("eager", "whole", "blocks", "blocks+rest")
"""The ways of compiling, in the table's order."""
SCOPES = {"whole": "model", "blocks": "blocks", "blocks+rest": "blocks"}
"""The ``trainer.compile_scope`` each compiled side compiles under."""
VOCAB = 256
"""Byte-level text, as ``data=pydocs``."""


@dataclass
class Measured:
    """One side's figures on one model."""

    first_s: float
    steady_s: float
    peak_rss_mib: float
    peak_device_mib: float | None
    frames: int
    graphs: int
    captured: int
    recompiles: int


def build_model(family: str, layers: int, width: int, seq: int):
    """A ``family`` model (gpt or llama) of ``layers`` blocks, ``width`` wide, with heads of 64 (the Llama with
    half as many key/value heads)."""
    import torch

    from disttrain.data.spec import DataSpec
    from disttrain.models.gpt import GPTConfig, build_gpt
    from disttrain.models.llama import LlamaConfig, build_llama

    torch.manual_seed(0)
    spec = DataSpec(kind="text", vocab_size=VOCAB, block_size=seq)
    heads = max(1, width // 64)
    if family == "gpt":
        return build_gpt(GPTConfig(n_layer=layers, n_head=heads, n_embd=width, block_size=seq), spec)
    return build_llama(LlamaConfig(n_layer=layers, n_head=heads, n_kv_head=max(1, heads // 2), n_embd=width,
                                   block_size=seq), spec)


def compile_side(model, side: str, mode: str) -> None:
    """Compile ``model`` in place as ``side`` says (nothing for eager) in torch.compile's ``mode``: through
    ``trainer.compile``'s own ``compile_model`` under the side's scope (``SCOPES``), the other top-level modules
    on their own too for ``blocks+rest``."""
    from disttrain.parallel.compile import Compilation, compile_model, torch_compile_mode
    from disttrain.parallel.model_plan import shard_units_of

    if side == "eager":
        return
    units = shard_units_of(model)
    compile_model(model, units, Compilation(mode, SCOPES[side]))
    if side == "blocks+rest":
        holders = {id(unit) for unit in units}
        for child in model.children():
            if not any(id(module) in holders for module in child.modules()):
                child.compile(mode=torch_compile_mode(mode))


def measure(family: str, layers: int, width: int, seq: int, batch: int, steps: int, side: str,
            device: str, mode: str) -> Measured:
    """Train ``steps`` + 3 steps of one model compiled as ``side``; this process's figures."""
    # an inductor cache of this process's own: each side compiles from nothing, as a first run does
    cache = tempfile.mkdtemp(prefix="compile-regions-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    try:
        return _train(family, layers, width, seq, batch, steps, side, device, mode)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _train(family: str, layers: int, width: int, seq: int, batch: int, steps: int, side: str,
           device: str, mode: str) -> Measured:
    import torch
    from torch._dynamo.utils import counters

    from disttrain.rank.loss import loss_function

    counters.clear()
    model = build_model(family, layers, width, seq).to(device)
    compile_side(model, side, mode)
    loss_fn = loss_function(None if side == "eager" else mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=torch.Generator().manual_seed(0)).to(device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")
    times = []
    for _ in range(steps + 3):
        start = time.perf_counter()
        with autocast:
            logits = model(tokens[:, :-1])
        loss_fn(logits, tokens[:, 1:], "mean").backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    recompiles = sum(counters["recompiles"].values()) if "recompiles" in counters else 0
    return Measured(
        first_s=times[0], steady_s=statistics.median(times[3:]),
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        peak_device_mib=torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None,
        frames=counters["frames"]["ok"], graphs=counters["stats"]["unique_graphs"],
        captured=counters["stats"]["calls_captured"], recompiles=recompiles)


def fastest(runs: list[Measured]) -> Measured:
    """The repeats of one side as one row: the fastest first and steady steps, the largest memory."""
    best = min(runs, key=lambda m: m.steady_s)
    best.first_s = min(m.first_s for m in runs)
    best.peak_rss_mib = max(m.peak_rss_mib for m in runs)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--layers", default="4,12", help="comma-separated block counts")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--mode", default="default", choices=COMPILE_MODES, help="torch.compile's mode")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the measuring processes read it (fresh_process)
    import torch

    sides = args.sides.split(",")
    unknown = sorted(set(sides) - set(SIDES))
    if unknown:
        parser.error(f"--sides {','.join(unknown)}: one of {', '.join(SIDES)}")
    cases = [(family, int(layers)) for family in args.models.split(",") for layers in args.layers.split(",")]
    machine = (torch.cuda.get_device_name() if args.device == "cuda" else
               f"{cpu_model()} ({cpu_features()}), {args.threads} thread(s)")
    print(f"{machine}, torch {torch.__version__}; width {args.width}, batch {args.batch} x sequence {args.seq}, "
          f"{'bf16 autocast' if args.device == 'cuda' else 'fp32'}, mode {args.mode}, steady step: median of "
          f"{args.steps}, {args.repeats} repeat(s)\n")
    runs: dict[tuple, list[Measured]] = {}
    for _ in range(args.repeats):
        for family, layers in cases:
            for side in sides:
                runs.setdefault((family, layers, side), []).append(in_fresh_process(
                    measure, family, layers, args.width, args.seq, args.batch, args.steps, side, args.device,
                    args.mode))
                m = runs[(family, layers, side)][-1]
                print(f"measured {family} {layers} {side}: first step {m.first_s:.1f} s, steady step "
                      f"{m.steady_s * 1e3:.1f} ms", file=sys.stderr, flush=True)
    device_column = " peak GPU allocated (MiB) |" if args.device == "cuda" else ""
    print("| model | layers | compiled | first step (s) | steady step (ms) | vs whole | peak RSS (MiB) |"
          f"{device_column} frames | graphs | ops traced | recompiles |")
    print("|---|---:|---|---:|---:|---:|---:|" + ("---:|" if device_column else "") + "---:|---:|---:|---:|")
    first_ratios, steady_ratios = [], []
    for family, layers in cases:
        rows = {side: fastest(runs[(family, layers, side)]) for side in sides}
        whole = rows.get("whole")
        for side, m in rows.items():
            versus = f"{m.steady_s / whole.steady_s:.2f}" if whole else "-"
            device_cell = f" {m.peak_device_mib:.0f} |" if device_column else ""
            print(f"| {family} | {layers} | {side} | {m.first_s:.1f} | {m.steady_s * 1e3:.1f} | {versus} | "
                  f"{m.peak_rss_mib:.0f} |{device_cell} {m.frames} | {m.graphs} | {m.captured} | {m.recompiles} |")
        if whole and "blocks" in rows:
            first_ratios.append(rows["blocks"].first_s / whole.first_s)
            steady_ratios.append(rows["blocks"].steady_s / whole.steady_s)
    if first_ratios:
        print(f"\nblocks / whole: first step {statistics.geometric_mean(first_ratios):.2f}x, steady step "
              f"{statistics.geometric_mean(steady_ratios):.2f}x (geometric means over {len(first_ratios)} models)")


if __name__ == "__main__":
    main()
