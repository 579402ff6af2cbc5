"""The plain FSDP2 training loop that ``throughput_mfu.py`` measures disttrain against, run in a process of its own."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from throughput_workloads import VOCAB, WARMUP, Row, Workload


def plain_fsdp_loop(w: Workload, data_dir: Path, steps: int, device: str, compiled: bool, out: Path,
                    autocast: bool = False) -> None:
    """A hand-written FSDP2 loop on one rank (this process): the same model class and optimiser, each block
    ``fully_shard``-ed with bf16 parameters and fp32 gradient reduction, compiled block by block as torchtitan
    does; random windows of the token file, read as nanoGPT reads them. ``autocast``: the forward and loss also
    run under bf16 autocast, as a ``bf16-mixed`` disttrain run's do (norms, softmax and the residual stream's
    sums in fp32); without it every operator runs in the parameters' bf16, as torchtitan's do. On a GPU with
    NVML, the energy of the steps after the first ``WARMUP`` is read off the GPU's counter. Writes its Row as
    JSON to ``out``."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from disttrain.models.gpt import GPT, GPTDims
    from disttrain.models.llama import Llama, LlamaDims
    from disttrain.rank.energy import NvmlMeter

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
    try:  # the GPU's own energy counter, read by disttrain's meter as its runs read it
        energy = NvmlMeter(dev.index or 0) if gpu else None
    except Exception:  # no nvidia-ml-py, or a GPU without the counter
        energy = None
    joules_at_warmup = None
    for step in range(steps):
        if step == WARMUP and energy is not None:
            joules_at_warmup = energy.so_far()
        start = time.perf_counter()
        x, y = batch()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()  # a host sync per step, as nanoGPT's log_interval=1 has
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 1e9 if gpu else None
    joules_per_token = ((energy.so_far() - joules_at_warmup) / ((steps - WARMUP) * w.tokens_per_step)
                        if joules_at_warmup is not None else None)
    dist.destroy_process_group()
    row = Row(w.name, "plain FSDP2" + (" compile" if compiled else "") + (" autocast" if autocast else ""),
              tokens_per_s=w.tokens_per_step / statistics.mean(times[WARMUP:]), loss=loss_value, peak_gb=peak,
              joules_per_token=joules_per_token)
    out.write_text(json.dumps(row.__dict__))


def run_plain(w: Workload, data_dir: Path, steps: int, device: str, compiled: bool, scratch: Path,
              timeout: float, autocast: bool = False) -> Row:
    """``plain_fsdp_loop`` in a process of its own (its own CUDA context and peak-memory counter)."""
    import multiprocessing

    out = scratch / f"plain-{w.name.replace(' ', '-')}-{compiled}-{autocast}.json"
    process = multiprocessing.get_context("spawn").Process(target=plain_fsdp_loop,
                                                           args=(w, data_dir, steps, device, compiled, out, autocast))
    process.start()
    process.join(timeout)
    if process.is_alive():
        process.kill()
        raise RuntimeError(f"plain loop still running after {timeout:.0f} s")
    if process.exitcode:
        raise RuntimeError(f"plain loop failed (exit code {process.exitcode}; its traceback is above)")
    return Row(**json.loads(out.read_text()))
