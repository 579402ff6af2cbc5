"""The planner against published runs: for each row of torchtitan's Llama 3.1 8B / 70B / 405B tables, of
Megatron-Core's weak-scaling table (1.7B-462B GPTs) and of this project's own one-GPU measurements, one predicted
tokens/s per GPU and memory per GPU with the row's own layout, batch, sequence, checkpointing and precision, and
its ratio to the published figure.

Each model is built on the meta device and measured by one forward and backward there (no memory, no GPU), as
``mode=plan`` does; the prediction is ``estimate`` of the row's layout on a profile of the hardware the
publication names. Every row is bf16 autocast with fp32 AdamW state (the planner's model of a run: it has no
compiler); a row whose run trained its linear layers in Float8 is planned with the float8 decision ``trainer.fp8``
makes for that model and layout (torchao's tensorwise recipe, weights gathered in float8 where FSDP shards them).

    python benchmarks/plan_at_scale.py [--rows tt-8b-fsdp mlm-1.7b ...] [--list]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import cpu_model  # noqa: E402

from disttrain.config.typed import model_typed  # noqa: E402
from disttrain.data.spec import DataSpec  # noqa: E402
from disttrain.models import MODELS, build_model  # noqa: E402
from disttrain.parallel.config import ParallelConfig  # noqa: E402
from disttrain.parallel.float8 import choose_float8_layers  # noqa: E402
from disttrain.plan.devices import HardwareProfile  # noqa: E402
from disttrain.plan.hardware import PROFILES  # noqa: E402
from disttrain.plan.inputs import PlanInputs  # noqa: E402
from disttrain.plan.layout import Layout  # noqa: E402
from disttrain.plan.planner import plan_inputs  # noqa: E402
from disttrain.plan.units import human_bytes  # noqa: E402

GIB = 2**30

# torchtitan's hardware (benchmarks/llama3_h100_202412_torchtitan.md, "Hardware"): Grand Teton hosts of 8 H100
# with 96 GB HBM2e at 2.4 TB/s, NVLink within a host, 400 Gb/s RDMA per GPU between hosts, 500 W power limit.
# Its footnote 2: the peak lies between the SXM and NVL parts' and is not known, so the SXM peak stays.
TORCHTITAN_H100 = replace(PROFILES["h100_sxm"], name="h100_96gb_500w", memory_bytes=96e9,
                          memory_bandwidth=2.4e12 * 0.8, watts=500.0,
                          source="torchtitan's Grand Teton H100: 96 GB HBM2e 2.4 TB/s, 500 W")
# Megatron-LM's README ("Performance Benchmarking"): H100 GPUs of DGX nodes, the stated SXM5 part
MEGATRON_H100 = PROFILES["h100_sxm"]
# this project's one-GPU measurements (benchmarks/README.md, throughput_mfu.py): an H200 SXM, 141 GB HBM3e at
# 4.8 TB/s, 700 W, the H100's tensor cores (989 TFLOP/s dense bf16)
H200 = replace(PROFILES["h100_sxm"], name="h200", memory_bytes=141e9, memory_bandwidth=4.8e12 * 0.8,
               source="NVIDIA H200 SXM datasheet x 0.7: 141 GB HBM3e 4.8 TB/s, 700 W")

LLAMA3 = {"name": "llama", "n_kv_head": 8, "rope_theta": 500000.0}
MODELS_PUBLISHED = {
    # name: (model config, vocabulary); Llama 3.1 as torchtitan's llama3 flavours define them
    "llama3-8b": ({**LLAMA3, "n_layer": 32, "n_head": 32, "n_embd": 4096, "mlp_hidden": 14336}, 128256),
    "llama3-70b": ({**LLAMA3, "n_layer": 80, "n_head": 64, "n_embd": 8192, "mlp_hidden": 28672}, 128256),
    "llama3-405b": ({**LLAMA3, "n_layer": 126, "n_head": 128, "n_embd": 16384, "mlp_hidden": 53248}, 128256),
    # Megatron's GPTs: width, heads and layers from its table, GELU MLP of 4 x width, biases, untied output
    # layer (1.7B and 7.1B count it), vocabulary 131,072
    **{f"gpt-{size}": ({"name": "gpt", "n_layer": layers, "n_head": heads, "n_embd": width, "tie_weights": False},
                       131072)
       for size, heads, width, layers in (("1.7b", 16, 2048, 24), ("7.1b", 32, 4096, 30), ("16b", 48, 6144, 32),
                                          ("32b", 56, 7168, 48), ("70b", 64, 8192, 84), ("119b", 80, 10240, 92),
                                          ("177b", 96, 12288, 96), ("314b", 128, 16384, 96),
                                          ("462b", 144, 18432, 112))},
    # throughput_workloads.py: bias-free GPT-2 124M, and the 1.2B Llama; vocabulary padded to 50,304
    "gpt2": ({"name": "gpt", "flavour": "gpt2", "bias": False}, 50304),
    "llama-1.2b": ({"name": "llama", "n_layer": 16, "n_head": 32, "n_kv_head": 8, "n_embd": 2048,
                    "mlp_hidden": 8192}, 50304),
}
"""Model key -> (disttrain model config, vocabulary size)."""


REASONS = {
    # tag: (which way it moves the tokens/s ratio, which way the memory ratio (-1 below 1, +1 above, 0 neither),
    # why the planner misses the run there)
    "compile": (-1, 0, "torch.compile fuses the element-wise operators the planner times one by one"),
    "fp8": (-1, 0, "Float8 linears: the planner prices their products at the profile's float8 rate and adds "
                   "their casts to float8 one operator at a time, where the run's compiler fuses those casts "
                   "into the operators around them"),
    "overlap": (-1, 0, "the run overlaps tensor-parallel collectives with the matrix products (AsyncTP; Megatron's "
                       "--tp-comm-overlap) and Megatron its optimizer's reduce-scatter and parameter gather "
                       "(--overlap-grad-reduce, --overlap-param-gather); the planner leaves tp collectives exposed "
                       "and ZeRO-1 all-reduces and broadcasts as this framework does"),
    "head": (-1, 1, "this framework's tp plan keeps the output layer and the loss whole on every tp rank, so the "
                    "planner computes and holds all the logits per rank; torchtitan and Megatron split the "
                    "vocabulary over tp"),
    "fp32-residual": (-1, 1, "under bf16 autocast the residual stream and the norms' outputs stay fp32 (the "
                             "planner's model of a run), so tp collectives and kept activations are twice the bf16 "
                             "ones of torchtitan and Megatron"),
    "cp": (1, 0, "the planner takes context parallelism's causal work as balanced over the ranks and its "
                 "key/value exchange as hidden; torchtitan's rate per FLOP falls at cp 4 and 8"),
    "schedule": (-1, 0, "Megatron's table does not state its pipeline schedule or micro-batch; the planner takes "
                        "1F1B with one sequence per microbatch (an interleaved schedule idles less)"),
    "reserved": (0, -1, "torchtitan's figure is the CUDA allocator's reserved peak (cached and fragmented "
                        "blocks too); the planner's is what tensors hold"),
    "selective": (1, 1, "torchtitan's op-level selective policy recomputes every second matrix product; the "
                        "planner's keeps them all"),
    "compiled-memory": (0, 1, "the compiled graph saves fewer activations than the eager operators counted"),
    "grads-held": (0, -1, "the run holds the last step's gradients through the next forward; freed after the "
                          "step it measured 19.79 GB, the moment the planner predicts"),
}
"""Why a row's prediction misses, by tag: which way it moves the predicted / published ratio of tokens/s and of
memory (below 1: the planner predicts less than the run), and how."""


@dataclass(frozen=True)
class Published:
    """One published measurement and the run it measured, as the planner lays it out."""

    key: str
    """Short name (``--rows``)."""
    source: str
    """Who measured it and how (the table row, in words)."""
    model: str
    """Key of ``MODELS_PUBLISHED``."""
    sequence: int
    """Tokens per sequence."""
    layout: Layout
    """Degrees, ZeRO stage, checkpointing and batch split of one rank (``micro_size`` sequences per forward)."""
    gpus: int
    """GPUs the publication names (the layout's world size must equal it)."""
    profile: HardwareProfile
    """The hardware it ran on."""
    tokens_per_s: float
    """Published tokens/s per GPU."""
    memory_bytes: float | None
    """Published peak memory per GPU (None: not published)."""
    reasons: tuple[str, ...] = ()
    """Tags of ``REASONS``: what the run does that the planner does not model (empty: nothing known)."""

    @property
    def float8_recipe(self) -> str | None:
        """torchao's recipe the run trained its linear layers with (None: none): torchtitan's Float8 rows ran the
        tensorwise one."""
        return "tensorwise" if "fp8" in self.reasons else None


def _titan(key: str, what: str, model: str, sequence: int, layout: Layout, gpus: int, tps: float, gib: float,
           *reasons: str) -> Published:
    """One row of torchtitan's tables (memory in GiB); its memory is the allocator's reserved figure, and under tp
    its logits are split and its residual stream bf16."""
    tp = ("head", "fp32-residual") if layout.tp > 1 else ()
    return Published(key, f"torchtitan {what}", model, sequence, layout, gpus, TORCHTITAN_H100, tps, gib * GIB,
                     (*reasons, *tp, "reserved"))


FAST = ("compile", "fp8")
"""torch.compile and Float8 linears, as torchtitan's rows name them."""

# torchtitan, benchmarks/llama3_h100_202412_torchtitan.md ("Results"; docs/performance.md before it moved): TPS/GPU
# and Memory(GiB), the maximum over ranks, at sequence 8192 unless the table varies it; bf16 FSDP2 mixed
# precision. "selective" is its op-level policy (every second matrix product recomputed), "full" whole blocks.
TORCHTITAN_8B_FSDP8 = Layout(dp_shard=8, zero_stage=3, activation_checkpoint="selective", micro_size=2)
TORCHTITAN_8B_FSDP128 = replace(TORCHTITAN_8B_FSDP8, dp_shard=128)
TORCHTITAN_70B = Layout(dp_shard=32, tp=8, zero_stage=3, sequence_parallel=True, activation_checkpoint="full",
                        micro_size=16)
# 405B: pp 8 stages; torchtitan's default pipeline microbatches are the pp degree, so local batch 32 is 8 of 4
TORCHTITAN_405B_PP = Layout(dp_shard=8, tp=8, pp=8, zero_stage=3, sequence_parallel=True,
                            activation_checkpoint="full", micro_size=32, microbatches=8, schedule="1f1b")
PUBLISHED_RUNS = [
    # Table 1: Llama 3.1 8B, 8 GPUs, FSDP, local batch 2, selective AC
    _titan("tt-8b-fsdp", "Table 1: 8B, FSDP 8", "llama3-8b", 8192, TORCHTITAN_8B_FSDP8, 8, 5762, 82.4, "selective"),
    _titan("tt-8b-fsdp-compile", "Table 1: 8B, FSDP 8 + compile", "llama3-8b", 8192, TORCHTITAN_8B_FSDP8, 8,
           6667, 77.0, "compile", "selective", "compiled-memory"),
    _titan("tt-8b-fsdp-float8", "Table 1: 8B, FSDP 8 + compile + Float8", "llama3-8b", 8192, TORCHTITAN_8B_FSDP8,
           8, 8532, 76.8, *FAST, "selective", "compiled-memory"),
    # Table 2: 8B, 8 GPUs, FSDP + CP + compile + Float8, local batch 1, full AC
    *[_titan(f"tt-8b-cp{cp}", f"Table 2: 8B, FSDP {8 // cp} CP {cp}, sequence {seq:,}", "llama3-8b", seq,
             Layout(dp_shard=8 // cp, cp=cp, zero_stage=3, activation_checkpoint="full", micro_size=1), 8, tps, gib,
             *FAST, *(("cp",) if cp > 1 else ()))
      for cp, seq, tps, gib in ((1, 32768, 3890, 83.9), (2, 65536, 2540, 84.2), (4, 131072, 1071, 84.0),
                                (8, 262144, 548, 84.5))],
    # Table 3: 8B, 128 GPUs, FSDP, local batch 2, selective AC
    _titan("tt-8b-fsdp128", "Table 3: 8B, FSDP 128", "llama3-8b", 8192, TORCHTITAN_8B_FSDP128, 128, 5605, 67.0,
           "selective"),
    _titan("tt-8b-fsdp128-compile", "Table 3: 8B, FSDP 128 + compile", "llama3-8b", 8192, TORCHTITAN_8B_FSDP128, 128,
           6514, 62.0, "compile", "selective", "compiled-memory"),
    _titan("tt-8b-fsdp128-float8", "Table 3: 8B, FSDP 128 + compile + Float8", "llama3-8b", 8192,
           TORCHTITAN_8B_FSDP128, 128, 8380, 61.8, *FAST, "selective", "compiled-memory"),
    # Table 4: 70B, 256 GPUs (FSDP 32, TP 8) + compile + Float8, local batch 16, full AC
    _titan("tt-70b-2d", "Table 4: 70B, FSDP 32 TP 8", "llama3-70b", 8192, TORCHTITAN_70B, 256, 829, 71.9, *FAST),
    _titan("tt-70b-2d-async", "Table 4: 70B, FSDP 32 TP 8 + AsyncTP", "llama3-70b", 8192, TORCHTITAN_70B, 256, 876,
           67.6, *FAST, "overlap"),
    # Table 5: 405B, 512 GPUs (FSDP 8, TP 8, PP 8) + compile + Float8 + AsyncTP, local batch 32, full AC
    _titan("tt-405b-1f1b", "Table 5: 405B, FSDP 8 TP 8 PP 8, 1F1B", "llama3-405b", 8192, TORCHTITAN_405B_PP, 512,
           100, 82.5, *FAST, "overlap"),
    _titan("tt-405b-interleaved", "Table 5: 405B, FSDP 8 TP 8 PP 8, interleaved 1F1B", "llama3-405b", 8192,
           replace(TORCHTITAN_405B_PP, schedule="interleaved_1f1b", stages_per_rank=2), 512, 128, 72.7, *FAST,
           "overlap"),
    # Table 6: 405B, 512 GPUs (TP 8, PP 8, FSDP x CP 8) + compile + Float8 + AsyncTP + 1F1B, local batch 8, full AC
    *[_titan(f"tt-405b-cp{cp}", f"Table 6: 405B, FSDP {8 // cp} CP {cp} TP 8 PP 8, sequence {seq:,}", "llama3-405b",
             seq, replace(TORCHTITAN_405B_PP, dp_shard=8 // cp, cp=cp, micro_size=8, microbatches=8), 512, tps, gib,
             *FAST, "overlap", *(("cp",) if cp > 1 else ()))
      for cp, seq, tps, gib in ((1, 32768, 76, 75.3), (2, 65536, 47, 75.9), (4, 131072, 31, 77.1),
                                (8, 262144, 16, 84.9))],
]


def megatron_flops_per_token(model: str, sequence: int) -> float:
    """Megatron-LM's model FLOPs per token of a GPT (``num_floating_point_operations`` in
    megatron/training/training.py at the README's commit f2e5db4): 12 L h^2 (2 + s/h + 4 + V / (2 L h)) for
    forward and backward, without recompute, attention counted whole."""
    cfg, vocab = MODELS_PUBLISHED[model]
    layers, width = cfg["n_layer"], cfg["n_embd"]
    return 12 * layers * width**2 * (2 + sequence / width + 4 + vocab / (2 * layers * width))


def _megatron(size: str, tp: int, pp: int, gpus: int, batch: int, tflops: float) -> Published:
    """One row of Megatron-LM's table: data parallelism 48 with its distributed optimizer (ZeRO-1), sequence
    parallelism under tp, no recompute (Megatron's default), micro-batch 1 with the rest accumulated (pp = 1) or
    as pipeline microbatches (1F1B); its per-GPU teraFLOP/s as tokens/s by its own FLOP count."""
    model, sequence, dp = f"gpt-{size}", 4096, 48
    per_rank = batch // dp
    layout = (Layout(dp_shard=dp, tp=tp, pp=pp, zero_stage=1, sequence_parallel=tp > 1, micro_size=per_rank,
                     microbatches=per_rank) if pp > 1 else
              Layout(dp_shard=dp, tp=tp, zero_stage=1, sequence_parallel=tp > 1, micro_size=1,
                     accumulation=per_rank))
    reasons = ("overlap", *(("head", "fp32-residual") if tp > 1 else ()), *(("schedule",) if pp > 1 else ()))
    return Published(f"mlm-{size}", f"Megatron-LM {size} GPT, TP {tp} PP {pp} DP {dp}, batch {batch}", model,
                     sequence, layout, gpus, MEGATRON_H100,
                     tflops * 1e12 / megatron_flops_per_token(model, sequence), None, reasons)


# Megatron-LM README.md ("Performance Benchmarking", images/model_table.png, commit f2e5db4, 2024-07): model size,
# TP, PP, number of GPUs (data-parallel size 48), batch size (sequences), per-GPU teraFLOP/s; sequence 4096,
# vocabulary 131,072, bf16, DP / TP / PP communication overlapped
PUBLISHED_RUNS += [_megatron(*row) for row in (
    ("1.7b", 1, 1, 48, 192, 408.8), ("7.1b", 2, 1, 96, 192, 465.9), ("16b", 4, 1, 192, 192, 489.1),
    ("32b", 8, 1, 384, 192, 459.6), ("70b", 8, 2, 768, 384, 419.7), ("119b", 8, 4, 1536, 768, 420.5),
    ("177b", 8, 6, 2304, 1152, 432.8), ("314b", 8, 8, 3072, 1536, 474.4), ("462b", 8, 16, 6144, 3072, 459.9))]

# this project's one-GPU runs, benchmarks/README.md ("throughput_mfu.py: on a GPU", H200, 2026-11-28): tokens/s
# and peak allocated GB of "disttrain single" (and its checkpointed and compiled rows)
SINGLE = Layout(micro_size=4)
PUBLISHED_RUNS += [
    Published("h200-gpt2-compile", "disttrain single, compile: GPT-2 124M, batch 12", "gpt2", 1024,
              Layout(micro_size=12), 1, H200, 429581, 8.45e9, ("compile", "compiled-memory")),
    Published("h200-llama1.2b", "disttrain single: Llama 1.2B, batch 4", "llama-1.2b", 2048, SINGLE, 1, H200, 53117,
              40.63e9),
    Published("h200-llama1.2b-full", "disttrain single, full checkpointing: Llama 1.2B, batch 4", "llama-1.2b", 2048,
              replace(SINGLE, activation_checkpoint="full"), 1, H200, 39817, 23.62e9, ("grads-held",)),
    Published("h200-llama1.2b-compile", "disttrain single, compile: Llama 1.2B, batch 4", "llama-1.2b", 2048,
              SINGLE, 1, H200, 67180, 34.35e9, ("compile", "compiled-memory")),
]
ROWS = {run.key: run for run in PUBLISHED_RUNS}
"""Every published row by its key."""

WITHIN = 0.10
"""The goal: predicted / published within this fraction."""


def model_inputs(run: Published) -> tuple[PlanInputs, torch.nn.Module]:
    """``run``'s model built on the meta device and measured for a bf16-mixed AdamW plan on its profile, at its
    sequences per forward (other micro-batches are measured as a layout asks), and the model."""
    cfg, vocab = MODELS_PUBLISHED[run.model]
    spec = DataSpec("text", vocab_size=vocab, block_size=run.sequence)
    typed = model_typed(OmegaConf.create({**cfg, "block_size": run.sequence, "vocab_size": vocab}), MODELS)
    with torch.device("meta"):
        net = build_model(typed, spec)
    per_pass = max(1, run.layout.micro_size // (run.layout.microbatches if run.layout.pp > 1 else 1))
    return plan_inputs(net, spec, per_pass, ParallelConfig(), OmegaConf.create({"name": "adamw"}), "bf16-mixed",
                       run.profile), net


def why(run: Published, aspect: int, ratio: float) -> str:
    """``run``'s reasons that move its ``aspect`` ratio (0: tokens/s, 1: memory) the way ``ratio`` misses, as
    their tags."""
    side = 1 if ratio > 1 else -1
    return ", ".join(tag for tag in run.reasons if REASONS[tag][aspect] == side) or "none known"


def speed_note(run: Published, ratio: float, hidden_ratio: float, comm_share: float, bubble: float) -> str:
    """Which term of the predicted step the gap lies in when ``ratio`` misses ``WITHIN`` (empty when it does not):
    exposed communication where hiding it (``hidden_ratio``) brings the prediction closer, else the pipeline
    bubble where there is one, else compute; and the reasons known."""
    if abs(ratio - 1) <= WITHIN:
        return ""
    if comm_share > 0.05 and abs(hidden_ratio - 1) < abs(ratio - 1):
        term = f"exposed communication, {comm_share:.0%} of the step ({hidden_ratio:.2f}x without it)"
    elif bubble > 0.05:
        term = f"pipeline bubble, {bubble:.0%} of the step"
    else:
        term = "compute"
    return f"{term}: {why(run, 0, ratio)}"


def memory_note(run: Published, ratio: float | None) -> str:
    """The reasons known why the predicted memory misses the published by more than ``WITHIN`` (empty when it
    does not, or when none was published)."""
    if ratio is None or abs(ratio - 1) <= WITHIN:
        return ""
    return f"memory: {why(run, 1, ratio)}"


def float8_inputs(run: Published, inputs: PlanInputs, net: torch.nn.Module) -> PlanInputs:
    """``inputs`` with the float8 decision ``trainer.fp8`` makes for ``run``'s model and layout (unchanged for a
    run without Float8)."""
    if run.float8_recipe is None:
        return replace(inputs, float8=None)
    layers, _ = choose_float8_layers(net, run.float8_recipe, None, True, run.layout.shards_parameters, "bf16-mixed")
    return replace(inputs, float8=layers)


def predict(run: Published, inputs: PlanInputs) -> tuple[str, float]:
    """The table row of ``run`` and its throughput ratio (predicted / published)."""
    e = inputs.estimate(run.layout)
    tps = e.tokens_per_s / run.gpus
    ratio = tps / run.tokens_per_s
    hidden_ratio = ratio * e.step_s / (e.step_s - e.exposed_comm_s)
    memory_ratio = None if run.memory_bytes is None else e.total_bytes / run.memory_bytes
    memory = "— | —" if memory_ratio is None else f"{human_bytes(run.memory_bytes)} | {memory_ratio:.2f}x"
    notes = [speed_note(run, ratio, hidden_ratio, e.exposed_comm_s / e.step_s, e.bubble),
             memory_note(run, memory_ratio)]
    row = (f"| {run.key} | {run.source} | {run.layout.describe()} | {run.profile.name} | {tps:,.0f} | "
           f"{run.tokens_per_s:,.0f} | **{ratio:.2f}x** | {human_bytes(e.total_bytes)} | {memory} | "
           f"{'; '.join(n for n in notes if n)} |")
    return row, ratio


def main(argv: list[str] | None = None) -> None:
    """Print the table for the rows ``--rows`` names (all by default), or ``--list`` them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), metavar="ROW",
                        help=f"published rows to predict (default: all): {', '.join(ROWS)}")
    parser.add_argument("--list", action="store_true", help="list the published rows and stop")
    args = parser.parse_args(argv)
    unknown = [key for key in args.rows if key not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown row {', '.join(unknown)}; known: {', '.join(ROWS)}")
    if args.list:
        for run in PUBLISHED_RUNS:
            print(f"{run.key}: {run.source} ({run.gpus} GPUs, {run.profile.name})")
        return
    started = time.perf_counter()
    print(f"CPU: {cpu_model()}; every row bf16 autocast with fp32 AdamW state, Float8 rows with the float8 decision "
          "of trainer.fp8=tensorwise; figures per GPU; GB = 10^9 bytes\n")
    print("| row | published run | layout | profile | predicted tokens/s | published tokens/s | ratio "
          "| predicted memory | published memory | ratio | off by >10%: the term, and why |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    measured: dict[tuple[str, int, str], tuple[PlanInputs, torch.nn.Module]] = {}
    ratios = []
    for key in args.rows:
        run = ROWS[key]
        which = (run.model, run.sequence, run.profile.name)
        if which not in measured:  # one model on meta per model and sequence; rows in turn share it
            measured = {which: model_inputs(run)}
        row, ratio = predict(run, float8_inputs(run, *measured[which]))
        ratios.append((run, ratio))
        print(row, flush=True)
    print()
    for tag in sorted({tag for run, _ in ratios for tag in run.reasons}):
        print(f"- {tag}: {REASONS[tag][2]}")
    plain = [r for run, r in ratios if not any(REASONS[tag][0] for tag in run.reasons)]
    print(f"\n{sum(abs(r - 1) <= WITHIN for _, r in ratios)} of {len(ratios)} rows within {WITHIN:.0%} in tokens/s; "
          f"{sum(abs(r - 1) <= WITHIN for r in plain)} of the {len(plain)} whose runs do nothing for speed that the "
          f"planner leaves out; {time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
