"""Per-rank parameter bytes under tensor parallelism (tp=2) and pipeline parallelism (pp=2) vs the whole model.

    python benchmarks/model_parallel_memory.py

Builds the same GPT on 2 gloo ranks, applies disttrain's tensor-parallel plan or pipeline split, and
counts the bytes of the parameters each rank actually holds (local shards of DTensors). Prints a
markdown table and, last, the headline ratio.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DIMS = {"n_layer": 8, "n_head": 8, "n_embd": 512, "block_size": 256, "vocab_size": 8192}


def local_bytes(module: torch.nn.Module) -> int:
    """Bytes of the parameters this rank holds (each shared parameter counted once)."""
    total = 0
    for p in module.parameters():
        tensor = p.to_local() if hasattr(p, "to_local") else p
        total += tensor.numel() * tensor.element_size()
    return total


def measure(rank: int, port: int, out: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from disttrain.models.gpt import GPT, GPTDims
    from disttrain.parallel.model_plan import pipeline_units_of
    from disttrain.parallel.pipeline.split import build_stage_module, unit_split_points
    from disttrain.parallel.tp import apply_tp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    whole = local_bytes(GPT(GPTDims(**DIMS), tie_weights=True))
    tp_model = GPT(GPTDims(**DIMS), tie_weights=True)
    apply_tp(tp_model, init_device_mesh("cpu", (2,)), tp_model.tp_plan())
    untied = GPT(GPTDims(**DIMS), tie_weights=False)
    untied_bytes = local_bytes(untied)
    units = pipeline_units_of(untied)
    stage = build_stage_module(untied, units, rank, unit_split_points(untied, units, 2))
    out[rank] = {"whole": whole, "tp": local_bytes(tp_model), "untied": untied_bytes, "pp": local_bytes(stage)}
    dist.destroy_process_group()


def main() -> None:
    from disttrain.parallel.process_group import free_port

    port = free_port()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(measure, args=(port, out), nprocs=2)
        rows = dict(out)
    mib = 2**20
    print(f"\nGPT {DIMS}, fp32\n")
    print("| layout | rank | parameter MiB held | whole model MiB | share |")
    print("|---|---|---|---|---|")
    for rank in (0, 1):
        r = rows[rank]
        print(f"| tp=2 (tied head) | {rank} | {r['tp'] / mib:.1f} | {r['whole'] / mib:.1f} | "
              f"{r['tp'] / r['whole']:.3f} |")
    for rank in (0, 1):
        r = rows[rank]
        print(f"| pp=2 (untied head) | {rank} | {r['pp'] / mib:.1f} | {r['untied'] / mib:.1f} | "
              f"{r['pp'] / r['untied']:.3f} |")
    tp_share = max(rows[r]["tp"] for r in (0, 1)) / rows[0]["whole"]
    pp_share = max(rows[r]["pp"] for r in (0, 1)) / rows[0]["untied"]
    print(f"\nlargest rank's share of the whole model: tp=2 {tp_share:.3f}, pp=2 {pp_share:.3f} (ideal 0.5; "
          "tp keeps embeddings and head replicated)")


if __name__ == "__main__":
    main()
