"""A plan as the terminal and ``plan.json`` show it (its pictures: ``disttrain.plan.pictures``)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from disttrain.plan.auto import Choice
from disttrain.plan.devices import HardwareProfile
from disttrain.plan.estimate import Estimate
from disttrain.plan.model_stats import ModelStats
from disttrain.plan.pictures import CANDIDATES_FILE, MEMORY_FILE, draw_candidates, draw_plan_memory
from disttrain.plan.units import human_bytes, human_count

TERMS = {"params": "parameters", "grads": "gradients", "optimizer": "optimiser state", "activations": "activations",
         "transient": "transient (gathered units, unreduced gradients, dequantised weights)"}


def render(e: Estimate, profile: HardwareProfile, params: int, model: str, stats: ModelStats | None = None) -> str:
    """The plan as text: memory terms, collectives, bubble and predicted time; with the model's ``stats``, its
    experts and expert parallelism too (for a model that has them)."""
    lay = e.layout
    experts = stats is not None and stats.has_experts
    active = f", {stats.active_params / 1e6:.4g}M active per token" if experts else ""
    if stats is not None and stats.frozen:  # LoRA: the optimiser and the gradients cover the adapters alone
        frozen = sum(stats.param_numel[name] for name in stats.frozen)
        active += f", {(stats.params - frozen) / 1e6:.4g}M trainable, {frozen / 1e6:.4g}M frozen"
    lines = [f"plan: {model} ({params / 1e6:.4g}M parameters{active}) on {lay.world_size} rank(s): {lay.describe()}",
             f"profile: {profile.name} ({profile.source})", "",
             "memory per rank (the most loaded rank)", "| term | bytes |", "|---|---|"]
    for key, label in TERMS.items():
        value = human_bytes(e.memory[key])
        if key == "activations":
            others = ", ".join(f"{policy}: {human_bytes(figure)}" for policy, figure in e.activations_by_policy.items()
                               if policy != lay.activation_checkpoint)
            value += f" (checkpointing {lay.activation_checkpoint}; {others})"
        if key == "grads" and e.grads_alternative is not None:
            value += (" (accumulated sharded: a reduce-scatter every micro-batch; unsharded: "
                      f"{human_bytes(e.grads_alternative)})" if lay.sharded_accumulation else
                      " (accumulated unsharded: one reduce-scatter per step; sharded: "
                      f"{human_bytes(e.grads_alternative)})")
        lines.append(f"| {label} | {value} |")
    verdict = "fits" if e.fits else f"DOES NOT FIT: {e.overflow()}"
    moment = max(e.phases, key=e.phases.get).replace("_", " ")
    lines += [f"| peak ({moment}) | {human_bytes(e.total_bytes)} of {human_bytes(e.capacity)}: {verdict} |", ""]
    lines += sequence_table(e)
    if experts:
        lines += expert_table(e, stats)
    if e.collectives:
        lines += ["communication per optimiser step (ring model, bytes this rank sends)",
                  "| collective | over | ranks | buffer | calls | sent | time |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {c.label} | {c.group} | {c.size} | {human_bytes(c.buffer_bytes)} | {c.calls} | "
                  f"{human_bytes(c.sent_bytes)} | {c.seconds * 1e3:.3g} ms |" for c in e.collectives]
        lines.append("")
    else:
        lines += ["communication: none", ""]
    if e.orthogonalise_flops:
        gathered = sum(c.sent_bytes for c in e.collectives if c.what == "whole matrices")
        lines.append(f"orthogonalisation (Muon's Newton-Schulz or SOAP's eigenbases, once per optimiser step): "
                     f"{e.orthogonalise_flops / 1e9:.4g} GFLOP, {e.orthogonalise_s * 1e3:.3g} ms "
                     f"({100 * e.orthogonalise_s / e.step_s:.1f}% of the step); gathers of whole matrices send "
                     f"{human_bytes(gathered)}")
    if lay.pp > 1:
        lines.append(f"pipeline bubble: {e.bubble:.3f} of a step ({lay.schedule}, {lay.microbatches} microbatches)")
    energy = e.joules_per_token
    lines.append(f"predicted step: compute {e.compute_s * 1e3:.3g} ms"
                 + (f" / (1 - bubble {e.bubble:.2f})" if e.bubble else "")
                 + f" + exposed communication {e.exposed_comm_s * 1e3:.3g} ms = {e.step_s * 1e3:.3g} ms; "
                 f"{e.tokens_per_s:,.0f} tokens/s over {lay.world_size} rank(s)"
                 + (f"; {energy * 1e3:.3g} mJ per token at {profile.watts:.0f} W per device"
                    + (f" ({profile.idle_watts:.0f} W while waiting)" if profile.idle_watts is not None else "")
                    if energy else
                    "; energy per token: unknown (the profile has no power figure)"))
    lines += [f"note: {note}" for note in e.notes]
    return "\n".join(lines)


def sequence_table(e: Estimate) -> list[str]:
    """Lines of the peak activations per rank of this layout by sequence length and cp degree (none for a
    model without sequences), and a blank line."""
    table = e.activations_by_length
    if not table:
        return []
    cps = list(next(iter(table.values())))
    run = e.tokens_per_step // (e.layout.micro_size * e.layout.accumulation * e.layout.dp)
    lines = ["peak activations per rank by sequence length, this layout at each cp (linear in tokens: fused "
             "attention keeps no tokens x tokens matrix; cp > 1 adds one layer's gathered keys and values)",
             "| sequence | " + " | ".join(f"cp={cp}" for cp in cps) + " |", "|---" * (len(cps) + 1) + "|"]
    for length, row in table.items():
        label = f"{length} (this run)" if length == run else str(length)
        lines.append(f"| {label} | " + " | ".join("-" if row[cp] is None else human_bytes(row[cp]) for cp in cps)
                     + " |")
    return [*lines, ""]


EP_COLUMNS = {"params": "parameters", "grads": "gradients", "optimizer": "optimiser state", "transient": "transient",
              "peak": "peak", "all_to_all": "all-to-all sent", "fsdp": "FSDP sent"}
"""Columns of the expert-parallel table (``Estimate.by_ep``'s keys) and their headings."""


def expert_table(e: Estimate, stats: ModelStats) -> list[str]:
    """Lines on the model's experts and this layout's memory per rank and expert traffic per step at each ep
    degree (``Estimate.by_ep``), and a blank line."""
    tokens = stats.micro_size * stats.tokens_per_sample
    modules: dict[str, tuple[int, int]] = {}
    for call in stats.expert_calls:
        rows = modules.get(call.module, (call.n_experts, 0))[1]
        modules[call.module] = (call.n_experts, rows + call.rows)
    counts = "/".join(str(n) for n in sorted(stats.expert_counts))
    per_token = "/".join(f"{rows / tokens:.3g}" for rows in sorted({r for _, r in modules.values()}))
    lines = [f"experts: {len(modules)} mixture layer(s) of {counts} experts, {per_token} per token (planned as "
             f"balanced routing); {human_count(stats.expert_param_count)} of the {human_count(stats.params)} "
             f"parameters are experts', {human_count(stats.active_params)} active per token"]
    if all(row is None for ep, row in e.by_ep.items() if ep > 1):
        return [*lines, f"expert parallelism: none in this layout (ep must divide dp_shard={e.layout.dp_shard} and "
                f"every layer's {counts} experts, under ZeRO-2/3; this run: {e.layout.zero_setting})", ""]
    lines += ["expert parallelism: this layout at each ep, per rank (all-to-all and FSDP: bytes a rank sends per "
              "optimiser step; FSDP's gathers and reduce-scatters, the experts' over their own ranks included)",
              "| ep | " + " | ".join(EP_COLUMNS.values()) + " |", "|---" * (len(EP_COLUMNS) + 1) + "|"]
    for ep, row in e.by_ep.items():
        label = f"{ep} (this run)" if ep == e.layout.ep else str(ep)
        cells = ["-"] * len(EP_COLUMNS) if row is None else [human_bytes(row[key]) for key in EP_COLUMNS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if None in e.by_ep.values():
        lines.append(f"-: ep must divide dp_shard={e.layout.dp_shard} and every layer's {counts} experts, under "
                     f"ZeRO-2/3 (this run: {e.layout.zero_setting})")
    return [*lines, ""]


def as_json(e: Estimate, profile: HardwareProfile) -> dict[str, Any]:
    """Everything the report shows, as plain JSON values."""
    return {"layout": asdict(e.layout), "memory_bytes": e.memory, "phases_bytes": e.phases,
            "total_bytes": e.total_bytes,
            "capacity_bytes": e.capacity, "fits": e.fits, "overflow": e.overflow() or None,
            "activations_held": e.activations_held, "activations_by_policy": e.activations_by_policy,
            "activations_by_length": e.activations_by_length, "by_ep": e.by_ep, "recompute_s": e.recompute_s,
            "collectives": [asdict(c) for c in e.collectives], "bubble": e.bubble, "compute_s": e.compute_s,
            "exposed_comm_s": e.exposed_comm_s, "step_s": e.step_s, "tokens_per_s": e.tokens_per_s,
            "joules_per_token": e.joules_per_token,
            "orthogonalise_flops": e.orthogonalise_flops, "orthogonalise_s": e.orthogonalise_s,
            "profile": asdict(profile)}


def write_plan(e: Estimate, profile: HardwareProfile, run_dir: Path, plots: bool,
               choice: Choice | None = None) -> list[Path]:
    """``plan.json`` and, with ``plots``, ``plots/plan_memory.png`` in ``run_dir``; with the ``choice`` of
    ``parallel=auto``, also ``plots/plan_candidates.png``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "plan.json"
    path.write_text(json.dumps(as_json(e, profile), indent=2))
    written = [path]
    if plots:
        pictures = [draw_plan_memory(e, run_dir / "plots" / MEMORY_FILE)]
        if choice is not None:
            pictures.append(draw_candidates(choice, run_dir / "plots" / CANDIDATES_FILE))
        written += [picture.path for picture in pictures if picture is not None]
    return written
