"""GPT-2 (124M) and a ~1B Llama on one accelerator: tokens/s, model FLOP utilisation and peak memory of
disttrain beside nanoGPT's ``train.py`` and a plain FSDP2 loop, and ``mode=plan``'s predicted memory beside
``torch.cuda.max_memory_allocated``.

    python benchmarks/throughput_mfu.py --device cuda --nanogpt PATH [--steps 50] [--cases gpt2,llama1b]
    python benchmarks/throughput_mfu.py --device cpu --steps 20     # the same table at test sizes (a check)

Every side trains the same model (bias-free GPT-2 at sequence 1024 and batch 12, nanoGPT's GPU defaults but
gradient accumulation; a Llama of width 2048, 16 layers, 32 query and 8 key/value heads at sequence 2048 and
batch 4), in bf16 autocast with fp32 weights, AdamW (lr 6e-4, betas 0.9/0.95, weight decay 0.1), clipping at
1.0, on the same token file (Python's documentation as bytes, vocabulary padded to 50304). Each run is its
own process, one after the other. Tokens/s: over the steps after the first ``WARMUP`` (10: compilation,
allocator warm-up and CUDA graphs' recording left out), each side by its own clock: disttrain's logged rows
(each row's rate runs from the end of step 1, so two rows give the rate between them), nanoGPT's per-iteration
timer, the plain loop's wall clock (each of these steps ends in a host read of the loss, as nanoGPT's do at
``log_interval=1``).

MFU = tokens/s x FLOPs per token / the device's dense bf16 peak, with nanoGPT's (PaLM's) count: 6 x the
weights that multiply (all but the position embedding) + 12 x layers x width x sequence for attention (the
full square, as both papers count it). Peak memory: ``torch.cuda.max_memory_allocated`` after the run;
predicted: ``mode=plan``'s total for the same config on the device's stated profile. Energy (mJ/token): the
GPU's NVML counter over the same steps after the first ``WARMUP`` (disttrain's ``energy.per_step_after`` in
results.json, the plain loop's own readings).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from machine import cpu_model  # noqa: E402
from nanogpt import iterations, write_corpus  # noqa: E402
from plain_fsdp import run_plain  # noqa: E402
from throughput_workloads import CPU_WORKLOADS, PEAK_BF16, VOCAB, WARMUP, WORKLOADS, Row, Workload  # noqa: E402


@dataclass(frozen=True)
class Side:
    """One disttrain configuration that ``--sides`` names."""

    parallel: str
    """The ``parallel`` preset."""
    compile_mode: str | None = None
    """torch.compile's mode (``trainer.compile_mode``); None: eager."""
    compile_scope: str = "blocks"
    """What one compiled region is (``trainer.compile_scope``): each block, or the whole model."""
    checkpointing: str = "none"
    """``parallel.activation_checkpoint``."""
    fp8: str = "none"
    """``trainer.fp8``'s recipe (its MFU is still counted against the bf16 peak)."""

    def label(self) -> str:
        """The side as the table names it."""
        compiled = {None: "", "default": " compile"}.get(self.compile_mode, f" {self.compile_mode}")
        return (f"disttrain {self.parallel}{compiled}"
                + (" whole model" if self.compile_mode is not None and self.compile_scope == "model" else "")
                + (f" ac={self.checkpointing}" if self.checkpointing != "none" else "")
                + (f" fp8={self.fp8}" if self.fp8 != "none" else ""))

    def overrides(self) -> list[str]:
        """Its disttrain overrides."""
        return [f"parallel={self.parallel}", f"trainer.compile={str(self.compile_mode is not None).lower()}",
                f"trainer.compile_mode={self.compile_mode or 'default'}",
                f"trainer.compile_scope={self.compile_scope if self.compile_mode is not None else 'blocks'}",
                f"parallel.activation_checkpoint={self.checkpointing}", f"trainer.fp8={self.fp8}"]


def disttrain_overrides(w: Workload, data_dir: Path, steps: int, side: Side, device: str,
                        log_every: int = 10) -> list[str]:
    """The measured disttrain run: training only (no validation, test or checkpoints), a CSV row every
    ``log_every`` steps (a logged step reads its metrics back to the host: a GPU synchronisation each)."""
    return [*w.model, "data=tokens", f"data.path={data_dir}", f"data.vocab_size={VOCAB}",
            f"data.block_size={w.block}", f"model.vocab_size={VOCAB}", f"batch.global_size={w.batch}",
            *side.overrides(), "trainer.devices=1", f"trainer.accelerator={device}",
            "trainer.precision=bf16-mixed", f"trainer.max_steps={steps}",
            "trainer.limit_val_batches=0", "trainer.run_test=false", f"trainer.log_every_n_steps={log_every}",
            "logger=csv", "checkpoint.save_last=false", "checkpoint.save_top_k=0", "plots=false",
            "optim=adamw", "optim.lr=6e-4", "optim.betas=[0.9,0.95]", "optim.weight_decay=0.1",
            "scheduler.warmup_fraction=null", "scheduler.warmup_steps=2", "scheduler.min_lr_ratio=0.1",
            "trainer.gradient_clip_val=1.0", "expect=null"]


def with_project_on_path() -> dict[str, str]:
    """This environment with the project first on ``PYTHONPATH`` (what was there stays after it)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def run_train_py(args: list[str], run_dir: Path, timeout: float) -> subprocess.CompletedProcess:
    """``train.py`` with ``args`` writing to ``run_dir``; raises with the output's tail if it fails."""
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env=with_project_on_path())
    if done.returncode:
        raise RuntimeError(f"train.py failed ({done.returncode}):\n{done.stdout[-1500:]}\n{done.stderr[-2500:]}")
    return done


def run_disttrain(w: Workload, data_dir: Path, steps: int, side: Side, device: str, scratch: Path, timeout: float,
                  log_every: int = 10, profile_dir: Path | None = None) -> Row:
    """One disttrain run: its tokens/s, last loss and peak memory, and ``mode=plan``'s prediction for the same
    config (on a GPU, for eager runs); with ``profile_dir``, a second run of the same config profiles five steps
    from step 21, with Python stacks, into ``profile_dir/<run>`` (``callbacks=profile``) and the row's note says
    what it found (the profiler slows the steps it records and writes its files inside the loop: that run's rate
    is not the row's)."""
    label = side.label()
    run_dir = scratch / re.sub(r"\W+", "-", f"{w.name}-{label}")
    args = disttrain_overrides(w, data_dir, steps, side, device, log_every)
    run_train_py(args, run_dir, timeout)
    results = json.loads((run_dir / "results.json").read_text())
    energy = results.get("energy") or {}
    measured_after = energy.get("source") == "nvml" and energy.get("after_step") == log_every
    row = Row(w.name, label, tokens_per_s=windowed_tokens_per_s(run_dir, w.tokens_per_step, WARMUP),
              loss=results["metrics"].get("train/loss"),
              peak_gb=(results.get("memory") or {}).get("max_allocated_gb"),
              joules_per_token=energy["per_step_after"] / w.tokens_per_step if measured_after else None)
    if profile_dir is not None:
        profiling = ["callbacks=profile", "callbacks.profile.start_step=20", "callbacks.profile.with_stack=true",
                     f"callbacks.profile.dirpath={profile_dir / run_dir.name}"]
        done = run_train_py([*args, *profiling], run_dir.with_name(run_dir.name + "-profile"), timeout)
        row.note = next((line for line in done.stdout.splitlines() if line.startswith("profile of steps")), "")
    # the plan models eager activations in bf16; compiled and float8 rows are read beside
    if device == "cuda" and side.compile_mode is None and side.fp8 == "none":
        plan_dir = run_dir.with_name(run_dir.name + "-plan")
        run_train_py([*args, "mode=plan", "plan.profile=h100_sxm"], plan_dir, timeout)
        row.predicted_gb = json.loads((plan_dir / "plan.json").read_text())["total_bytes"] / 1e9
    return row


def windowed_tokens_per_s(run_dir: Path, tokens_per_step: int, after_step: int) -> float:
    """disttrain's tokens/s from the end of step ``after_step`` (or the first logged step after it) to its last
    logged step. Each CSV row's ``train/tokens_per_sec`` runs from the end of step 1, so the row of step s was
    logged (s - 1) x tokens per step / rate seconds after it."""
    with open(run_dir / "csv" / "metrics.csv") as handle:
        rows = sorted({int(float(row["step"])): float(row["train/tokens_per_sec"])
                       for row in csv.DictReader(handle) if row.get("train/tokens_per_sec")}.items())
    window = [(step, (step - 1) * tokens_per_step / rate) for step, rate in rows if step >= after_step]
    if len(window) < 2:
        raise RuntimeError(f"fewer than two rows logged from step {after_step} on: more --steps, or a smaller "
                           "--log-every-n-steps")
    (first, first_s), (last, last_s) = window[0], window[-1]
    return (last - first) * tokens_per_step / (last_s - first_s)


def run_nanogpt(nanogpt: Path, w: Workload, data_dir: Path, steps: int, device: str, scratch: Path,
                timeout: float) -> Row:
    """nanoGPT's ``train.py`` at its GPU defaults (bf16, compile; CPU: fp32, eager) on the same tokens,
    batch and optimiser, with gradient accumulation 1; tokens/s from its per-iteration timer."""
    work = scratch / "nanogpt"
    work.mkdir(exist_ok=True)
    for name in ("train.py", "model.py", "configurator.py"):
        shutil.copy(nanogpt / name, work / name)
    (work / "data").mkdir(exist_ok=True)
    if not (work / "data" / "pydocs").exists():
        (work / "data" / "pydocs").symlink_to(data_dir)
    gpu = device == "cuda"
    args = [f"--max_iters={steps}", f"--lr_decay_iters={steps}", "--eval_interval=100000", "--eval_iters=1",
            "--dataset=pydocs", f"--device={device}", f"--compile={gpu}",
            f"--dtype={'bfloat16' if gpu else 'float32'}", "--log_interval=1", f"--block_size={w.block}",
            f"--batch_size={w.batch}", f"--n_layer={w.n_layer}", f"--n_head={w.n_head}", f"--n_embd={w.n_embd}",
            "--dropout=0.0", "--bias=False", "--learning_rate=6e-4", "--min_lr=6e-5", "--warmup_iters=2",
            "--gradient_accumulation_steps=1", "--always_save_checkpoint=False", f"--out_dir={work / 'out'}"]
    done = subprocess.run([sys.executable, "train.py", *args], cwd=work, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"nanoGPT failed:\n{done.stdout[-1500:]}\n{done.stderr[-2500:]}")
    iters = iterations(done.stdout)
    steady = [iters[i][1] for i in range(WARMUP, steps + 1) if i in iters]
    return Row(w.name, "nanoGPT" + (" compile" if gpu else ""),
               tokens_per_s=w.tokens_per_step / (statistics.mean(steady) / 1000), loss=iters[max(iters)][0])


WORKLOADS_BY_DEVICE = {"cuda": WORKLOADS, "cpu": CPU_WORKLOADS}


def device_description(device: str) -> tuple[str, float | None]:
    """The device's name and its dense bf16 peak (None where not listed or on a CPU)."""
    if device != "cuda":
        return f"CPU: {cpu_model()}", None
    name = torch.cuda.get_device_name()
    peak = next((value for key, value in PEAK_BF16.items() if key in name), None)
    return f"{name} (CUDA {torch.version.cuda}), host CPU: {cpu_model()}", peak


def print_table(rows: list[Row], workloads: list[Workload], device: str, steps: int) -> None:
    """The markdown table, with MFU and prediction error where they apply, and the headline ratios."""
    described, peak = device_description(device)
    precision = ("bf16 autocast, fp32 weights" if device == "cuda" else
                 "disttrain in bf16 autocast, the other sides in fp32: a check of the script, not a comparison")
    print(f"\n{described}; torch {torch.__version__}; {time.strftime('%Y-%m-%d')}; {steps} steps, the first "
          f"{WARMUP} left out; {precision}\n")
    print("| model | trainer | tokens/s | MFU | loss at last step | peak allocated GB | plan's GB (error) | mJ/token "
          "| note |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        w = next(v for v in workloads if v.name == r.workload)
        mfu = f"{r.tokens_per_s * w.flops_per_token() / peak:.1%}" if peak and r.tokens_per_s else "-"
        tps = f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "-"
        loss = f"{r.loss:.3f}" if r.loss is not None else "-"
        peak_gb = f"{r.peak_gb:.2f}" if r.peak_gb else "-"
        predicted = (f"{r.predicted_gb:.2f} ({r.predicted_gb / r.peak_gb - 1:+.0%})"
                     if r.predicted_gb and r.peak_gb else "-")
        energy = f"{r.joules_per_token * 1e3:.3f}" if r.joules_per_token else "-"
        print(f"| {r.workload} | {r.side} | {tps} | {mfu} | {loss} | {peak_gb} | {predicted} | {energy} | {r.note} |")
    for name in {r.workload for r in rows}:
        by_side = {r.side: r.tokens_per_s for r in rows if r.workload == name and r.tokens_per_s}
        ours = max((v, k) for k, v in by_side.items() if k.startswith("disttrain")) if any(
            k.startswith("disttrain") for k in by_side) else None
        for peer in ("nanoGPT compile", "nanoGPT", "plain FSDP2 compile", "plain FSDP2 compile autocast",
                     "plain FSDP2", "plain FSDP2 autocast"):
            if ours and peer in by_side:
                print(f"{name}: fastest disttrain ({ours[1]}) vs {peer}: {ours[0] / by_side[peer]:.3f}x tokens/s")
        for side, reference in PAIRED_SIDES:
            mine, theirs = (by_side.get(DISTTRAIN_SIDES[s].label()) for s in (side, reference))
            if mine and theirs:
                print(f"{name}: {side} vs {reference}: {mine / theirs:.3f}x tokens/s")


DISTTRAIN_SIDES = {"single": Side("single"), "single-compile": Side("single", "default"),
                   "single-compile-model": Side("single", "default", compile_scope="model"),
                   "single-cudagraphs": Side("single", "reduce-overhead"),
                   "zero3": Side("zero3"), "zero3-compile": Side("zero3", "default"),
                   "ac": Side("single", checkpointing="full"),
                   "single-compile-fp8": Side("single", "default", fp8="tensorwise"),
                   "single-compile-fp8-rowwise": Side("single", "default", fp8="rowwise"),
                   "zero3-compile-fp8": Side("zero3", "default", fp8="tensorwise")}
"""disttrain's runs by ``--sides`` name. A compiled side compiles each block on its own (``trainer.compile_scope``'s
default) unless its name ends in ``-model`` (the whole model as one graph, as nanoGPT compiles it). The float8 sides
train their linear layers in float8 (a GPU of compute capability 8.9 or more), compiled, as torchao's float8
training is meant to run: its casts fuse into the neighbouring kernels."""

PAIRED_SIDES = (("single-compile-model", "single-compile"), ("zero3-compile-fp8", "single-compile-fp8"),
                ("single-compile-fp8", "single-compile"))
"""Pairs of ``--sides`` whose ratio of tokens/s the table ends with when both ran: the whole-model compile over
the per-block one, one-rank ZeRO-3 in float8 over one process in float8, float8 over bf16."""


def run_side(side: str, w: Workload, args: argparse.Namespace, scratch: Path) -> Row:
    """One run of ``w`` by ``--sides`` name."""
    tokens = scratch / "tokens"
    if side in ("plain", "plain-autocast"):
        return run_plain(w, tokens, args.steps, args.device, args.device == "cuda", scratch, args.run_timeout_s,
                         autocast=side == "plain-autocast")
    if side == "nanogpt":
        return run_nanogpt(args.nanogpt, w, tokens, args.steps, args.device, scratch, args.run_timeout_s)
    return run_disttrain(w, tokens, args.steps, DISTTRAIN_SIDES[side], args.device, scratch, args.run_timeout_s,
                         args.log_every_n_steps, args.profile_dir)


def main() -> None:
    """Run the chosen cases one after the other, print each row as it lands, then the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--nanogpt", type=Path, help="a checkout of karpathy/nanoGPT (its train.py, model.py, "
                                                     "configurator.py); left out when not given")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--cases", default="gpt2,llama1b", help="workloads, from gpt2, llama1b")
    parser.add_argument("--sides",
                        default="single,single-compile,single-cudagraphs,zero3,zero3-compile,ac,plain,plain-autocast,"
                                "nanogpt",
                        help="what runs of each workload: single, single-compile (each block compiled), "
                             "single-compile-model (the whole model as one graph), single-cudagraphs (compile_mode="
                             "reduce-overhead), zero3, zero3-compile (disttrain), "
                             "ac (single, full activation checkpointing), single-compile-fp8, "
                             "single-compile-fp8-rowwise, zero3-compile-fp8 (trainer.fp8), plain (plain FSDP2 loop, "
                             "compiled on a GPU, bf16 parameters), plain-autocast (the same under bf16 autocast, "
                             "as disttrain's bf16-mixed), nanogpt (GPT-2 only)")
    parser.add_argument("--batch", type=int, help="sequences per step for every case and side, in place of the "
                                                  "workload's own (12 for GPT-2, 4 for the Llama)")
    parser.add_argument("--budget-s", type=float, default=1e9, help="start no run after this many seconds")
    parser.add_argument("--log-every-n-steps", type=int, default=10,
                        help="disttrain's trainer.log_every_n_steps (its default; nanoGPT reads its loss every step)")
    parser.add_argument("--run-timeout-s", type=float, default=600, help="stop any one run after this long")
    parser.add_argument("--jsonl", type=Path, help="append each row here as it lands")
    parser.add_argument("--profile-dir", type=Path, help="also run each disttrain side once more with steps 21-25 "
                                                         "profiled into this folder (callbacks=profile)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("Error: --device cuda: torch sees no GPU here (--device cpu prints the table at test sizes)")
    if args.steps < WARMUP + args.log_every_n_steps:
        sys.exit(f"Error: --steps {args.steps} is too few: the first {WARMUP} are left out and disttrain's rate needs "
                 f"two logged rows after them (--steps >= {WARMUP + args.log_every_n_steps})")
    workloads = WORKLOADS_BY_DEVICE[args.device]
    unknown = [c for c in args.cases.split(",") if c not in workloads]
    if unknown:
        sys.exit(f"Error: --cases {','.join(unknown)} unknown; from {', '.join(workloads)}")
    sides = [*DISTTRAIN_SIDES, "plain", "plain-autocast", "nanogpt"]
    unknown = [s for s in args.sides.split(",") if s not in sides]
    if unknown:
        sys.exit(f"Error: --sides {','.join(unknown)} unknown; from {', '.join(sides)}")
    if args.batch is not None and args.batch < 1:
        sys.exit(f"Error: --batch {args.batch}: a step needs at least one sequence")
    chosen = {case: workloads[case] for case in args.cases.split(",")}
    if args.batch is not None:
        chosen = {case: dataclasses.replace(w, name=f"{w.name} batch {args.batch}", batch=args.batch)
                  for case, w in chosen.items()}
    began = time.perf_counter()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        write_corpus(scratch / "tokens", vocab_size=None)  # GPT-2's padded vocabulary, as disttrain's
        for case, w in chosen.items():
            for side in args.sides.split(","):
                if side == "nanogpt" and (case != "gpt2" or args.nanogpt is None):
                    continue
                if time.perf_counter() - began > args.budget_s:
                    print(f"skipped {case} {side}: past --budget-s", flush=True)
                    continue
                try:
                    row = run_side(side, w, args, scratch)
                except Exception as error:  # one failed run is a row of the table, not the end of the others
                    row = Row(w.name, side, note=f"failed: {str(error).strip().splitlines()[-1][:200]}")
                    print(str(error)[-4000:], file=sys.stderr, flush=True)
                rows.append(row)
                print(f"{w.name} {row.side}: {row.__dict__}", flush=True)
                if args.jsonl:
                    with args.jsonl.open("a") as handle:
                        handle.write(json.dumps(row.__dict__) + "\n")
    print_table(rows, list(chosen.values()), args.device, args.steps)


if __name__ == "__main__":
    main()
