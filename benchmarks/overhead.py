"""Overhead of disttrain over a hand-written PyTorch loop: same GPT, data, global batch and optimiser.

    python benchmarks/overhead.py [--steps 60] [--flavour nano]
    python benchmarks/overhead.py --flavour cnn --global-batch 64 --steps 320 --repeats 3   # the digits CNN
    python benchmarks/overhead.py --device cuda --flavour mini --global-batch 64   # on GPUs (2 ranks: 2+ GPUs)

Runs, in one process tree and one after the other: disttrain single-process, a plain loop
single-process, disttrain DDP on 2 ranks and a plain DDP loop on 2 ranks. The plain loops read each step's
batch out of tensors holding the training set (and, in a second column, through a DataLoader); on 2 ranks
they run torch DDP as it comes (buffers broadcast before every forward) and without that broadcast
(``forward_sync_buffers=False``, which disttrain chooses for models whose only buffers are normalisation
statistics). A last column runs the same step as the smallest LightningModule under Lightning's own Trainer:
what a step inside Lightning's loop costs before any framework adds to it. Each reports optimiser steps per
second measured after the first (warm-up) step, excluding validation. Prints a markdown table and, last, the
headline ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from machine import cpu_model  # noqa: E402

from disttrain.rank.host_memory import keep_freed_host_memory  # noqa: E402


def overrides(flavour: str, steps: int, global_batch: int, devices: int, preset: str = "ddp",
              device: str = "cpu") -> list[str]:
    """The disttrain run being measured: no logging, checkpoints, validation or test. ``flavour`` cnn: the
    digits CNN; else a GPT flavour on pydocs. ``device``: cpu or cuda (a GPU per rank)."""
    workload = ["model=cnn", "data=digits"] if flavour == "cnn" else ["model=gpt", f"model.flavour={flavour}",
                                                                      "data=pydocs"]
    return [
        *workload, f"batch.global_size={global_batch}", f"trainer.accelerator={device}",
        f"trainer.max_steps={steps}", "trainer.limit_val_batches=0", "trainer.run_test=false",
        "trainer.log_every_n_steps=1000000", "logger=none", "callbacks=none",
        "checkpoint.save_last=false", "checkpoint.save_top_k=0",
        *([f"parallel={preset}", f"trainer.devices={devices}"] if devices > 1 else []),
    ]


def in_fresh_process(measure: Callable[..., float], *args: Any, **kwargs: Any) -> float:
    """``measure(*args, **kwargs)`` in a new Python process: each side starts from a fresh allocator and fresh
    caches (the first run in a process measured up to 10% slower than the next), and a setting one side makes
    (disttrain's host-memory thresholds) stays out of the other side's process."""
    context = mp.get_context("spawn")
    answers = context.SimpleQueue()
    child = context.Process(target=_answer, args=(answers, measure, args, kwargs))
    child.start()
    child.join()
    if child.exitcode != 0 or answers.empty():
        raise RuntimeError(f"{measure.__name__} failed in its process (exit code {child.exitcode})")
    return answers.get()


def _answer(answers: Any, measure: Callable[..., float], args: tuple, kwargs: dict) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    answers.put(measure(*args, **kwargs))


def disttrain_steps_per_sec(flavour: str, steps: int, global_batch: int, devices: int, preset: str = "ddp",
                            device: str = "cpu") -> float:
    """Steps/s of ``train()`` as reported in its results.json (clock starts after step 1); one rank runs in a
    fresh process of its own (``in_fresh_process``), as several ranks do."""
    if devices == 1:
        return in_fresh_process(disttrain_in_this_process, flavour, steps, global_batch, device)
    return disttrain_in_this_process(flavour, steps, global_batch, device, devices, preset)


def disttrain_in_this_process(flavour: str, steps: int, global_batch: int, device: str = "cpu", devices: int = 1,
                              preset: str = "ddp") -> float:
    """Steps/s of ``train()`` started from this process."""
    from hydra import compose, initialize_config_dir

    from disttrain.config import register
    from disttrain.launch.job import train

    register()

    with tempfile.TemporaryDirectory() as run_dir:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=[*overrides(flavour, steps, global_batch, devices, preset, device),
                                                     f"run_dir={run_dir}"])
        train(cfg)
        results = json.loads((Path(run_dir) / "results.json").read_text())
    return results["samples_per_sec"] / global_batch


def plain_loop(
    rank: int, world: int, port: int, flavour: str, steps: int, global_batch: int, out: dict, wrap: str = "ddp",
    source: str = "memory", phases: bool = False, device: str = "cpu", keep_memory: bool = False,
) -> None:
    """A hand-written loop: model, AdamW, clipping, cosine schedule; ``wrap``: ddp, ddp_no_buffer_broadcast, fsdp
    (FSDP2 resharding after forward, ZeRO-3) or fsdp_keep (parameters kept gathered after forward, ZeRO-2).
    ``source`` memory: each step indexes this rank's rows of the epoch's permutation out of tensors that hold the
    whole training set (what a loop written by hand does when the data fits in memory); loader: a DataLoader over
    a DistributedSampler. ``phases``: also time each step's phases (``out["phases"]``, rank 0), at the boundaries
    where ``step_phases.py`` times disttrain's step. ``device`` cuda: rank r on GPU r (NCCL), each step's batch
    copied there as Lightning copies disttrain's, the clock read after the GPU has finished. ``keep_memory``: set
    glibc's thresholds as disttrain's ranks do (``trainer.keep_freed_host_memory``) before anything is built."""
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from disttrain.data import build_datamodule
    from disttrain.data.digits import DigitsConfig
    from disttrain.data.text import PyDocsConfig
    from disttrain.models import build_model
    from disttrain.models.cnn import CNNConfig
    from disttrain.models.gpt import GPTConfig
    from disttrain.optim import AdamWConfig, SchedulerConfig, build_optimizer, build_scheduler
    from disttrain.parallel.apply import buffer_sync_option

    if keep_memory:
        keep_freed_host_memory()
    gpu = torch.device("cuda", rank) if device == "cuda" else None
    if gpu is not None:
        torch.cuda.set_device(gpu)
    if world > 1:
        dist.init_process_group("nccl" if gpu is not None else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(0)
    cnn = flavour == "cnn"
    data_cfg = DigitsConfig() if cnn else PyDocsConfig()
    datamodule = build_datamodule(data_cfg, micro_batch_size=global_batch // world, seed=0)
    datamodule.setup("fit")
    model = build_model(CNNConfig() if cnn else GPTConfig(flavour=flavour), datamodule.spec).to(gpu or "cpu")
    if world > 1 and wrap.startswith("ddp"):
        model = DistributedDataParallel(model, device_ids=[rank] if gpu is not None else None,
                                        **buffer_sync_option(wrap == "ddp"))
    elif world > 1:  # FSDP2 per transformer block (the CNN: whole), then the root; ZeRO-3 reshards after forward
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device, (world,))
        for block in getattr(model, "blocks", []):
            fully_shard(block, mesh=mesh, reshard_after_forward=wrap == "fsdp")
        fully_shard(model, mesh=mesh, reshard_after_forward=wrap == "fsdp")
    optimizer = build_optimizer(AdamWConfig(lr=3e-3), model)
    scheduler = build_scheduler(SchedulerConfig(warmup_fraction=0.05), optimizer, steps)
    dataset = datamodule.datasets["train"]
    micro = global_batch // world
    if source == "memory":
        every_row = dataset.get_batch(list(range(len(dataset))))
        steps_per_epoch = len(dataset) // global_batch
        batches = iter(())
    else:
        sampler = DistributedSampler(dataset, world, rank, shuffle=True, seed=0, drop_last=True)
        loader = DataLoader(dataset, batch_size=micro, sampler=sampler, drop_last=True)
        batches = iter(())
    epoch, start = 0, 0.0
    clock = PhaseClock(synchronize=gpu is not None) if phases else None
    mark = clock.mark if clock else (lambda _name: None)
    for step in range(steps):
        if step == 1:
            if gpu is not None:
                torch.cuda.synchronize()
            start = time.perf_counter()
        mark("step")
        if source == "memory":
            within = step % steps_per_epoch
            if within == 0:  # a new epoch: one permutation, the same on every rank (the digits hold 19 steps of 64)
                order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(step))
            rows = order[within * global_batch + rank * micro: within * global_batch + (rank + 1) * micro]
            inputs, targets = every_row[0][rows], every_row[1][rows]
        else:
            try:
                inputs, targets = next(batches)
            except StopIteration:
                sampler.set_epoch(epoch)
                epoch += 1
                batches = iter(loader)
                inputs, targets = next(batches)
        if gpu is not None:
            inputs, targets = inputs.to(gpu), targets.to(gpu)
        mark("data")
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        mark("forward")
        loss.backward()
        mark("backward")
        mark("after backward")  # nothing runs here in a plain loop; Lightning's hooks and the loss logging do
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        mark("optimiser")
    if gpu is not None:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    if rank == 0:
        out["steps_per_sec"] = (steps - 1) / elapsed
        if clock:
            out["phases"] = clock.medians()
    if world > 1:
        # drain gloo's queue and drop DDP's reducer while the group lives: freeing both at once at exit
        # deadlocked here (the group's destructor waited on its worker thread, which waited for the GIL)
        dist.barrier()
        del model, optimizer, scheduler
        dist.destroy_process_group()


def lightning_loop(rank: int, world: int, port: int, flavour: str, steps: int, global_batch: int, out: dict,
                   device: str = "cpu") -> None:
    """The plain loop's model, data, optimiser, clipping and schedule written as the smallest LightningModule and run
    by Lightning's own Trainer (no logger, checkpoints or progress bar; on 2 ranks its DDP strategy without the
    per-step buffer broadcast): what any framework whose step runs inside Lightning's loop starts from. Batches
    are the plain loop's in-memory rows, one step's batch per item of a DataLoader."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from disttrain.data import build_datamodule
    from disttrain.data.digits import DigitsConfig
    from disttrain.data.text import PyDocsConfig
    from disttrain.models import build_model
    from disttrain.models.cnn import CNNConfig
    from disttrain.models.gpt import GPTConfig
    from disttrain.optim import AdamWConfig, SchedulerConfig, build_optimizer, build_scheduler
    from disttrain.parallel.apply import buffer_sync_option

    if world > 1:  # Lightning joins the ranks these processes already are
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                          LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(0)
    cnn = flavour == "cnn"
    datamodule = build_datamodule(DigitsConfig() if cnn else PyDocsConfig(), micro_batch_size=global_batch // world,
                                  seed=0)
    datamodule.setup("fit")
    dataset = datamodule.datasets["train"]
    every_row = dataset.get_batch(list(range(len(dataset))))
    micro, steps_per_epoch = global_batch // world, len(dataset) // global_batch

    class StepBatches(torch.utils.data.Dataset):
        """Item ``step``: this rank's rows of the epoch's permutation, indexed as the plain loop does."""

        def __len__(self) -> int:
            return steps

        def __getitem__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
            within = step % steps_per_epoch
            if within == 0 or not hasattr(self, "order"):
                self.order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(step))
            rows = self.order[within * global_batch + rank * micro: within * global_batch + (rank + 1) * micro]
            return every_row[0][rows], every_row[1][rows]

    class Task(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(CNNConfig() if cnn else GPTConfig(flavour=flavour), datamodule.spec)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            inputs, targets = batch
            logits = self.model(inputs)
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

        def configure_optimizers(self) -> dict:
            optimizer = build_optimizer(AdamWConfig(lr=3e-3), self.model)
            scheduler = build_scheduler(SchedulerConfig(warmup_fraction=0.05), optimizer, steps)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    class Clock(pl.Callback):
        """The time from the start of the second step to the end of the last."""

        def on_train_batch_start(self, trainer: pl.Trainer, *_: object) -> None:
            if trainer.global_step == 1:
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: pl.Trainer, *_: object) -> None:
            if trainer.global_step == steps:
                self.elapsed = time.perf_counter() - self.start

    clock = Clock()
    trainer = pl.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu", devices=world, max_steps=steps, gradient_clip_val=1.0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[clock],
        strategy=DDPStrategy(**buffer_sync_option(False)) if world > 1 else "auto", use_distributed_sampler=False,
    )
    trainer.fit(Task(), torch.utils.data.DataLoader(StepBatches(), batch_size=None))
    if rank == 0:
        out["steps_per_sec"] = (steps - 1) / clock.elapsed
    if world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


class PhaseClock:
    """Times between named marks in each step ("step" opens one): per phase, the median milliseconds from the
    previous mark to the named one, over the steps after the first five (warm-up)."""

    WARMUP = 5

    def __init__(self, synchronize: bool = False) -> None:
        self.steps: list[dict[str, float]] = []
        self._last = 0.0
        self.synchronize = synchronize
        """Wait for the GPU at each mark, so that a phase holds the GPU work it queued (the marks then stop the
        host from running ahead: a measured step is a serialised one)."""

    def mark(self, name: str) -> None:
        """Close the phase ``name`` (the time since the previous mark); ``step`` closes the time between steps."""
        if self.synchronize:
            torch.cuda.synchronize()
        now = time.perf_counter()
        if name == "step":
            self.steps.append({})
            if len(self.steps) > 1:
                self.steps[-2]["between steps"] = now - self._last
        elif self.steps:
            self.steps[-1][name] = self.steps[-1].get(name, 0.0) + now - self._last
        self._last = now

    def medians(self) -> dict[str, float]:
        """Median milliseconds of each phase over the measured steps."""
        import statistics

        measured = [step for step in self.steps[self.WARMUP:-1] if step]
        names = list(dict.fromkeys(name for step in measured for name in step))
        return {name: 1e3 * statistics.median(step.get(name, 0.0) for step in measured) for name in names}


def plain_steps_per_sec(flavour: str, steps: int, global_batch: int, devices: int, wrap: str = "ddp",
                        source: str = "memory", device: str = "cpu", keep_memory: bool = False) -> float:
    """Steps/s of the plain loop on ``devices`` ranks (one: in a fresh process), its batches read as ``source``
    says (memory or loader); ``keep_memory``: glibc's thresholds set as disttrain sets them."""
    if devices == 1:
        return in_fresh_process(_plain_one_process, flavour, steps, global_batch, source, device, keep_memory)
    from disttrain.parallel.process_group import free_port

    port = free_port()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(plain_loop, args=(devices, port, flavour, steps, global_batch, out, wrap, source, False, device,
                                   keep_memory), nprocs=devices)
        return out["steps_per_sec"]


def _plain_one_process(flavour: str, steps: int, global_batch: int, source: str, device: str,
                       keep_memory: bool) -> float:
    out: dict = {}
    plain_loop(0, 1, 0, flavour, steps, global_batch, out, source=source, device=device, keep_memory=keep_memory)
    return out["steps_per_sec"]


def _lightning_one_process(flavour: str, steps: int, global_batch: int, device: str) -> float:
    out: dict = {}
    lightning_loop(0, 1, 0, flavour, steps, global_batch, out, device)
    return out["steps_per_sec"]


def lightning_steps_per_sec(flavour: str, steps: int, global_batch: int, devices: int, device: str = "cpu") -> float:
    """Steps/s of ``lightning_loop`` on ``devices`` ranks (one: in a fresh process)."""
    if devices == 1:
        return in_fresh_process(_lightning_one_process, flavour, steps, global_batch, device)
    from disttrain.parallel.process_group import free_port

    port = free_port()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(lightning_loop, args=(devices, port, flavour, steps, global_batch, out, device), nprocs=devices)
        return out["steps_per_sec"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--flavour", default="nano")
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs of each side; the best counts")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: a GPU per rank (the 2-rank row needs 2 GPUs)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("Error: --device cuda: torch sees no GPU here")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    on = {"device": args.device}
    rows = []
    for devices in (1, 2) if args.device == "cpu" or torch.cuda.device_count() > 1 else (1,):
        ours = plain = loader = quiet = peer = kept = 0.0
        for _ in range(args.repeats):  # alternating, so a noisy stretch of the machine hits both sides
            ours = max(ours, disttrain_steps_per_sec(args.flavour, args.steps, args.global_batch, devices, **on))
            plain = max(plain, plain_steps_per_sec(args.flavour, args.steps, args.global_batch, devices, **on))
            loader = max(loader, plain_steps_per_sec(args.flavour, args.steps, args.global_batch, devices,
                                                     source="loader", **on))
            if devices > 1:
                quiet = max(quiet, plain_steps_per_sec(args.flavour, args.steps, args.global_batch, devices,
                                                       wrap="ddp_no_buffer_broadcast", **on))
            peer = max(peer, lightning_steps_per_sec(args.flavour, args.steps, args.global_batch, devices, **on))
            kept = max(kept, plain_steps_per_sec(args.flavour, args.steps, args.global_batch, devices,
                                                 wrap="ddp" if devices == 1 else "ddp_no_buffer_broadcast",
                                                 keep_memory=True, **on))
        rows.append((devices, ours, plain, loader, quiet or plain, peer, kept))
    workload = "digits CNN" if args.flavour == "cnn" else f"GPT {args.flavour}, pydocs"
    machine = f"GPU: {torch.cuda.get_device_name()}, host CPU: {cpu_model()}" if args.device == "cuda" else \
        f"CPU: {cpu_model()}"
    print(f"\n{machine}; {workload}, global batch {args.global_batch}, {args.steps} steps, "
          f"{args.threads} thread(s) per rank, best of {args.repeats}, torch {torch.__version__}\n")
    print("Plain loops read each step's batch out of in-memory tensors; the DataLoader column reads it through "
          "torch's DataLoader and DistributedSampler. The goals compare with the plain loop that makes no "
          "collective beyond DDP's gradient all-reduce (in one process: the plain loop). Plain Lightning: the "
          "same step as the smallest LightningModule under Lightning's own Trainer, in-memory batches (on 2 "
          "ranks without the buffer broadcast). Host memory kept: the plain loop (no extra collective) with "
          "glibc's thresholds set as disttrain's ranks set them (trainer.keep_freed_host_memory). Each "
          "one-process run starts in a fresh process.\n")
    print("| ranks | disttrain steps/s | plain steps/s | ratio | plain, DataLoader | ratio "
          "| plain, no per-step buffer broadcast | ratio | plain Lightning | ratio | plain Lightning / plain "
          "| plain, host memory kept | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for devices, ours, plain, loader, quiet, peer, kept in rows:
        print(f"| {devices} | {ours:.2f} | {plain:.2f} | {ours / plain:.3f} | {loader:.2f} | {ours / loader:.3f} "
              f"| {quiet:.2f} | {ours / quiet:.3f} | {peer:.2f} | {ours / peer:.3f} | {peer / quiet:.3f} "
              f"| {kept:.2f} | {ours / kept:.3f} |")
    ratios = [row[1] / row[4] for row in rows]
    peers = [row[5] / row[4] for row in rows]
    kept_ratios = [row[1] / row[6] for row in rows]
    two = f", {ratios[1]:.3f}x on 2 ranks (goal >= 0.97x)" if len(rows) > 1 else ""
    two_peer = f" and {peers[1]:.3f}x" if len(rows) > 1 else ""
    print(f"\ndisttrain / plain PyTorch (in-memory batches, no extra collective) steps/s: {ratios[0]:.3f}x in one "
          f"process (goal >= 0.99x){two}; plain Lightning reaches {peers[0]:.3f}x{two_peer}; against the plain "
          f"loop with host memory kept as disttrain keeps it: {' and '.join(f'{r:.3f}x' for r in kept_ratios)}")


if __name__ == "__main__":
    main()
