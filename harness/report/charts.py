"""Inline SVG charts for the HTML reports: small, dependency-free, no scripts.

- `margin_chart`: the reference's top-1 − top-2 logit margin over positions (log scale), with the
  first divergence and the calibrated noise floor marked;
- `bar_chart`: horizontal bars (tokens/s, acceptance, speed-up), with an optional reference line;
- `position_chart`: acceptance per draft position, the baseline's beside this run's.
"""

import math
from html import escape

from markupsafe import Markup

WIDTH = 640


def _f(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".")


def margin_chart(margins: list[float | None], index: int | None, floor: float | None, height: int = 150) -> Markup:
    """The margins (None = not logged at that position) as a line on a log scale; a red line at the
    divergence `index`, a dashed orange line at the noise `floor`."""
    values = [m for m in margins if m is not None and m > 0]
    if not values:
        return Markup("")
    lo = 10 ** math.floor(math.log10(min(min(values), floor or min(values), 1e-2) / 2))
    hi = 10 ** math.ceil(math.log10(max(max(values), floor or 0) * 1.2))
    left, right, top, bottom = 44, 8, 8, 22
    n = max(len(margins), (index or 0) + 1, 2)
    x = lambda i: left + (WIDTH - left - right) * i / (n - 1)  # noqa: E731

    def y(v):
        return top + (height - top - bottom) * (
            1
            - (math.log10(max(v, lo)) - math.log10(lo))  # noqa: E731
            / (math.log10(hi) - math.log10(lo))
        )

    parts = [
        f'<svg class="chart" role="img" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" '
        f'xmlns="http://www.w3.org/2000/svg"><title>reference top-1 minus top-2 margin per position</title>'
    ]
    for e in range(round(math.log10(lo)), round(math.log10(hi)) + 1):
        yy = _f(y(10**e))
        parts.append(
            f'<line x1="{left}" x2="{WIDTH - right}" y1="{yy}" y2="{yy}" class="grid"/>'
            f'<text x="{left - 4}" y="{yy}" class="tick" text-anchor="end" dy="3">1e{e}</text>'
        )
    step = next(s for s in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10**9) if n / s <= 10)
    for i in range(0, n, step):
        parts.append(f'<text x="{_f(x(i))}" y="{height - 6}" class="tick" text-anchor="middle">{i}</text>')
    path, pen = [], "M"
    for i, m in enumerate(margins):
        if m is None:
            pen = "M"
            continue
        path.append(f"{pen}{_f(x(i))} {_f(y(m))}")
        pen = "L"
    parts.append(f'<path d="{" ".join(path)}" class="line"/>')
    if floor:
        yy = _f(y(floor))
        parts.append(
            f'<line x1="{left}" x2="{WIDTH - right}" y1="{yy}" y2="{yy}" class="floor"/>'
            f'<text x="{WIDTH - right}" y="{yy}" dy="-3" class="tick floor-label" text-anchor="end">'
            f"noise floor {floor:.3g}</text>"
        )
    if index is not None:
        xx = _f(x(index))
        parts.append(
            f'<line x1="{xx}" x2="{xx}" y1="{top}" y2="{height - bottom}" class="divergence"/>'
            f'<text x="{xx}" y="{top + 9}" dx="3" class="tick div-label">divergence @ {index}</text>'
        )
        if index < len(margins) and margins[index] is not None:
            parts.append(f'<circle cx="{xx}" cy="{_f(y(margins[index]))}" r="3.5" class="divergence-dot"/>')
    parts.append("</svg>")
    return Markup("".join(parts))


def bar_chart(
    rows: list[tuple[str, float, str]], ref: float | None = None, label_width: int = 300, bar_class: str = "bar"
) -> Markup:
    """One horizontal bar per (label, value, text shown after the bar); `ref` draws a vertical line
    (1.0 for speed-ups). A row whose value is worse than `ref` gets the class `worse`."""
    if not rows:
        return Markup("")
    row_h, top = 18, 4
    height = top + row_h * len(rows) + 4
    hi = max([v for _, v, _ in rows] + [ref or 0]) or 1.0
    span = WIDTH - label_width - 70
    parts = [
        f'<svg class="chart" role="img" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" '
        f'xmlns="http://www.w3.org/2000/svg">'
    ]
    for i, (label, value, text) in enumerate(rows):
        yy = top + i * row_h
        w = span * max(value, 0) / hi
        cls = bar_class + (" worse" if ref is not None and value < ref else "")
        parts.append(
            f'<text x="{label_width - 6}" y="{yy + 12}" class="tick" text-anchor="end">{escape(label)}</text>'
            f'<rect x="{label_width}" y="{yy + 2}" width="{_f(w)}" height="{row_h - 5}" class="{cls}"/>'
            f'<text x="{_f(label_width + w + 4)}" y="{yy + 12}" class="tick">{escape(text)}</text>'
        )
    if ref is not None:
        xx = _f(label_width + span * ref / hi)
        parts.append(f'<line x1="{xx}" x2="{xx}" y1="0" y2="{height}" class="ref"/>')
    parts.append("</svg>")
    return Markup("".join(parts))


def position_chart(before: list[float] | None, after: list[float], height: int = 110) -> Markup:
    """Per draft position, the share of drafts whose token there was accepted: the baseline's bar (grey)
    beside this run's (class `worse` where it is lower)."""
    n = max(len(before or []), len(after))
    if not n:
        return Markup("")
    left, bottom, top = 36, 18, 6
    slot = (WIDTH - left - 8) / n
    y = lambda v: top + (height - top - bottom) * (1 - v)  # noqa: E731
    parts = [
        f'<svg class="chart" role="img" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" '
        f'xmlns="http://www.w3.org/2000/svg"><title>acceptance per draft position: baseline, this run</title>'
    ]
    for v in (0.0, 0.5, 1.0):
        parts.append(
            f'<line x1="{left}" x2="{WIDTH - 8}" y1="{_f(y(v))}" y2="{_f(y(v))}" class="grid"/>'
            f'<text x="{left - 4}" y="{_f(y(v))}" class="tick" text-anchor="end" dy="3">{int(100 * v)} %</text>'
        )
    for k in range(n):
        x0 = left + k * slot
        was = (before or [])[k] if k < len(before or []) else None
        now = after[k] if k < len(after) else 0.0
        w = slot * 0.38
        if was is not None:
            parts.append(
                f'<rect x="{_f(x0 + slot * 0.1)}" y="{_f(y(was))}" width="{_f(w)}" '
                f'height="{_f(y(0) - y(was))}" class="bar baseline"><title>baseline {100 * was:.0f} %</title></rect>'
            )
        cls = "bar accept" + (" worse" if was is not None and now < was else "")
        parts.append(
            f'<rect x="{_f(x0 + slot * 0.1 + w)}" y="{_f(y(now))}" width="{_f(w)}" height="{_f(y(0) - y(now))}" '
            f'class="{cls}"><title>this run {100 * now:.0f} %</title></rect>'
            f'<text x="{_f(x0 + slot / 2)}" y="{height - 5}" class="tick" text-anchor="middle">{k + 1}</text>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))
