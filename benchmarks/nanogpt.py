"""disttrain's GPT recipe side by side with nanoGPT's ``train.py``: tokens/s and validation loss at equal steps.

    python benchmarks/nanogpt.py --nanogpt PATH [--steps 300] [--rounds 3] [--variants fp32,bf16,compile,auto]
        [--same-init] [--device cpu|cuda]

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

``--same-init``: both sides start from the same weights. Each round builds nanoGPT's initial model as its
``train.py`` does (its ``model.py``'s ``GPT(config)`` right after ``torch.manual_seed(seed)``), writes it under
disttrain's names as a safetensors file (the tied embedding and head once) and starts disttrain from it with
``model.init_weights``; nanoGPT starts from its own initialisation, which is those weights (its ``train.py`` also
writes the model it built, and the round stops unless every tensor equals the file's). The data order still
differs (nanoGPT samples random windows with its own generator, disttrain reads shuffled windows of its own), so
the comparison is the loss curves at an equal start, over the seeds: each side's training loss at the same steps
(nanoGPT's per-iteration lines, disttrain's CSV log), averaged over windows of steps and over the rounds, beside
the final validation bits per byte by the one estimator.

``--device cuda``: the same comparison on a GPU at GPT-2 124M's size (12 layers, 12 heads, width 768, context 1024,
GPT-2's vocabulary padded to 50304, of which the bytes use the first 256) and nanoGPT's batch of 12 sequences, with
nanoGPT's GPU settings (``--device=cuda --dtype=bfloat16 --compile=True``: bf16 autocast over fp32 weights, the whole
model compiled; its learning rate 6e-4 to 6e-5 and betas (0.9, 0.95)) and disttrain's matching ones
(``trainer.accelerator=cuda``, ``bf16-mixed``, ``trainer.compile_scope=model``: the ``bf16+compile-model``
variant); gradient accumulation 1 and 100 warm-up steps on both, as on the CPU. The validation estimator runs on the
GPU under the same bf16 autocast. The corpus is small for this model: the header line says how many passes over the
training file the run makes, and past the first the two data orders (random windows against shuffled fixed
windows) weigh on the curves more than on the CPU. The tokens/s columns are each side's own clock with its
compilation in the first steps; ``throughput_mfu.py`` is the speed measurement.
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from machine import cpu_features, cpu_model  # noqa: E402

NANOGPT_FILES = ("train.py", "model.py", "configurator.py")
VARIANTS = {
    "fp32": ["trainer.precision=32-true"],
    "bf16": ["trainer.precision=bf16-mixed"],
    "compile": ["trainer.compile=true"],
    "bf16+compile": ["trainer.precision=bf16-mixed", "trainer.compile=true"],
    "bf16+compile-model": ["trainer.precision=bf16-mixed", "trainer.compile=true", "trainer.compile_scope=model"],
    "auto": ["trainer.precision=auto"],
}
"""disttrain's configurations, by the name the table gives them."""
GPT2_VOCAB = 50304
"""GPT-2's vocabulary padded to a multiple of 64: nanoGPT's when its data folder names none."""


@dataclass(frozen=True)
class Setting:
    """The model, batch and schedule both sides train at on one device, and each side's flags for that device."""

    device: str
    n_layer: int
    n_head: int
    n_embd: int
    block: int
    """Context length in tokens."""
    batch: int
    """Sequences per optimiser step (no gradient accumulation on either side)."""
    meta_vocab: int | None
    """The vocabulary ``meta.pkl`` names (None: no meta.pkl, and nanoGPT takes ``GPT2_VOCAB``)."""
    lr: float
    min_lr: float
    beta2: float
    warmup: int
    """Warm-up steps of both sides' learning rate (nanoGPT's cosine divides by the steps after them)."""
    nanogpt_flags: tuple[str, ...]
    """nanoGPT's ``train.py`` flags for the device, its precision and compilation."""
    disttrain_overrides: tuple[str, ...]
    """disttrain's overrides beyond ``recipe=gpt_pydocs``'s model and device."""
    variants: str
    """``--variants``' default here."""

    @property
    def vocab(self) -> int:
        """The vocabulary both models are built with."""
        return self.meta_vocab or GPT2_VOCAB


SETTINGS = {
    "cpu": Setting("cpu", 4, 4, 128, 64, 12, 256, 1e-3, 1e-4, 0.99, 100, ("--device=cpu", "--compile=False"), (),
                   "fp32,bf16,compile,auto"),
    "cuda": Setting("cuda", 12, 12, 768, 1024, 12, None, 6e-4, 6e-5, 0.95, 100,
                    ("--device=cuda", "--compile=True", "--dtype=bfloat16"),
                    ("model.flavour=gpt2", f"model.vocab_size={GPT2_VOCAB}", "trainer.accelerator=cuda",
                     "trainer.devices=1"), "bf16+compile-model"),
}
"""By ``--device``: nanoGPT's CPU settings (its README's small model), and GPT-2 124M at nanoGPT's GPU defaults
(batch 12 x 1024, lr 6e-4 to 6e-5, betas (0.9, 0.95), bf16, compiled), its warm-up shortened to the CPU's 100."""


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


def run_nanogpt(workdir: Path, steps: int, seed: int, setting: Setting, same_init: Path | None = None) -> dict:
    """nanoGPT's train.py at ``setting`` and ``seed``; tokens/s over iterations 1..steps-1, the val bpb
    of its final checkpoint by disttrain's estimator, its own estimate and its loss at each iteration. With
    ``same_init`` (the file disttrain starts from), its train.py also writes the model it built, which must equal
    the file."""
    script = (workdir / "train.py").read_text()
    fixed, built = "torch.manual_seed(1337 + seed_offset)", "    model = GPT(gptconf)\n"
    if fixed not in script or built not in script:
        raise RuntimeError(f"nanoGPT's train.py no longer seeds with {fixed!r} and builds with {built.strip()!r}; "
                           "update this benchmark")
    script = script.replace(fixed, f"torch.manual_seed({seed} + seed_offset)")
    out = workdir / f"out-{seed}"
    if same_init is not None:  # writing the model draws no random number: its training is unchanged
        script = script.replace(built, f"{built}    torch.save(model.state_dict(), {str(out / 'init.pt')!r})\n", 1)
    (workdir / "train_seeded.py").write_text(script)
    s = setting
    args = [f"--max_iters={steps}", f"--lr_decay_iters={steps}", f"--eval_interval={steps}",
            "--eval_iters=100", "--dataset=pydocs", *s.nanogpt_flags,
            "--log_interval=1", f"--block_size={s.block}", f"--batch_size={s.batch}", f"--n_layer={s.n_layer}",
            f"--n_head={s.n_head}", f"--n_embd={s.n_embd}", "--dropout=0.0", f"--learning_rate={s.lr:g}",
            f"--min_lr={s.min_lr:g}", f"--beta2={s.beta2:g}", f"--warmup_iters={s.warmup}",
            "--always_save_checkpoint=True", "--gradient_accumulation_steps=1", f"--out_dir={out}"]
    done = subprocess.run([sys.executable, "train_seeded.py", *args], cwd=workdir, capture_output=True, text=True,
                          env=os.environ.copy())
    if done.returncode:
        raise RuntimeError(f"nanoGPT failed:\n{done.stderr[-3000:]}")
    logged = iterations(done.stdout)
    times = {i: ms for i, (_, ms) in logged.items()}
    vals = [float(m[1]) for m in re.finditer(r"val loss ([\d.]+)", done.stdout)]
    # iteration 0 and the last one include the evaluations that run before them
    steady = [times[i] for i in range(1, steps) if i in times]
    result = {"tokens_per_s": s.batch * s.block / (statistics.mean(steady) / 1000),
              "val_bpb": every_window_bpb(out / "ckpt.pt", workdir / "data" / "pydocs" / "val.bin", s),
              "own_estimate_bpb": vals[-1] / math.log(2), "losses": [logged[i][0] for i in range(steps)]}
    if same_init is not None:
        result["start_difference"] = check_same_start(out / "init.pt", same_init)
    return result


def disttrain_names(state: dict) -> dict:
    """nanoGPT's GPT state dict under disttrain's GPT names (the same architecture: nanoGPT's fused ``c_attn`` rows
    are query, key and value), the tied head included as ``lm_head.weight``."""
    state = {key.removeprefix("_orig_mod.").removeprefix("transformer."): value for key, value in state.items()}
    ours = {"embed.wte.weight": state["wte.weight"], "embed.wpe.weight": state["wpe.weight"],
            "ln_f.weight": state["ln_f.weight"], "lm_head.weight": state["lm_head.weight"]}
    for i in range(sum(key.endswith(".attn.c_attn.weight") for key in state)):
        q, k, v = state[f"h.{i}.attn.c_attn.weight"].chunk(3)
        ours.update({f"blocks.{i}.ln_1.weight": state[f"h.{i}.ln_1.weight"], f"blocks.{i}.attn.q.weight": q,
                     f"blocks.{i}.attn.k.weight": k, f"blocks.{i}.attn.v.weight": v,
                     f"blocks.{i}.attn.proj.weight": state[f"h.{i}.attn.c_proj.weight"],
                     f"blocks.{i}.ln_2.weight": state[f"h.{i}.ln_2.weight"],
                     f"blocks.{i}.mlp.fc.weight": state[f"h.{i}.mlp.c_fc.weight"],
                     f"blocks.{i}.mlp.proj.weight": state[f"h.{i}.mlp.c_proj.weight"]})
    return ours


def write_nanogpt_init(workdir: Path, seed: int, path: Path, setting: Setting) -> Path:
    """nanoGPT's initial model at ``seed``, built as its ``train.py`` builds it at ``setting`` (seed, then
    ``GPT(config)`` of its ``model.py``, nothing drawn between), written under disttrain's names to ``path`` (a
    safetensors file; the head, tied to the embedding, once)."""
    import importlib.util

    import torch
    from safetensors.torch import save_file

    spec = importlib.util.spec_from_file_location("nanogpt_model", workdir / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(seed)
    model = module.GPT(module.GPTConfig(n_layer=setting.n_layer, n_head=setting.n_head, n_embd=setting.n_embd,
                                        block_size=setting.block, bias=False, vocab_size=setting.vocab, dropout=0.0))
    state = disttrain_names(model.state_dict())
    del state["lm_head.weight"]  # disttrain's GPT ties it to embed.wte.weight, as nanoGPT does
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(path))
    return path


def check_same_start(nanogpt_init: Path, file: Path) -> float:
    """The largest difference between the model nanoGPT's ``train.py`` built (written beside its checkpoint) and
    the file disttrain starts from; RuntimeError unless it is zero for every tensor."""
    from functools import partial

    from disttrain.checkpoint.io import CheckpointReadError, load_weights_file
    from disttrain.safetensors_reader import SafetensorsFile

    built = disttrain_names(load_weights_file(nanogpt_init))
    written = SafetensorsFile(Path(file), partial(CheckpointReadError, file)).tensors()
    differences = {name: (built[name] - tensor).abs().max().item() for name, tensor in written.items()}
    if set(built) - {"lm_head.weight"} != set(written):
        raise RuntimeError(f"nanoGPT built {sorted(built)}, the file holds {sorted(written)}")
    if any(differences.values()):
        worst = max(differences, key=differences.__getitem__)
        raise RuntimeError(f"nanoGPT did not start from {file}: {sum(map(bool, differences.values()))} tensors "
                           f"differ, most {worst} (by {differences[worst]:g})")
    return max(differences.values())


def every_window_bpb(checkpoint: Path, val_file: Path, setting: Setting) -> float:
    """Bits per byte of nanoGPT's checkpoint over every non-overlapping window of ``val_file``, computed by
    disttrain's GPT (the same architecture: nanoGPT's fused ``c_attn`` rows are query, key and value) on
    ``setting``'s device: fp32 on the CPU, under bf16 autocast on a GPU (as both sides trained and disttrain
    validates there)."""
    import contextlib

    import torch

    from disttrain.checkpoint.io import load_weights_file
    from disttrain.data.windows import TokenWindows
    from disttrain.models.gpt import GPT, GPTDims

    s = setting
    model = GPT(GPTDims(n_layer=s.n_layer, n_head=s.n_head, n_embd=s.n_embd, block_size=s.block,
                        vocab_size=s.vocab), bias=False)
    model.load_state_dict(disttrain_names(load_weights_file(checkpoint)["model"]))
    model.to(s.device)
    windows = TokenWindows(np.fromfile(val_file, dtype=np.uint16), s.block)
    per_batch = max(1, 16384 // s.block)  # a batch's logits stay a few GB at GPT-2's vocabulary
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if s.device == "cuda" else contextlib.nullcontext())
    nats, tokens = 0.0, 0
    with torch.no_grad(), autocast:
        for start in range(0, len(windows), per_batch):
            x, y = (t.to(s.device) for t in windows.get_batch(list(range(start, min(start + per_batch,
                                                                                      len(windows))))))
            nats += torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(),
                                                      reduction="sum").item()
            tokens += y.numel()
    return nats / tokens / math.log(2)


def run_disttrain(data_dir: Path, steps: int, seed: int, extra: list[str], run_dir: Path, setting: Setting,
                  init_weights: Path | None = None) -> dict:
    """``recipe=gpt_pydocs`` on the same files and hyper-parameters, at ``setting``; tokens/s and val bpb from
    results.json. With ``init_weights``, started from that file, and the loss of every step from the CSV log."""
    if init_weights is not None:  # every step logged, as nanoGPT's log_interval=1 prints every iteration
        extra = [*extra, f"model.init_weights={init_weights}", "trainer.log_every_n_steps=1"]
    s = setting
    args = ["recipe=gpt_pydocs", "data=tokens", f"data.path={data_dir}", f"data.vocab_size={s.vocab}",
            f"data.block_size={s.block}", "model.bias=false", f"batch.global_size={s.batch}",
            f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}", "trainer.limit_val_batches=null",
            "trainer.run_test=false", f"optim.lr={s.lr:g}", f"optim.betas=[0.9,{s.beta2:g}]",
            "optim.weight_decay=0.1", "scheduler.warmup_fraction=null", f"scheduler.warmup_steps={s.warmup}",
            f"scheduler.min_lr_ratio={s.min_lr / s.lr:g}", "trainer.gradient_clip_val=1.0", "logger=csv",
            "expect=null", f"seed={seed}", *s.disttrain_overrides, *extra, f"hydra.run.dir={run_dir}"]
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode:
        raise RuntimeError(f"disttrain failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    results = json.loads((run_dir / "results.json").read_text())
    # every token of these files is one byte; disttrain names bits per byte only at a byte vocabulary (256), not
    # at GPT-2's padded one, so its loss in nats per token converts here
    result = {"tokens_per_s": results["tokens_per_sec"], "val_bpb": results["metrics"]["val/loss"] / math.log(2),
              "precision": results.get("precision", ""),
              "first_step_s": results["throughput"]["time_to_first_step_s"]}
    if init_weights is not None:
        result["losses"] = step_losses(run_dir / "csv" / "metrics.csv")
    return result


def step_losses(metrics_csv: Path) -> list[float]:
    """disttrain's training loss of each optimiser step, in order, from its CSV log (a step's first row)."""
    import csv

    by_step: dict[int, float] = {}
    with open(metrics_csv) as handle:
        for row in csv.DictReader(handle):
            if row.get("train/loss"):
                by_step.setdefault(int(row["step"]), float(row["train/loss"]))
    return [by_step[step] for step in sorted(by_step)]


def curve_windows(steps: int) -> list[tuple[int, int]]:
    """The windows of steps the curves are compared over: the first step alone (equal weights, different
    batches), then ten windows of equal length (a window's mean evens out the batch-to-batch noise)."""
    width = max(1, (steps - 1) // 10)
    return [(0, 1)] + [(start, min(start + width, steps)) for start in range(1, steps, width)]


def print_curves(results: dict[str, list[dict]], steps: int) -> None:
    """Each side's training loss over windows of steps, mean over the rounds, and disttrain's difference."""
    sides = [side for side, rounds in results.items() if "losses" in rounds[0]]
    print("\nTraining loss (nats per token) at equal start, mean over the steps of each window and over the seeds:\n")
    print("| steps | " + " | ".join(sides) + " | " + " | ".join(f"{side} - nanoGPT" for side in sides[1:]) + " |")
    print("|---|" + "---:|" * (2 * len(sides) - 1))
    gaps: dict[str, list[float]] = {side: [] for side in sides[1:]}
    for start, end in curve_windows(steps):
        means = {side: statistics.mean(statistics.mean(r["losses"][start:end]) for r in results[side])
                 for side in sides}
        for side in sides[1:]:
            gaps[side].append(means[side] - means["nanoGPT"])
        label = f"{start}" if end == start + 1 else f"{start}-{end - 1}"
        print(f"| {label} | " + " | ".join(f"{means[side]:.4f}" for side in sides) + " | "
              + " | ".join(f"{means[side] - means['nanoGPT']:+.4f}" for side in sides[1:]) + " |")
    for side in sides[1:]:
        print(f"{side} vs nanoGPT at equal start: mean window difference {statistics.mean(gaps[side][1:]):+.4f} "
              f"nats (largest {max(gaps[side][1:], key=abs):+.4f}) over steps 1-{steps - 1}")


def main() -> None:
    """Run both sides, alternating, and print the table and the headline ratio."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nanogpt", required=True, type=Path, help="a checkout of karpathy/nanoGPT")
    parser.add_argument("--device", choices=tuple(SETTINGS), default="cpu",
                        help="cpu: nanoGPT's CPU settings; cuda: GPT-2 124M at nanoGPT's GPU settings")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each with its own seed (1337 + round)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--variants", help=f"disttrain configurations, from {', '.join(VARIANTS)} (default: "
                                           + "; ".join(f"{s.variants} on {d}" for d, s in SETTINGS.items()) + ")")
    parser.add_argument("--same-init", action="store_true",
                        help="start disttrain from nanoGPT's initial weights of each round (model.init_weights) "
                             "and compare the loss curves")
    args = parser.parse_args()
    setting = SETTINGS[args.device]
    variants = (args.variants or setting.variants).split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not all((args.nanogpt / f).is_file() for f in NANOGPT_FILES):
        sys.exit(f"Error: --variants {unknown} unknown (one of {', '.join(VARIANTS)})" if unknown else
                 f"Error: --nanogpt {args.nanogpt} holds no {', '.join(NANOGPT_FILES)}")
    if args.steps <= setting.warmup:  # nanoGPT's cosine then divides by lr_decay_iters - warmup_iters = 0
        sys.exit(f"Error: --steps {args.steps} must exceed the {setting.warmup} warm-up steps both sides take")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("Error: --device cuda: torch sees no GPU here (--device cpu runs nanoGPT's CPU settings)")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        for name in NANOGPT_FILES:
            shutil.copy(args.nanogpt / name, work / name)
        write_corpus(work / "data" / "pydocs", setting.meta_vocab)
        training_tokens = (work / "data" / "pydocs" / "train.bin").stat().st_size // 2
        for round_ in range(args.rounds):
            seed = 1337 + round_
            start = (write_nanogpt_init(work, seed, work / f"init-{seed}.safetensors", setting) if args.same_init
                     else None)
            for variant in ["nanoGPT", *variants]:
                if variant == "nanoGPT":
                    result = run_nanogpt(work, args.steps, seed, setting, start)
                else:
                    result = run_disttrain(work / "data" / "pydocs", args.steps, seed, VARIANTS[variant],
                                           work / f"run-{variant}-{round_}", setting, start)
                shown = {key: value for key, value in result.items() if key != "losses"}
                print(f"round {round_ + 1} (seed {seed}) {variant}: {shown}", flush=True)
                results.setdefault(variant, []).append(result)
    speed = {variant: max(r["tokens_per_s"] for r in rounds) for variant, rounds in results.items()}
    bpb = {variant: [r["val_bpb"] for r in rounds] for variant, rounds in results.items()}
    reference = speed["nanoGPT"]
    start = ("both sides from nanoGPT's initial weights of the round's seed (model.init_weights)" if args.same_init
             else "each side from its own initialisation")
    gpu = f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; host " if args.device == "cuda" else ""
    passes = args.steps * setting.batch * setting.block / training_tokens
    print(f"\n{gpu}CPU: {cpu_model()} ({cpu_features()}), {args.threads} threads, one process, {args.steps} steps "
          f"of batch {setting.batch} x {setting.block} tokens ({passes:.2g} passes over the training file), "
          f"{args.rounds} rounds (seeds 1337..{1336 + args.rounds}), {start}\n")
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
    if args.same_init:
        largest = max(r["start_difference"] for r in results["nanoGPT"])
        print(f"\nnanoGPT's train.py built the file's weights in every round (largest difference {largest:g})")
        print_curves(results, args.steps)
    fastest = max(variants, key=speed.__getitem__)
    print(f"disttrain ({fastest}) vs nanoGPT: {speed[fastest] / reference:.2f}x tokens/s, "
          f"val bpb {statistics.mean(bpb[fastest]):.4f} vs {statistics.mean(bpb['nanoGPT']):.4f}")


if __name__ == "__main__":
    main()
