"""What the terminal shows besides the run's own lines: Lightning's and torch's noise is filtered where it is
emitted (one logging filter per logger, one warnings filter per message), and nothing else is hidden."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

# (logger, start of the message) pairs that say nothing about this run
_BANNER = "-" * 100 + "\ndistributed_backend="
_NOISE = (  # Lightning routes fabric's rank-zero messages through the pytorch logger once that is imported
    ("lightning.pytorch.utilities.rank_zero", "💡 Tip: For seamless cloud logging"),
    ("lightning.pytorch.utilities.rank_zero", _BANNER),
    # the accelerators Lightning looked for, on every run: the run's own summary names the device it used
    ("lightning.pytorch.utilities.rank_zero", "GPU available:"),
    ("lightning.pytorch.utilities.rank_zero", "TPU available:"),
    ("lightning.pytorch.utilities.rank_zero", "HPU available:"),
    ("lightning.fabric.utilities.rank_zero", _BANNER),
    ("lightning.fabric.utilities.distributed", "Initializing distributed:"),
)
_WARNINGS = (
    # Lightning's own use of a deprecated torch._pytree name, once per rank
    r".*isinstance\(treespec, LeafSpec\)` is deprecated",
    # pipeline stages other than the last hold no loss, yet every rank must join the metric's reduction
    r"The ``compute`` method of metric \w+ was called before the ``update`` method",
    # resuming mid-epoch is exact here: StepSampler skips the samples the checkpoint's steps consumed
    r"You're resuming from a checkpoint that ended before the epoch ended",
    # a resumed or restarted run writes into its own checkpoint folder by design
    r"Checkpoint directory .* exists and is not empty",
)


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.prefixes)


def quiet_noise() -> None:
    """Install the filters, and leave Lightning's lines to the root logger's handlers where it has any
    (idempotent)."""
    # the ``lightning`` package gives its logger a console handler of its own and lets records propagate too: under
    # Hydra's job logging (the console and train.log on the root logger) every Lightning line printed twice
    if logging.getLogger().handlers:
        lightning_logger = logging.getLogger("lightning")
        for handler in list(lightning_logger.handlers):
            if type(handler) is logging.StreamHandler:
                lightning_logger.removeHandler(handler)
    by_logger: dict[str, tuple[str, ...]] = {}
    for name, prefix in _NOISE:
        by_logger[name] = (*by_logger.get(name, ()), prefix)
    for name, prefixes in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(prefixes))
    for message in _WARNINGS:
        warnings.filterwarnings("ignore", message=message)


def _exchange_line(results: dict[str, Any]) -> str | None:
    """What the data-parallel exchange sent and a matrix optimiser gathered, as ``results.json``'s ``comm``,
    ``outer_steps`` and ``param_server`` say (None for a run with neither)."""
    comm = results.get("comm") or {}
    gathered = comm.get("matrix_gather_bytes_per_step")
    parts = []
    if comm.get("compression_ratio"):  # layouts whose exchange is not measured, or sent nothing, have none
        how = "counted" if comm["counted"] else "from the layout's formula"
        ratio = comm["compression_ratio"]
        versus = "an fp32 all-reduce" if ratio == 1 else (f"{ratio:g}x fewer than an fp32 all-reduce" if ratio > 1
                                                           else f"{1 / ratio:.3g}x more than an fp32 all-reduce")
        parts.append(f"{comm['bytes_sent_per_step']:,} bytes per rank and step ({versus}, {how})")
    if gathered:
        parts.append(f"whole-matrix gathers {gathered:,} bytes per rank and step (counted)")
    if not parts:
        return None
    parts[0] = f"  exchange: {parts[0]}"
    outer = results.get("outer_steps")
    if outer:
        parts.append(f"{outer['count']} outer steps, every {outer['sync_every']}")
    server = results.get("param_server")
    if server:
        parts.append(f"busiest server {server['busiest_server_bytes_per_step']:,} bytes per step")
        if server.get("staleness"):
            total = server["applied_updates"] + server["dropped_updates"]
            parts.append(f"{server['dropped_updates']:,} of {total:,} gradients dropped as more than "
                         f"{server['staleness']} version(s) late (logs/server<rank>.jsonl)")
    return "; ".join(parts)


def _federated_line(fed: dict[str, Any]) -> str:
    """Clients' accuracy on their own data, traffic per round and the privacy spent."""
    parts = []
    if fed.get("client_acc_mean") is not None:
        parts.append(f"clients' own-data accuracy {fed['client_acc_mean']:.4f} ± {fed['client_acc_std']:.4f} "
                     "(last round, before local training)")
    if fed.get("bytes_up_per_round"):
        parts.append(f"{fed['bytes_up_per_round'] / 1e6:.2f} MB up, {fed['bytes_down_per_round'] / 1e6:.2f} MB down "
                     "per round")
    privacy = fed.get("privacy")
    if privacy:
        parts.append(f"epsilon {privacy['epsilon']:.3g} at delta {privacy['delta']:g}")
    if fed.get("aggregation", "mean") != "mean":
        parts.append(f"aggregation {fed['aggregation']}")
    attack = fed.get("attack") or {}
    if attack.get("kind", "none") != "none":
        parts.append(f"{attack['fraction']:.0%} of clients attacking ({attack['kind']})")
    if fed.get("dropout"):
        parts.append(f"{fed['dropout']:.0%} of drawn clients dropping each round")
    if fed.get("sim_time") is not None:
        parts.append(f"{fed.get('mode', 'sync')} aggregation, simulated time {fed['sim_time']:.1f}")
    return "  federated: " + "; ".join(parts)


def _experts_line(experts: dict[str, Any]) -> str:
    """How evenly a mixture of experts was loaded over the run, what it dropped and what its all-to-alls sent."""
    worst = max(experts["load_max_over_mean_per_layer"], default=1.0)
    parts = [f"busiest expert {worst:.3g}x the mean load (worst layer, whole run)",
             f"{experts['dropped_fraction']:.2%} of assignments dropped"]
    if experts.get("all_to_all_bytes_per_step"):
        parts.append(f"all-to-all {experts['all_to_all_bytes_per_step']:,.0f} bytes per rank and step")
    return "  experts: " + "; ".join(parts)


def data_read_line(read: dict[str, Any]) -> str:
    """One line: the tokens and documents a mixture's training read, and each source's share against its weight."""
    shares = "; ".join(f"{Path(source['path']).name} {source['document_share']:.1%} of documents "
                       f"(weight {source['weight_share']:.1%}), {source['token_share']:.1%} of tokens"
                       for source in read["sources"])
    return f"  read {read['tokens']:,} tokens of {read['documents']:,} documents: {shares}"


def task_scores_line(evaluation: dict[str, Any]) -> str:
    """One line: each task score at the first scoring and at the last (the starting weights and the trained ones
    where ``trainer.validate_before_training`` is on)."""
    first, last = evaluation["scored"][0], evaluation["scored"][-1]
    scores = "; ".join(f"{name} {value:.4f} at step {first['step']} -> {last['scores'][name]:.4f} at step "
                       f"{last['step']}" for name, value in sorted(first["scores"].items()) if name in last["scores"])
    return f"  task scores: {scores}"


def _stragglers_line(stragglers: dict[str, Any]) -> str:
    """Each rank's mean step and its slowest phase, and the ranks named as stragglers."""
    ranks = "; ".join(f"rank {row['rank']} {row['step_ms']:.1f} ms ({row['slowest_phase']} "
                      f"{row['slowest_phase_ms']:.1f})" for row in stragglers["ranks"])
    named = sorted({row["rank"] for row in stragglers["named"]})
    verdict = f"stragglers named: rank {', '.join(map(str, named))}" if named else "no straggler"
    return f"  step by rank: {ranks}; {verdict}"


def run_summary(results: dict[str, Any], results_path: Path) -> str:
    """The lines that end a run: time and throughput, best validation, test metrics, the recipe's check and
    where everything is. Every figure is the one in ``results.json``, rounded for reading."""
    rate = f", {results['samples_per_sec']:g} samples/s" if results.get("samples_per_sec") else ""
    if results.get("tokens_per_sec"):
        rate += f", {results['tokens_per_sec']:g} tokens/s"
    fed = results.get("federated")
    if fed:
        rate = f", {fed['client_samples_per_sec']:.0f} client samples/s" if fed.get("client_samples_per_sec") else ""
        done = (f"{results['global_steps']} rounds of {fed['clients_per_round']} of {fed['clients']} clients "
                f"({fed['strategy']}, {fed['partition']})")
    else:
        done = f"{results['global_steps']} steps"
    lines = [f"Run complete: {done} on {results['world_size']} rank(s), {results['wall_time_s']:g} s in fit{rate}"]
    best = results.get("best")
    if best:
        where = Path(results["best_checkpoint"]).relative_to(results_path.parent) if results["best_checkpoint"] else ""
        lines.append(f"  best {best['metric']} {best['value']:.4f} ({where})")
    tests = {k: v for k, v in results["metrics"].items() if k.startswith("test/")}
    if tests:
        lines.append("  test: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(tests.items())))
    timing = results.get("throughput") or {}
    if timing.get("shares"):
        shares = ", ".join(f"{name} {share:.0%}" for name, share in timing["shares"].items() if share >= 0.005)
        first = timing.get("time_to_first_step_s")
        first_step = f"first step after {first:g} s" if first is not None else "no training step in this process"
        lines.append(f"  wall time {timing['wall_time_s']:g} s from the command: {shares}; {first_step}; "
                     f"{timing['end_to_end_samples_per_sec']:g} samples/s end to end")
    energy = results.get("energy") or {}
    if energy.get("joules") is not None:
        how = f"estimated by {energy['source']}" if energy["estimated"] else f"measured by {energy['source']}"
        lines.append(f"  energy {energy['joules']:,.0f} J in fit ({how}), {energy['per_step']:.3g} J per step")
    if fed:
        lines.append(_federated_line(fed))
    exchange = _exchange_line(results)
    if exchange:
        lines.append(exchange)
    if results.get("experts"):
        lines.append(_experts_line(results["experts"]))
    if results.get("data", {}).get("sources"):
        lines.append(data_read_line(results["data"]))
    if (results.get("eval") or {}).get("scored"):
        lines.append(task_scores_line(results["eval"]))
    if (results.get("stragglers") or {}).get("ranks"):
        lines.append(_stragglers_line(results["stragglers"]))
    expect = results.get("expect")
    if expect:
        value = "not measured" if expect["value"] is None else f"{expect['value']:.4f}"
        relation = ">=" if expect["mode"] == "max" else "<="
        verdict = "met" if expect["met"] else "NOT met"
        lines.append(f"  expected {expect['metric']} {relation} {expect['bound']:.4f}: {value}, {verdict}")
    faults = results.get("fault_tolerance") or {}
    events = []
    if faults.get("restarts"):
        events.append(f"{faults['restarts']} restart(s) (causes in logs/restarts.json)")
    for change in faults.get("world_size_changes") or []:
        events.append(f"resumed at step {change['at_step']} on {change['to_ranks']} ranks instead of "
                      f"{change['from_ranks']} (data-parallel {change['from_dp']} -> {change['to_dp']})")
    if faults.get("skipped_steps"):
        events.append(f"{faults['skipped_steps']} step(s) skipped for non-finite numbers")
    if events:
        lines.append("  " + "; ".join(events))
    lines.append(f"  run directory {results_path.parent}; results in {results_path.name}")
    return "\n".join(lines)


def skipped_steps_warning(skipped: int, steps: int) -> str:
    """The line that ends a run some of whose steps ``nan_policy=skip`` dropped: its weights took fewer updates
    than its step count says, which the exit status (0) does not show."""
    return (f"disttrain: warning: {skipped} of {steps} optimiser steps were skipped for non-finite numbers "
            f"(fault_tolerance.nan_policy=skip): the weights took {steps - skipped} updates; a run that keeps "
            "producing them has diverged (a lower learning rate, or nan_policy=stop to end at the first)")
