"""The planner's pictures: a plan's memory per rank (``plan_memory.png``), the layouts ``parallel=auto`` weighed
(``plan_candidates.png``) and a dry run's measured memory beside the plan's (``dryrun_memory.png``).

Every figure is a horizontal bar with its value written beside it, on an axis scaled to the figures drawn rather
than to the device: a plan that uses a hundredth of the device would otherwise be a sliver under the capacity line.
The capacity is a line where it falls within that scale and a sentence where it does not. Each drawing returns
what it drew (``Picture``), read back from the figure, so that a test can hold it to what a reader should see.
Matplotlib is optional: without it nothing is drawn and the drawings return None.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disttrain.plan.auto import TIE, Choice
from disttrain.plan.estimate import Estimate
from disttrain.plan.units import human_bytes

MEMORY_FILE = "plan_memory.png"
"""The plan's memory per rank, in the run directory's ``plots/``."""
CANDIDATES_FILE = "plan_candidates.png"
"""The layouts ``parallel=auto`` weighed, in the run directory's ``plots/``."""
DRY_RUN_FILE = "dryrun_memory.png"
"""A dry run's measured memory against the plan's, in the run directory's ``plots/``."""

TERM_LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimiser state",
               "activations": "activations", "transient": "transient buffers"}
"""Rows of the memory picture: ``Estimate.memory``'s terms and what they are called."""
MOMENT_LABELS = {"after_forward": "after forward", "in_first_block": "in the first block's backward",
                 "after_backward": "after backward", "after_step": "after the optimiser step"}
"""Moments a plan predicts (``Estimate.phases``) or a dry run measures, in the order a step reaches them."""

CHOSEN, FITS, TOO_BIG = "tab:green", "tab:blue", "tab:red"
"""Bar colours of the candidates: the chosen layout, the others that fit, those that do not."""
PLANNED, MEASURED = "tab:gray", "tab:orange"
"""Bar colours of a dry run's planned and measured figures."""
CAPACITY_ON_SCALE = 4.0
"""The capacity is drawn as a line when it is at most this many times the largest figure drawn (beyond, the
figures would shrink to slivers beside it, and it is written out instead)."""


@dataclass(frozen=True)
class Bar:
    """One bar as drawn."""

    row: str
    """The label of its row."""
    series: str
    """What it shows where a row holds more than one bar (``planned``, ``measured``) or a panel's name."""
    value: float
    """Its length in the axis' unit."""
    share: float
    """Its length as a share of the axis' width (what a reader sees; clipped at 1)."""
    colour: str
    """Its fill, as ``#rrggbb``."""


@dataclass(frozen=True)
class Picture:
    """What a drawing put on its figure, read back from it."""

    path: Path
    """The PNG written."""
    title: str
    """The figure's title."""
    bars: tuple[Bar, ...]
    """Every bar, panel by panel, top to bottom."""
    texts: tuple[str, ...]
    """Every text drawn: the title, the rows' labels, values, notes."""

    def rows(self, series: str | None = None) -> list[str]:
        """The rows' labels (of ``series`` alone where given), top to bottom, each once."""
        seen = [bar.row for bar in self.bars if series is None or bar.series == series]
        return list(dict.fromkeys(seen))


def _unit(largest: float) -> tuple[str, float]:
    """The byte unit in which ``largest`` reads as a number >= 1 (as ``human_bytes`` writes it)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if largest >= size:
            return unit, size
    return "B", 1.0


@dataclass(frozen=True)
class MemoryScale:
    """How memory axes are scaled: to the figures drawn, and the capacity beside them."""

    unit: str
    """The axis' unit (kB, MB, GB ...)."""
    size: float
    """Bytes per unit."""
    limit: float
    """The axis' right end, in bytes (room left for the values' labels)."""
    capacity: float
    """The device's memory per rank, in bytes."""
    capacity_on_scale: bool
    """Whether the capacity is drawn as a line (else written as a sentence)."""

    @staticmethod
    def of(figures: list[float], capacity: float) -> MemoryScale:
        """The scale for ``figures`` (bytes) beside ``capacity``: a figure many times the capacity (a layout that
        does not fit by far) is clipped at twice the capacity, so that those that fit stay legible."""
        largest = max([*figures, 1.0])
        on_scale = capacity <= CAPACITY_ON_SCALE * largest
        drawn = min(largest, 2 * capacity) if on_scale else largest
        right = max(drawn, capacity if on_scale else 0.0) * 1.35
        unit, size = _unit(drawn)
        return MemoryScale(unit, size, right, capacity, on_scale)

    def apply(self, axes: Any, label: str, name_capacity: bool = True) -> None:
        """Set ``axes``' x range and label in this scale; draw the capacity line where it is on the scale (named
        above the axes with ``name_capacity``)."""
        axes.set_xlim(0, self.limit / self.size)
        axes.set_xlabel(f"{label} ({self.unit})")
        if self.capacity_on_scale:
            axes.axvline(self.capacity / self.size, color="black", linestyle="--", linewidth=1.2)
        if self.capacity_on_scale and name_capacity:
            axes.annotate(f"capacity {human_bytes(self.capacity)}", (self.capacity / self.size, 1.0),
                          xycoords=("data", "axes fraction"), xytext=(0, 2), textcoords="offset points",
                          fontsize=8, va="bottom", ha="center")

    def off_scale_note(self, figure: float, what: str = "the peak") -> str:
        """The sentence that stands for the capacity line when it is off the scale, as a multiple of ``figure``
        (called ``what``); empty when the line is on the scale."""
        if self.capacity_on_scale:
            return ""
        return (f"capacity {human_bytes(self.capacity)} per rank: off this scale "
                f"({self.capacity / max(figure, 1.0):,.0f}x {what})")


def draw_plan_memory(e: Estimate, path: Path) -> Picture | None:
    """The plan's memory per rank: a bar per term (each at its largest) and, below, a bar per moment of the step
    (the bytes in use together then), the peak's marked; titled with the layout, the peak, the capacity and the
    headroom or the overflow."""
    plt = _pyplot()
    if plt is None:
        return None
    terms = {label: e.memory[key] for key, label in TERM_LABELS.items()}
    moments = {_moment(name): e.phases[name] for name in _in_step_order(e.phases)}
    peak_moment = _moment(max(e.phases, key=e.phases.get))
    scale = MemoryScale.of([*terms.values(), *moments.values()], e.capacity)
    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8.5, 4.8), layout="constrained",
                                         gridspec_kw={"height_ratios": [len(terms), len(moments)]})
    colours = [f"C{i}" for i in range(len(terms))]
    policy = e.layout.activation_checkpoint
    labels = [f"{label} (checkpointing {policy})" if label == "activations" else label for label in terms]
    peak = e.total_bytes
    _bars(top, labels, list(terms.values()), scale.size, scale.limit / scale.size, colours,
          [f"{human_bytes(value)}, {_percent(value / peak)} of the peak" for value in terms.values()], "term")
    top.set_title("each term at its largest", fontsize=9, loc="left")
    moment_colours = ["black" if label == peak_moment else "darkgray" for label in moments]
    values = [human_bytes(value) + (f": the peak, {_percent(peak / e.capacity)} of the device" if label == peak_moment
                                    else "") for label, value in moments.items()]
    _bars(bottom, [f"{label} (peak)" if label == peak_moment else label for label in moments],
          list(moments.values()), scale.size, scale.limit / scale.size, moment_colours, values, "moment")
    bottom.set_title("bytes in use together at each moment of the step", fontsize=9, loc="left")
    scale.apply(top, "")
    scale.apply(bottom, "bytes per rank", name_capacity=False)
    top.set_xlabel("")
    note = scale.off_scale_note(peak)
    if note:
        figure.text(0.99, 0.0, note, ha="right", va="top", fontsize=8, style="italic")
    verdict = (f"fits, {human_bytes(e.capacity - peak)} headroom" if e.fits else
               f"DOES NOT FIT: {human_bytes(peak - e.capacity)} over")
    title = (f"{e.layout.describe()} on {e.layout.world_size} rank(s)\n"
             f"peak {human_bytes(peak)} ({peak_moment}) of {human_bytes(e.capacity)} per rank: {verdict}")
    figure.suptitle(title, fontsize=10)
    return _finish(figure, plt, path, title, [top, bottom])


def shown_candidates(choice: Choice, fitting: int = 12, too_big: int = 4) -> tuple[list[Estimate], list[Estimate]]:
    """The candidates a picture shows: up to ``fitting`` of those that fit, the fastest first and the chosen one
    always among them, and up to ``too_big`` of those that do not, the closest to fitting first."""
    fast = sorted(choice.ranked, key=lambda e: e.step_s)
    shown = fast[:fitting]
    if choice.best is not None and not any(e is choice.best for e in shown):
        shown = [*shown[:fitting - 1], choice.best]
    return sorted(shown, key=lambda e: e.step_s), choice.too_big[:too_big]


def draw_candidates(choice: Choice, path: Path) -> Picture | None:
    """The layouts ``parallel=auto`` weighed, side by side: memory per rank and predicted step time of each, the
    chosen one marked, those that do not fit marked (hatched, at their smallest micro-batch); those the run's
    settings excluded are counted in the note below, not drawn."""
    plt = _pyplot()
    if plt is None:
        return None
    fitting, too_big = shown_candidates(choice)
    shown = [*fitting, *too_big]
    if not shown:
        return None
    best = choice.best
    labels = [e.layout.describe() + (" (chosen)" if e is best else "" if e.fits else " (does not fit)")
              for e in shown]
    colours = [CHOSEN if e is best else FITS if e.fits else TOO_BIG for e in shown]
    capacity = shown[0].capacity
    scale = MemoryScale.of([e.total_bytes for e in shown], capacity)
    figure, (memory, time) = plt.subplots(1, 2, sharey=True, figsize=(12, 1.4 + 0.36 * len(shown)),
                                          layout="constrained")
    _bars(memory, labels, [e.total_bytes for e in shown], scale.size, scale.limit / scale.size, colours,
          [human_bytes(e.total_bytes) for e in shown], "memory per rank", hatched=[not e.fits for e in shown])
    scale.apply(memory, "peak memory per rank")
    seconds = [e.step_s for e in shown]
    time_unit, time_size = ("s", 1.0) if max(seconds) >= 1 else ("ms", 1e-3)
    _bars(time, labels, seconds, time_size, max(seconds) / time_size * 1.3, colours,
          [f"{s / time_size:.3g} {time_unit}" for s in seconds], "step time", hatched=[not e.fits for e in shown])
    time.set_xlabel(f"predicted time per optimiser step ({time_unit})")
    for label, colour in zip(memory.get_yticklabels(), colours, strict=True):
        label.set_color(colour if colour != FITS else "black")
        label.set_fontweight("bold" if colour == CHOSEN else "normal")
    if too_big:  # a line between the layouts that fit and those that do not
        for axes in (memory, time):
            axes.axhline(len(fitting) - 0.5, color="black", linewidth=0.8)
    slower, others = len(choice.ranked) - len(fitting), len(choice.too_big) - len(too_big)
    notes = ["one bar per layout at its fastest micro-batch that fits" +
             ("; those that do not fit (hatched) at their smallest" if too_big else "")]
    excluded = [f"{x.count} excluded by {x.refusal.setting}" for x in choice.excluded]  # as the notice leaves them out
    if slower or others or excluded:
        notes.append("not drawn: " + ", ".join(part for part in (
            f"{slower} slower layout(s) that fit" if slower else "",
            f"{others} more that do not fit" if others else "", *excluded) if part))
    note = scale.off_scale_note(max(e.total_bytes for e in shown), "the largest peak drawn")
    notes += [note] if note else []
    figure.text(0.01, 0.0, "\n".join(notes), fontsize=8, style="italic", va="top")
    world = shown[0].layout.world_size
    if best is None:
        why = "none fits"
    else:
        fastest = min(choice.ranked, key=lambda e: e.step_s)
        why = (f"chose {best.layout.describe()}: " + (
            "the fastest predicted" if fastest is best else
            f"within {TIE:.0%} of the fastest ({fastest.layout.describe()}), and simpler"))
    counted = (f"all {len(choice.ranked)} layouts fit" if not choice.too_big else
               f"{len(choice.ranked)} layout(s) fit, {len(choice.too_big)} do not")
    title = f"parallel=auto on {world} rank(s), {human_bytes(capacity)} per rank: {counted}\n{why}"
    figure.suptitle(title, fontsize=10)
    return _finish(figure, plt, path, title, [memory, time])


def draw_dry_run(result: dict[str, Any], path: Path) -> Picture | None:
    """A dry run's memory beside the plan's: for the peak and each moment, the planned bar above the measured one,
    the measured one labelled with its ratio to the plan; titled with the rank, the layout, the peaks, the
    compute time per step and whether it fits."""
    plt = _pyplot()
    if plt is None:
        return None
    planned_moments, measured_moments = result["planned_moments_bytes"], result["measured_moments_bytes"]
    names = [name for name in MOMENT_LABELS if name in planned_moments or name in measured_moments]
    names += [name for name in [*planned_moments, *measured_moments] if name not in names]
    rows = [("peak", result["planned_peak_bytes"], result["measured_peak_bytes"])]
    rows += [(MOMENT_LABELS.get(name, name.replace("_", " ")), planned_moments.get(name),
              measured_moments.get(name)) for name in names]
    # a GPU's allocator peaks, each beside the plan's peak
    rows += [(f"{name} (GPU)", result["planned_peak_bytes"], value)
             for name, value in (result.get("allocator_peak_bytes") or {}).items()]
    capacity = result["capacity_bytes"]
    scale = MemoryScale.of([value for _, *pair in rows for value in pair if value is not None], capacity)
    figure, axes = plt.subplots(figsize=(9, 1.5 + 0.62 * len(rows)), layout="constrained")
    height = 0.38
    for index, (label, planned, measured) in enumerate(rows):
        for offset, value, series, colour, other in ((-height / 2, planned, "planned", PLANNED, None),
                                                    (height / 2, measured, "measured", MEASURED, planned)):
            y = index + offset
            if value is None:
                axes.annotate(f"not {series}", (0, y), xytext=(4, 0), textcoords="offset points", va="center",
                              fontsize=8, color="dimgray", style="italic")
                continue
            bar = axes.barh(y, value / scale.size, height=height, color=colour)[0]
            bar.set_label(label)
            bar.set_gid(series)
            text = f"{series} {human_bytes(value)}"
            if other:
                text += f"  (measured / planned {value / other:.3f})"
            axes.annotate(text, (value / scale.size, y), xytext=(4, 0), textcoords="offset points", va="center",
                          fontsize=8)
    axes.set_yticks(range(len(rows)), [label for label, *_ in rows])
    axes.get_yticklabels()[0].set_fontweight("bold")
    axes.invert_yaxis()
    scale.apply(axes, "bytes of the rank's tensors" if result.get("device") == "cpu" else "bytes on the device")
    note = scale.off_scale_note(result["measured_peak_bytes"], "the measured peak")
    if note:
        figure.text(0.99, 0.0, note, ha="right", va="top", fontsize=8, style="italic")
    # the plan priced on this CPU where the dry run priced it (``dry_compute``), else the named profile's
    ratio, planned = result.get("compute_ratio"), result.get("planned_compute_s")
    where = result.get("compute_profile") if planned is not None else result.get("profile")
    planned = planned if planned is not None else result.get("planned_compute_s_on_profile", 0.0)
    compute = (f"compute per step: measured {result['measured_step_s'] * 1e3:.3g} ms, planned "
               f"{planned * 1e3:.3g} ms on {where}" + (f" (measured / planned {ratio:.3g})" if ratio else "") +
               "; communication absent (fake process group)")
    verdict = "fits" if result["fits"] else "DOES NOT FIT"
    title = (f"dry run: rank {result['rank']} of {result['world_size']} ({result['layout']}) on {result['device']}\n"
             f"peak measured {human_bytes(result['measured_peak_bytes'])}, planned "
             f"{human_bytes(result['planned_peak_bytes'])}: {verdict} the profile's {human_bytes(capacity)} per "
             f"rank\n{compute}")
    figure.suptitle(title, fontsize=10)
    return _finish(figure, plt, path, title, [axes])


def _percent(share: float) -> str:
    """A share as a percentage: whole from 10% up (95%, 136%), else with two significant figures (0.64%, 0.0012%)."""
    return f"{100 * share:.0f}%" if share >= 0.1 else f"{100 * share:.2g}%"


def write_dry_run_pictures(est: Estimate, result: dict[str, Any], folder: Path) -> list[Path]:
    """A dry run's pictures in ``folder``: the plan of its rank (``MEMORY_FILE``) and, beside it, what the rank
    measured against that plan (``DRY_RUN_FILE``)."""
    pictures = [draw_plan_memory(est, folder / MEMORY_FILE), draw_dry_run(result, folder / DRY_RUN_FILE)]
    return [picture.path for picture in pictures if picture is not None]


def _moment(name: str) -> str:
    """What a moment of the step is called in a picture."""
    return MOMENT_LABELS.get(name, name.replace("_", " "))


def _in_step_order(moments: dict[str, Any]) -> list[str]:
    """``moments``' names in the order a step reaches them (``MOMENT_LABELS``'), unknown ones last."""
    return sorted(moments, key=lambda name: list(MOMENT_LABELS).index(name) if name in MOMENT_LABELS else
                  len(MOMENT_LABELS))


def _bars(axes: Any, labels: list[str], values: list[float], size: float, limit: float, colours: list[str],
          texts: list[str], series: str, hatched: list[bool] | None = None) -> None:
    """One horizontal bar per row, top to bottom, in units of ``size`` on an axis ending at ``limit`` units, each
    with its value written at its end (inside it where the axis clips it)."""
    rows = range(len(labels))
    drawn = axes.barh(rows, [value / size for value in values], color=colours, height=0.62)
    for bar, label, value, text, hatch in zip(drawn, labels, values, texts, hatched or [False] * len(values),
                                              strict=True):
        bar.set_label(label)
        bar.set_gid(series)
        if hatch:
            bar.set_hatch("//")
            bar.set_alpha(0.55)
        centre = bar.get_y() + bar.get_height() / 2
        if value / size > limit:  # off the axis: the figure goes inside the bar's visible end
            axes.annotate(f"{text} >>", (limit, centre), xytext=(-4, 0), textcoords="offset points", va="center",
                          ha="right", fontsize=8, color="white", fontweight="bold")
        else:
            axes.annotate(text, (value / size, centre), xytext=(4, 0), textcoords="offset points", va="center",
                          fontsize=8)
    axes.set_yticks(list(rows), labels)
    axes.set_xlim(0, limit)
    if not axes.yaxis_inverted():  # the first row on top (axes that share y are inverted once)
        axes.invert_yaxis()
    axes.grid(axis="x", alpha=0.3)
    axes.set_axisbelow(True)


def _pyplot() -> Any:
    from disttrain.report.plots import pyplot

    return pyplot()


def _finish(figure: Any, plt: Any, path: Path, title: str, panels: list[Any]) -> Picture:
    """Read back what ``panels`` show, write the figure to ``path`` and free it."""
    from matplotlib.colors import to_hex
    from matplotlib.text import Text

    from disttrain.report.plots import save

    bars = []
    for axes in panels:
        left, right = axes.get_xlim()
        for patch in axes.patches:  # each bar carries its row's label and its series (``_bars``, ``draw_dry_run``)
            width = patch.get_width()
            bars.append(Bar(patch.get_label(), patch.get_gid() or "", float(width),
                            float(min(width, right - left) / (right - left)), to_hex(patch.get_facecolor())))
    texts = tuple(text.get_text() for text in figure.findobj(Text) if text.get_text())
    save(figure, plt, path)
    return Picture(path, title, tuple(bars), texts)
