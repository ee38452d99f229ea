"""Server-rendered SVG charts: a line chart (loss curves) and a bar chart (usage per day), no JavaScript.

The SVG is built from numbers only (labels are escaped by the template that places them), uses
presentation attributes rather than inline styles (the dashboard's CSP forbids those) and carries a
`<title>` so screen readers announce what it shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

WIDTH, HEIGHT, PAD = 640, 220, 40


@dataclass(frozen=True)
class Chart:
    """Markup ready for `|safe` in a template, and a one-line text summary for those who cannot see it."""

    svg: str
    summary: str


def _scale(values: Sequence[float]) -> tuple[float, float]:
    low, high = min(values), max(values)
    return (low, high) if high > low else (low - 1.0, high + 1.0)


def line_chart(points: Sequence[tuple[float, float]], *, title: str) -> Chart | None:
    """A polyline of (x, y) points, or None when there is nothing to draw."""
    if not points:
        return None
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    (x0, x1), (y0, y1) = _scale(xs), _scale(ys)

    def at(x: float, y: float) -> str:
        px = PAD + (x - x0) / (x1 - x0) * (WIDTH - 2 * PAD)
        py = HEIGHT - PAD - (y - y0) / (y1 - y0) * (HEIGHT - 2 * PAD)
        return f"{px:.1f},{py:.1f}"

    line = " ".join(at(x, y) for x, y in points)
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
           f'class="chart"><title>{escape(title)}</title>'
           f'{_axes(f"{y1:.4g}", f"{y0:.4g}", f"{x0:.0f}", f"{x1:.0f}")}'
           f'<polyline points="{line}" fill="none" stroke="#1f5fbf" stroke-width="2"/></svg>')
    summary = f"{len(points)} points; first {ys[0]:.4g}, last {ys[-1]:.4g}, min {min(ys):.4g}, max {max(ys):.4g}"
    return Chart(svg, summary)


def bar_chart(bars: Sequence[tuple[str, float]], *, title: str) -> Chart | None:
    """Vertical bars with their labels under them, or None when there is nothing to draw."""
    if not bars:
        return None
    top = max(v for _, v in bars) or 1.0
    slot = (WIDTH - 2 * PAD) / len(bars)
    parts = []
    for i, (label, value) in enumerate(bars):
        h = value / top * (HEIGHT - 2 * PAD)
        x = PAD + i * slot + slot * 0.15
        parts.append(f'<rect x="{x:.1f}" y="{HEIGHT - PAD - h:.1f}" width="{slot * 0.7:.1f}" height="{h:.1f}" '
                     f'fill="#1f5fbf"><title>{escape(label)}: {value:.0f}</title></rect>')
        if len(bars) <= 16:
            parts.append(f'<text x="{x + slot * 0.35:.1f}" y="{HEIGHT - PAD + 14}" font-size="10" '
                         f'text-anchor="middle" fill="#222">{escape(label[5:] if len(label) == 10 else label)}</text>')
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" class="chart">'
           f'<title>{escape(title)}</title>{_axes(f"{top:.4g}", "0", "", "")}{"".join(parts)}</svg>')
    summary = "; ".join(f"{label}: {value:.0f}" for label, value in bars[:31])
    return Chart(svg, summary)


def _axes(y_top: str, y_bottom: str, x_left: str, x_right: str) -> str:
    base = HEIGHT - PAD
    return (f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{base}" stroke="#555"/>'
            f'<line x1="{PAD}" y1="{base}" x2="{WIDTH - PAD}" y2="{base}" stroke="#555"/>'
            f'<text x="{PAD - 4}" y="{PAD + 4}" font-size="10" text-anchor="end" fill="#222">{escape(y_top)}</text>'
            f'<text x="{PAD - 4}" y="{base}" font-size="10" text-anchor="end" fill="#222">{escape(y_bottom)}</text>'
            f'<text x="{PAD}" y="{base + 28}" font-size="10" fill="#222">{escape(x_left)}</text>'
            f'<text x="{WIDTH - PAD}" y="{base + 28}" font-size="10" text-anchor="end" fill="#222">'
            f'{escape(x_right)}</text>')
