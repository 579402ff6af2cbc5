"""Context parallelism's causal blocks on one sequence: their error and time against whole-sequence attention.

    python benchmarks/context_kernels.py --device cuda [--json PATH]
    python benchmarks/context_kernels.py --device cpu --heads 4 --tokens 1024 --head-dim 64

Splits one sequence of ``T`` tokens into 1, 2 and 4 chunks in one process (``CausalChunks`` over the chunks of one
sequence, as a rank runs its own; no ranks here) and runs, in bf16 and fp32 on fresh random inputs:

- whole: ``F.scaled_dot_product_attention(is_causal=True)`` over the whole sequence;
- blocks: ``disttrain.parallel.causal_blocks.CausalChunks`` with the kernel ``supported`` picks (its name printed);
- masked: one masked call per chunk, the form context parallelism falls back to (``SequenceSplit._attend``).

Each is compared with whole-sequence attention computed in float64 on the same (rounded) inputs, output and the
gradients of q, k and v for one random output gradient: relative error ``||a - b|| / ||b||``. Each is timed
forward + backward (median of ``--repeats`` after one warm-up; CUDA events on a GPU). Prints the CPU model and the
GPU's name, a table, and last a headline line (the blocks' worst error over whole attention's, their time over
whole attention's and the masked form's over theirs); writes every figure as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import cpu_model  # noqa: E402

from disttrain.parallel.causal_blocks import CausalChunks, supported  # noqa: E402

CHUNK_COUNTS = (1, 2, 4)
"""How many chunks the sequence is split into."""
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""The dtypes measured, by the names the table prints."""

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def chunks_of(tokens: int, count: int) -> list[tuple[slice, int]]:
    """``count`` equal chunks of a sequence of ``tokens``: each one's rows and its start, as ``CausalChunks`` takes
    them."""
    c = tokens // count
    return [(slice(i * c, (i + 1) * c), i * c) for i in range(count)]


def whole(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over the whole sequence in one call."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def blocks(count: int) -> Attention:
    """Attention as ``count`` chunks through ``CausalChunks`` with the kernel ``supported`` picks."""
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kernel = supported(q, k, v, 0.0)
        if kernel is None:
            raise SystemExit(f"no kernel with a log-sum-exp takes {q.dtype} on {q.device}")
        return CausalChunks.apply(q, k, v, chunks_of(q.size(2), count), kernel)
    return attend


def masked(count: int) -> Attention:
    """Attention as ``count`` chunks, one masked call each over the keys up to the chunk's end."""
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outputs = []
        for rows, start in chunks_of(q.size(2), count):
            end = rows.stop
            mask = torch.arange(end, device=q.device)[None, :] <= torch.arange(start, end, device=q.device)[:, None]
            outputs.append(F.scaled_dot_product_attention(q[:, :, rows], k[:, :, :end], v[:, :, :end],
                                                          attn_mask=mask))
        return torch.cat(outputs, dim=2)
    return attend


def run(attend: Attention, inputs: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
    """Output and the gradients of q, k and v of ``attend`` on ``inputs`` for output gradient ``grad``."""
    q, k, v = (x.detach().requires_grad_() for x in inputs)
    out = attend(q, k, v)
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


def relative_errors(got: list[torch.Tensor], reference: list[torch.Tensor]) -> list[float]:
    """``||a - b|| / ||b||`` for each pair (output, dq, dk, dv), computed in float64."""
    return [((a.double() - b).norm() / b.norm()).item() for a, b in zip(got, reference, strict=True)]


def median_ms(attend: Attention, inputs: list[torch.Tensor], grad: torch.Tensor, repeats: int) -> float:
    """Median milliseconds of a forward and backward of ``attend`` after one warm-up."""
    cuda = inputs[0].device.type == "cuda"
    run(attend, inputs, grad)
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            run(attend, inputs, grad)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            run(attend, inputs, grad)
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def measure(device: str, shape: tuple[int, int, int, int], repeats: int, seed: int) -> list[dict]:
    """One row per dtype and chunk count: the kernel, each method's relative errors and median milliseconds."""
    generator = torch.Generator(device=device).manual_seed(seed)
    base = [torch.randn(shape, device=device, dtype=torch.float64, generator=generator) for _ in range(4)]
    rows = []
    for name, dtype in DTYPES.items():
        inputs = [x.to(dtype) for x in base[:3]]
        grad = base[3].to(dtype)
        reference = run(whole, [x.double() for x in inputs], grad.double())  # the same rounded inputs, in fp64
        whole_errors = relative_errors(run(whole, inputs, grad), reference)
        whole_ms = median_ms(whole, inputs, grad, repeats)
        kernel = supported(*(x.detach().requires_grad_() for x in inputs), 0.0)
        for count in CHUNK_COUNTS:
            rows.append({
                "dtype": name, "chunks": count, "kernel": kernel.name if kernel else None,
                "errors": {"whole": whole_errors,
                           "blocks": relative_errors(run(blocks(count), inputs, grad), reference),
                           "masked": relative_errors(run(masked(count), inputs, grad), reference)},
                "ms": {"whole": whole_ms, "blocks": median_ms(blocks(count), inputs, grad, repeats),
                       "masked": median_ms(masked(count), inputs, grad, repeats)},
            })
        del reference
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a markdown table: blocks' errors per tensor, the worst of whole's and masked's, the times."""
    lines = ["| dtype | chunks | kernel | blocks out / dq / dk / dv rel. error | whole worst | masked worst "
             "| whole ms | blocks ms | masked ms | blocks / whole | masked / blocks |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        errors, ms = row["errors"], row["ms"]
        lines.append(f"| {row['dtype']} | {row['chunks']} | {row['kernel']} | "
                     f"{' / '.join(f'{e:.1e}' for e in errors['blocks'])} | {max(errors['whole']):.1e} | "
                     f"{max(errors['masked']):.1e} | {ms['whole']:.2f} | {ms['blocks']:.2f} | {ms['masked']:.2f} | "
                     f"{ms['blocks'] / ms['whole']:.2f} | {ms['masked'] / ms['blocks']:.2f} |")
    return "\n".join(lines)


def headline(rows: list[dict]) -> str:
    """One line: per dtype, the blocks' worst error over whole attention's, and at the most chunks the blocks' time
    over whole attention's and the masked form's over the blocks'."""
    parts = []
    for name in DTYPES:
        mine = [row for row in rows if row["dtype"] == name]
        last = mine[-1]
        worst = max(max(row["errors"]["blocks"]) for row in mine) / max(mine[0]["errors"]["whole"])
        parts.append(f"{name}: worst error {worst:.2f}x whole's, at {last['chunks']} chunks blocks / whole "
                     f"{last['ms']['blocks'] / last['ms']['whole']:.2f}, masked / blocks "
                     f"{last['ms']['masked'] / last['ms']['blocks']:.2f}")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> list[dict]:
    """Parse the options, measure, print the machine and the table, write the JSON; returns the rows."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=8192, help="a multiple of 4 (the chunks are equal)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=None, help="default: a fresh one (printed)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = parser.parse_args(argv)
    if args.tokens % max(CHUNK_COUNTS):
        parser.error(f"--tokens={args.tokens}: must be a multiple of {max(CHUNK_COUNTS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device=cuda: torch sees no GPU here (use --device=cpu)")
    seed = torch.seed() % 2**31 if args.seed is None else args.seed
    shape = (args.batch, args.heads, args.tokens, args.head_dim)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "none"
    print(f"CPU: {cpu_model()}; GPU: {gpu}; torch {torch.__version__}; B, H, T, D = {shape}; seed {seed}; "
          f"median of {args.repeats}")
    rows = measure(args.device, shape, args.repeats, seed)
    print(table(rows))
    print(headline(rows))
    if args.json is not None:
        args.json.write_text(json.dumps({"cpu": cpu_model(), "gpu": gpu, "torch": torch.__version__,
                                         "shape": shape, "seed": seed, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
