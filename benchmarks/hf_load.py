"""Starting a 1B-parameter-class Hugging Face model from its safetensors under ZeRO-3: memory of the largest rank.

A seeded Llama-architecture model (built from config, saved locally once with ``save_pretrained``) is started
with ``model=hf model.path=DIR model.pretrained=true parallel=zero3`` on N ranks. The model is built on the meta
device, sharded, and each rank allocates and reads only its shards (torch.distributed.checkpoint's Hugging Face
reader), so the largest rank's peak resident memory when training starts is compared with the whole model's
fp32 size, and with the same run built whole on every rank first (``model.pretrained=false``: a seeded
initialisation, sharded afterwards).
Also: the time from the command to the first step, and the time to export the trained checkpoint back to a
Hugging Face folder.

    python benchmarks/hf_load.py [--ranks 4] [--hidden 2048] [--layers 16] [--intermediate 5504] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


class PeakAtStart(pl.Callback):
    """Writes each rank's peak resident memory when training starts (the weights are loaded by then) into
    ``logs/peak_rank<N>.json`` of the run directory."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        folder = Path(trainer.default_root_dir) / "logs"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"peak_rank{trainer.global_rank}.json").write_text(json.dumps({"peak_rss": peak_rss_bytes()}))


def cpu_model() -> str:
    """The CPU's model name and its bf16 instructions, for the table."""
    sys.path.insert(0, str(ROOT))
    from disttrain.plan.devices import native_bf16

    name = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), platform.processor() or "unknown CPU")
    return f"{name} ({native_bf16(False)[1]})"


def save_model(folder: Path, args: argparse.Namespace) -> int:
    """Save the seeded model once; its parameter count."""
    import torch
    import transformers

    config = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                      num_key_value_heads=args.heads, vocab_size=args.vocab,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    count = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=5504)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=ROOT / "outputs") as scratch:
        scratch = Path(scratch)
        folder, run_dir = scratch / "model", scratch / "run"
        params = save_model(folder, args)
        fp32 = params * 4
        pretrained = run_peaks(folder, run_dir, args.ranks, "true")
        whole = run_peaks(folder, scratch / "whole", args.ranks, "false")
        first_step = json.loads((run_dir / "results.json").read_text())["throughput"]["time_to_first_step_s"]
        sys.path.insert(0, str(ROOT))
        from disttrain.checkpoint.export import export_hf

        started = time.perf_counter()
        export_hf(run_dir, scratch / "exported")
        export_s = time.perf_counter() - started
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; {params / 1e9:.2f}B parameters, fp32 {fp32 / GIB:.2f} GiB; "
          f"ZeRO-3 on {args.ranks} gloo ranks")
    print()
    print("| rank | from the folder, built on meta: GiB | / model fp32 | built whole first: GiB | / model fp32 |")
    print("|---|---|---|---|---|")
    for rank, (ours, theirs) in enumerate(zip(pretrained, whole, strict=True)):
        print(f"| {rank} | {ours / GIB:.2f} | {ours / fp32:.2f} | {theirs / GIB:.2f} | {theirs / fp32:.2f} |")
    print()
    print(f"time to first step {first_step:.1f} s from the command; export to a Hugging Face folder {export_s:.1f} s")
    print(f"Headline: the largest rank's peak is {max(pretrained) / fp32:.2f}x the model's fp32 size "
          f"({max(pretrained) / max(whole):.2f}x the same run built whole on every rank)")


def run_peaks(folder: Path, run_dir: Path, ranks: int, pretrained: str) -> list[int]:
    """Start the model on ``ranks`` ZeRO-3 ranks for one step; each rank's peak when training started."""
    command = [sys.executable, "train.py", "model=hf", f"model.path={folder}", f"model.pretrained={pretrained}",
               "data=pydocs", "data.block_size=64", f"batch.global_size={ranks}", "parallel=zero3",
               f"trainer.devices={ranks}", "trainer.max_steps=1", "trainer.run_test=false",
               "trainer.limit_val_batches=0", "optim=sgd", "logger=none", "callbacks=none", "plots=false",
               "energy=false", "+callbacks.peak._target_=hf_load.PeakAtStart", f"hydra.run.dir={run_dir}"]
    # the ranks import this module by its file's name (an installed package may be called "benchmarks")
    subprocess.run(command, cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "benchmarks")},
                   stdout=subprocess.DEVNULL)
    return [json.loads((run_dir / "logs" / f"peak_rank{r}.json").read_text())["peak_rss"] for r in range(ranks)]


if __name__ == "__main__":
    main()
