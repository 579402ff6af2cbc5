"""disttrain's GPT recipe side by side with nanoGPT's ``train.py``: tokens/s and validation loss at equal steps.

    python benchmarks/nanogpt.py --nanogpt PATH [--steps 300] [--repeats 2] [--variants fp32,bf16,compile]

PATH is a checkout of https://github.com/karpathy/nanoGPT (its ``train.py``, ``model.py`` and
``configurator.py`` are run as they are, from a scratch directory). Both sides train the same model at
nanoGPT's CPU settings (4 layers, 4 heads, width 128, context 64, no bias, tied embedding, dropout 0,
batch 12, AdamW lr 1e-3 with betas (0.9, 0.99), weight decay 0.1, 100 warm-up steps, cosine to 1e-4,
clipping at 1.0) on the same token files: Python's documentation as bytes, the last 10% held out, written
in nanoGPT's format (uint16 ``train.bin``/``val.bin`` and ``meta.pkl``). Both run in one process with the
same threads, one after the other, alternating over ``--repeats`` rounds; each side's best round counts.

Tokens/s: mean over the steps after the first, validation and checkpoint saves left out (nanoGPT's own
per-iteration timer; disttrain's ``results.json``). Validation loss at the last step in bits per byte:
nanoGPT estimates it from ``eval_iters`` random batches, disttrain from every validation window.
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
    "fp32": [],
    "bf16": ["trainer.precision=bf16-mixed"],
    "compile": ["trainer.compile=true"],
    "bf16+compile": ["trainer.precision=bf16-mixed", "trainer.compile=true"],
    "auto": ["trainer.precision=auto"],
}
"""disttrain's configurations, by the name the table gives them."""


def write_corpus(data_dir: Path) -> None:
    """Python's documentation as byte tokens in nanoGPT's format: 90% train, 10% validation."""
    from disttrain.data.text import pydocs_bytes

    data = pydocs_bytes().astype(np.uint16)
    split = len(data) - int(len(data) * 0.1)
    data_dir.mkdir(parents=True, exist_ok=True)
    data[:split].tofile(data_dir / "train.bin")
    data[split:].tofile(data_dir / "val.bin")
    with open(data_dir / "meta.pkl", "wb") as handle:  # nanoGPT reads the vocabulary from here
        pickle.dump({"vocab_size": 256}, handle)


def run_nanogpt(workdir: Path, steps: int, eval_iters: int) -> dict[str, float]:
    """nanoGPT's train.py at its CPU settings; tokens/s over iterations 1..steps-1 and the final val loss."""
    args = [f"--max_iters={steps}", f"--lr_decay_iters={steps}", f"--eval_interval={steps}",
            f"--eval_iters={eval_iters}", "--dataset=pydocs", "--device=cpu", "--compile=False",
            "--log_interval=1", f"--block_size={BLOCK}", f"--batch_size={BATCH}", "--n_layer=4", "--n_head=4",
            "--n_embd=128", "--dropout=0.0", "--learning_rate=1e-3", "--min_lr=1e-4", "--beta2=0.99",
            "--warmup_iters=100", "--always_save_checkpoint=False", "--gradient_accumulation_steps=1",
            f"--out_dir={workdir / 'out'}"]
    done = subprocess.run([sys.executable, "train.py", *args], cwd=workdir, capture_output=True, text=True,
                          env=os.environ.copy())
    if done.returncode:
        raise RuntimeError(f"nanoGPT failed:\n{done.stderr[-3000:]}")
    times = {int(m[1]): float(m[2]) for m in re.finditer(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms",
                                                          done.stdout, re.M)}
    vals = [float(m[1]) for m in re.finditer(r"val loss ([\d.]+)", done.stdout)]
    # iteration 0 and the last one include the evaluations that run before them
    steady = [times[i] for i in range(1, steps) if i in times]
    return {"tokens_per_s": BATCH * BLOCK / (statistics.mean(steady) / 1000), "val_bpb": vals[-1] / math.log(2)}


def run_disttrain(data_dir: Path, steps: int, extra: list[str], run_dir: Path) -> dict[str, float]:
    """``recipe=gpt_pydocs`` on the same files and hyper-parameters; tokens/s and val bpb from results.json."""
    args = ["recipe=gpt_pydocs", "data=tokens", f"data.path={data_dir}", "data.vocab_size=256",
            f"data.block_size={BLOCK}", "model.bias=false", f"batch.global_size={BATCH}",
            f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}", "trainer.limit_val_batches=null",
            "trainer.run_test=false", "optim.lr=1e-3", "optim.betas=[0.9,0.99]", "optim.weight_decay=0.1",
            "scheduler.warmup_fraction=null", "scheduler.warmup_steps=100", "scheduler.min_lr_ratio=0.1",
            "trainer.gradient_clip_val=1.0", "logger=csv", "expect=null", *extra, f"hydra.run.dir={run_dir}"]
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
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--eval-iters", type=int, default=100)
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
    best: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        for name in NANOGPT_FILES:
            shutil.copy(args.nanogpt / name, work / name)
        write_corpus(work / "data" / "pydocs")
        for round_ in range(args.repeats):
            for variant in ["nanoGPT", *variants]:
                if variant == "nanoGPT":
                    result = run_nanogpt(work, args.steps, args.eval_iters)
                else:
                    result = run_disttrain(work / "data" / "pydocs", args.steps, VARIANTS[variant],
                                           work / f"run-{variant}-{round_}")
                print(f"round {round_ + 1} {variant}: {result}", flush=True)
                if variant not in best or result["tokens_per_s"] > best[variant]["tokens_per_s"]:
                    best[variant] = result
    reference = best["nanoGPT"]["tokens_per_s"]
    print(f"\nCPU: {cpu_model()} ({cpu_features()}), {args.threads} threads, one process, {args.steps} steps "
          f"of batch {BATCH} x {BLOCK} tokens, best of {args.repeats}\n")
    print("| trainer | precision | tokens/s | vs nanoGPT | val bpb at the last step | first step (s) |")
    print("|---|---|---:|---:|---:|---:|")
    for variant, result in best.items():
        precision = result.get("precision") or "fp32"
        first = f"{result['first_step_s']:.1f}" if "first_step_s" in result else "-"
        print(f"| {variant} | {precision} | {result['tokens_per_s']:,.0f} | {result['tokens_per_s'] / reference:.2f}x "
              f"| {result['val_bpb']:.4f} | {first} |")
    fastest = max(variants, key=lambda v: best[v]["tokens_per_s"])
    print(f"\ndisttrain ({fastest}) vs nanoGPT: {best[fastest]['tokens_per_s'] / reference:.2f}x tokens/s, "
          f"val bpb {best[fastest]['val_bpb']:.4f} vs {best['nanoGPT']['val_bpb']:.4f}")


if __name__ == "__main__":
    main()
