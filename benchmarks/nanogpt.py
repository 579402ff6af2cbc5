"""disttrain's GPT recipe side by side with nanoGPT's ``train.py``: tokens/s and validation loss at equal steps.

    python benchmarks/nanogpt.py --nanogpt PATH [--steps 300] [--rounds 3] [--variants fp32,bf16,compile,auto]

PATH is a checkout of https://github.com/karpathy/nanoGPT (its ``train.py``, ``model.py`` and
``configurator.py`` are run from a scratch directory, as they are but for the seed: round ``k`` replaces
its fixed ``torch.manual_seed(1337 + ...)`` by seed ``1337 + k``, the seed disttrain gets in that round).
Both sides train the same model at nanoGPT's CPU settings (4 layers, 4 heads, width 128, context 64, no bias,
tied embedding, dropout 0, batch 12, AdamW lr 1e-3 with betas (0.9, 0.99), weight decay 0.1, 100 warm-up
steps, cosine to 1e-4, clipping at 1.0) on the same token files: Python's documentation as bytes, the last
10% held out, written in nanoGPT's format (uint16 ``train.bin``/``val.bin`` and ``meta.pkl``). Both run in
one process with the same threads, one after the other, alternating over ``--rounds``.

Tokens/s: mean over the steps after the first, validation and checkpoint saves left out (nanoGPT's own
per-iteration timer; disttrain's ``results.json``); the best round counts. Validation loss after the last
step, in bits per byte, by one estimator for both: every non-overlapping window of ``val.bin`` (disttrain's
validation; nanoGPT's final checkpoint is loaded into disttrain's GPT and scored the same way, since its own
estimate from 100 random batches varies by about 0.03 bits). The mean over the rounds' seeds counts, and
the table gives the range: between seeds nanoGPT's result varies by up to 0.04 bits per byte here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from machine import cpu_features, cpu_model  # noqa: E402

BATCH, BLOCK = 12, 64
NANOGPT_FILES = ("train.py", "model.py", "configurator.py")
VARIANTS = {
    "fp32": ["trainer.precision=32-true"],
    "bf16": ["trainer.precision=bf16-mixed"],
    "compile": ["trainer.compile=true"],
    "bf16+compile": ["trainer.precision=bf16-mixed", "trainer.compile=true"],
    "auto": ["trainer.precision=auto"],
}
"""disttrain's configurations, by the name the table gives them."""


def write_corpus(data_dir: Path, vocab_size: int | None = 256) -> None:
    """Python's documentation as byte tokens in nanoGPT's format: 90% train, 10% validation; ``meta.pkl`` names
    ``vocab_size`` (None: no meta.pkl, and nanoGPT takes GPT-2's padded vocabulary of 50304)."""
    from disttrain.data.text import pydocs_bytes

    data = pydocs_bytes().astype(np.uint16)
    split = len(data) - int(len(data) * 0.1)
    data_dir.mkdir(parents=True, exist_ok=True)
    data[:split].tofile(data_dir / "train.bin")
    data[split:].tofile(data_dir / "val.bin")
    if vocab_size is not None:
        with open(data_dir / "meta.pkl", "wb") as handle:  # nanoGPT reads the vocabulary from here
            pickle.dump({"vocab_size": vocab_size}, handle)


def iterations(stdout: str) -> dict[int, tuple[float, float]]:
    """nanoGPT's per-iteration log lines: iteration -> (its loss, its milliseconds)."""
    return {int(m[1]): (float(m[2]), float(m[3]))
            for m in re.finditer(r"^iter (\d+): loss ([\d.]+), time ([\d.]+)ms", stdout, re.M)}


def run_nanogpt(workdir: Path, steps: int, seed: int) -> dict[str, float]:
    """nanoGPT's train.py at its CPU settings and ``seed``; tokens/s over iterations 1..steps-1, the val bpb
    of its final checkpoint by disttrain's estimator, and its own estimate."""
    script = (workdir / "train.py").read_text()
    fixed = "torch.manual_seed(1337 + seed_offset)"
    if fixed not in script:
        raise RuntimeError(f"nanoGPT's train.py no longer seeds with {fixed!r}; update this benchmark")
    (workdir / "train_seeded.py").write_text(script.replace(fixed, f"torch.manual_seed({seed} + seed_offset)"))
    out = workdir / f"out-{seed}"
    args = [f"--max_iters={steps}", f"--lr_decay_iters={steps}", f"--eval_interval={steps}",
            "--eval_iters=100", "--dataset=pydocs", "--device=cpu", "--compile=False",
            "--log_interval=1", f"--block_size={BLOCK}", f"--batch_size={BATCH}", "--n_layer=4", "--n_head=4",
            "--n_embd=128", "--dropout=0.0", "--learning_rate=1e-3", "--min_lr=1e-4", "--beta2=0.99",
            "--warmup_iters=100", "--always_save_checkpoint=True", "--gradient_accumulation_steps=1",
            f"--out_dir={out}"]
    done = subprocess.run([sys.executable, "train_seeded.py", *args], cwd=workdir, capture_output=True, text=True,
                          env=os.environ.copy())
    if done.returncode:
        raise RuntimeError(f"nanoGPT failed:\n{done.stderr[-3000:]}")
    times = {i: ms for i, (_, ms) in iterations(done.stdout).items()}
    vals = [float(m[1]) for m in re.finditer(r"val loss ([\d.]+)", done.stdout)]
    # iteration 0 and the last one include the evaluations that run before them
    steady = [times[i] for i in range(1, steps) if i in times]
    return {"tokens_per_s": BATCH * BLOCK / (statistics.mean(steady) / 1000),
            "val_bpb": every_window_bpb(out / "ckpt.pt", workdir / "data" / "pydocs" / "val.bin"),
            "own_estimate_bpb": vals[-1] / math.log(2)}


def every_window_bpb(checkpoint: Path, val_file: Path) -> float:
    """Bits per byte of nanoGPT's checkpoint over every non-overlapping window of ``val_file``, computed by
    disttrain's GPT (the same architecture: nanoGPT's fused ``c_attn`` rows are query, key and value)."""
    import torch

    from disttrain.checkpoint.io import load_weights_file
    from disttrain.data.windows import TokenWindows
    from disttrain.models.gpt import GPT, GPTDims

    state = load_weights_file(checkpoint)["model"]
    state = {key.removeprefix("_orig_mod.").removeprefix("transformer."): value for key, value in state.items()}
    ours = {"embed.wte.weight": state["wte.weight"], "embed.wpe.weight": state["wpe.weight"],
            "ln_f.weight": state["ln_f.weight"], "lm_head.weight": state["lm_head.weight"]}
    for i in range(4):
        q, k, v = state[f"h.{i}.attn.c_attn.weight"].chunk(3)
        ours.update({f"blocks.{i}.ln_1.weight": state[f"h.{i}.ln_1.weight"], f"blocks.{i}.attn.q.weight": q,
                     f"blocks.{i}.attn.k.weight": k, f"blocks.{i}.attn.v.weight": v,
                     f"blocks.{i}.attn.proj.weight": state[f"h.{i}.attn.c_proj.weight"],
                     f"blocks.{i}.ln_2.weight": state[f"h.{i}.ln_2.weight"],
                     f"blocks.{i}.mlp.fc.weight": state[f"h.{i}.mlp.c_fc.weight"],
                     f"blocks.{i}.mlp.proj.weight": state[f"h.{i}.mlp.c_proj.weight"]})
    model = GPT(GPTDims(n_layer=4, n_head=4, n_embd=128, block_size=BLOCK, vocab_size=256), bias=False)
    model.load_state_dict(ours)
    windows = TokenWindows(np.fromfile(val_file, dtype=np.uint16), BLOCK)
    nats, tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(windows), 256):
            x, y = windows.get_batch(list(range(start, min(start + 256, len(windows)))))
            nats += torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").item()
            tokens += y.numel()
    return nats / tokens / math.log(2)


def run_disttrain(data_dir: Path, steps: int, seed: int, extra: list[str], run_dir: Path) -> dict[str, float]:
    """``recipe=gpt_pydocs`` on the same files and hyper-parameters; tokens/s and val bpb from results.json."""
    args = ["recipe=gpt_pydocs", "data=tokens", f"data.path={data_dir}", "data.vocab_size=256",
            f"data.block_size={BLOCK}", "model.bias=false", f"batch.global_size={BATCH}",
            f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}", "trainer.limit_val_batches=null",
            "trainer.run_test=false", "optim.lr=1e-3", "optim.betas=[0.9,0.99]", "optim.weight_decay=0.1",
            "scheduler.warmup_fraction=null", "scheduler.warmup_steps=100", "scheduler.min_lr_ratio=0.1",
            "trainer.gradient_clip_val=1.0", "logger=csv", "expect=null", f"seed={seed}", *extra,
            f"hydra.run.dir={run_dir}"]
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode:
        raise RuntimeError(f"disttrain failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    results = json.loads((run_dir / "results.json").read_text())
    return {"tokens_per_s": results["tokens_per_sec"], "val_bpb": results["metrics"]["val/bpb"],
            "precision": results.get("precision", ""), "first_step_s": results["throughput"]["time_to_first_step_s"]}


def main() -> None:
    """Run both sides, alternating, and print the table and the headline ratio."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nanogpt", required=True, type=Path, help="a checkout of karpathy/nanoGPT")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each with its own seed (1337 + round)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--variants", default="fp32,bf16,compile,auto",
                        help=f"disttrain configurations, from {', '.join(VARIANTS)}")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not all((args.nanogpt / f).is_file() for f in NANOGPT_FILES):
        sys.exit(f"Error: --variants {unknown} unknown (one of {', '.join(VARIANTS)})" if unknown else
                 f"Error: --nanogpt {args.nanogpt} holds no {', '.join(NANOGPT_FILES)}")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        for name in NANOGPT_FILES:
            shutil.copy(args.nanogpt / name, work / name)
        write_corpus(work / "data" / "pydocs")
        for round_ in range(args.rounds):
            seed = 1337 + round_
            for variant in ["nanoGPT", *variants]:
                if variant == "nanoGPT":
                    result = run_nanogpt(work, args.steps, seed)
                else:
                    result = run_disttrain(work / "data" / "pydocs", args.steps, seed, VARIANTS[variant],
                                           work / f"run-{variant}-{round_}")
                print(f"round {round_ + 1} (seed {seed}) {variant}: {result}", flush=True)
                results.setdefault(variant, []).append(result)
    speed = {variant: max(r["tokens_per_s"] for r in rounds) for variant, rounds in results.items()}
    bpb = {variant: [r["val_bpb"] for r in rounds] for variant, rounds in results.items()}
    reference = speed["nanoGPT"]
    print(f"\nCPU: {cpu_model()} ({cpu_features()}), {args.threads} threads, one process, {args.steps} steps "
          f"of batch {BATCH} x {BLOCK} tokens, {args.rounds} rounds (seeds 1337..{1336 + args.rounds})\n")
    print("| trainer | precision | tokens/s (best round) | vs nanoGPT | val bpb, mean of the seeds (range) "
          "| first step (s) |")
    print("|---|---|---:|---:|---:|---:|")
    for variant, rounds in results.items():
        precision = rounds[0].get("precision") or "fp32"
        first = f"{min(r['first_step_s'] for r in rounds):.1f}" if "first_step_s" in rounds[0] else "-"
        print(f"| {variant} | {precision} | {speed[variant]:,.0f} | {speed[variant] / reference:.2f}x "
              f"| {statistics.mean(bpb[variant]):.4f} ({min(bpb[variant]):.4f}-{max(bpb[variant]):.4f}) | {first} |")
    own = [r["own_estimate_bpb"] for r in results["nanoGPT"]]
    print(f"\nnanoGPT's own estimate (100 random validation batches): mean {statistics.mean(own):.4f} "
          f"({min(own):.4f}-{max(own):.4f})")
    fastest = max(variants, key=speed.__getitem__)
    print(f"disttrain ({fastest}) vs nanoGPT: {speed[fastest] / reference:.2f}x tokens/s, "
          f"val bpb {statistics.mean(bpb[fastest]):.4f} vs {statistics.mean(bpb['nanoGPT']):.4f}")


if __name__ == "__main__":
    main()
