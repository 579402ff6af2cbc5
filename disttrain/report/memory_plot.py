"""The picture of one step's memory (``plots/memory_step.png``): bytes alive after each change, the phases
shaded, the step's named moments marked, and the plan's bytes at its moments as labelled lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from disttrain.report.plots import pyplot, save

PHASE_COLOURS = {"forward": "tab:blue", "backward": "tab:orange", "optimiser": "tab:green"}
"""Shading of each phase; other phases are left unshaded."""


def write_memory_plot(record: dict[str, Any], path: Path) -> Path | None:
    """Draw ``record`` (``logs/memory_step.json``'s content) into ``path``; None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    mb = 1e6
    live = [record["start_bytes"], *record["timeline"]["live_bytes"]]
    figure, axes = plt.subplots(figsize=(10, 4.5))
    axes.step(range(len(live)), [value / mb for value in live], where="post", color="black", linewidth=1,
              label="alive (measured)")
    shaded = set()
    for span in record["phases"]:
        colour = PHASE_COLOURS.get(span["phase"])
        if colour is not None:
            axes.axvspan(span["first_event"], span["end_event"], color=colour, alpha=0.12,
                         label=None if span["phase"] in shaded else span["phase"])
            shaded.add(span["phase"])
    for name, at in record["moments_after_events"].items():
        value = record["measured_moments_bytes"][name] / mb
        axes.plot([at], [value], marker="o", color="black", linestyle="none")
        axes.annotate(name.replace("_", " "), (at, value), textcoords="offset points", xytext=(4, 4), fontsize=7)
    for index, (name, value) in enumerate((record.get("planned_moments_bytes") or {}).items()):
        axes.axhline(value / mb, color=f"C{index + 3}", linestyle="--", linewidth=1,
                     label=f"plan: {name.replace('_', ' ')} {value / mb:.4g} MB")
    peak, at = record["peak_bytes"] / mb, record["peak_after_events"]
    largest = record["largest_at_peak"][0] if record["largest_at_peak"] else None
    note = f"peak {peak:.4g} MB" + (f"\nlargest: {largest['module'] or largest['made_by']} "
                                     f"{largest['bytes_at_peak'] / mb:.3g} MB" if largest else "")
    axes.plot([at], [peak], marker="v", color="red", linestyle="none")
    axes.annotate(note, (at, peak), textcoords="offset points", xytext=(10, -30), fontsize=7, color="red")
    axes.set_xlabel("allocations and releases, in order")
    axes.set_ylabel("MB alive on the rank")
    axes.set_title(f"memory of step {record['step'] + 1}, rank {record['rank']} ({record['counted_by']})", fontsize=9)
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save(figure, plt, path)
