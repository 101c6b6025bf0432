"""A small dependency-free PNG line plot (numpy raster + zlib + struct): axes with ticks and tick
labels, lines with point markers, optional intervals (error bars), reference lines and a legend.
Text uses a built-in 5x7 bitmap font in capitals (digits, letters and a little punctuation).

    line_plot("verify.png", {"ctx 443": (widths, ms), "ctx 1596": (widths, ms, lo, hi)},
              x_label="rows", y_label="ms", title="verify time")

Used by ``adaspark profile --plot`` (time against rows, one line per context) and meant for any
other figure of the toolkit (e.g. a per-source ratio with intervals: ``connect=False``,
``x_ticks=[(0, "SRC A"), ...]``, ``hlines=[1.0]``).
"""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

# Distinct colours (the "tab10" palette), RGB.
PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
           (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]
BLACK, GREY, LIGHT, WHITE = (0, 0, 0), (110, 110, 110), (230, 230, 230), (255, 255, 255)

# 5x7 glyphs, one int per row (top first), bit 4 = leftmost column (HD44780 style).
FONT = {
    "0": (0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E), "1": (0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E),
    "2": (0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F), "3": (0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E),
    "4": (0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02), "5": (0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E),
    "6": (0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E), "7": (0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08),
    "8": (0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E), "9": (0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C),
    "A": (0x0E, 0x11, 0x11, 0x11, 0x1F, 0x11, 0x11), "B": (0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E),
    "C": (0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E), "D": (0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C),
    "E": (0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F), "F": (0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10),
    "G": (0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F), "H": (0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11),
    "I": (0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E), "J": (0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C),
    "K": (0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11), "L": (0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F),
    "M": (0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11), "N": (0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11),
    "O": (0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E), "P": (0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10),
    "Q": (0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D), "R": (0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11),
    "S": (0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E), "T": (0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04),
    "U": (0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E), "V": (0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04),
    "W": (0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A), "X": (0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11),
    "Y": (0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04), "Z": (0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F),
    " ": (0, 0, 0, 0, 0, 0, 0), ".": (0, 0, 0, 0, 0, 0x0C, 0x0C), ",": (0, 0, 0, 0, 0x0C, 0x04, 0x08),
    "-": (0, 0, 0, 0x1F, 0, 0, 0), "+": (0, 0x04, 0x04, 0x1F, 0x04, 0x04, 0), "=": (0, 0, 0x1F, 0, 0x1F, 0, 0),
    ":": (0, 0x0C, 0x0C, 0, 0x0C, 0x0C, 0), "(": (0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02),
    ")": (0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08), "/": (0, 0x01, 0x02, 0x04, 0x08, 0x10, 0),
    "%": (0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03), "_": (0, 0, 0, 0, 0, 0, 0x1F),
    "*": (0, 0x04, 0x15, 0x0E, 0x15, 0x04, 0), "<": (0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02),
    ">": (0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08), "?": (0x0E, 0x11, 0x01, 0x02, 0x04, 0, 0x04),
    "[": (0x0E, 0x08, 0x08, 0x08, 0x08, 0x08, 0x0E), "]": (0x0E, 0x02, 0x02, 0x02, 0x02, 0x02, 0x0E),
    "'": (0x04, 0x04, 0x08, 0, 0, 0, 0), "#": (0x0A, 0x0A, 0x1F, 0x0A, 0x1F, 0x0A, 0x0A),
}
GLYPH_W, GLYPH_H, ADVANCE = 5, 7, 6


def text_mask(text: str, scale: int = 1) -> np.ndarray:
    """A boolean (7*scale, 6*scale*len - scale) mask of ``text``; lower case is drawn in capitals,
    unknown characters as '?'."""
    text = text.upper()
    m = np.zeros((GLYPH_H, max(ADVANCE * len(text) - 1, 1)), dtype=bool)
    for i, ch in enumerate(text):
        rows = FONT.get(ch, FONT["?"])
        for r, bits in enumerate(rows):
            for col in range(GLYPH_W):
                if bits & (1 << (GLYPH_W - 1 - col)):
                    m[r, i * ADVANCE + col] = True
    return np.kron(m, np.ones((scale, scale), dtype=bool)) if scale > 1 else m


class Canvas:
    """An RGB raster, origin top left, with clipped drawing primitives."""

    def __init__(self, width: int, height: int, bg=WHITE):
        self.w, self.h = width, height
        self.px = np.empty((height, width, 3), dtype=np.uint8)
        self.px[:] = bg

    def rect(self, x0: int, y0: int, x1: int, y1: int, color) -> None:
        """Fill [x0, x1] x [y0, y1] (inclusive, any corner order)."""
        xa, xb = sorted((int(round(x0)), int(round(x1))))
        ya, yb = sorted((int(round(y0)), int(round(y1))))
        xa, ya = max(xa, 0), max(ya, 0)
        xb, yb = min(xb, self.w - 1), min(yb, self.h - 1)
        if xa <= xb and ya <= yb:
            self.px[ya : yb + 1, xa : xb + 1] = color

    def line(self, x0: float, y0: float, x1: float, y1: float, color, width: int = 1, dash: int = 0) -> None:
        """A line ``width`` pixels thick (square pen), dashed in ``dash``-pixel runs if dash > 0."""
        n = int(max(abs(x1 - x0), abs(y1 - y0)) * 2) + 1
        t = np.linspace(0.0, 1.0, n + 1)
        xs = np.rint(x0 + (x1 - x0) * t).astype(int)
        ys = np.rint(y0 + (y1 - y0) * t).astype(int)
        if dash > 0:
            along = t * math.hypot(x1 - x0, y1 - y0)
            keep = (along // dash).astype(int) % 2 == 0
            xs, ys = xs[keep], ys[keep]
        lo = -((width - 1) // 2)
        for dx in range(lo, lo + width):
            for dy in range(lo, lo + width):
                px, py = xs + dx, ys + dy
                ok = (px >= 0) & (px < self.w) & (py >= 0) & (py < self.h)
                self.px[py[ok], px[ok]] = color

    def blit(self, mask: np.ndarray, x: int, y: int, color) -> None:
        """Paint ``mask``'s true pixels with its top-left corner at (x, y)."""
        h, w = mask.shape
        x, y = int(round(x)), int(round(y))
        xa, ya = max(x, 0), max(y, 0)
        xb, yb = min(x + w, self.w), min(y + h, self.h)
        if xa >= xb or ya >= yb:
            return
        sub = mask[ya - y : yb - y, xa - x : xb - x]
        region = self.px[ya:yb, xa:xb]
        region[sub] = color

    def text(self, s: str, x: float, y: float, color=BLACK, scale: int = 1, anchor: str = "lt",
             vertical: bool = False) -> tuple[int, int]:
        """Draw ``s`` so that (x, y) is its anchor: first letter l/c/r (horizontal), second t/m/b
        (vertical). ``vertical`` rotates it a quarter turn anticlockwise (reads bottom to top).
        Returns the drawn (width, height)."""
        m = text_mask(s, scale)
        if vertical:
            m = np.rot90(m)
        h, w = m.shape
        ox = {"l": 0, "c": w / 2, "r": w}[anchor[0]]
        oy = {"t": 0, "m": h / 2, "b": h}[anchor[1]]
        self.blit(m, x - ox, y - oy, color)
        return w, h

    def png_bytes(self) -> bytes:
        return encode_png(self.px)


def encode_png(rgb: np.ndarray) -> bytes:
    """PNG bytes of an (H, W, 3) uint8 array: 8-bit truecolour, no interlace, filter 0 rows."""
    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    h, w, ch = rgb.shape
    if ch != 3:
        raise ValueError("expected an (H, W, 3) array")
    raw = np.concatenate([np.zeros((h, 1), dtype=np.uint8), rgb.reshape(h, w * 3)], axis=1).tobytes()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def nice_ticks(lo: float, hi: float, target: int = 6, integer: bool = False) -> list[float]:
    """Round tick values (1, 2, 2.5 or 5 times a power of ten apart) covering [lo, hi]; with
    ``integer`` the step is a whole number (an axis of counts, e.g. rows)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError("axis limits must be finite")
    if hi <= lo:
        hi = lo + (abs(lo) if lo else 1.0)
    raw = (hi - lo) / max(target - 1, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    if integer:
        step = 1 if step < 1 else 2 if step == 2.5 else step
    first = math.floor(lo / step + 1e-9) * step
    ticks, t = [], first
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    if ticks[-1] < hi - step * 1e-9:
        ticks.append(ticks[-1] + step)
    return ticks


def tick_label(v: float, step: float) -> str:
    """A tick value with as many decimals as the step needs (0.25 -> 2, 5 -> 0)."""
    d = 0
    while d < 6 and abs(round(step, d) - step) > 1e-9 * max(abs(step), 1e-12):
        d += 1
    return f"{v:.{d}f}"


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


def render(series: dict, x_label: str = "", y_label: str = "", title: str = "", size=(800, 500),
           y_zero: bool = False, connect: bool = True, x_ticks: Optional[Sequence[tuple[float, str]]] = None,
           hlines: Sequence[float] = (), legend: str = "auto") -> Canvas:
    """The plot on a canvas (see ``line_plot``)."""
    data = {name: _unpack(spec) for name, spec in series.items()}
    W, H = size
    cv = Canvas(W, H)
    allx = [x for xs, *_ in data.values() for x in xs] + [t for t, _ in (x_ticks or [])]
    ally = [y for _, ys, lo, hi in data.values() for y in ys + (lo or []) + (hi or [])] + list(hlines)
    ally = [y for y in ally if math.isfinite(y)]
    if not allx or not ally:
        raise ValueError("nothing to plot")
    ylo, yhi = min(ally), max(ally)
    if y_zero:
        ylo, yhi = min(ylo, 0.0), max(yhi, 0.0)
    pad = (yhi - ylo) * 0.05 or (abs(yhi) * 0.1 or 1.0)
    yt = nice_ticks(ylo if (y_zero and ylo == 0) else ylo - pad, yhi + pad)
    ylo, yhi = yt[0], yt[-1]
    if x_ticks is not None:
        xt = [t for t, _ in x_ticks]
        xlabels = [lab for _, lab in x_ticks]
        xlo, xhi = min(allx), max(allx)
        # Categories: half a category's spacing beyond the outermost ones.
        span = xhi - xlo
        pad = max(span * 0.05, 0.5 * span / max(len(xt) - 1, 1)) if span else 0.5
        xlo, xhi = xlo - pad, xhi + pad
    else:
        # The x axis spans the data (plus a margin); the round ticks that fall inside it are drawn.
        xlo, xhi = min(allx), max(allx)
        span = (xhi - xlo) or (abs(xhi) or 1.0)
        xlo, xhi = xlo - span * 0.03, xhi + span * 0.03
        xt = nice_ticks(xlo, xhi, 8, integer=all(float(x).is_integer() for x in allx))
        xlabels = [tick_label(t, xt[1] - xt[0] if len(xt) > 1 else 1) for t in xt]
    ystep = yt[1] - yt[0] if len(yt) > 1 else 1
    ylabels = [tick_label(t, ystep) for t in yt]

    # Plot area: leave room for tick labels, axis labels and the title.
    left = 14 + (GLYPH_H + 6 if y_label else 0) + max(len(s) for s in ylabels) * ADVANCE + 8
    top = 14 + (GLYPH_H * 2 + 10 if title else 0)
    bottom = H - (14 + GLYPH_H + 8 + (GLYPH_H + 8 if x_label else 0))
    right = W - 20
    if right - left < 50 or bottom - top < 50:
        raise ValueError("the image is too small for a plot")

    def X(x: float) -> float:
        return left + (x - xlo) / (xhi - xlo) * (right - left)

    def Y(y: float) -> float:
        return bottom - (y - ylo) / (yhi - ylo) * (bottom - top)

    # Grid, reference lines, axes, ticks, labels.
    for t in yt:
        cv.line(left, Y(t), right, Y(t), LIGHT)
    for t in xt:
        if xlo <= t <= xhi:
            cv.line(X(t), top, X(t), bottom, LIGHT)
    for h in hlines:
        cv.line(left, Y(h), right, Y(h), GREY, dash=4)
    cv.line(left, top, left, bottom, BLACK)
    cv.line(left, bottom, right, bottom, BLACK)
    for t, lab in zip(yt, ylabels):
        cv.line(left - 5, Y(t), left, Y(t), BLACK)
        cv.text(lab, left - 8, Y(t), anchor="rm")
    for t, lab in zip(xt, xlabels):
        if xlo <= t <= xhi:
            cv.line(X(t), bottom, X(t), bottom + 5, BLACK)
            cv.text(lab, X(t), bottom + 9, anchor="ct")
    if title:
        cv.text(title, (left + right) / 2, 12, scale=2, anchor="ct")
    if x_label:
        cv.text(x_label, (left + right) / 2, H - 10, anchor="cb")
    if y_label:
        cv.text(y_label, 10, (top + bottom) / 2, anchor="lm", vertical=True)

    # Series: intervals, lines, markers.
    for i, (name, (xs, ys, lo, hi)) in enumerate(data.items()):
        color = PALETTE[i % len(PALETTE)]
        pts = [(X(x), Y(y)) for x, y in zip(xs, ys) if math.isfinite(y)]
        if lo is not None:
            for x, a, b in zip(xs, lo, hi):
                if math.isfinite(a) and math.isfinite(b):
                    cv.line(X(x), Y(a), X(x), Y(b), color)
                    cv.line(X(x) - 3, Y(a), X(x) + 3, Y(a), color)
                    cv.line(X(x) - 3, Y(b), X(x) + 3, Y(b), color)
        if connect:
            for (xa, ya), (xb, yb) in zip(pts, pts[1:]):
                cv.line(xa, ya, xb, yb, color, width=2)
        for x, y in pts:
            cv.rect(x - 2, y - 2, x + 2, y + 2, color)

    # Legend: a framed box, top left or top right of the plot area, whichever covers fewer points.
    if data and legend != "none":
        lw = 30 + max(len(n) for n in data) * ADVANCE + 10
        lh = 8 + len(data) * (GLYPH_H + 7)
        if legend == "auto":
            def covered(x0):
                return sum(1 for xs, ys, *_ in data.values() for x, y in zip(xs, ys)
                           if x0 <= X(x) <= x0 + lw and top + 6 <= Y(y) <= top + 6 + lh)
            x0 = left + 8 if covered(left + 8) <= covered(right - 8 - lw) else right - 8 - lw
        else:
            x0 = left + 8 if legend == "left" else right - 8 - lw
        y0 = top + 6
        cv.rect(x0, y0, x0 + lw, y0 + lh, WHITE)
        cv.line(x0, y0, x0 + lw, y0, GREY)
        cv.line(x0, y0 + lh, x0 + lw, y0 + lh, GREY)
        cv.line(x0, y0, x0, y0 + lh, GREY)
        cv.line(x0 + lw, y0, x0 + lw, y0 + lh, GREY)
        for i, name in enumerate(data):
            color = PALETTE[i % len(PALETTE)]
            yy = y0 + 8 + i * (GLYPH_H + 7) + GLYPH_H / 2
            if connect:
                cv.line(x0 + 6, yy, x0 + 24, yy, color, width=2)
            cv.rect(x0 + 13, yy - 2, x0 + 17, yy + 2, color)
            cv.text(name, x0 + 30, yy, anchor="lm")
    return cv


def line_plot(path, series: dict, x_label: str = "", y_label: str = "", title: str = "", *, size=(800, 500),
              y_zero: bool = False, connect: bool = True, x_ticks: Optional[Sequence[tuple[float, str]]] = None,
              hlines: Sequence[float] = (), legend: str = "auto") -> Path:
    """Write a PNG line plot to ``path`` and return the path.

    ``series`` maps a legend label to ``(xs, ys)`` or ``(xs, ys, lo, hi)`` (an interval drawn as an
    error bar at each point); one colour per series, in insertion order (up to 10 distinct).
    ``y_zero`` puts 0 on the y axis; ``connect=False`` draws points (and intervals) only;
    ``x_ticks`` replaces the x ticks with (value, label) pairs (categories); ``hlines`` draws
    dashed reference lines (e.g. a ratio of 1); ``legend`` is auto, left, right or none.
    Text is drawn in capitals by a 5x7 bitmap font.
    """
    from adaspark_core.files import replace

    cv = render(series, x_label, y_label, title, size, y_zero, connect, x_ticks, hlines, legend)
    p = Path(path)
    replace(p, cv.png_bytes())  # a user-named file: never over a device or a FIFO (files.py)
    return p
