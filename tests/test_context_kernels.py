"""The attention kernels of context parallelism's causal blocks: which one a device and dtype get, the CUDA kernels'
calls wired through ``CausalChunks`` (on meta tensors, which run torch's shape functions of the CUDA ops and no
kernel), and ``benchmarks/context_kernels.py`` at tiny sizes on a CPU. The CUDA kernels' numbers are
``tests/test_cuda.py``'s."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from disttrain.parallel.attention_kernels import CPU_FLASH, CUDA_EFFICIENT, CUDA_FLASH, kernel_for, pick_kernel
from disttrain.parallel.causal_blocks import CausalChunks, supported

BLOCKS_RTOL = {"bf16": 2e-2, "fp32": 1e-5}
"""How far the blocks' output and gradients may lie from float64 whole-sequence attention, relative: bf16 rounds
each input and output to 8 bits of mantissa (2^-9 = 2e-3 per value; measured 2-4e-3 at the benchmark's CPU sizes),
fp32 to 24 (measured 2-3e-7)."""


def _benchmark():
    # loaded by path: "benchmarks" is also the name of a package some dependencies install
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "context_kernels.py"
    spec = importlib.util.spec_from_file_location("context_kernels_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_cpu_takes_its_flash_kernel_in_every_float_dtype(dtype) -> None:
    assert pick_kernel("cpu", dtype) is CPU_FLASH
    q = torch.zeros(1, 2, 8, 16, dtype=dtype)
    assert kernel_for(q, q, q, 0.0) is CPU_FLASH and supported(q, q, q, 0.0) is CPU_FLASH


def test_cuda_takes_flash_for_bf16_and_fp16_and_the_efficient_kernel_for_fp32() -> None:
    assert pick_kernel("cuda", torch.bfloat16) is CUDA_FLASH
    assert pick_kernel("cuda", torch.float16) is CUDA_FLASH
    assert pick_kernel("cuda", torch.float32) is CUDA_EFFICIENT
    # flash's limits unmet (head dim, an older GPU, its switch off): the efficient kernel; neither: the masked form
    assert pick_kernel("cuda", torch.bfloat16, flash_fits=False) is CUDA_EFFICIENT
    assert pick_kernel("cuda", torch.bfloat16, flash_fits=False, efficient_fits=False) is None
    assert pick_kernel("cuda", torch.float32, efficient_fits=False) is None
    assert pick_kernel("cuda", torch.float64) is None
    assert pick_kernel("mps", torch.float32) is None


def test_dropout_takes_the_masked_form() -> None:
    q = torch.zeros(1, 2, 8, 16)
    assert kernel_for(q, q, q, 0.1) is None


@pytest.mark.parametrize(("kernel", "dtype"), [(CUDA_FLASH, torch.bfloat16), (CUDA_EFFICIENT, torch.float32)],
                         ids=["flash", "efficient"])
def test_cuda_kernels_are_called_as_their_schemas_say_through_causal_chunks(kernel, dtype) -> None:
    # 40 queries per chunk: the efficient kernel pads its log-sum-exp to 64 rows, which the merge must slice off
    q, k, v = (torch.empty(2, 3, 80, 16, device="meta", dtype=dtype, requires_grad=True) for _ in range(3))
    out, lse, _ = kernel.forward(q[:, :, :40].detach(), k.detach(), v.detach(), False)
    assert out.shape == (2, 3, 40, 16) and lse.shape == (2, 3, 40) and lse.dtype == torch.float32
    y = CausalChunks.apply(q, k, v, [(slice(0, 40), 0), (slice(40, 80), 40)], kernel)
    y.backward(torch.empty_like(y))
    assert y.shape == q.shape and y.dtype == dtype
    assert all(x.grad.shape == x.shape and x.grad.dtype == dtype for x in (q, k, v))


def test_the_benchmark_runs_on_a_cpu_and_the_blocks_match_float64_attention(tmp_path, capsys) -> None:
    path = tmp_path / "kernels.json"
    rows = _benchmark().main(["--device", "cpu", "--heads", "2", "--tokens", "64", "--head-dim", "16",
                              "--repeats", "1", "--json", str(path)])
    printed = capsys.readouterr().out
    assert printed.startswith("CPU: ") and "GPU: none" in printed and "| fp32 | 4 | cpu-flash |" in printed
    assert [(row["dtype"], row["chunks"]) for row in rows] == [(d, c) for d in ("bf16", "fp32") for c in (1, 2, 4)]
    for row in rows:
        assert max(row["errors"]["blocks"]) < BLOCKS_RTOL[row["dtype"]], (row["dtype"], row["chunks"],
                                                                           row["errors"]["blocks"])
        assert all(ms > 0 for ms in row["ms"].values()), row
    assert json.loads(path.read_text())["rows"] == json.loads(json.dumps(rows))
