"""Checks of the ``trainer`` group's values that its types cannot express, and the rule of the compile settings
against the layout they would run under (``compile_refusal``)."""

from __future__ import annotations

from disttrain import checks
from disttrain.config.precision import MATMUL_PRECISIONS
from disttrain.config.schema import PRECISIONS, RANK_STARTS, TrainerConfig, fork_server_available
from disttrain.errors import ConfigError, Refusal
from disttrain.parallel.compile import COMPILE_MODES, COMPILE_SCOPES, CUDA_GRAPH_MODES, Compilation
from disttrain.parallel.float8 import FP8_RECIPES
from disttrain.parallel.layout import Layout

OTHER_MODES = " or ".join(mode for mode in COMPILE_MODES if mode not in CUDA_GRAPH_MODES)
"""The modes a layout that refuses CUDA graphs runs (``default or max-autotune-no-cudagraphs``)."""


def check_trainer(t: TrainerConfig) -> None:
    """Semantic checks of the Trainer options that the type system cannot express."""
    if t.accelerator not in ("auto", "cpu", "gpu", "cuda"):
        raise ConfigError("trainer.accelerator", t.accelerator, "one of auto, cpu, gpu, cuda")
    if t.devices != "auto" and (not isinstance(t.devices, int) or isinstance(t.devices, bool) or t.devices < 1):
        raise ConfigError("trainer.devices", t.devices, "a positive number of ranks per node, or auto, or "
                          "MIN:MAX (a range that disttrain's supervisor shrinks within when ranks fail)")
    if not isinstance(t.num_nodes, int) or isinstance(t.num_nodes, bool) or t.num_nodes < 1:
        raise ConfigError("trainer.num_nodes", t.num_nodes, "a positive number of nodes, or MIN:MAX under a launcher "
                          "that adds and removes nodes (torchrun --nnodes=MIN:MAX)")
    if t.max_steps == 0 or t.max_steps < -1:
        raise ConfigError("trainer.max_steps", t.max_steps, "a positive number of steps, or -1")
    if t.max_steps == -1 and not t.max_epochs:
        raise ConfigError("trainer.max_epochs", t.max_epochs, "a positive number of epochs when max_steps is -1")
    if t.precision in ("16-mixed", "16"):
        raise ConfigError("trainer.precision", t.precision,
                          f"one of {list(PRECISIONS)}: fp16 autocast needs a gradient scaler, which the sharded "
                          "strategy does not run; bf16-mixed needs none")
    if t.precision not in (*PRECISIONS, "auto"):
        raise ConfigError("trainer.precision", t.precision,
                          f"one of {list(PRECISIONS)}, or auto (bf16-mixed where the device computes bf16 "
                          "natively and, on a CPU, measures faster)")
    checks.one_of("trainer.matmul_precision", t.matmul_precision, MATMUL_PRECISIONS)
    checks.one_of("trainer.fp8", t.fp8, FP8_RECIPES)
    if t.rank_start not in RANK_STARTS:
        raise ConfigError("trainer.rank_start", t.rank_start, f"one of {list(RANK_STARTS)}")
    if t.rank_start == "fork_server" and not fork_server_available():
        raise ConfigError("trainer.rank_start", t.rank_start, "interpreter or auto: this platform has no fork server")
    if t.gradient_clip_val is not None and t.gradient_clip_val <= 0:
        raise ConfigError("trainer.gradient_clip_val", t.gradient_clip_val, "a positive norm, or null")
    if t.validate_before_training and t.num_sanity_val_steps:
        raise ConfigError("trainer.num_sanity_val_steps", t.num_sanity_val_steps, "0 with "
                          "trainer.validate_before_training=true (which validates over limit_val_batches)")
    for key in ("val_check_interval", "limit_val_batches", "limit_test_batches"):
        checks.count_or_fraction(f"trainer.{key}", getattr(t, key), allow_zero=key != "val_check_interval")
    check_compile_settings(t)


def check_compile_settings(t: TrainerConfig) -> None:
    """``trainer.compile_mode`` is one of torch.compile's modes and ``trainer.compile_scope`` one of
    ``COMPILE_SCOPES``, each other than its default only with ``trainer.compile`` on: what holds under any layout,
    checked before ``parallel=auto`` weighs layouts against ``compile_refusal``."""
    checks.one_of("trainer.compile_mode", t.compile_mode, COMPILE_MODES)
    if t.compile_mode != "default" and not t.compile:
        raise ConfigError("trainer.compile_mode", t.compile_mode, "default unless trainer.compile=true")
    checks.one_of("trainer.compile_scope", t.compile_scope, COMPILE_SCOPES)
    if t.compile_scope != "blocks" and not t.compile:
        raise ConfigError("trainer.compile_scope", t.compile_scope, "blocks unless trainer.compile=true")


def compile_refusal(compilation: Compilation | None, layout: Layout, accumulation: int) -> Refusal | None:
    """How the run's compilation (``TrainerConfig.compilation``; None: eager) refuses ``layout`` with
    ``accumulation`` micro-batches a step, or None where it runs there. The one rule of compilation against a
    layout, one of the run's ``disttrain.config.layout_refusals.LayoutRefusals``: validation raises its error for
    the run's layout, and ``parallel=auto`` weighs only the candidates it leaves.

    The modes that record CUDA graphs run on one rank whose step launches no collective (a graph replays no
    communication; checked first, as it refuses every layout of more than one rank, pipelines too) and takes one
    micro-batch (the next micro-batch's replay would write over the gradients being summed); pipeline stages are not
    compiled; the whole model as one graph runs without FSDP2, whose hooks on every unit stop dynamo inside the loop
    over the units (``TrainerConfig.compile_scope``)."""
    if compilation is None:
        return None
    mode, scope = compilation.mode, compilation.scope
    if mode in CUDA_GRAPH_MODES and (layout.world_size > 1 or layout.shards_optimizer_state):
        return Refusal("trainer.compile_mode", mode, OTHER_MODES, "on more than one rank or under ZeRO (CUDA graphs "
                       "replay no collectives); parallel=single runs it",
                       "layouts of more than one rank or under ZeRO (CUDA graphs replay no collectives)")
    if mode in CUDA_GRAPH_MODES and accumulation > 1:
        return Refusal("trainer.compile_mode", mode, OTHER_MODES, f"with {accumulation} micro-batches a step (a "
                       "replay writes over the gradients being summed); batch.micro_size equal to batch.global_size "
                       "runs it", "layouts that accumulate micro-batches (a CUDA graph's replay writes over the "
                       "gradients being summed)")
    if layout.pp_enabled:
        return Refusal("trainer.compile", True, "false", "with pipeline parallelism (stages are not compiled yet)",
                       "pipelines (stages are not compiled yet)")
    if scope == "model" and layout.shards_parameters:
        return Refusal("trainer.compile_scope", scope, "blocks", f"under this layout ({layout.describe()}): FSDP2's "
                       "hooks on every block (ZeRO-2/3 shard the parameters) stop a whole-model graph at the first "
                       "block, leaving the model's forward eager; parallel=single, ddp and tp run it",
                       "layouts that shard parameters (ZeRO-2/3: FSDP2's hooks stop a whole-model graph)")
    return None
