"""The reference loops that disttrain's overhead is measured against: a hand-written PyTorch loop (plain DDP or
FSDP2) and the same step as the smallest LightningModule under Lightning's own Trainer; the phase clock that
times both the same way; and their steps/s on one or several ranks."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fresh_process import in_fresh_process

LINEAR = "linear"
"""The flavour whose model is one linear layer over the digits' 64 pixels: its step computes next to nothing, so a
loop's time per step there is the loop's own (what a framework adds to every step, in microseconds)."""


def linear_classifier(num_classes: int, in_channels: int, image_size: int) -> torch.nn.Module:
    """The ``linear`` flavour's model; disttrain builds it by ``model._target_``, the data filling in the sizes."""
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(in_channels * image_size**2, num_classes))


def workload_configs(flavour: str) -> tuple[Any, Any]:
    """The data and model configs of ``flavour``: cnn, the digits CNN; linear, ``linear_classifier`` on the digits;
    else that GPT flavour on pydocs."""
    from disttrain.data.digits import DigitsConfig
    from disttrain.data.text import PyDocsConfig
    from disttrain.models.cnn import CNNConfig
    from disttrain.models.gpt import GPTConfig
    from disttrain.models.target import TargetModelConfig

    if flavour == "cnn":
        return DigitsConfig(), CNNConfig()
    if flavour == LINEAR:
        return DigitsConfig(), TargetModelConfig(f"{__name__}.linear_classifier")
    return PyDocsConfig(), GPTConfig(flavour=flavour)


def workload_overrides(flavour: str) -> list[str]:
    """``workload_configs(flavour)`` as the overrides of a disttrain run."""
    if flavour == "cnn":
        return ["model=cnn", "data=digits"]
    if flavour == LINEAR:
        return ["model=custom", f"model._target_={__name__}.linear_classifier", "data=digits"]
    return ["model=gpt", f"model.flavour={flavour}", "data=pydocs"]


def workload_name(flavour: str) -> str:
    """How tables name ``flavour``'s workload."""
    return {"cnn": "digits CNN", LINEAR: "one linear layer on the digits"}.get(flavour, f"GPT {flavour}, pydocs")


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

    from disttrain.data import build_datamodule
    from disttrain.models import build_model
    from disttrain.parallel.apply import buffer_sync_option

    if keep_memory:
        from disttrain.rank.host_memory import keep_freed_host_memory

        keep_freed_host_memory()
    gpu = torch.device("cuda", rank) if device == "cuda" else None
    if gpu is not None:
        torch.cuda.set_device(gpu)
    if world > 1:
        dist.init_process_group("nccl" if gpu is not None else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(0)
    data_cfg, model_cfg = workload_configs(flavour)
    datamodule = build_datamodule(data_cfg, micro_batch_size=global_batch // world, seed=0)
    datamodule.setup("fit")
    model = build_model(model_cfg, datamodule.spec).to(gpu or "cpu")
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
    stepper = PlainStepper(model, datamodule.datasets["train"], steps, global_batch, world, rank, source, gpu)
    start = 0.0
    clock = PhaseClock(synchronize=gpu is not None) if phases else None
    mark = clock.mark if clock else (lambda _name: None)
    for step in range(steps):
        if step == 1:
            if gpu is not None:
                torch.cuda.synchronize()
            start = time.perf_counter()
        mark("step")
        stepper.step(step, mark)
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
        del model, stepper
        dist.destroy_process_group()


class PlainStepper:
    """The plain loop's step, one call per optimiser step: AdamW (lr 3e-3), clipping at 1.0 and a cosine schedule
    with 5% warm-up over ``steps``. ``source`` memory: each step indexes this rank's rows of the epoch's permutation
    out of tensors holding ``dataset`` (the digits hold 19 steps of 64); loader: a DataLoader over a
    DistributedSampler. ``gpu``: the device each batch is copied to, or None."""

    def __init__(self, model: torch.nn.Module, dataset: Any, steps: int, global_batch: int, world: int = 1,
                 rank: int = 0, source: str = "memory", gpu: torch.device | None = None) -> None:
        from torch.utils.data import DataLoader, DistributedSampler

        from disttrain.optim import AdamWConfig, SchedulerConfig, build_optimizer, build_scheduler

        self.model, self.gpu, self.source = model, gpu, source
        self.optimizer = build_optimizer(AdamWConfig(lr=3e-3), model)
        self.scheduler = build_scheduler(SchedulerConfig(warmup_fraction=0.05), self.optimizer, steps)
        self.global_batch, self.micro, self.rank = global_batch, global_batch // world, rank
        self.size = len(dataset)
        if source == "memory":
            self.every_row = dataset.get_batch(list(range(len(dataset))))
            self.steps_per_epoch = len(dataset) // global_batch
        else:
            self.sampler = DistributedSampler(dataset, world, rank, shuffle=True, seed=0, drop_last=True)
            self.loader = DataLoader(dataset, batch_size=self.micro, sampler=self.sampler, drop_last=True)
        self.batches: Any = iter(())
        self.epoch = 0

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``step``'s inputs and targets on this rank."""
        if self.source == "memory":
            within = step % self.steps_per_epoch
            if within == 0:  # a new epoch: one permutation, the same on every rank
                self.order = torch.randperm(self.size, generator=torch.Generator().manual_seed(step))
            first = within * self.global_batch + self.rank * self.micro
            rows = self.order[first: first + self.micro]
            return self.every_row[0][rows], self.every_row[1][rows]
        try:
            return next(self.batches)
        except StopIteration:
            self.sampler.set_epoch(self.epoch)
            self.epoch += 1
            self.batches = iter(self.loader)
            return next(self.batches)

    def step(self, step: int, mark: Any = None) -> None:
        """One optimiser step; ``mark(phase)`` is called at the end of each phase (see ``PhaseClock``)."""
        mark = mark or _no_mark
        inputs, targets = self.batch(step)
        if self.gpu is not None:
            inputs, targets = inputs.to(self.gpu), targets.to(self.gpu)
        mark("data")
        logits = self.model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        mark("forward")
        loss.backward()
        mark("backward")
        mark("after backward")  # nothing runs here in a plain loop; Lightning's hooks and the loss logging do
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.scheduler.step()
        mark("optimiser")


def _no_mark(_phase: str) -> None:
    """A phase mark that times nothing."""


def lightning_loop(rank: int, world: int, port: int, flavour: str, steps: int, global_batch: int, out: dict,
                   device: str = "cpu") -> None:
    """The plain loop's model, data, optimiser, clipping and schedule written as the smallest LightningModule and run
    by Lightning's own Trainer (no logger, checkpoints or progress bar; on 2 ranks its DDP strategy without the
    per-step buffer broadcast): what any framework whose step runs inside Lightning's loop starts from. Batches
    are the plain loop's in-memory rows, one step's batch per item of a DataLoader."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from disttrain.data import build_datamodule
    from disttrain.models import build_model
    from disttrain.optim import AdamWConfig, SchedulerConfig, build_optimizer, build_scheduler
    from disttrain.parallel.apply import buffer_sync_option

    if world > 1:  # Lightning joins the ranks these processes already are
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                          LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(0)
    data_cfg, model_cfg = workload_configs(flavour)
    datamodule = build_datamodule(data_cfg, micro_batch_size=global_batch // world, seed=0)
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
            self.model = build_model(model_cfg, datamodule.spec)

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


def loop_steps_per_sec(loop: Any, devices: int, flavour: str, steps: int, global_batch: int, *extra: Any) -> float:
    """Steps/s of ``loop(rank, world, port, flavour, steps, global_batch, out, *extra)`` on ``devices`` ranks, each a
    process of its own (one rank: ``in_fresh_process``)."""
    if devices == 1:
        return in_fresh_process(_one_rank, loop, flavour, steps, global_batch, *extra)
    from disttrain.parallel.process_group import free_port

    port = free_port()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(loop, args=(devices, port, flavour, steps, global_batch, out, *extra), nprocs=devices)
        return out["steps_per_sec"]


def _one_rank(loop: Any, flavour: str, steps: int, global_batch: int, *extra: Any) -> float:
    out: dict = {}
    loop(0, 1, 0, flavour, steps, global_batch, out, *extra)
    return out["steps_per_sec"]


def plain_steps_per_sec(flavour: str, steps: int, global_batch: int, devices: int, wrap: str = "ddp",
                        source: str = "memory", device: str = "cpu", keep_memory: bool = False) -> float:
    """Steps/s of the plain loop on ``devices`` ranks, its batches read as ``source`` says (memory or loader);
    ``keep_memory``: glibc's thresholds set as disttrain sets them."""
    return loop_steps_per_sec(plain_loop, devices, flavour, steps, global_batch, wrap, source, False, device,
                              keep_memory)


def lightning_steps_per_sec(flavour: str, steps: int, global_batch: int, devices: int, device: str = "cpu") -> float:
    """Steps/s of ``lightning_loop`` on ``devices`` ranks."""
    return loop_steps_per_sec(lightning_loop, devices, flavour, steps, global_batch, device)
