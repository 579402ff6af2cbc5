"""Measure this machine for the planner: matrix-multiply FLOP/s per core and dtype, memory bandwidth, the
overhead each operator costs, and the bandwidth and latency of gloo collectives between two local processes.

    python -m disttrain.plan --calibrate
"""

from __future__ import annotations

import os
import platform
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.plan.devices import HardwareProfile, Link

DEFAULT_LOOPBACK = Link(bandwidth=1e9, latency=100e-6)
"""gloo over loopback when not calibrated: a cautious 1 GB/s and 100 us per message."""


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where it exists)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def total_memory_bytes() -> float:
    """Physical memory of this machine."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def measure_compute(seconds: float = 1.0, threads: int = 1) -> dict[str, float]:
    """Matrix-multiply and convolution FLOP/s on ``threads`` threads per dtype (``fp32``, ``fp32_conv``,
    ``bf16``, ``bf16_conv``; bf16 only measured where the CPU computes it natively, elsewhere a third of fp32,
    what emulated bf16 measured on such CPUs)."""
    from disttrain.plan.devices import native_bf16

    with _threads(threads):
        rates = {"fp32": _matmul_rate(torch.float32, seconds), "fp32_conv": _conv_rate(None, seconds)}
        native = native_bf16(uses_gpu=False)[0]
        rates["bf16"] = _matmul_rate(torch.bfloat16, seconds) if native else rates["fp32"] / 3
        rates["bf16_conv"] = _conv_rate(torch.bfloat16, seconds) if native else rates["fp32_conv"] / 3
    return rates


class _threads:
    def __init__(self, n: int) -> None:
        self.n, self.saved = n, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.saved)


def seconds_per_call(fn, seconds: float) -> float:
    """Mean seconds per call of ``fn`` over about ``seconds`` (after one untimed call)."""
    fn()
    runs, start = 0, time.perf_counter()
    while runs < 3 or time.perf_counter() - start < seconds:
        fn()
        runs += 1
    return (time.perf_counter() - start) / runs


def _matmul_rate(dtype: torch.dtype, seconds: float, n: int = 1024) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / seconds_per_call(lambda: a @ b, seconds)


def _conv_rate(dtype: torch.dtype | None, seconds: float) -> float:
    """FLOP/s of forward and backward of a 3x3 convolution, 32 to 32 channels on 16 x 16 images, batch 32 (a
    small CNN's layer), FLOPs as the plan counts them."""
    from disttrain.plan.ops import count_ops

    conv, x = nn.Conv2d(32, 32, 3, padding=1), torch.randn(32, 32, 16, 16, requires_grad=True)

    def step() -> None:
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = conv(x)
        out.float().sum().backward()

    flops = sum(op[0] for op in count_ops(step))
    return flops / seconds_per_call(step, seconds)


def measure_memory_bandwidth(seconds: float = 0.5, threads: int = 1) -> float:
    """Bytes per second that element-wise work moves: forward and backward of GELU, LayerNorm and a residual
    add on a 1024 x 512 activation, bytes counted operator by operator as a plan counts them (on a CPU these
    operators are bound by their arithmetic as much as by DRAM, so a plain copy would overstate them)."""
    from disttrain.plan.ops import count_ops

    norm, x = nn.LayerNorm(512), torch.randn(1024, 512, requires_grad=True)

    def step() -> None:
        (F.gelu(norm(x)) + x).sum().backward()

    ops = count_ops(step)
    with _threads(threads):
        return sum(nbytes for flops, nbytes, *_ in ops if flops == 0) / seconds_per_call(step, seconds)


class _TinyBlock(nn.Module):
    """A pre-LN transformer block of torch's own layers: ``x + proj(attend(q, k, v))`` with separate q, k, v
    projections and causal ``scaled_dot_product_attention``, then ``x + fc2(gelu(fc1(x)))`` at 4x width.

    The operators are those of the decoder blocks a plan measures, so the overhead per operator is measured on
    the same mix. torch's ``nn.TransformerEncoderLayer`` is not used: its attention goes through the Python
    argument checks of ``multi_head_attention_forward``, which the models' blocks skip and which add about a
    sixth to the overhead per operator measured on a CPU.
    """

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.proj = nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, C] -> [B, T, C]``."""
        b, t, _ = x.shape
        h = self.ln_1(x)
        q, k, v = (lin(h).view(b, t, self.heads, -1).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln_2(x))))


def measure_op_overhead(seconds: float = 0.5, rate: float = 1e11, bandwidth: float = 1e10) -> float:
    """Seconds per operator beyond its work, from forward and backward of two tiny transformer blocks
    (``_TinyBlock``: width 32, 2 heads, 16 tokens: almost all overhead: dispatch, Python, autograd nodes, the
    backward engine), with the little work there is (at ``rate`` FLOP/s and ``bandwidth`` bytes/s) taken out."""
    from disttrain.plan.ops import count_ops

    blocks = nn.Sequential(_TinyBlock(32, 2), _TinyBlock(32, 2))
    x = torch.randn(1, 16, 32, requires_grad=True)

    def step() -> None:
        blocks(x).sum().backward()

    with _threads(1):
        per_step = seconds_per_call(step, seconds)
    ops = count_ops(step)
    work = sum(max(flops / rate, nbytes / bandwidth) for flops, nbytes, *_ in ops)
    return max(per_step - work, 0.0) / len(ops)


def _link_rank(rank: int, init_file: str, sizes: list[int], out: dict) -> None:
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        for size in sizes:
            buf = torch.zeros(size // 4)
            for _ in range(3):
                dist.all_reduce(buf)
            runs, start = 0, time.perf_counter()
            while runs < 5 or time.perf_counter() - start < 0.3:
                dist.all_reduce(buf)
                runs += 1
            if rank == 0:
                out[size] = (time.perf_counter() - start) / runs
    finally:
        dist.destroy_process_group()


def measure_link() -> Link:
    """alpha-beta fit of gloo all-reduces between two local processes: latency from a 4-byte all-reduce,
    bandwidth from a 16 MiB one (a 2-rank ring all-reduce sends the buffer once each way: 2(N-1)/N = 1)."""
    import torch.multiprocessing as mp

    sizes = [4, 16 * 2**20]
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, ctx.Manager() as manager:
        out = manager.dict()
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_link_rank, args=(r, init_file, sizes, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError("the link measurement's ranks failed")
        small, large = out[sizes[0]], out[sizes[1]]
    latency = small / 2  # a 2-rank ring all-reduce is two steps
    return Link(bandwidth=sizes[1] / max(large - small, 1e-9), latency=latency)


def this_machine(flops_per_core: dict[str, float], bandwidth: float, overhead: float, links: Link | None,
                 source: str, watts: float | None = None) -> HardwareProfile:
    """This machine as a profile whose device is one core (CPU ranks share the cores; see ``estimate``);
    ``watts``: the whole machine's power under load, if known."""
    cores = os.cpu_count() or 1
    link = links or DEFAULT_LOOPBACK
    return HardwareProfile(f"machine ({cpu_model()}, {cores} cores)", flops_per_core, bandwidth, overhead,
                           total_memory_bytes() / cores, link, link, cores, watts / cores if watts else None,
                           source, cpu=True)


def calibrate(seconds: float = 1.0, watts: float | None = None) -> HardwareProfile:
    """Measure compute per core, memory bandwidth, per-operator overhead and the loopback link."""
    compute, bandwidth = measure_compute(seconds), measure_memory_bandwidth(seconds / 2)
    return this_machine(compute, bandwidth, measure_op_overhead(seconds / 2, compute["fp32"], bandwidth),
                        measure_link(), f"calibrated {time.strftime('%Y-%m-%d %H:%M')}", watts)
