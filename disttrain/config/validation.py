"""The one validation pass: a composed config in, typed objects, resolved numbers and the execution plan out.

Everything is checked here, before any worker rank starts; every mistake is one ``ConfigError`` naming the
key, the value and what is allowed. The pieces live beside it: ``typed`` (nodes into schemas), ``batch``
(the batch numbers) and ``execution`` (the kind of run and what the Trainer is told).
"""

from __future__ import annotations

import copy
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from disttrain.checkpoint.init_weights import InitWeightsFile, check_init_weights, init_weights_of
from disttrain.config.batch import ResolvedBatch, resolve_batch
from disttrain.config.evaluation import check_eval
from disttrain.config.execution import execution_plan
from disttrain.config.layout_refusals import LayoutRefusals
from disttrain.config.plan_checks import check_plan_options
from disttrain.config.precision import resolve_matmul_precision, resolve_precision
from disttrain.config.ranks import RankRange, elastic_batch, largest_world, launched, rank_ranges, restart_worlds
from disttrain.config.resume import check_resume_fits, checkpoint_folder
from disttrain.config.run import RunConfig
from disttrain.config.schema import TrainConfig, TrainerConfig
from disttrain.config.torchft_checks import check_torchft
from disttrain.config.trainer_checks import check_trainer
from disttrain.config.typed import typed_groups
from disttrain.errors import ConfigError
from disttrain.federated.checks import check_federated
from disttrain.models.hf.weights import check_starting_weights
from disttrain.models.lora import adapter_summary, check_base_precision, check_quantised_base
from disttrain.models.target import TargetModelConfig
from disttrain.observe.memory_options import check_memory_callbacks
from disttrain.parallel.config import ParallelConfig
from disttrain.parallel.layout import Layout
from disttrain.parallel.model_checks import check_model_plan, model_on_meta


def world_size_of(trainer: TrainerConfig) -> int:
    """Number of ranks: the launcher's WORLD_SIZE under torchrun/SLURM, else devices x num_nodes."""
    if launched():
        return int(os.environ["WORLD_SIZE"])
    return trainer.devices * trainer.num_nodes


def resolve_devices(trainer: TrainerConfig, parallel: ParallelConfig) -> tuple[int, str | None]:
    """``trainer.devices`` as a number, and a one-line notice when ``auto`` chose it."""
    if trainer.devices != "auto":
        return trainer.devices, None
    if _uses_gpu(trainer.accelerator):
        import torch

        # a preset of fixed degrees (single: 1) takes that many GPUs, one of -1 (ddp, zero3) every GPU here
        count = parallel.fixed_ranks() or max(1, torch.cuda.device_count())
        return count, f"trainer.devices=auto: {count} GPU rank(s) per node"
    fewest = parallel.fewest_ranks()
    if fewest == 1:
        return 1, None
    return fewest, (f"trainer.devices=auto: starting {fewest} CPU ranks, the fewest parallel={parallel.name} runs "
                    "on (trainer.devices=N for another number)")


def check_gpu_count(trainer: TrainerConfig, devices_range: RankRange | None = None) -> None:
    """A GPU run that disttrain's supervisor starts needs a GPU per rank on this machine (rank r takes
    ``cuda:r``; ``trainer.num_nodes`` > 1 without a launcher starts them all here): ConfigError naming
    ``trainer.devices`` (or the range it came from) otherwise, before Lightning refuses it in every rank.
    Under torchrun or SLURM the launcher placed the ranks and nothing is checked."""
    if launched() or not _uses_gpu(trainer.accelerator):
        return
    import torch

    count, ranks = torch.cuda.device_count(), trainer.devices * trainer.num_nodes
    if count == 0:
        raise ConfigError("trainer.accelerator", trainer.accelerator, "cpu or auto: this machine shows no GPU")
    if ranks <= count:
        return
    limit = f"MIN:MAX with MAX at most {count}" if devices_range else f"at most {count}"
    if trainer.num_nodes > 1:
        limit = (f"at most {count} ranks in all with trainer.num_nodes={trainer.num_nodes} (without a launcher "
                 "every rank starts on this machine)")
    raise ConfigError("trainer.devices", devices_range.text if devices_range else trainer.devices,
                      f"{limit}, as this machine shows {count} GPU{'s' * (count > 1)} (one per rank); "
                      f"trainer.accelerator=cpu runs {ranks} CPU ranks")


def validate(cfg: DictConfig, world_size: int | None = None) -> RunConfig:
    """Check a composed config once and return typed, resolved objects; raise ConfigError on bad input.

    A straight sequence: the groups as typed objects, the checks of their values, then named steps that decide
    what the checks cannot (ranks per node, the planner's layout for ``parallel=auto``, the data, the precision
    probe, the model's parallel plan, the kind of run). ``cfg`` itself is never changed: the decisions are
    written into the typed groups and the resolved copy of ``cfg`` (``RunConfig.yaml``). It runs once per job: the
    ranks the job starts read the result (``disttrain.config.resolved``) and decide nothing again.
    """
    from torch.nn.modules.batchnorm import _BatchNorm

    from disttrain.data import build_datamodule

    cfg = copy.deepcopy(cfg)
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(str(getattr(err, "full_key", "config")), None, f"cannot be resolved: {err}") from None
    top, model, data, optim, scheduler = typed_groups(cfg)
    devices_range, nodes_range = rank_ranges(top.trainer)
    notices = _check_options(top, model, data, optim, scheduler)
    top.trainer.devices, devices_notice = resolve_devices(top.trainer, top.parallel)
    notices += [devices_notice] if devices_notice else []
    if world_size is None and top.mode == "train":  # a caller naming the world starts no ranks from this config
        check_gpu_count(top.trainer, devices_range)
    world = world_size if world_size is not None else world_size_of(top.trainer)
    elastic = devices_range is not None or nodes_range is not None
    chose_layout = top.parallel.name == "auto"
    choice = None
    if chose_layout:
        choice, notice = _choose_parallel(top, model, data, optim, world)
        notices.append(notice)
    p = top.parallel
    layout = Layout.on(p, world)
    p.check_layout(layout)
    top.comm.check_layout(layout, p.sync_every, p.servers)
    if hasattr(optim, "check_run"):  # an optimiser that exchanges over the ranks itself
        optim.check_run(layout, top.comm)
    if elastic:  # the global batch of the largest world, on every world of the range
        largest = largest_world(top.trainer, devices_range, nodes_range, world)
        top.batch = elastic_batch(top.batch, Layout.on(p, largest).dp)
    batch = resolve_batch(top.batch, layout.dp)
    LayoutRefusals.of(top, model, optim).check(layout, batch.accumulation)
    datamodule = build_datamodule(data, micro_batch_size=batch.micro_size, seed=top.seed)
    notices += [datamodule.notice] if getattr(datamodule, "notice", None) else []
    if not isinstance(model, TargetModelConfig):
        model.validate(datamodule.spec)
        notices += model.notices(datamodule.spec) if hasattr(model, "notices") else []
    notices += _decide_precision(top, model, datamodule.spec, batch.micro_size)
    check_base_precision(getattr(model, "lora", None), top.trainer.precision)
    net, init_weights = _check_model(top, model, optim, layout, batch, datamodule.spec, chose_layout)
    notices += [init_weights.notice(top.resume)] if init_weights is not None else []
    check_quantised_base(getattr(model, "lora", None), net)
    notices += [line for line in (adapter_summary(net),) if line]
    notices += _decide_float8(top, model, net, layout)
    notices += check_federated(top, layout, datamodule)
    plan = execution_plan(layout, batch, top.trainer, p, datamodule.spec, top.fault_tolerance.engine)
    check_eval(top.eval, model.name, getattr(data, "tokenizer", None), layout, plan.kind, top.checkpoint.monitor)
    if plan.kind != "federated":
        steps_per_epoch = datamodule.num_train_samples // batch.global_size
        notices += length_notices(top.trainer, steps_per_epoch)
        notices += validation_schedule(top.trainer, steps_per_epoch * batch.accumulation, batch.accumulation)
    world_sizes: tuple[int, ...] = ()
    if elastic:
        world_sizes = restart_worlds(top, plan.kind, devices_range or nodes_range,  # type: ignore[arg-type]
                                      lambda w: _runs_on(w, top, model.name, net, datamodule.spec))
        if world_sizes and devices_range and not top.fault_tolerance.max_restarts:
            notices.append(f"trainer.devices={devices_range.text} with fault_tolerance.max_restarts=0: no "
                           f"restart, so the run trains on {world} ranks only")
    if layout.world_size == 1 and layout.shards_parameters and not layout.cpu_offload:
        notices.append(f"parallel.{layout.zero_setting} on 1 rank: nothing to shard, yet FSDP2 runs its hooks "
                       "around every unit, host time in every step (benchmarks/README.md measures its cost); "
                       "parallel=single trains the same model without them")
    if batch.accumulation > 1 and any(isinstance(m, _BatchNorm) for m in net.modules()):
        notices.append(f"batch.accumulation={batch.accumulation} with BatchNorm layers: their statistics come from "
                       f"each micro-batch of {batch.micro_size} samples, not from the step's {batch.global_size}, so "
                       "the curve differs from a run without accumulation (as anywhere BatchNorm meets accumulation)")
    if getattr(model, "init_weights", None) is not None:
        OmegaConf.update(cfg, "model.init_weights", model.init_weights)
    yaml = _resolved_yaml(cfg, top, chose_layout, devices_range, nodes_range)
    return RunConfig(top, model, data, optim, scheduler, layout, batch, yaml, tuple(notices), plan, datamodule,
                     world_sizes, choice, init_weights)


def _runs_on(world: int, top: TrainConfig, model_name: str, net: Any, spec: Any) -> None:
    """Raise the ConfigError that a run of this config on ``world`` ranks would meet (degrees, batch, the model's
    plan); nothing if it runs."""
    p = top.parallel
    layout = Layout.on(p, world)
    p.check_layout(layout)
    top.comm.check_layout(layout, p.sync_every, p.servers)
    check_model_plan(model_name, net, p, layout, resolve_batch(top.batch, layout.dp).micro_size, spec)


def _check_model(top: TrainConfig, model: Any, optim: Any, layout: Layout, batch: ResolvedBatch, spec: Any,
                 chose_layout: bool) -> tuple[Any, InitWeightsFile | None]:
    """The model built on the meta device and checked against the layout: its parallel plan, the headers of the
    weights it starts from (a pretrained folder or ``model.init_weights``), the checkpoint it resumes from, the
    gradient codec's rank (resolved here when unset), torchft and the memory budget. Returns the model (the
    notices that follow read it) and the ``model.init_weights`` file as checked (None without one)."""
    p = top.parallel
    net = model_on_meta(model, spec)
    check_model_plan(model.name, net, p, layout, batch.micro_size, spec)
    check_starting_weights(net)
    init_weights = None
    if getattr(model, "init_weights", None) is not None:
        init_weights = check_init_weights(net, model.init_weights)
    if top.resume not in (None, "auto"):
        check_resume_fits(top.resume, net)
    top.comm.check_model(net)
    check_torchft(top, layout, net)
    if top.plan.memory_gb is not None and top.mode == "train" and not chose_layout:
        from disttrain.plan.planner import check_memory_budget

        check_memory_budget(net, spec, layout, p, batch, optim, top.trainer.precision, top.plan.memory_gb)
    return net, init_weights


def _check_options(top: TrainConfig, model: Any, data: Any, optim: Any, scheduler: Any) -> list[str]:
    """Every check of a value or a pair of values that needs nothing built; the notices they give."""
    notices = [notice for part in (data, optim, scheduler) for notice in (part.validate() or [])]
    top.parallel.validate()
    gpu = _uses_gpu(top.trainer.accelerator)
    if top.parallel.cpu_offload and not gpu:
        raise ConfigError("parallel.cpu_offload", True,
                          "false on a CPU run (offloading moves state from GPU memory to the CPU, where it already is)")
    check_trainer(top.trainer)
    top.fault_tolerance.validate(top.parallel.timeout_s)
    top.observe.validate()
    check_memory_callbacks(top.callbacks, top.trainer.max_steps)
    top.comm.validate()
    if top.checkpoint.keep_last < 1:
        raise ConfigError("checkpoint.keep_last", top.checkpoint.keep_last, "1 or more save points")
    every = top.checkpoint.every_n_train_steps
    if every is not None and (every < 1 or not top.checkpoint.save_last):
        raise ConfigError("checkpoint.every_n_train_steps", every, "null, or a positive number of steps with "
                          "checkpoint.save_last=true (its save points write last.ckpt)")
    if getattr(model, "sync_batchnorm", False) and not gpu:
        raise ConfigError("model.sync_batchnorm", True,
                          "false on a CPU run (torch's SyncBatchNorm runs on GPUs only)")
    if top.resume not in (None, "auto"):
        top.resume = checkpoint_folder(top.resume)
    if hasattr(model, "init_weights"):  # resolved once, to an absolute path: every rank reads this file
        model.init_weights = init_weights_of(model)
    if top.mode not in ("train", "plan", "dryrun"):
        raise ConfigError("mode", top.mode, "train (fit and test), plan (print the plan and stop) or dryrun (run "
                          "one rank of the layout here and hold it against the plan)")
    if top.dryrun.steps < 1:
        raise ConfigError("dryrun.steps", top.dryrun.steps, "1 or more optimiser steps")
    check_plan_options(top.plan)
    return notices


def _decide_float8(top: TrainConfig, model: Any, net: Any, layout: Layout) -> list[str]:
    """``trainer.fp8``: the linear layers that train in float8 and whether FSDP2 gathers them in float8, decided
    here on the model on the meta device and written into ``top.trainer`` (what the ranks convert); the line that
    says so. A ConfigError where float8 cannot run: no torchao, a GPU without float8 products, adapters."""
    t = top.trainer
    if t.fp8 == "none":
        return []
    from disttrain.parallel.float8 import check_float8_device, choose_float8_layers, require_torchao

    require_torchao()
    gpu = _uses_gpu(t.accelerator)
    check_float8_device(gpu, _gpu_capability() if gpu else None)
    lora = getattr(model, "lora", None)
    if lora is not None and lora.enabled:
        raise ConfigError("trainer.fp8", t.fp8, "none with model.lora (the frozen base's layers are not float8 "
                          "trained)")
    layers, line = choose_float8_layers(net, t.fp8, t.fp8_layers or None, t.fp8_all_gather,
                                        layout.shards_parameters, t.precision)
    t.fp8_layers, t.fp8_all_gather = list(layers.modules), layers.all_gather
    if top.mode in ("plan", "dryrun"):
        line += ("; the plan prices their products at the profile's float8 rate, their casts to float8"
                 + (" and their float8 gathers" if layers.all_gather else "") + " (a profile without a float8 "
                 "rate, as a CPU's, prices the products at the run's)")
    return [line]


def _gpu_capability() -> tuple[int, int] | None:
    """The first GPU's compute capability, None where torch sees none."""
    import torch

    return torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None


def _decide_precision(top: TrainConfig, model: Any, spec: Any, micro_size: int) -> list[str]:
    """``trainer.precision=auto``: the planner's choice for a plan (its model may not fit here to be measured),
    else bf16 where this device computes it natively and measures faster; the notice that says which."""
    if top.mode in ("plan", "dryrun"):  # a dry run is held against the plan: both take its precision
        from disttrain.plan.hardware import resolve_profile
        from disttrain.plan.planner import planned_precision

        top.trainer.precision = planned_precision(top.trainer.precision,
                                                  resolve_profile(top.plan.profile, top.plan.memory_gb))
    top.trainer.precision, notice = resolve_precision(top.trainer.precision, _uses_gpu(top.trainer.accelerator),
                                                      model, spec, micro_size)
    top.trainer.matmul_precision = resolve_matmul_precision(top.trainer.matmul_precision,
                                                            _uses_gpu(top.trainer.accelerator))
    top.fault_tolerance.resolve_nan_check(_uses_gpu(top.trainer.accelerator))
    return [notice] if notice else []


def _resolved_yaml(cfg: DictConfig, top: TrainConfig, chose_layout: bool, devices: RankRange | None = None,
                   nodes: RankRange | None = None) -> str:
    """The resolved config with validation's decisions written in (what workers read, so they never decide
    again): ranks per node, the resume folder, precision, PowerSGD's rank, validation and length settings, the
    FedProx weight, for ``parallel=auto`` the chosen layout and batch, and for a range of ranks the range itself
    (each rank checks its world against it) and the batch kept on every world of it."""
    t = top.trainer
    for key, value in (("trainer.devices", devices.text if devices else t.devices),
                       ("trainer.num_nodes", nodes.text if nodes else t.num_nodes),
                       ("trainer.precision", t.precision), ("trainer.matmul_precision", t.matmul_precision),
                       ("trainer.fp8_layers", t.fp8_layers), ("trainer.fp8_all_gather", t.fp8_all_gather),
                       ("fault_tolerance.nan_check", top.fault_tolerance.nan_check),
                       ("trainer.max_steps", t.max_steps),
                       ("trainer.check_val_every_n_epoch", t.check_val_every_n_epoch), ("resume", top.resume),
                       ("comm.rank", top.comm.rank), ("federated.mu", top.federated.mu)):
        OmegaConf.update(cfg, key, value)
    if chose_layout:
        OmegaConf.update(cfg, "parallel", OmegaConf.structured(top.parallel), merge=False)
    if chose_layout or devices or nodes:
        OmegaConf.update(cfg, "batch", OmegaConf.structured(top.batch), merge=False)
    return OmegaConf.to_yaml(cfg)


def _choose_parallel(top: TrainConfig, model: Any, data: Any, optim: Any, world: int) -> tuple[Any, str]:
    """``parallel=auto``: run the planner over the layouts the run's settings allow (``LayoutRefusals``, the rule a
    run's own layout is checked by), put the chosen degrees, options and micro-batch into ``top`` and return what
    it weighed (``disttrain.plan.auto.Choice``) and the notice that says why."""
    from disttrain.data import build_datamodule
    from disttrain.plan.hardware import profile_of_plan
    from disttrain.plan.planner import apply_layout, chosen_layout, weigh_layouts

    if top.batch.global_size is None:
        raise ConfigError("batch.global_size", None, "a number of samples per step with parallel=auto (it picks the "
                          "micro-batch and accumulation)")
    spec = build_datamodule(data, micro_batch_size=1, seed=top.seed).spec
    profile = profile_of_plan(top.plan)
    choice = weigh_layouts(model_on_meta(model, spec), spec, world, top.batch.global_size, top.parallel, optim,
                           top.trainer.precision, profile, top.plan.objective,
                           LayoutRefusals.of(top, model, optim).of_candidate)
    layout, notice = chosen_layout(choice, world, profile, top.plan.alternatives)
    top.parallel = apply_layout(top.parallel, layout)
    top.batch.micro_size, top.batch.accumulation = layout.micro_size, layout.accumulation
    return choice, notice


def length_notices(t: TrainerConfig, steps_per_epoch: int) -> list[str]:
    """Lines that say how ``max_steps`` and ``max_epochs`` combine, where it may surprise."""
    notices = []
    if steps_per_epoch < 1:
        raise ConfigError("batch.global_size", None, "at most the number of training samples (an epoch would "
                          "hold no whole optimiser step)")
    if t.max_steps > 0:
        epochs = -(-t.max_steps // steps_per_epoch)
        if t.max_epochs and epochs > t.max_epochs:
            notices.append(f"trainer.max_steps={t.max_steps} sets the length: {epochs} epochs of {steps_per_epoch} "
                           f"steps (trainer.max_epochs={t.max_epochs} applies only when max_steps is -1)")
    return notices


def validation_schedule(t: TrainerConfig, batches_per_epoch: int, accumulation: int) -> list[str]:
    """Check how the validation settings combine, in Lightning's terms (training batches per rank: an optimiser
    step is ``accumulation`` of them), before any rank starts; a step interval longer than an epoch validates
    across epochs (``check_val_every_n_epoch`` null), where Lightning would refuse it once the ranks run."""
    interval, every_epochs = t.val_check_interval, t.check_val_every_n_epoch
    if every_epochs is not None and every_epochs < 1:
        raise ConfigError("trainer.check_val_every_n_epoch", every_epochs, "a positive number of epochs, or null "
                          "(with an integer val_check_interval: validate every that many batches across epochs)")
    counted = isinstance(interval, int) and not isinstance(interval, bool)
    if every_epochs is None and not counted:
        raise ConfigError("trainer.val_check_interval", interval, "a number of training batches (an int) with "
                          "trainer.check_val_every_n_epoch=null (a fraction or null needs epochs to count in)")
    if not counted:
        return []
    notices = []
    if every_epochs is not None and interval > batches_per_epoch:
        t.check_val_every_n_epoch = None
        notices.append(f"trainer.val_check_interval={interval} is longer than an epoch ({batches_per_epoch} "
                       f"batches): validating every {interval} batches across epochs "
                       "(trainer.check_val_every_n_epoch=null)")
    total = t.max_steps * accumulation if t.max_steps > 0 else None
    if total is not None and interval > total and t.check_val_every_n_epoch is None:
        batches = f" ({total} training batches)" if accumulation > 1 else ""
        notices.append(f"trainer.val_check_interval={interval} is beyond trainer.max_steps={t.max_steps}{batches}: "
                       "this run never validates (no val metrics, no best checkpoint)")
    return notices


def _uses_gpu(accelerator: str) -> bool:
    import torch

    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
