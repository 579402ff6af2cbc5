"""The one validation pass: a composed config in, typed objects, resolved numbers and the execution plan out.

Everything is checked here, before any worker rank starts; every mistake is one ``ConfigError`` naming the
key, the value and what is allowed.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from disttrain import checks
from disttrain.config.schema import PRECISIONS, BatchConfig, TrainConfig, TrainerConfig
from disttrain.errors import ConfigError
from disttrain.models.target import TargetModelConfig
from disttrain.parallel.config import ParallelConfig
from disttrain.parallel.dims import ParallelDims


@dataclass(frozen=True)
class ResolvedBatch:
    """The three batch numbers after resolution; ``global_size == micro_size * accumulation * dp``."""

    global_size: int
    micro_size: int
    accumulation: int


def resolve_batch(batch: BatchConfig, dp: int) -> ResolvedBatch:
    """Derive the missing batch number from the two given ones and check all three agree."""
    for key in ("global_size", "micro_size", "accumulation"):
        value = getattr(batch, key)
        if value is not None and value <= 0:
            raise ConfigError(f"batch.{key}", value, "a positive integer, or null to derive it")
    g, m, a = batch.global_size, batch.micro_size, batch.accumulation
    if g is None:
        if m is None:
            raise ConfigError("batch.global_size", None, "set at least one of batch.global_size, batch.micro_size")
        a = a or 1
        return ResolvedBatch(m * a * dp, m, a)
    if m is None:
        a = a or 1
        if g % (dp * a):
            raise ConfigError(
                "batch.global_size", g,
                f"a multiple of data-parallel size x accumulation = {dp} x {a} = {dp * a}",
            )
        return ResolvedBatch(g, g // (dp * a), a)
    if a is None:
        if g % (dp * m):
            raise ConfigError(
                "batch.global_size", g,
                f"a multiple of data-parallel size x batch.micro_size = {dp} x {m} = {dp * m}",
            )
        return ResolvedBatch(g, m, g // (dp * m))
    if g != m * a * dp:
        raise ConfigError(
            "batch.global_size", g,
            f"must equal micro_size x accumulation x data-parallel size = {m} x {a} x {dp} = {m * a * dp}"
            " (set only two of the three)",
        )
    return ResolvedBatch(g, m, a)





@dataclass(frozen=True)
class ExecutionPlan:
    """How a run executes, decided once during validation (the runner and the strategy only read it)."""

    pipelined: bool
    """Pipeline stages run a schedule per step: the task optimises manually (accumulates and clips itself)."""
    trainer_accumulation: int
    """Lightning's ``accumulate_grad_batches`` (1 when the task accumulates itself)."""
    trainer_clip: float | None
    """Lightning's ``gradient_clip_val`` (None when the task clips itself)."""
    inference_mode: bool
    """Evaluate under ``torch.inference_mode`` (not for pipeline stages, whose activations autograd tracks)."""
    full_eval_batches: bool
    """Pad evaluation to whole batches on every rank (pipeline stages need one batch shape throughout)."""
    microbatch_shape: tuple[int, ...] = ()
    """Shape of one pipeline microbatch's input (pipelined runs)."""
    microbatch_dtype: str = "float32"
    """Its dtype: int64 for token ids, float32 for images."""
    loss_divisor: int = 1
    """Microbatches x accumulation: a pipelined microbatch loss is divided by it."""
    loss_ranks: int = 1
    """Ranks that hold the last stage's losses (data-parallel x tensor-parallel)."""


def execution_plan(dims: ParallelDims, batch: ResolvedBatch, trainer: TrainerConfig, parallel: ParallelConfig,
                   spec: Any) -> ExecutionPlan:
    """The plan for a run of these degrees, batch and data."""
    if not dims.pp_enabled:
        return ExecutionPlan(False, batch.accumulation, trainer.gradient_clip_val, True, False)
    size = batch.micro_size // parallel.pipeline.microbatches
    text = spec.kind == "text"
    shape = (size, spec.block_size) if text else (size, spec.in_channels, spec.image_size, spec.image_size)
    return ExecutionPlan(True, 1, None, False, True, shape, "int64" if text else "float32",
                         parallel.pipeline.microbatches * batch.accumulation, dims.dp * dims.tp)


@dataclass(frozen=True)
class RunConfig:
    """A validated run: typed objects for every group plus the resolved numbers derived from them."""

    train: TrainConfig
    model: Any
    data: Any
    optim: Any
    scheduler: Any
    dims: ParallelDims
    batch: ResolvedBatch
    yaml: str
    """The resolved config as YAML (what workers receive and what is written to the run directory)."""
    notices: tuple[str, ...] = ()
    """Lines to show the user before ranks start (e.g. how many ranks ``trainer.devices=auto`` chose)."""
    plan: ExecutionPlan | None = None
    """How the run executes."""
    datamodule: Any = field(default=None, compare=False, repr=False)
    """The data module validation built (its datasets load on first use): a rank builds no other."""

    @property
    def config_hash(self) -> str:
        """Short hash of the resolved config, excluding where it runs (run_dir, resume)."""
        text = self.yaml.replace(self.train.run_dir, "<run_dir>")
        text = "\n".join(line for line in text.splitlines() if not line.startswith(("run_dir:", "resume:")))
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def world_size_of(trainer: TrainerConfig) -> int:
    """Number of ranks: the launcher's WORLD_SIZE under torchrun/SLURM, else devices x num_nodes."""
    if "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return trainer.devices * trainer.num_nodes


def resolve_devices(trainer: TrainerConfig, parallel: ParallelConfig) -> tuple[int, str | None]:
    """``trainer.devices`` as a number, and a one-line notice when ``auto`` chose it."""
    if trainer.devices != "auto":
        return trainer.devices, None
    if _uses_gpu(trainer.accelerator):
        import torch

        count = max(1, torch.cuda.device_count())
        return count, f"trainer.devices=auto: {count} GPU rank(s) per node"
    fewest = parallel.fewest_ranks()
    if fewest == 1:
        return 1, None
    return fewest, (f"trainer.devices=auto: starting {fewest} CPU ranks, the fewest parallel={parallel.name} runs "
                    "on (trainer.devices=N for another number)")


def _typed(group: str, node: Any, schema: type) -> Any:
    """Merge a config node into its dataclass schema; rephrase OmegaConf's errors as one line."""
    _reject_unknown_keys(group, node, schema)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node)
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = ".".join(part for part in (group, getattr(err, "full_key", None)) if part) or "config"
        if isinstance(err, MissingMandatoryValue) or "Missing mandatory value" in str(err):
            missing = key if key.count(".") or not group else f"{group}.{_missing_field(err)}"
            raise ConfigError(missing, "???", f"a value is required (set {missing}=...)") from None
        value = getattr(err, "value", None) or _lookup(node, err.full_key)
        raise ConfigError(key, value, f"expected {_field_type(schema, err.full_key)}") from None
    return obj


def _missing_field(err: OmegaConfBaseException) -> str:
    """The field a structured config's "has missing mandatory value: <field>" message names."""
    return str(err).split("missing mandatory value:")[-1].split()[0] if "missing mandatory value:" in str(err) \
        else "?"


def _reject_unknown_keys(prefix: str, node: Any, schema: type) -> None:
    """Keys forced in with ``+key=...`` or left in a typed node survive a merge silently; name them here."""
    fields = getattr(schema, "__dataclass_fields__", None)
    if fields is None or not isinstance(node, (DictConfig, dict)):
        return
    for key in node:
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            raise ConfigError(path, node[key], f"not a known key; {prefix or 'top-level'} keys are {list(fields)}")
        factory = fields[key].default_factory
        if hasattr(factory, "__dataclass_fields__"):
            _reject_unknown_keys(path, node[key], factory)


def _field_type(schema: type, dotted: str | None) -> str:
    """Readable type of a (possibly nested) dataclass field."""
    fields = getattr(schema, "__dataclass_fields__", {})
    head, _, rest = (dotted or "").partition(".")
    if head not in fields:
        return "a value of the schema's type"
    ftype = fields[head].type
    if rest and hasattr(fields[head].default_factory, "__dataclass_fields__"):
        return _field_type(fields[head].default_factory, rest)
    return f"type {ftype}"


def _lookup(node: Any, dotted: str | None) -> Any:
    """Value at a dotted path of a config node, or None."""
    try:
        return OmegaConf.select(node, dotted) if dotted else None
    except OmegaConfBaseException:
        return None


def _model_typed(node: Any, registry: Any) -> Any:
    """A registered model by ``name``, or a user's model by ``_target_``."""
    if isinstance(node, DictConfig) and "_target_" in node:
        if "name" in node:
            raise ConfigError("model.name", node.name, "absent when model._target_ is set (one or the other)")
        return TargetModelConfig.from_node(OmegaConf.to_container(node, resolve=True))
    return _registry_typed("model", node, registry)


def _data_typed(node: Any, registry: Any) -> Any:
    """A registered data set by ``name``, or a user's data by ``_target_``."""
    from disttrain.data import UserDataConfig

    if isinstance(node, DictConfig) and "_target_" in node:
        if "name" in node:
            raise ConfigError("data.name", node.name, "absent when data._target_ is set (one or the other)")
        return UserDataConfig(OmegaConf.to_container(node, resolve=True))
    return _registry_typed("data", node, registry)


def _registry_typed(group: str, node: Any, registry: Any) -> Any:
    """Type a polymorphic group by the schema its ``name`` selects in ``registry``."""
    if not isinstance(node, DictConfig) or "name" not in node:
        raise ConfigError(f"{group}.name", None, f"a {group} config needs a name, one of {registry.names()}")
    return _typed(group, node, registry.get(node.name).schema)


def parallel_options(cfg: DictConfig) -> ParallelConfig:
    """The typed ``parallel`` node alone (its backend and timeout join a launcher's process group before the
    run directory is agreed and the whole config validated)."""
    return _typed("parallel", cfg.parallel, ParallelConfig)


def validate(cfg: DictConfig, world_size: int | None = None) -> RunConfig:
    """Check a composed config once and return typed, resolved objects; raise ConfigError on bad input."""
    from disttrain.data import DATA, build_datamodule
    from disttrain.models import MODELS
    from disttrain.optim import OPTIMIZERS, SchedulerConfig

    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(str(getattr(err, "full_key", "config")), None, f"cannot be resolved: {err}") from None
    top = _typed("", cfg, TrainConfig)
    model = _model_typed(cfg.model, MODELS)
    data = _data_typed(cfg.data, DATA)
    optim = _registry_typed("optim", cfg.optim, OPTIMIZERS)
    scheduler = _typed("scheduler", cfg.scheduler, SchedulerConfig)
    notices = [notice for part in (data, optim, scheduler) for notice in (part.validate() or [])]
    top.parallel.validate()
    if top.parallel.cpu_offload and not _uses_gpu(top.trainer.accelerator):
        raise ConfigError("parallel.cpu_offload", True,
                          "false on a CPU run (offloading moves state from GPU memory to the CPU, where it already is)")
    _validate_trainer(top.trainer)
    top.trainer.devices, devices_notice = resolve_devices(top.trainer, top.parallel)
    notices += [devices_notice] if devices_notice else []
    OmegaConf.update(cfg, "trainer.devices", top.trainer.devices)  # workers read the number, not auto
    if getattr(model, "sync_batchnorm", False) and not _uses_gpu(top.trainer.accelerator):
        raise ConfigError("model.sync_batchnorm", True,
                          "false on a CPU run (torch's SyncBatchNorm runs on GPUs only)")
    if top.resume not in (None, "auto"):
        top.resume = checkpoint_folder(top.resume)
        OmegaConf.update(cfg, "resume", top.resume)
    world = world_size if world_size is not None else world_size_of(top.trainer)
    p = top.parallel
    dims = ParallelDims.resolve(world, p.pp, p.dp_replicate, p.dp_shard, p.tp)
    p.check_dims(dims)
    batch = resolve_batch(top.batch, dims.dp)
    datamodule = build_datamodule(data, micro_batch_size=batch.micro_size, seed=top.seed)
    notices += [datamodule.notice] if getattr(datamodule, "notice", None) else []
    if not isinstance(model, TargetModelConfig):
        model.validate(datamodule.spec)
    check_model_plan(model.name, model_on_meta(model, datamodule.spec), p, dims, batch.micro_size)
    notices += length_notices(top.trainer, datamodule.num_train_samples // batch.global_size)
    plan = execution_plan(dims, batch, top.trainer, p, datamodule.spec)
    return RunConfig(top, model, data, optim, scheduler, dims, batch, OmegaConf.to_yaml(cfg), tuple(notices), plan,
                     datamodule)


def length_notices(t: TrainerConfig, steps_per_epoch: int) -> list[str]:
    """Lines that say how ``max_steps``, ``max_epochs`` and validation combine, where it may surprise."""
    notices = []
    if steps_per_epoch < 1:
        raise ConfigError("batch.global_size", None, "at most the number of training samples (an epoch would "
                          "hold no whole optimiser step)")
    if t.max_steps > 0:
        epochs = -(-t.max_steps // steps_per_epoch)
        if t.max_epochs and epochs > t.max_epochs:
            notices.append(f"trainer.max_steps={t.max_steps} sets the length: {epochs} epochs of {steps_per_epoch} "
                           f"steps (trainer.max_epochs={t.max_epochs} applies only when max_steps is -1)")
        interval = t.val_check_interval
        if isinstance(interval, int) and not isinstance(interval, bool) and interval > t.max_steps \
                and t.check_val_every_n_epoch is None:
            notices.append(f"trainer.val_check_interval={interval} is beyond trainer.max_steps={t.max_steps}: "
                           "this run never validates (no val metrics, no best checkpoint)")
    return notices


def checkpoint_folder(resume: str) -> str:
    """``resume=PATH``: a checkpoint folder, or a run directory whose ``checkpoints/last.ckpt`` is taken."""
    path = os.path.expanduser(resume)
    allowed = "null, auto, a checkpoint folder (with meta.pt) or a run directory with checkpoints/last.ckpt"
    if not os.path.exists(path):
        raise ConfigError("resume", resume, f"{allowed}; there is no such path")
    last = os.path.join(path, "checkpoints", "last.ckpt")
    if os.path.isfile(os.path.join(path, "meta.pt")) and os.path.isfile(os.path.join(path, ".metadata")):
        return path
    if os.path.isdir(last):
        return last
    raise ConfigError("resume", resume, f"{allowed}; this is neither")


def model_on_meta(model: Any, spec: Any) -> Any:
    """The model built on the meta device (no memory, no init cost), to check its parallel plan; a user's
    model that cannot be built there is built on the CPU (and its error, if any, comes from there)."""
    import torch

    from disttrain.models import build_model

    try:
        with torch.device("meta"):
            return build_model(model, spec)
    except ConfigError:
        if not isinstance(model, TargetModelConfig):
            raise
    # a user's constructor may need real tensors (it reads values while building): build it on the CPU
    return build_model(model, spec)


def check_model_plan(name: str, net: Any, p: ParallelConfig, dims: ParallelDims, micro_size: int) -> None:
    """The model has what the degrees need from it: a tp plan that splits evenly, pipeline units that the
    schedule can cut, and shard units that exist (from its methods or from ``parallel``)."""
    from disttrain.parallel.pipeline.split import check_pipeline, check_units
    from disttrain.parallel.plan import pipeline_units_of, tp_plan_of
    from disttrain.parallel.tp import check_tp_plan

    for key in ("pipeline_units", "shard_units"):
        for unit in getattr(p, key) or []:
            _check_submodule(net, f"parallel.{key}", unit)
    if dims.tp_enabled:
        plan = tp_plan_of(net, p.tp_plan)
        if not plan:
            raise ConfigError("parallel.tp", dims.tp, f"1 for model {name}: it declares no tp_plan() and "
                              "parallel.tp_plan is not set (module-name pattern -> colwise | rowwise)")
        check_tp_plan(net, plan, dims.tp, p.sequence_parallel, "parallel.tp_plan" if p.tp_plan else "tp_plan()")
    if dims.pp_enabled:
        units = pipeline_units_of(net, p.pipeline_units)
        if not units:
            raise ConfigError("parallel.pp", dims.pp, f"1 for model {name}: it declares no pipeline_units() and "
                              "parallel.pipeline_units is not set (ordered submodules whose application is forward)")
        check_units(net, units, dims.pp, name)
        o = p.pipeline
        check_pipeline(o.schedule, dims.pp, o.stages_per_rank, o.microbatches, micro_size, len(units))


def _check_submodule(net: Any, key: str, name: str) -> None:
    try:
        net.get_submodule(name)
    except AttributeError:
        raise ConfigError(key, name, f"names of submodules of {type(net).__name__}") from None


def _uses_gpu(accelerator: str) -> bool:
    import torch

    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def _validate_trainer(t: TrainerConfig) -> None:
    """Semantic checks of the Trainer options that the type system cannot express."""
    if t.accelerator not in ("auto", "cpu", "gpu", "cuda"):
        raise ConfigError("trainer.accelerator", t.accelerator, "one of auto, cpu, gpu, cuda")
    if t.devices != "auto" and (not isinstance(t.devices, int) or isinstance(t.devices, bool) or t.devices < 1):
        raise ConfigError("trainer.devices", t.devices, "a positive number of ranks per node, or auto")
    if t.num_nodes < 1:
        raise ConfigError("trainer.num_nodes", t.num_nodes, "a positive number of nodes")
    if t.max_steps == 0 or t.max_steps < -1:
        raise ConfigError("trainer.max_steps", t.max_steps, "a positive number of steps, or -1")
    if t.max_steps == -1 and not t.max_epochs:
        raise ConfigError("trainer.max_epochs", t.max_epochs, "a positive number of epochs when max_steps is -1")
    if t.precision in ("16-mixed", "16"):
        raise ConfigError("trainer.precision", t.precision,
                          f"one of {list(PRECISIONS)}: fp16 autocast needs a gradient scaler, which the sharded "
                          "strategy does not run; bf16-mixed needs none")
    if t.precision not in PRECISIONS:
        raise ConfigError("trainer.precision", t.precision, f"one of {list(PRECISIONS)}")
    if t.gradient_clip_val is not None and t.gradient_clip_val <= 0:
        raise ConfigError("trainer.gradient_clip_val", t.gradient_clip_val, "a positive norm, or null")
    for key in ("val_check_interval", "limit_val_batches", "limit_test_batches"):
        checks.count_or_fraction(f"trainer.{key}", getattr(t, key), allow_zero=key != "val_check_interval")
