"""Runs on a GPU: what the CPU suite cannot check. Every test is marked ``cuda`` and skips unless
``DISTTRAIN_TEST_DEVICE=cuda`` and torch sees a GPU (the suite hides GPUs otherwise, see ``conftest``):

    DISTTRAIN_TEST_DEVICE=cuda pytest -m cuda tests/test_cuda.py -p no:xdist -o addopts=

Each run is small (the digits CNN or a micro GPT, a few to 20 steps) and trains in this process, as one rank.
"""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from disttrain.launch.job import train
from disttrain.parallel.attention_kernels import CUDA_EFFICIENT, CUDA_FLASH
from disttrain.parallel.causal_blocks import CausalChunks, supported
from tests.conftest import compose_config, logged_metric, train_cli, train_cli_in_process
from tests.test_run import GPT_FAST, step_losses

pytestmark = pytest.mark.cuda

SHORT = ["trainer.max_steps=5", "trainer.limit_val_batches=2", "trainer.limit_test_batches=2"]
BF16_GPT = [*GPT_FAST, "trainer.accelerator=gpu", "trainer.devices=1", "trainer.precision=bf16-mixed"]
"""The micro GPT on pydocs, 20 steps in bf16 autocast on one GPU (the layout and ``trainer.compile`` added)."""
BF16_RTOL = 2e-3
"""How far two bf16 loss curves of ``BF16_GPT`` may lie apart, per step, relative to the loss. The runs compared
round in different places (ZeRO-3's FSDP2 policy holds parameters, the residual stream and gradients in bf16 where
single's autocast keeps them fp32; a compiled step fuses ops that eager rounds one by one), and the fp32 master
weights and AdamW state keep the rounding from piling up. Measured on a CPU over these 20 steps: FSDP2's bf16
policy forced on 5e-4 from single's losses, compiled 5.4e-5 (another seed lies 5% off)."""
BF16_NORM_RTOL = 1e-2
"""The same for the pre-clip gradient norms (1.1 to 2.2 here: clipping at 1.0 binds every step, so a wrong
gradient scale moves them by its factor): compiled measured 2.05e-3 from eager on a CPU."""
CAUSAL_BLOCKS_RTOL = {torch.bfloat16: 6e-3, torch.float32: 2e-6}
"""How far context parallelism's causal blocks on CUDA kernels may lie from float64 whole-sequence attention, per
tensor (output, dq, dk, dv), relative: twice the worst measured on an H200 (torch 2.11, 2 and 4 chunks of 1,000
tokens): 3.0e-3 in bf16 (flash; bf16 keeps 8 bits of mantissa, 2^-9 = 2e-3 per value) and 7.7e-7 in fp32
(memory-efficient), each within 1.3x of whole-sequence attention's own error in that dtype
(``benchmarks/context_kernels.py``)."""
IDLE_S = 2.0
"""Seconds the energy run waits before fit ends, so that fit lasts long enough for NVML's energy counter to move
however fast the GPU trains (an idle GPU still draws tens of watts)."""


class IdleAtTrainEnd(pl.Callback):
    """Waits ``seconds`` when training ends, inside fit: a short run still lasts long enough to meter."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_end(self, *_: Any) -> None:
        """Wait."""
        time.sleep(self.seconds)


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any]]:
    """``python train.py trainer.devices=auto`` (the default run: the CNN on digits, shortened) on this machine:
    its captured output and ``results.json``."""
    if torch.cuda.device_count() != 1:
        pytest.skip("on several GPUs trainer.devices=auto starts a rank on each, which parallel=single refuses")
    cwd = tmp_path_factory.mktemp("default")
    proc = train_cli_in_process(["trainer.devices=auto", *SHORT, "hydra.run.dir=run",
                                 "+callbacks.idle._target_=tests.test_cuda.IdleAtTrainEnd",
                                 f"+callbacks.idle.seconds={IDLE_S}"], cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads((cwd / "run" / "results.json").read_text())


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory: pytest.TempPathFactory):
    """``bf16_run(parallel, compile_mode)``: the per-step losses and ``results.json`` of ``BF16_GPT`` under that
    layout, compiled in that mode (None: eager), trained once per module."""
    runs: dict[tuple[str, str | None], tuple[list[float], dict[str, Any]]] = {}

    def run(parallel: str, mode: str | None = None) -> tuple[tuple[list[float], list[float]], dict[str, Any]]:
        if (parallel, mode) not in runs:
            run_dir = tmp_path_factory.mktemp(f"{parallel}-{mode or 'eager'}")
            compiling = [] if mode is None else ["trainer.compile=true", f"trainer.compile_mode={mode}"]
            train(compose_config([*BF16_GPT, f"parallel={parallel}", *compiling], run_dir))
            norms = [value for _, value in logged_metric(run_dir, "train/grad_norm")]
            runs[parallel, mode] = ((step_losses(run_dir), norms), json.loads((run_dir / "results.json").read_text()))
        return runs[parallel, mode]

    return run


def assert_learned(curves: tuple[list[float], list[float]]) -> None:
    """20 steps with a gradient norm each, and the loss fell from ln 256 = 5.5 by over half a nat (some 1.3 in
    these steps on a CPU; a run that does not learn stays within a tenth of where it started)."""
    losses, norms = curves
    assert len(losses) == len(norms) == 20, curves
    assert losses[-1] < losses[0] - 0.5, losses


def assert_same_curve(a: tuple[list[float], list[float]], b: tuple[list[float], list[float]], what: str) -> None:
    """Losses step by step within ``BF16_RTOL``, gradient norms within ``BF16_NORM_RTOL``."""
    for (xs, ys), tolerance, name in zip(zip(a, b, strict=True), (BF16_RTOL, BF16_NORM_RTOL), ("loss", "norm"),
                                         strict=True):
        for step, (x, y) in enumerate(zip(xs, ys, strict=True)):
            assert abs(x - y) <= tolerance * abs(x), f"{what}, {name} at step {step}: {x} vs {y}\n{xs}\n{ys}"


def test_devices_auto_takes_the_gpu_and_results_say_so(default_run):
    proc, results = default_run
    assert "trainer.devices=auto: 1 GPU rank(s) per node" in proc.stdout
    assert results["world_size"] == 1 and results["device"] == "cuda:0"
    # the CNN's tensors are small, but cuBLAS's and cuDNN's workspaces come from the same allocator: megabytes
    assert results["memory"]["max_allocated_gb"] > 0
    assert results["memory"]["max_reserved_gb"] >= results["memory"]["max_allocated_gb"]


def test_the_energy_of_a_gpu_rank_is_measured_by_nvml(default_run):
    pytest.importorskip("pynvml", reason="NVML's energy counter is read through pynvml (pip install nvidia-ml-py)")
    energy = default_run[1]["energy"]
    assert energy["source"] == "nvml" and energy["estimated"] is False, energy
    assert energy["joules"] > 0 and energy["per_step"] > 0, energy


def test_bf16_single_and_zero3_on_one_rank_train_the_same_curve(bf16_run):
    (single, single_results), (zero3, zero3_results) = bf16_run("single"), bf16_run("zero3")
    assert_learned(single)
    assert_learned(zero3)
    assert_same_curve(single, zero3, "single vs zero3")
    for results in (single_results, zero3_results):
        assert results["device"] == "cuda:0" and results["precision"] == "bf16-mixed" and not results["compiled"]
    assert zero3_results["world_size"] == 1 and zero3_results["parallel"]["dp_shard"] == 1


def test_compiled_runs_train_the_eager_curve(bf16_run):
    eager = bf16_run("single")[0]
    for parallel in ("single", "zero3"):
        curve, results = bf16_run(parallel, "default")
        assert results["compiled"] is True and results["device"] == "cuda:0"
        assert_learned(curve)
        assert_same_curve(eager, curve, f"single eager vs {parallel} compiled")


def test_cuda_graph_replays_train_the_eager_curve(bf16_run):
    """``compile_mode=reduce-overhead``: each step's forward and backward replayed as CUDA graphs, the losses kept
    across steps copied out of the graphs' memory before the next replay writes over it."""
    curve, results = bf16_run("single", "reduce-overhead")
    assert results["compile_mode"] == "reduce-overhead" and results["device"] == "cuda:0"
    assert_learned(curve)
    assert_same_curve(bf16_run("single")[0], curve, "single eager vs CUDA graphs")


def csv_steps(run_dir: Path) -> list[int]:
    """The optimiser steps whose training loss the CSV log holds."""
    with open(run_dir / "csv" / "metrics.csv") as handle:
        return sorted({int(row["step"]) for row in csv.DictReader(handle) if row.get("train/loss")})


def test_a_run_resumed_from_its_directory_continues_at_the_next_step(tmp_path):
    # the default CNN, whole epochs at a constant learning rate: a 1-epoch run and a 2-epoch run share the first
    gpu = ["scheduler=constant", "logger=csv", "callbacks=none", "trainer.log_every_n_steps=1",
           "trainer.run_test=false", "trainer.accelerator=gpu", "trainer.devices=1", "trainer.deterministic=true"]
    train(compose_config([*gpu, "trainer.max_epochs=2"], tmp_path / "straight"))
    train(compose_config([*gpu, "trainer.max_epochs=1"], tmp_path / "first"))
    assert (tmp_path / "first" / "checkpoints" / "last.ckpt").is_dir()
    train(compose_config([*gpu, "trainer.max_epochs=2", f"resume={tmp_path / 'first'}"], tmp_path / "resumed"))
    first, resumed = csv_steps(tmp_path / "first"), csv_steps(tmp_path / "resumed")
    assert len(first) == len(resumed) > 1 and resumed[0] == first[-1] + 1, (first, resumed)
    results = json.loads((tmp_path / "resumed" / "results.json").read_text())
    assert results["global_steps"] == 2 * len(first) and results["device"] == "cuda:0"
    # fp32 with deterministic kernels (no atomic adds in cuDNN's backward), the same weights, optimiser state and
    # batches: the uninterrupted run's losses, as on a CPU; a lost optimiser state or batch order is off by percents
    straight = step_losses(tmp_path / "straight")
    assert step_losses(tmp_path / "resumed") == pytest.approx(straight[len(first):], rel=1e-6)


def test_more_ranks_than_gpus_is_one_line_before_any_rank_starts(tmp_path):
    if torch.cuda.device_count() != 1:
        pytest.skip("needs a machine with exactly one GPU (two ranks fit on more)")
    proc = train_cli(["parallel=ddp", "trainer.devices=2"], tmp_path)  # a fresh interpreter, as a shell runs it
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.strip() == ("Error: trainer.devices=2 is invalid: at most 1, as this machine shows 1 GPU "
                                   "(one per rank); trainer.accelerator=cpu runs 2 CPU ranks")
    assert not list(tmp_path.iterdir())  # no run directory, no outputs/


def test_a_gpu_step_s_memory_is_recorded_from_cuda_s_history(tmp_path):
    """callbacks=memory on a GPU: the allocator's record of one step, read from allocation to completed free. The
    allocator's peak of the run so far is at least the step's, and the same where the step is the heaviest yet
    (the third step: the optimiser's state exists from the first)."""
    proc = train_cli_in_process([*GPT_FAST, "trainer.accelerator=gpu", "trainer.devices=1", "trainer.max_steps=4",
                                 "callbacks=memory", "callbacks.memory.step=2", "energy=false",
                                 f"hydra.run.dir={tmp_path}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "logs" / "memory_step.json").read_text())
    results = json.loads((tmp_path / "results.json").read_text())
    assert record["counted_by"].startswith("CUDA memory history") and record["events"] > 0
    assert record["peak_bytes"] > record["start_bytes"] > 0
    assert results["memory"]["recorded_step"]["peak_bytes"] >= record["peak_bytes"]
    assert "memory of step 3 on rank 0: peak " in proc.stdout


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("chunks", [2, 4])
def test_causal_blocks_on_cuda_kernels_equal_whole_sequence_attention(chunks, dtype):
    """``CausalChunks`` over ``chunks`` chunks of one sequence, on the kernel ``supported`` picks (flash for bf16,
    memory-efficient for fp32), against whole-sequence causal attention in float64 on the same inputs: output and
    gradients. 1,000 tokens: chunks of 500 and 250 queries, not multiples of the efficient kernel's 32-row padding
    of its log-sum-exp."""
    generator = torch.Generator("cuda").manual_seed(0)
    base = [torch.randn(2, 4, 1000, 64, device="cuda", dtype=torch.float64, generator=generator) for _ in range(4)]
    inputs, grad = [x.to(dtype).requires_grad_() for x in base[:3]], base[3].to(dtype)
    kernel = supported(*inputs, 0.0)
    assert kernel is (CUDA_FLASH if dtype == torch.bfloat16 else CUDA_EFFICIENT), kernel
    c = 1000 // chunks
    out = CausalChunks.apply(*inputs, [(slice(i * c, (i + 1) * c), i * c) for i in range(chunks)], kernel)
    out.backward(grad)
    wide = [x.detach().double().requires_grad_() for x in inputs]
    reference = F.scaled_dot_product_attention(*wide, is_causal=True)
    reference.backward(grad.double())
    for name, got, want in zip(("out", "dq", "dk", "dv"), [out.detach(), *(x.grad for x in inputs)],
                               [reference.detach(), *(x.grad for x in wide)], strict=True):
        assert got.dtype == dtype
        error = ((got.double() - want).norm() / want.norm()).item()
        print(f"causal blocks, {chunks} chunks, {dtype}: {name} relative error {error:.2e}")
        assert error < CAUSAL_BLOCKS_RTOL[dtype], f"{name}: relative error {error:.2e}"


FP8_GPT = ["model=gpt", "model.flavour=mini", "data=pydocs", "data.block_size=256", "batch.global_size=64",
           "trainer.max_steps=300", "trainer.log_every_n_steps=1", "trainer.limit_val_batches=0",
           "trainer.run_test=false", "logger=csv", "callbacks=none", "checkpoint.save_last=false",
           "checkpoint.save_top_k=0", "plots=false", "energy=false", "trainer.accelerator=gpu", "trainer.devices=1",
           "trainer.precision=bf16-mixed", "optim=adamw", "optim.lr=1e-3", "scheduler.warmup_fraction=0.05"]
"""300 steps of the mini GPT (6 blocks of width 384, sequence 256: nanoGPT's character-level size) on Python's
documentation as bytes, 64 sequences a step, in bf16 autocast: every block's linear layer has dimensions that are
multiples of 16, so every one but the head trains in float8."""
FP8_RUNS = {"bf16": [], "bf16-compile": ["trainer.compile=true"],
            "fp8": ["trainer.fp8=tensorwise"], "fp8-zero3": ["trainer.fp8=tensorwise", "parallel=zero3"],
            "fp8-compile": ["trainer.fp8=tensorwise", "trainer.compile=true"],
            "fp8-zero3-compile": ["trainer.fp8=tensorwise", "parallel=zero3", "trainer.compile=true"],
            "fp8-rowwise-compile": ["trainer.fp8=rowwise", "trainer.compile=true"]}
"""The runs compared, by name: bf16 (the reference, eager and compiled) and float8 under single and one-rank
ZeRO-3 (its weights gathered in float8), eager and compiled, and the rowwise recipe compiled."""
FP8_WINDOW = 25
"""Steps per window of the band: the mean loss of each 25 steps is compared, so the band holds the curve, not the
loss of one batch."""
FP8_BAND = 0.03
"""How far a float8 run's windowed loss may lie from the bf16 run's, relative to it: measured on an H200 (torch
2.11, torchao 0.18), the largest gap of any window was 1.67e-2 (single), 1.58e-2 (ZeRO-3), 1.68e-2 (single,
compiled), 1.94e-2 (ZeRO-3, compiled) and 1.22e-2 (rowwise, compiled); the last losses lay from 1.7% under to 0.1%
over bf16's. Float8 rounds each operand to 3 (e4m3) or 2 (e5m2, gradients) mantissa bits: the curves part by
about a percent and do not drift apart."""


@pytest.fixture(scope="module")
def fp8_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[float], str, dict[str, Any]]]:
    """Each of ``FP8_RUNS`` as ``train.py`` runs it, all at once (the GPU has room for the seven; each run's
    numbers do not depend on the others'): by name, its per-step losses, its output and ``results.json``."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    root = tmp_path_factory.mktemp("fp8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    started = {name: subprocess.Popen([sys.executable, str(ROOT / "train.py"), *FP8_GPT, *extra,
                                       f"hydra.run.dir={root / name}"], cwd=root, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
               for name, extra in FP8_RUNS.items()}
    runs = {}
    for name, proc in started.items():
        output = proc.communicate(timeout=900)[0]
        assert proc.returncode == 0, f"{name}:\n{output[-4000:]}"
        runs[name] = (step_losses(root / name), output,
                      json.loads((root / name / "results.json").read_text()))
    return runs


def windowed(losses: list[float]) -> torch.Tensor:
    """The mean loss of each ``FP8_WINDOW`` steps."""
    return torch.tensor(losses, dtype=torch.float64).view(-1, FP8_WINDOW).mean(dim=1)


@pytest.mark.parametrize("name", [name for name in FP8_RUNS if name.startswith("fp8")])
def test_a_300_step_float8_run_stays_within_its_band_of_the_bf16_curve(fp8_runs, name):
    losses, output, results = fp8_runs[name]
    reference = fp8_runs["bf16-compile" if results["compiled"] else "bf16"][0]
    assert len(losses) == len(reference) == 300
    gap = ((windowed(losses) - windowed(reference)).abs() / windowed(reference))
    print(f"{name}: windowed loss gap to bf16 max {gap.max():.2e}, last window {gap[-1]:.2e}; "
          f"last loss {losses[-1]:.4f} vs {reference[-1]:.4f}")
    assert gap.max() < FP8_BAND, gap
    assert windowed(losses)[-1] < windowed(losses)[0] - 1.0, "the float8 run did not learn"
    assert gap.max() > 0, "the float8 run equals the bf16 one: no layer trained in float8"
    recipe = "rowwise" if "rowwise" in name else "tensorwise"
    assert f"trainer.fp8={recipe}: 36 linear layers in float8" in output, output[-3000:]
    assert results["device"] == "cuda:0" and results["compiled"] is ("compile" in name)
