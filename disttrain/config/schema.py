"""Typed schema of a run, registered with Hydra's ConfigStore by ``register()``.

The top-level schema (``train_schema``) makes Hydra itself reject a misspelled key or a wrongly typed value
while composing. The ``model``, ``data`` and ``optim`` groups are polymorphic: their schema is chosen by
their ``name`` through the component registries (``schema/<group>/<name>``), and validation merges each
into its schema (``disttrain.config.validation``). Nothing is registered at import: ``train.py``, the
tests and the benchmarks call ``register()``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import MISSING, OmegaConf

from disttrain.comm.config import CommConfig
from disttrain.config.evaluation import EvalConfig
from disttrain.fault.config import FaultToleranceConfig
from disttrain.federated.config import FederatedConfig
from disttrain.observe.config import ObserveConfig
from disttrain.parallel.config import ParallelConfig

if TYPE_CHECKING:
    from disttrain.parallel.compile import Compilation

CONF_DIR = Path(__file__).resolve().parent.parent.parent / "conf"
"""The config groups shipped beside the package."""

RANK_STARTS = ("auto", "fork_server", "interpreter")
"""The values of ``trainer.rank_start``."""


def fork_server_available() -> bool:
    """Whether this platform has multiprocessing's fork server (every POSIX system; not Windows), which
    ``trainer.rank_start=fork_server`` needs."""
    import multiprocessing

    return "forkserver" in multiprocessing.get_all_start_methods()


PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16-true", "16-true")
"""The precisions the strategy runs (Lightning's ModelParallelStrategy plugins)."""


@dataclass
class BatchConfig:
    """Batch sizes, kept in one place: set two of the three, the third follows."""

    global_size: int | None = 64
    """Samples per optimiser step, summed over all data-parallel ranks and accumulation steps."""
    micro_size: int | None = None
    """Samples per forward/backward on one rank. None: follows from the other two."""
    accumulation: int | None = None
    """Micro-batches accumulated per optimiser step on each rank. None: follows (1 if undetermined)."""



@dataclass
class TrainerConfig:
    """Options handed to Lightning's ``Trainer`` (batch sizes live in ``batch``, parallelism in ``parallel``)."""

    accelerator: str = "auto"
    """Device type: auto, cpu or gpu."""
    devices: Any = "auto"
    """Ranks per node that the runner starts (ignored under torchrun/SLURM, which start their own): a number,
    or auto: every GPU of the machine, or on a CPU the fewest ranks the ``parallel`` preset runs on (one for
    single, two where a degree is "the rest of the world", e.g. zero3; four for hsdp and hybrid); or ``MIN:MAX``:
    start on MAX and, when a rank fails, restart on the largest count from MIN up that the devices left, the
    layout and the global batch allow (``fault_tolerance.max_restarts`` restarts; the global batch is MAX's)."""
    num_nodes: Any = 1
    """Number of machines (needs torchrun or SLURM when > 1), or ``MIN:MAX`` under torchrun ``--nnodes=MIN:MAX``:
    every rank checks that the launcher's nodes lie in the range, and the global batch is the one of MAX nodes."""
    max_steps: int = -1
    """Optimiser steps to train for; -1: bounded by max_epochs."""
    max_epochs: int | None = None
    """Epochs to train for when max_steps is -1."""
    precision: str = "32-true"
    """Lightning precision: 32-true, bf16-mixed (bf16 autocast), bf16-true or 16-true (parameters in that type);
    auto: bf16-mixed on a GPU with bf16, and on a CPU with AMX or AVX512-BF16 where bf16 autocast also measures
    at least 1.05x fp32 on the run's own model (timed before ranks start); else 32-true."""
    matmul_precision: str = "auto"
    """fp32 matrix products: highest (full fp32), high (TF32 on NVIDIA GPUs: fp32 sums of products of 10-bit
    mantissas, several times faster), medium (bf16 products where the device has them); auto: high on a GPU, as
    nanoGPT and torchtitan train, highest on a CPU (where fp32 runs match one process to 1e-6). Under bf16-mixed
    only the products autocast leaves in fp32 are affected."""
    compile: bool = False
    """torch.compile the model (in place, after its parallel layout) and the loss: a slower first step (tens of
    seconds), faster steps after it. What is one compiled region: ``trainer.compile_scope``; the loss is compiled
    apart. Not with pipeline parallelism; ``parallel=auto`` weighs only the layouts the compile settings allow
    (``disttrain.config.trainer_checks.compile_refusal``)."""
    compile_scope: str = "blocks"
    """What ``trainer.compile`` compiles as one region. blocks: each transformer block (the model's
    ``shard_units``) on its own, embedding, final norm and head eager; the blocks share one compiled code, so what
    is traced and compiled is one block's whatever the depth: a fraction of the whole model's compile time and a
    little less memory, and a steady step as fast where a step is long. model: the whole model as one graph; each
    compiled region costs host time on every call (guards, an autograd wrapper), which a long step hides and a
    short one does not, so pick it for a small model whose step is short and host-bound (GPT-2 124M on a fast
    GPU; ``benchmarks/compile_regions.py`` measures the two side by side, figures in ``benchmarks/README.md``).
    model runs on one rank, under DDP and under tensor parallelism (whose DTensors trace into one graph); where
    FSDP2 shards the parameters (ZeRO-2/3, HSDP) the run refuses it: FSDP2's hooks on every block are not traced,
    dynamo falls back to eager for the model's forward at the first block and compiles what lies below it one frame at a
    time, per-block compilation by another route rather than what was asked. A model without blocks, and the
    compile modes that record CUDA graphs, are compiled whole under either scope."""
    compile_mode: str = "default"
    """torch.compile's mode under ``trainer.compile``: default; reduce-overhead (CUDA graphs: each step's
    forward and backward kernels replayed by one launch each, for steps whose launches hold the GPU back; one
    rank without sharding or collectives, e.g. parallel=single); max-autotune (kernel configurations tried on the
    first step, then CUDA graphs, as reduce-overhead); max-autotune-no-cudagraphs."""

    fp8: str = "none"
    """Float8 training of the linear layers through torchao (``pip install 'disttrain[fp8]'``): tensorwise (one
    scale per tensor; under ZeRO-2/3 and HSDP FSDP2 gathers those weights in float8; under parallel.tp each
    tensor's scale is its whole DTensor's) or rowwise (one scale per row: closer to bf16, slower; under parallel.tp
    each rank scales the rows of its slice); none: off. The output head and layers whose
    dimensions are not multiples of 16 stay in the run's precision, as the line printed at start lists. On a GPU it
    needs compute capability 8.9 or more; on a CPU torch's float8 products run, slower than bf16, to check a run
    before it takes a GPU."""
    fp8_layers: list[str] = field(default_factory=list)
    """Under ``trainer.fp8``, fnmatch patterns of the linear layers' module names eligible for float8 (e.g.
    ``['blocks.*.mlp.*']``); empty: every linear layer. Before ranks start it is resolved to the names chosen."""
    fp8_all_gather: bool = True
    """Under ``trainer.fp8=tensorwise`` with sharded parameters (ZeRO-2/3, HSDP), FSDP2 gathers the float8
    layers' weights in float8, each scaled by the amax of its whole weight; the scales of all of them are
    precomputed once per optimiser step (one fused norm and one all-reduce, torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``) rather than by each gather in forward and backward, and dropped
    when a checkpoint load replaces the weights. false: in the run's precision. Resolved to false where it does not
    apply."""

    @property
    def float8(self) -> Any:
        """The run's ``disttrain.parallel.float8.Float8Layers`` as validation resolved it; None without fp8."""
        if self.fp8 == "none":
            return None
        from disttrain.parallel.float8 import Float8Layers

        return Float8Layers(self.fp8, tuple(self.fp8_layers), self.fp8_all_gather)

    @property
    def compiled_mode(self) -> str | None:
        """torch.compile's mode for the model and the loss; None: they run eager."""
        return self.compile_mode if self.compile else None

    @property
    def compilation(self) -> Compilation | None:
        """How the model is compiled (its mode and scope), as ``disttrain.parallel.compile`` takes it; None: eager."""
        if not self.compile:
            return None
        from disttrain.parallel.compile import Compilation

        return Compilation(self.compile_mode, self.compile_scope)
    gradient_clip_val: float | None = 1.0
    """Clip gradients to this global norm; null disables clipping."""
    val_check_interval: Any = None
    """Validate every this many training batches (an int, e.g. 50) or fraction of an epoch (a float in (0, 1],
    e.g. 0.5); null: each epoch. As in Lightning, 1 means one batch and 1.0 the whole epoch."""
    check_val_every_n_epoch: int | None = 1
    """Validate every n epochs (null with an integer val_check_interval to validate by steps only)."""
    limit_val_batches: Any = None
    """Validation batches per rank: a count (an int, e.g. 1) or a fraction (a float in (0, 1]); null: all."""
    limit_test_batches: Any = None
    """Test batches per rank: a count (an int) or a fraction (a float in (0, 1]); null: all."""
    log_every_n_steps: int = 10
    """How often training metrics are logged."""
    num_sanity_val_steps: int = 0
    """Validation batches run before training as a smoke check (not logged; see ``validate_before_training``)."""
    validate_before_training: bool = False
    """Score the weights training starts from (the initialisation, the pretrained weights or the resumed
    checkpoint) on the validation split before the first step: logged as ``val/*`` at the starting step and
    printed, through Lightning's sanity validation over ``limit_val_batches``."""
    keep_freed_host_memory: bool = True
    """Keep the host memory that freed tensors leave mapped for the next step (glibc's malloc: allocations up to
    32 MB from its heap, which goes back to the OS only past 1 GB free) rather than returning it and faulting it
    in again every step (on a CPU, page faults every step that small steps feel; benchmarks/README.md, Figures
    cited elsewhere). Resident memory then stays near its peak. Ignored without glibc, under another preloaded
    allocator, or where a MALLOC_*_ threshold variable is set."""
    deterministic: bool = False
    """Ask torch for deterministic algorithms (slower on GPU; CPU fp32 runs are reproducible anyway)."""
    run_test: bool = True
    """Evaluate the best checkpoint on the test split after fitting."""
    rank_start: str = "auto"
    """How the runner starts its ranks: fork_server (forked from one process that imported torch, Lightning
    and disttrain once per job, so no rank or restart imports them again), interpreter (a new Python per
    rank, as torchrun does), or auto: fork_server where the platform has one (Linux, macOS), else interpreter.
    Ignored under torchrun or SLURM, which start the ranks themselves."""


@dataclass
class CheckpointConfig:
    """Which checkpoints are kept (written as sharded, atomically replaced folders)."""

    save_last: bool = True
    """Keep ``last.ckpt``, the newest state, for ``resume=auto``."""
    save_top_k: int = 1
    """How many best-by-monitor checkpoints to keep (0: none, -1: all)."""
    monitor: str | None = None
    """Metric that ranks checkpoints; null: the task's validation metric (val/acc or val/loss). A task score
    (``eval/<task>/<metric>``) ranks them where the tasks are scored at every validation."""
    every_n_train_steps: int | None = None
    """A save point (``last.ckpt``) every n optimiser steps as well, from the first step on, whatever is
    monitored; null: save points at each validation and the end only. Saves between validations are not
    ranked: only a validation scores the weights it sees."""
    keep_last: int = 1
    """How many of the newest save points to keep (``last.ckpt`` and ``last-step<N>.ckpt`` before it);
    resuming skips a damaged newest one for the one before."""
    async_save: bool = False
    """Write checkpoints in the background (torch.distributed.checkpoint.async_save, one save in flight)."""


@dataclass
class ExpectConfig:
    """What a recipe must reproduce: the metric, its bound and the hardware it was measured on."""

    metric: str = MISSING
    """Metric name in results.json (e.g. test/acc)."""
    value: float = MISSING
    """Value reached on the stated hardware."""
    tolerance: float = 0.0
    """Allowed shortfall from ``value``."""
    mode: str = "max"
    """max: higher is better (metric >= value - tolerance); min: lower is better."""
    hardware: str = ""
    """Machine the value and wall time were measured on."""
    wall_time_s: float | None = None
    """Measured wall time of the full recipe on that hardware."""
    command: str = ""
    """Command that reproduces the recipe."""


@dataclass
class PlanConfig:
    """The planner's options (``mode=plan`` and ``parallel=auto``)."""

    profile: str = "machine"
    """Hardware predicted for: machine (this machine; ``python -m disttrain.plan --calibrate`` measures it), or
    a stated profile: h100_sxm, a100_80gb."""
    memory_gb: float | None = None
    """Memory each rank may use, in GB, in place of the profile's per device (what-if plans; parallel=auto fits to
    it; on a CPU it is a budget per rank, not a share of the machine). A training run whose layout the planner
    predicts above it is refused before ranks start, with what would fit."""
    alternatives: int = 3
    """Runner-up layouts ``parallel=auto`` prints beside its choice."""
    objective: str = "time"
    """What ``parallel=auto`` minimises among the layouts that fit: time (the predicted step time) or energy (the
    predicted joules per token: the profile's power while the busiest rank computes, its idle power, where stated,
    while the devices wait). Its choice line says what the other would have picked."""
    watts: float | None = None
    """Power per device under load in watts, in place of the profile's (what-if plans; a CPU profile's device is
    one core). None: the profile's."""
    idle_watts: float | None = None
    """Power per device while it waits (communication compute does not hide, a pipeline's bubble), in watts, at
    most the power under load. None: the profile's (no stated profile has one: a device then draws its power under
    load for the whole step, and energy per token follows the step time)."""


@dataclass
class DryRunConfig:
    """``mode=dryrun``: one rank of the layout built and stepped in this process under a fake process group."""

    rank: int | None = None
    """Global rank to build (0 to world size - 1); null: the busiest one the plan names (the first rank of the
    first pipeline stage, which holds the most microbatches in flight)."""
    steps: int = 3
    """Optimiser steps to run (forward, backward and step of every micro-batch): the first two under the byte
    counter (the first allocates the optimiser's state), the others timed (with fewer, the counted ones are)."""


@dataclass
class TrainConfig:
    """Schema of a whole run. ``model``, ``data`` and ``optim`` are checked against their registry schema."""

    model: Any = MISSING
    """Model group: a registry name plus its options."""
    data: Any = MISSING
    """Data group: a registry name plus its options."""
    optim: Any = MISSING
    """Optimiser group: a registry name plus its options."""
    scheduler: Any = MISSING
    """Learning-rate schedule."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the run is spread over ranks."""
    comm: CommConfig = field(default_factory=CommConfig)
    """What data-parallel gradients are sent as (comm group)."""
    federated: FederatedConfig = field(default_factory=FederatedConfig)
    """Federated learning (``parallel=federated``): clients, rounds, strategy, partition, privacy."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Lightning Trainer options."""
    batch: BatchConfig = field(default_factory=BatchConfig)
    """Global batch, micro-batch and accumulation."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints kept."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """lm-evaluation-harness tasks scored on the model as it trains (``eval.tasks``)."""
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    """Restarts, hang detection, preemption and non-finite steps."""
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    """Straggler detection: ranks slower than the others, named with their slow phase."""
    logger: dict[str, Any] = field(default_factory=dict)
    """Loggers to instantiate (each a ``_target_`` node)."""
    callbacks: dict[str, Any] = field(default_factory=dict)
    """Extra Lightning callbacks to instantiate (each a ``_target_`` node)."""
    mode: str = "train"
    """train: fit, then test; plan: print the plan of this config per rank (memory, communication, pipeline
    bubble, predicted step time and energy), write plan.json, and stop without training; dryrun: build one rank
    of the layout here under a fake process group, run a few real steps on it, and print and write (dryrun.json)
    its measured peak memory and step time beside the plan's."""
    plan: PlanConfig = field(default_factory=PlanConfig)
    """The planner's hardware profile and options."""
    dryrun: DryRunConfig = field(default_factory=DryRunConfig)
    """Which rank ``mode=dryrun`` builds and how many steps it runs."""
    plots: bool = True
    """Draw the run's pictures into ``plots/`` after training (loss curves, where the wall time went); needs
    matplotlib, and the CSV logger for the loss curves."""
    energy: bool = True
    """Meter the energy of fit into results.json: RAPL counters or a GPU's NVML counter where readable, else
    CodeCarbon's estimate (labelled ``estimated``) when the energy extra is installed."""
    seed: int = 0
    """Seed of model init, data order and dropout."""
    resume: str | None = None
    """null: fresh start (from the seeded initialisation, or ``model.init_weights``: weights only, at step 0);
    auto: newest checkpoint in the run directory if any; or a checkpoint path (weights, optimiser state, step and
    schedule, continued)."""
    run_dir: str = MISSING
    """The run directory (Hydra's output dir); every rank writes here."""
    optimized_metric: str | None = None
    """Metric that ``train()`` returns for a sweeper; null: the checkpoint monitor."""
    expect: ExpectConfig | None = None
    """Set by recipes: what the run must reproduce."""
    recipe_name: str | None = None
    """Set by recipes: the recipe's name."""


def register() -> None:
    """Store the run schema and every component schema (as ``schema/<group>/<name>``) in Hydra's ConfigStore,
    and the resolvers the group files use (idempotent).

    Each file in ``conf/<group>/`` starts from its schema, so Hydra rejects a misspelled key or a wrong
    type while composing, and any field can be overridden on the command line.
    """
    from hydra.core.config_store import ConfigStore

    from disttrain.data import DATA
    from disttrain.models import MODELS
    from disttrain.optim import OPTIMIZERS, SchedulerConfig

    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    for group, registry in (("model", MODELS), ("data", DATA), ("optim", OPTIMIZERS)):
        for name in registry.names():
            store.store(group=f"schema/{group}", name=name, node=registry.get(name).schema)
    store.store(group="schema/scheduler", name="cosine", node=SchedulerConfig)
    OmegaConf.register_new_resolver("config_groups", config_groups_help, replace=True)
    # wandb logs offline unless an API key is configured, so a run never waits on the network.
    OmegaConf.register_new_resolver("wandb_offline", lambda: "WANDB_API_KEY" not in os.environ, replace=True)


def config_groups_help() -> str:
    """The groups of ``conf/`` and their options, one line each, for ``--help`` (Hydra's own list would also
    show the typed schemas that the group files start from)."""
    groups = sorted(p for p in CONF_DIR.iterdir() if p.is_dir()) if CONF_DIR.is_dir() else []
    return "\n".join(f"{group.name}: {', '.join(sorted(f.stem for f in group.glob('*.yaml')))}" for group in groups)
