"""GPT-2 (124M) and a ~1B Llama on one accelerator: tokens/s, model FLOP utilisation and peak memory of
disttrain beside nanoGPT's ``train.py`` and a plain FSDP2 loop, and ``mode=plan``'s predicted memory beside
``torch.cuda.max_memory_allocated``.

    python benchmarks/throughput_mfu.py --device cuda --nanogpt PATH [--steps 50] [--cases gpt2,llama1b]
    python benchmarks/throughput_mfu.py --device cpu --steps 6      # the same table at test sizes (a check)

Every side trains the same model (bias-free GPT-2 at sequence 1024 and batch 12, nanoGPT's GPU defaults but
gradient accumulation; a Llama of width 2048, 16 layers, 32 query and 8 key/value heads at sequence 2048 and
batch 4), in bf16 autocast with fp32 weights, AdamW (lr 6e-4, betas 0.9/0.95, weight decay 0.1), clipping at
1.0, on the same token file (Python's documentation as bytes, vocabulary padded to 50304). Each run is its
own process, one after the other. Tokens/s: over the steps after the first ``WARMUP`` (compilation and
allocator warm-up left out), each side by its own clock: disttrain's ``results.json`` (from the end of step
1), nanoGPT's per-iteration timer, the plain loop's wall clock (each of these steps ends in a host read of the
loss, as nanoGPT's do at ``log_interval=1``).

MFU = tokens/s x FLOPs per token / the device's dense bf16 peak, with nanoGPT's (PaLM's) count: 6 x the
weights that multiply (all but the position embedding) + 12 x layers x width x sequence for attention (the
full square, as both papers count it). Peak memory: ``torch.cuda.max_memory_allocated`` after the run;
predicted: ``mode=plan``'s total for the same config on the device's stated profile.
"""

from __future__ import annotations

import argparse
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

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from machine import cpu_model  # noqa: E402
from nanogpt import iterations, write_corpus  # noqa: E402

WARMUP = 1
"""Steps left out of every side's tokens/s (compilation, autotuning): disttrain's meter starts its clock at the
end of the first optimiser step, so the other sides leave out the same one."""
VOCAB = 50304
"""GPT-2's vocabulary padded to a multiple of 64, as nanoGPT does (the byte tokens use the first 256)."""
PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12,
             "L40S": 362e12, "L4": 121e12}
"""Dense bf16 tensor-core peak by device name (vendors' datasheets, SXM parts unless named), in FLOP/s;
the first name found in the device's name counts, so the longer names come first."""


@dataclass(frozen=True)
class Workload:
    """One model at one batch: the overrides that build it and the sizes the FLOP count needs."""

    name: str
    model: list[str]
    """disttrain overrides of the model group."""
    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int
    mlp_hidden: int
    """Hidden width of the feed-forward network (4 x width for GPT's GELU MLP, SwiGLU's for the Llama)."""
    block: int
    batch: int
    tied: bool
    """The output layer shares the token embedding."""
    swiglu: bool = False

    def params(self) -> int:
        """Weights that multiply an activation: every linear layer and the output layer (the position
        embedding is a lookup, nanoGPT's count leaves it out; norms are negligible and left out too)."""
        head = self.n_embd // self.n_head
        attention = self.n_embd * self.n_embd * 2 + 2 * self.n_embd * self.n_kv_head * head
        mlp = (3 if self.swiglu else 2) * self.n_embd * self.mlp_hidden
        embeddings = VOCAB * self.n_embd * (1 if self.tied else 2)
        return self.n_layer * (attention + mlp) + embeddings

    def flops_per_token(self) -> float:
        """6N + 12 L C T: a forward and backward pass per token (nanoGPT's estimate_mfu, PaLM appendix B)."""
        return 6 * self.params() + 12 * self.n_layer * self.n_embd * self.block

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one optimiser step."""
        return self.batch * self.block


WORKLOADS = {
    "gpt2": Workload("GPT-2 124M", ["model=gpt", "model.flavour=gpt2", "model.bias=false"],
                     12, 768, 12, 12, 3072, 1024, 12, tied=True),
    "llama1b": Workload("Llama 1.2B", ["model=llama", "model.n_layer=16", "model.n_embd=2048", "model.n_head=32",
                                       "model.n_kv_head=8", "model.mlp_hidden=8192"],
                        16, 2048, 32, 8, 8192, 2048, 4, tied=False, swiglu=True),
}
"""The workloads on a GPU, by the name ``--cases`` takes."""
CPU_WORKLOADS = {
    "gpt2": Workload("GPT micro", ["model=gpt", "model.flavour=micro", "model.bias=false"],
                     2, 32, 2, 2, 128, 32, 4, tied=True),
    "llama1b": Workload("Llama micro", ["model=llama", "model.flavour=micro", "model.mlp_hidden=96"],
                        2, 32, 4, 2, 96, 32, 4, tied=False, swiglu=True),
}
"""The same table's workloads at test sizes, for ``--device cpu``."""


@dataclass
class Row:
    """One measured run."""

    workload: str
    side: str
    tokens_per_s: float | None = None
    loss: float | None = None
    peak_gb: float | None = None
    predicted_gb: float | None = None
    note: str = ""


def disttrain_overrides(w: Workload, data_dir: Path, steps: int, parallel: str, compile_mode: str | None,
                        checkpointing: str, device: str, log_every: int = 10) -> list[str]:
    """The measured disttrain run: training only (no validation, test or checkpoints), a CSV row every
    ``log_every`` steps (a logged step reads its metrics back to the host: a GPU synchronisation each)."""
    return [*w.model, "data=tokens", f"data.path={data_dir}", f"data.vocab_size={VOCAB}",
            f"data.block_size={w.block}", f"model.vocab_size={VOCAB}", f"batch.global_size={w.batch}",
            f"parallel={parallel}", "trainer.devices=1", f"trainer.accelerator={device}",
            "trainer.precision=bf16-mixed", f"trainer.compile={str(compile_mode is not None).lower()}",
            f"trainer.compile_mode={compile_mode or 'default'}",
            f"parallel.activation_checkpoint={checkpointing}", f"trainer.max_steps={steps}",
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


def run_disttrain(w: Workload, data_dir: Path, steps: int, parallel: str, compile_mode: str | None,
                  checkpointing: str, device: str, scratch: Path, timeout: float, log_every: int = 10,
                  profile_dir: Path | None = None) -> Row:
    """One disttrain run: its tokens/s, last loss and peak memory, and ``mode=plan``'s prediction for the same
    config (on a GPU, for eager runs); with ``profile_dir``, a second run of the same config profiles five steps
    from step 21, with Python stacks, into ``profile_dir/<run>`` (``callbacks=profile``) and the row's note says
    what it found (the profiler slows the steps it records and writes its files inside the loop: that run's rate
    is not the row's)."""
    label = f"disttrain {parallel}" + {None: "", "default": " compile"}.get(compile_mode, f" {compile_mode}") + (
        f" ac={checkpointing}" if checkpointing != "none" else "")
    run_dir = scratch / re.sub(r"\W+", "-", f"{w.name}-{label}")
    args = disttrain_overrides(w, data_dir, steps, parallel, compile_mode, checkpointing, device, log_every)
    run_train_py(args, run_dir, timeout)
    results = json.loads((run_dir / "results.json").read_text())
    row = Row(w.name, label, tokens_per_s=results["tokens_per_sec"], loss=results["metrics"].get("train/loss"),
              peak_gb=(results.get("memory") or {}).get("max_allocated_gb"))
    if profile_dir is not None:
        profiling = ["callbacks=profile", "callbacks.profile.start_step=20", "callbacks.profile.with_stack=true",
                     f"callbacks.profile.dirpath={profile_dir / run_dir.name}"]
        done = run_train_py([*args, *profiling], run_dir.with_name(run_dir.name + "-profile"), timeout)
        row.note = next((line for line in done.stdout.splitlines() if line.startswith("profile of steps")), "")
    if device == "cuda" and compile_mode is None:  # the plan models eager activations; compiled rows are read beside
        plan_dir = run_dir.with_name(run_dir.name + "-plan")
        run_train_py([*args, "mode=plan", "plan.profile=h100_sxm"], plan_dir, timeout)
        row.predicted_gb = json.loads((plan_dir / "plan.json").read_text())["total_bytes"] / 1e9
    return row


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


def plain_fsdp_loop(w: Workload, data_dir: Path, steps: int, device: str, compiled: bool, out: Path) -> None:
    """A hand-written FSDP2 loop on one rank (this process): the same model class and optimiser, each block
    ``fully_shard``-ed with bf16 parameters and fp32 gradient reduction, compiled block by block as torchtitan
    does; random windows of the token file, read as nanoGPT reads them. Writes its Row as JSON to ``out``."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from disttrain.models.gpt import GPT, GPTDims
    from disttrain.models.llama import Llama, LlamaDims

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0",
                      WORLD_SIZE="1")
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    torch.manual_seed(0)
    dev = torch.device(device)
    if w.swiglu:
        model = Llama(LlamaDims(w.n_layer, w.n_head, w.n_kv_head, w.n_embd, w.block, VOCAB, w.mlp_hidden))
    else:
        model = GPT(GPTDims(w.n_layer, w.n_head, w.n_embd, w.block, VOCAB), bias=False)
    model.to(dev)
    gpu = device == "cuda"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if gpu else \
        MixedPrecisionPolicy()
    blocks = list(model.blocks if hasattr(model, "blocks") else model.layers)
    for block in blocks:
        if compiled:
            block.compile()
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=6e-4, betas=(0.9, 0.95), fused=gpu)
    data = np.memmap(data_dir / "train.bin", dtype=np.uint16, mode="r")
    generator = torch.Generator().manual_seed(0)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(data) - w.block - 1, (w.batch,), generator=generator).tolist()
        rows = torch.from_numpy(np.stack([data[s:s + w.block + 1].astype(np.int64) for s in starts]))
        if gpu:
            rows = rows.pin_memory().to(dev, non_blocking=True)
        return rows[:, :-1], rows[:, 1:]

    times, loss_value = [], float("nan")
    torch.cuda.reset_peak_memory_stats() if gpu else None
    for _ in range(steps):
        start = time.perf_counter()
        x, y = batch()
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()  # a host sync per step, as nanoGPT's log_interval=1 has
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 1e9 if gpu else None
    dist.destroy_process_group()
    row = Row(w.name, "plain FSDP2" + (" compile" if compiled else ""),
              tokens_per_s=w.tokens_per_step / statistics.mean(times[WARMUP:]), loss=loss_value, peak_gb=peak)
    out.write_text(json.dumps(row.__dict__))


def run_plain(w: Workload, data_dir: Path, steps: int, device: str, compiled: bool, scratch: Path,
              timeout: float) -> Row:
    """``plain_fsdp_loop`` in a process of its own (its own CUDA context and peak-memory counter)."""
    import multiprocessing

    out = scratch / f"plain-{w.name.replace(' ', '-')}-{compiled}.json"
    process = multiprocessing.get_context("spawn").Process(target=plain_fsdp_loop,
                                                           args=(w, data_dir, steps, device, compiled, out))
    process.start()
    process.join(timeout)
    if process.is_alive():
        process.kill()
        raise RuntimeError(f"plain loop still running after {timeout:.0f} s")
    if process.exitcode:
        raise RuntimeError(f"plain loop failed (exit code {process.exitcode}; its traceback is above)")
    return Row(**json.loads(out.read_text()))


WORKLOADS_BY_DEVICE = {"cuda": WORKLOADS, "cpu": CPU_WORKLOADS}


def device_description(device: str) -> tuple[str, float | None]:
    """The device's name and its dense bf16 peak (None where not listed or on a CPU)."""
    if device != "cuda":
        return f"CPU: {cpu_model()}", None
    name = torch.cuda.get_device_name()
    peak = next((value for key, value in PEAK_BF16.items() if key in name), None)
    return f"{name} (CUDA {torch.version.cuda}), host CPU: {cpu_model()}", peak


def print_table(rows: list[Row], device: str, steps: int) -> None:
    """The markdown table, with MFU and prediction error where they apply, and the headline ratios."""
    described, peak = device_description(device)
    precision = ("bf16 autocast, fp32 weights" if device == "cuda" else
                 "disttrain in bf16 autocast, the other sides in fp32: a check of the script, not a comparison")
    print(f"\n{described}; torch {torch.__version__}; {time.strftime('%Y-%m-%d')}; {steps} steps, the first "
          f"{WARMUP} left out; {precision}\n")
    print("| model | trainer | tokens/s | MFU | loss at last step | peak allocated GB | plan's GB (error) | note |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        w = next(v for v in WORKLOADS_BY_DEVICE[device].values() if v.name == r.workload)
        mfu = f"{r.tokens_per_s * w.flops_per_token() / peak:.1%}" if peak and r.tokens_per_s else "-"
        tps = f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "-"
        loss = f"{r.loss:.3f}" if r.loss is not None else "-"
        peak_gb = f"{r.peak_gb:.2f}" if r.peak_gb else "-"
        predicted = (f"{r.predicted_gb:.2f} ({r.predicted_gb / r.peak_gb - 1:+.0%})"
                     if r.predicted_gb and r.peak_gb else "-")
        print(f"| {r.workload} | {r.side} | {tps} | {mfu} | {loss} | {peak_gb} | {predicted} | {r.note} |")
    for name in {r.workload for r in rows}:
        by_side = {r.side: r.tokens_per_s for r in rows if r.workload == name and r.tokens_per_s}
        ours = max((v, k) for k, v in by_side.items() if k.startswith("disttrain")) if any(
            k.startswith("disttrain") for k in by_side) else None
        for peer in ("nanoGPT compile", "nanoGPT", "plain FSDP2 compile", "plain FSDP2"):
            if ours and peer in by_side:
                print(f"{name}: fastest disttrain ({ours[1]}) vs {peer}: {ours[0] / by_side[peer]:.3f}x tokens/s")


DISTTRAIN_SIDES = {"single": ("single", None, "none"), "single-compile": ("single", "default", "none"),
                   "single-cudagraphs": ("single", "reduce-overhead", "none"),
                   "zero3": ("zero3", None, "none"), "zero3-compile": ("zero3", "default", "none"),
                   "ac": ("single", None, "full")}
"""disttrain's runs by ``--sides`` name: preset, torch.compile's mode (None: eager), activation checkpointing."""


def run_side(side: str, w: Workload, args: argparse.Namespace, scratch: Path) -> Row:
    """One run of ``w`` by ``--sides`` name."""
    tokens = scratch / "tokens"
    if side == "plain":
        return run_plain(w, tokens, args.steps, args.device, args.device == "cuda", scratch, args.run_timeout_s)
    if side == "nanogpt":
        return run_nanogpt(args.nanogpt, w, tokens, args.steps, args.device, scratch, args.run_timeout_s)
    parallel, compile_mode, checkpointing = DISTTRAIN_SIDES[side]
    return run_disttrain(w, tokens, args.steps, parallel, compile_mode, checkpointing, args.device, scratch,
                         args.run_timeout_s, args.log_every_n_steps, args.profile_dir)


def main() -> None:
    """Run the chosen cases one after the other, print each row as it lands, then the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--nanogpt", type=Path, help="a checkout of karpathy/nanoGPT (its train.py, model.py, "
                                                     "configurator.py); left out when not given")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--cases", default="gpt2,llama1b", help="workloads, from gpt2, llama1b")
    parser.add_argument("--sides",
                        default="single,single-compile,single-cudagraphs,zero3,zero3-compile,ac,plain,nanogpt",
                        help="what runs of each workload: single, single-compile, single-cudagraphs (compile_mode="
                             "reduce-overhead), zero3, zero3-compile (disttrain), "
                             "ac (single, full activation checkpointing), plain (plain FSDP2 loop, "
                             "compiled on a GPU), nanogpt (GPT-2 only)")
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
    if args.steps <= WARMUP + 1:
        sys.exit(f"Error: --steps {args.steps} must exceed {WARMUP + 1} (the first {WARMUP} are left out)")
    workloads = WORKLOADS_BY_DEVICE[args.device]
    unknown = [c for c in args.cases.split(",") if c not in workloads]
    if unknown:
        sys.exit(f"Error: --cases {','.join(unknown)} unknown; from {', '.join(workloads)}")
    sides = [*DISTTRAIN_SIDES, "plain", "nanogpt"]
    unknown = [s for s in args.sides.split(",") if s not in sides]
    if unknown:
        sys.exit(f"Error: --sides {','.join(unknown)} unknown; from {', '.join(sides)}")
    began = time.perf_counter()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        write_corpus(scratch / "tokens", vocab_size=None)  # GPT-2's padded vocabulary, as disttrain's
        for case in args.cases.split(","):
            w = workloads[case]
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
    print_table(rows, args.device, args.steps)


if __name__ == "__main__":
    main()
