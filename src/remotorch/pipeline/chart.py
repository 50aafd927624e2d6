"""Pictures of a simulated schedule: a plain-text chart for the terminal, a PNG through matplotlib.

One row per worker, time across. In the text chart each action is written
where it starts (``F3``: forward of microbatch 3, ``B0``: backward of
microbatch 0; ``2F3`` when the worker holds several stages, so the stage is
named) and fills its columns to where it ends; idle time is ``.``. These
functions return text or write files; the command line prints.
"""

from __future__ import annotations

from pathlib import Path

from .schedules import Action
from .simulate import Timeline

__all__ = ["figures", "render", "write_png"]

_TICKS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


def render(timeline: Timeline, width: int | None = None) -> str:
    """The timeline as a text chart, at most ``width`` columns of time (``None``: as wide as it needs).

    Each action gets room for its label and a space when the width allows.
    In a chart squeezed to ``width``, an action too narrow for its label
    drops the stage (``F3``), then shows only its kind in every column it
    covers (``FF``, ``BBBB``), so the shape of the schedule stays visible.
    """
    labels = _labels(timeline)
    longest = max((len(label) for row in labels for label in row), default=2)
    shortest = min((sp.end - sp.start for row in timeline.spans for sp in row if sp.end > sp.start), default=1.0)
    scale = (longest + 1) / shortest  # columns per unit of time: the shortest action fits its label
    if width is not None and timeline.total * scale > width:
        fit = int(max(width, 1) * shortest / timeline.total)  # whole columns for the shortest action
        scale = fit / shortest if fit >= 1 else max(width, 1) / timeline.total
    narrowest = int(shortest * scale + 1e-9)
    columns = max(1, round(timeline.total * scale))
    name_width = len(f"w{timeline.workers - 1}") + 1
    lines = [" " * name_width + _axis(timeline.total, scale, columns)]
    for w, (row, row_labels) in enumerate(zip(timeline.spans, labels)):
        cells = ["."] * columns
        for sp, label in zip(row, row_labels):
            first = min(round(sp.start * scale), columns - 1)
            last = max(first + 1, round(sp.end * scale))
            cells[first:last] = _cell(label, sp.action, last - first, narrowest)
        lines.append((f"{'w' + str(w):<{name_width}}" + "".join(cells[:columns])).rstrip())
    return "\n".join(lines)


def _cell(label: str, action: Action, columns: int, narrowest: int) -> list[str]:
    """What an action shows in its ``columns``: its label, the label without the stage, or its kind letter.

    The form is the fullest one that the chart's narrowest action has room
    for (with a space after it), so all actions of a chart look alike.
    """
    for text in (label, f"{action.kind}{action.microbatch}"):
        if narrowest > len(text) and columns > len(text):
            return list(text.ljust(columns))
    return [action.kind] * columns


def _labels(timeline: Timeline) -> list[list[str]]:
    schedule = timeline.schedule
    several = [len(schedule.stages_of(w)) > 1 for w in range(schedule.workers)]
    return [[str(sp.action) if several[w] else f"{sp.action.kind}{sp.action.microbatch}" for sp in row]
            for w, row in enumerate(timeline.spans)]


def _axis(total: float, scale: float, columns: int) -> str:
    """Time marks above the chart, spaced at least 8 columns apart."""
    step = next((t for t in _TICKS if t * scale >= 8), _TICKS[-1])
    cells = [" "] * (columns + 8)
    t = 0
    while t <= total:
        mark = f"{t:g}"
        at = round(t * scale)
        if at + len(mark) <= len(cells):
            cells[at:at + len(mark)] = list(mark)
        t += step
    return "".join(cells).rstrip()


def figures(timeline: Timeline) -> str:
    """The timeline's figures in words: makespan, bubble fraction, peak activations per worker."""
    s, t = timeline.schedule, timeline
    costs = (f"forward {_costs(t.forward)}, backward {_costs(t.backward)}, comm {t.comm:g}")
    peaks = ", ".join(f"w{w} {p}" for w, p in enumerate(t.peak_activations))
    return "\n".join([
        f"{s.name}: {s.stages} stages on {s.workers} workers, {s.microbatches} microbatches ({costs})",
        f"makespan          {t.total:g}",
        f"bubble fraction   {t.bubble_fraction:.4f} ({100 * t.bubble_fraction:.1f}% of {s.workers} workers "
        f"x {t.total:g} idle)",
        f"peak activations  {peaks} (stage-microbatch pairs forwarded, not yet backwarded)",
    ])


def _costs(values: tuple[float, ...]) -> str:
    return f"{values[0]:g}" if len(set(values)) == 1 else "/".join(f"{v:g}" for v in values)


def write_png(timeline: Timeline, path: str | Path) -> None:
    """Draw the timeline as a PNG: a bar per action (forwards blue, backwards orange), labelled when room allows.

    Needs matplotlib (``pip install remotorch[profile]``); raises
    ``ImportError`` saying so when it is missing.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("writing a PNG needs matplotlib: pip install 'remotorch[profile]' "
                          "(or pip install matplotlib)") from exc
    s, labels = timeline.schedule, _labels(timeline)
    fig = Figure(figsize=(min(40.0, 3 + 0.25 * timeline.total), 1.2 + 0.5 * s.workers), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    label_all = sum(len(row) for row in timeline.spans) <= 600
    for w, row in enumerate(timeline.spans):
        bars = [(sp.start, sp.end - sp.start) for sp in row]
        colors = ["#3b82f6" if sp.action.kind == "F" else "#f59e0b" for sp in row]
        ax.broken_barh(bars, (w - 0.4, 0.8), facecolors=colors, edgecolor="white", linewidth=0.5)
        for sp, label in zip(row, labels[w]) if label_all else ():
            ax.text((sp.start + sp.end) / 2, w, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(s.workers), [f"worker {w}" for w in range(s.workers)])
    ax.invert_yaxis()
    ax.set_xlim(0, max(timeline.total, 1e-9))
    ax.set_xlabel("time (cost units)")
    ax.set_title(f"{s.name}: {s.stages} stages, {s.workers} workers, {s.microbatches} microbatches; "
                 f"bubble {100 * timeline.bubble_fraction:.1f}%")
    fig.tight_layout()
    fig.savefig(str(path), format="png")
