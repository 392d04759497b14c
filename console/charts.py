"""Charts as server-made SVG: no JavaScript, no library. Each chart has a table of the same
data (``table``), so the numbers are readable without the picture.

Every text drawn (title, labels, series names: tenant-chosen model and key names) is escaped;
values that are None, NaN or infinite are missing (a gap in a line, no bar).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

# A fixed palette (Tableau 10): series keep their colour by position.
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
           "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac")
WIDTH = 640
HEIGHT = 240
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 56, 12, 28, 28
MAX_X_LABELS = 8
MAX_NAME_CHARS = 28
CHAR_WIDTH_PX = 6.5  # an estimate for 11px system-ui text: legends wrap by it
# XML 1.0 refuses these even as references: a hostile name must not break the document.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff\ud800-\udfff]")

Number = float | int | None
Series = Mapping[str, Sequence[Number]]


def _text(value: object, limit: int | None = None) -> str:
    """``value`` as escaped text fit for SVG and HTML (shortened to ``limit`` characters)."""
    text = _NOT_XML.sub("\ufffd", str(value))
    if limit is not None and len(text) > limit:
        text = text[: limit - 1] + "…"
    return escape(text)


def _clean(value: Number) -> float | None:
    """A finite float, or None for what is missing (None, NaN, inf, not a number)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def human(value: float, unit: str = "") -> str:
    """A short number for an axis or a hover: 950, 1.2k, 3.4M, 0.25 (then ``unit``)."""
    if value == 0:
        return f"0{unit}"
    sign = "-" if value < 0 else ""
    magnitude = abs(value)
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if magnitude >= scale * 0.9995:
            text = f"{magnitude / scale:.1f}".removesuffix(".0")
            return f"{sign}{text}{suffix}{unit}"
    if magnitude < 1:
        text = f"{magnitude:.3g}"
    else:
        text = f"{magnitude:.2f}".rstrip("0").rstrip(".")
    return f"{sign}{text}{unit}"


def exact(value: Number, unit: str = "") -> str:
    """A number as a table shows it: integers with separators, others to 3 decimals."""
    number = _clean(value)
    if number is None:
        return "–"
    if number == int(number) and abs(number) < 1e15:
        return f"{int(number):,}{unit}"
    return f"{number:,.3f}".rstrip("0").rstrip(".") + unit


def nice_ticks(low: float, high: float, count: int = 4) -> list[float]:
    """About ``count`` round ticks (steps of 1, 2, 2.5 or 5 × 10ⁿ) covering low..high."""
    if high <= low:
        high = low + (abs(low) or 1.0)
    raw = (high - low) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(s * power for s in (1, 2, 2.5, 5, 10) if s * power >= raw)
    first = math.floor(low / step + 1e-9) * step
    last = math.ceil(high / step - 1e-9) * step
    ticks, tick = [], first
    while tick <= last + step / 2:
        ticks.append(round(tick, 10) + 0.0)  # + 0.0: never "-0"
        tick += step
    return ticks


def _columns(labels: Sequence[object], series: Series) -> dict[str, list[float | None]]:
    """Each series cleaned and cut or padded to the labels' length."""
    size = len(labels)
    return {str(name): [_clean(v) for v in list(values)[:size]] + [None] * (size - len(values))
            for name, values in series.items()}


def _has_data(columns: Mapping[str, list[float | None]]) -> bool:
    return any(v is not None for values in columns.values() for v in values)


class _Frame:
    """The plot area of one chart: its y scale, axes and x labels."""

    def __init__(self, labels: Sequence[object], low: float, high: float, height: int,
                 unit: str):
        self.labels = [str(label) for label in labels]
        self.ticks = nice_ticks(min(low, 0.0), max(high, 0.0))
        self.low, self.high = self.ticks[0], self.ticks[-1]
        self.left, self.top = MARGIN_LEFT, MARGIN_TOP
        self.right = WIDTH - MARGIN_RIGHT
        self.bottom = height - MARGIN_BOTTOM
        self.unit = unit

    def y(self, value: float) -> float:
        share = (value - self.low) / (self.high - self.low)
        return round(self.bottom - share * (self.bottom - self.top), 2)

    def band(self) -> float:
        return (self.right - self.left) / max(len(self.labels), 1)

    def x(self, index: int) -> float:
        """The centre of the label's band."""
        return round(self.left + self.band() * (index + 0.5), 2)

    def axes(self) -> list[str]:
        parts = []
        for tick in self.ticks:
            y = self.y(tick)
            parts.append(f'<line class="grid" x1="{self.left}" x2="{self.right}" y1="{y}" '
                         f'y2="{y}" stroke="#e3e6ec"/>')
            parts.append(f'<text x="{self.left - 6}" y="{y + 4}" text-anchor="end">'
                         f'{_text(human(tick, self.unit))}</text>')
        every = max(1, math.ceil(len(self.labels) / MAX_X_LABELS))
        for index in range(0, len(self.labels), every):
            parts.append(f'<text x="{self.x(index)}" y="{self.bottom + 16}" '
                         f'text-anchor="middle">{_text(self.labels[index], 16)}</text>')
        parts.append(f'<line x1="{self.left}" x2="{self.right}" y1="{self.y(0)}" '
                     f'y2="{self.y(0)}" stroke="#6b7385"/>')
        return parts


def _legend(names: Sequence[str], top: float) -> tuple[list[str], float]:
    """The legend's items, wrapped in rows under the plot; and the height it takes."""
    parts, x, y = [], float(MARGIN_LEFT), top
    for index, name in enumerate(names):
        shown = _text(name, MAX_NAME_CHARS)
        width = 18 + min(len(name), MAX_NAME_CHARS) * CHAR_WIDTH_PX + 14
        if x + width > WIDTH - MARGIN_RIGHT and x > MARGIN_LEFT:
            x, y = float(MARGIN_LEFT), y + 16
        parts.append(f'<g class="legend-item"><title>{_text(name)}</title>'
                     f'<rect x="{x:.1f}" y="{y - 9}" width="10" height="10" '
                     f'fill="{PALETTE[index % len(PALETTE)]}"/>'
                     f'<text x="{x + 14:.1f}" y="{y}">{shown}</text></g>')
        x += width
    return parts, (y - top + 16) if names else 0.0


def _svg(title: str, description: str, height: float, body: Iterable[str]) -> SafeString:
    label = _text(f"{title}: {description}")
    return mark_safe(
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" role="img" '
        f'aria-label="{label}" viewBox="0 0 {WIDTH} {height:.0f}" width="100%" '
        f'font-family="system-ui, sans-serif" font-size="11" fill="#1d2433">'
        f'<title>{label}</title>'
        f'<text class="chart-title" x="{MARGIN_LEFT}" y="16" font-size="13" '
        f'font-weight="600">{_text(title)}</text>'
        + "".join(body) + "</svg>")


def _no_data(title: str, height: int) -> SafeString:
    return _svg(title, "no data", height, [
        f'<text x="{WIDTH / 2}" y="{height / 2}" text-anchor="middle" fill="#6b7385">'
        f'No data</text>'])


def line_chart(labels: Sequence[object], series: Series, *, title: str, unit: str = "",
               height: int = HEIGHT) -> SafeString:
    """A line per series over the labels (a gap where a value is missing); each point has
    a hover title. Empty data gives a "No data" chart."""
    columns = _columns(labels, series)
    if not labels or not _has_data(columns):
        return _no_data(title, height)
    values = [v for column in columns.values() for v in column if v is not None]
    frame = _Frame(labels, min(values), max(values), height, unit)
    body = frame.axes()
    for index, (name, column) in enumerate(columns.items()):
        colour = PALETTE[index % len(PALETTE)]
        run: list[str] = []
        for position, value in enumerate([*column, None]):
            if value is not None:
                run.append(f"{frame.x(position)},{frame.y(value)}")
            elif run:
                if len(run) > 1:
                    body.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" '
                                f'points="{" ".join(run)}"/>')
                run = []
        for position, value in enumerate(column):
            if value is not None:
                body.append(
                    f'<circle cx="{frame.x(position)}" cy="{frame.y(value)}" r="2.5" '
                    f'fill="{colour}"><title>{_text(frame.labels[position])} · {_text(name)}: '
                    f'{_text(exact(value, unit))}</title></circle>')
    legend, legend_height = _legend(list(columns), frame.bottom + 34)
    description = f"line chart of {len(columns)} series over {len(labels)} points"
    return _svg(title, description, height + legend_height + 8, body + legend)


def bar_chart(labels: Sequence[object], series: Series, *, stacked: bool = True, title: str,
              unit: str = "", height: int = HEIGHT) -> SafeString:
    """Bars per label: stacked (positive values up, negative down) or side by side; each
    bar has a hover title. Empty data gives a "No data" chart."""
    columns = _columns(labels, series)
    if not labels or not _has_data(columns):
        return _no_data(title, height)
    if stacked:
        ups = [sum(c[i] for c in columns.values() if c[i] and c[i] > 0)
               for i in range(len(labels))]
        downs = [sum(c[i] for c in columns.values() if c[i] and c[i] < 0)
                 for i in range(len(labels))]
        low, high = min(downs), max(ups)
    else:
        values = [v for column in columns.values() for v in column if v is not None]
        low, high = min(values), max(values)
    frame = _Frame(labels, low, high, height, unit)
    body = frame.axes()
    band = frame.band()
    width = band * 0.8 if stacked else band * 0.8 / len(columns)
    up_base = [0.0] * len(labels)
    down_base = [0.0] * len(labels)
    for index, (name, column) in enumerate(columns.items()):
        colour = PALETTE[index % len(PALETTE)]
        for position, value in enumerate(column):
            if not value:
                continue
            if stacked:
                base = up_base if value > 0 else down_base
                start, end = base[position], base[position] + value
                base[position] = end
                x = frame.left + band * position + band * 0.1
            else:
                start, end = 0.0, value
                x = frame.left + band * position + band * 0.1 + width * index
            top, bottom = frame.y(max(start, end)), frame.y(min(start, end))
            body.append(
                f'<rect x="{x:.2f}" y="{top}" width="{width:.2f}" '
                f'height="{max(bottom - top, 0.5):.2f}" fill="{colour}"><title>'
                f'{_text(frame.labels[position])} · {_text(name)}: {_text(exact(value, unit))}'
                f'</title></rect>')
    legend, legend_height = _legend(list(columns), frame.bottom + 34)
    kind = "stacked bar chart" if stacked else "bar chart"
    description = f"{kind} of {len(columns)} series over {len(labels)} points"
    return _svg(title, description, height + legend_height + 8, body + legend)


def table_rows(labels: Sequence[object], series: Series, unit: str = ""
               ) -> tuple[list[str], list[list[str]]]:
    """The chart's data for a template: the header (label, then each series) and one row
    per label, numbers formatted (not escaped: the template escapes them)."""
    columns = _columns(labels, series)
    header = ["", *columns]
    rows = [[str(label), *(exact(column[i], unit) for column in columns.values())]
            for i, label in enumerate(labels)]
    return header, rows


def table(labels: Sequence[object], series: Series, *, unit: str = "",
          caption: str = "") -> SafeString:
    """The chart's data as an HTML table: a row per label, a column per series."""
    header, rows = table_rows(labels, series, unit)
    parts = ['<table class="chart-data">']
    if caption:
        parts.append(f"<caption>{_text(caption)}</caption>")
    parts.append('<thead><tr><th scope="col"></th>' + "".join(
        f'<th scope="col" class="num">{_text(name)}</th>' for name in header[1:])
        + "</tr></thead><tbody>")
    if not rows:
        parts.append(f'<tr><td colspan="{len(header)}" class="muted">No data</td></tr>')
    for row in rows:
        parts.append(f'<tr><th scope="row">{_text(row[0])}</th>' + "".join(
            f'<td class="num">{_text(cell)}</td>' for cell in row[1:]) + "</tr>")
    parts.append("</tbody></table>")
    return mark_safe("".join(parts))
