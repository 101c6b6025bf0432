"""PNG line plots drawn by matplotlib, an optional extra (``pip install 'adaspark[plot]'``).

    line_plot("verify.png", {"ctx 443": (widths, ms), "ctx 1596": (widths, ms, lo, hi)},
              x_label="rows", y_label="ms", title="verify time")

Used by ``adaspark profile --plot`` (time against rows, one line per context) and by ``adaspark
compare --out`` (each arm's ratio per source with intervals: ``connect=False``,
``x_ticks=[(0, "src a"), ...]``, ``hlines=[1.0]``).

matplotlib is imported only when a plot is drawn, so the commands load without it; a caller that
would plot checks ``missing()`` or ``require_matplotlib()`` first, before its long work. The figure
is drawn on a ``Figure`` with an Agg canvas, never through pyplot: no display, no global state.
"""

from __future__ import annotations

import importlib
import io
import math
from pathlib import Path
from typing import Optional, Sequence

from adaspark_core.base.errors import InputError
from adaspark_core.base.files import replace

INSTALL = "pip install 'adaspark[plot]'"
DPI = 100  # ``size`` is in pixels: figsize = size / DPI
LEGEND = {"auto": "best", "left": "upper left", "right": "upper right", "none": None}


def missing() -> str:
    """'' when matplotlib can be imported; else a few words saying it is not, with the fix."""
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        return f"matplotlib is not installed ({INSTALL})"
    return ""


def require_matplotlib(option: str = "--plot") -> None:
    """InputError in one line when matplotlib is missing, naming the ``option`` that needs it."""
    if missing():
        raise InputError(f"{option} needs matplotlib: {INSTALL}")


def _unpack(spec) -> tuple[list[float], list[float], Optional[list[float]], Optional[list[float]]]:
    if len(spec) == 2:
        xs, ys = spec
        lo = hi = None
    elif len(spec) == 4:
        xs, ys, lo, hi = spec
    else:
        raise ValueError("a series is (xs, ys) or (xs, ys, lo, hi)")
    xs, ys = [float(x) for x in xs], [float(y) for y in ys]
    if len(xs) != len(ys):
        raise ValueError("a series' xs and ys differ in length")
    if lo is not None:
        lo, hi = [float(v) for v in lo], [float(v) for v in hi]
        if not len(lo) == len(hi) == len(xs):
            raise ValueError("a series' intervals must match its points")
    return xs, ys, lo, hi


def line_plot(path, series: dict, x_label: str = "", y_label: str = "", title: str = "", *, size=(800, 500),
              y_zero: bool = False, connect: bool = True, x_ticks: Optional[Sequence[tuple[float, str]]] = None,
              hlines: Sequence[float] = (), legend: str = "auto") -> Path:
    """Write a PNG line plot to ``path`` and return the path.

    ``series`` maps a legend label to ``(xs, ys)`` or ``(xs, ys, lo, hi)`` (an interval drawn as an
    error bar at each point); one colour per series, in insertion order (up to 10 distinct).
    ``size`` is (width, height) in pixels; ``y_zero`` puts 0 on the y axis; ``connect=False``
    draws points (and intervals) only; ``x_ticks`` replaces the x ticks with (value, label) pairs
    (categories); ``hlines`` draws dashed reference lines (e.g. a ratio of 1); ``legend`` is auto,
    left, right or none. ValueError for malformed series; InputError without matplotlib.
    """
    data = {name: _unpack(spec) for name, spec in series.items()}
    if legend not in LEGEND:
        raise ValueError(f"legend is one of {', '.join(LEGEND)}, got {legend!r}")
    finite = [y for _, ys, lo, hi in data.values() for y in ys + (lo or []) + (hi or []) if math.isfinite(y)]
    if not finite:
        raise ValueError("nothing to plot")
    require_matplotlib("a plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(size[0] / DPI, size[1] / DPI), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)  # rasterizes in memory: never a display
    ax = fig.add_subplot()
    ax.grid(True, color="0.9", zorder=0)
    for h in hlines:
        ax.axhline(h, color="0.45", linestyle="--", linewidth=1)
    for i, (name, (xs, ys, lo, hi)) in enumerate(data.items()):
        color = f"C{i % 10}"
        if lo is not None:
            # vlines, not errorbar: errorbar wants lo <= y <= hi, which a bootstrap interval
            # need not honour.
            ax.vlines(xs, lo, hi, color=color, linewidth=1)
            ax.plot(xs + xs, lo + hi, "_", color=color, markersize=7)
        ax.plot(xs, ys, "o-" if connect else "o", color=color, markersize=4, linewidth=2, label=name)
    if x_ticks is not None:
        at = [t for t, _ in x_ticks]
        ax.set_xticks(at, [lab for _, lab in x_ticks])
        # Categories: half a category's spacing beyond the outermost ones.
        allx = at + [x for xs, *_ in data.values() for x in xs]
        span = max(allx) - min(allx)
        pad = max(span * 0.05, 0.5 * span / max(len(at) - 1, 1)) if span else 0.5
        ax.set_xlim(min(allx) - pad, max(allx) + pad)
    elif all(x.is_integer() for xs, *_ in data.values() for x in xs):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # counts (rows): no 2.5-row tick
    if y_zero:
        lo_, hi_ = ax.get_ylim()
        ax.set_ylim(min(lo_, 0.0), max(hi_, 0.0))
    ax.set(xlabel=x_label, ylabel=y_label, title=title)
    if LEGEND[legend] and data:
        ax.legend(loc=LEGEND[legend], framealpha=0.9)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    p = Path(path)
    replace(p, buf.getvalue())  # a user-named file: never over a device or a FIFO (files.py)
    return p
