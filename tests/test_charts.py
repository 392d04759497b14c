"""console/charts.py: server-made SVG charts and their tables (no database)."""

import math
import re
import xml.etree.ElementTree as ET

from django.utils.safestring import SafeString

from console import charts

SVG = "{http://www.w3.org/2000/svg}"
HOSTILE = '<script>alert("x")</script>\'&"'


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)


def texts(root: ET.Element) -> list[str]:
    return ["".join(el.itertext()) for el in root.iter() if el.tag in (f"{SVG}text",
                                                                       f"{SVG}title")]


def test_hostile_names_are_escaped_and_the_svg_parses():
    labels = ["d1", HOSTILE]
    for chart in (charts.line_chart(labels, {HOSTILE: [1, 2]}, title=HOSTILE, unit=HOSTILE),
                  charts.bar_chart(labels, {HOSTILE: [1, 2], "x\x00\x1b": [3, None]},
                                   title=HOSTILE)):
        assert isinstance(chart, SafeString)
        assert "<script" not in chart
        assert 'alert("x")' not in chart
        root = parse(chart)
        # the name comes back whole (as text) in the legend's title and the hovers
        assert any(HOSTILE in text for text in texts(root))
        assert root.get("role") == "img"
        assert HOSTILE in root.get("aria-label")


def test_table_escapes_hostile_names():
    html = charts.table(["a", HOSTILE], {HOSTILE: [1, 2]}, caption=HOSTILE)
    assert isinstance(html, SafeString)
    assert "<script" not in html
    root = parse(html)  # the table is well-formed XML too
    assert HOSTILE in ["".join(th.itertext()) for th in root.iter("th")]


def test_empty_data_is_a_no_data_chart():
    for chart in (charts.line_chart([], {}, title="t"),
                  charts.line_chart(["a", "b"], {"s": [None, None]}, title="t"),
                  charts.bar_chart(["a"], {}, title="t"),
                  charts.bar_chart(["a"], {"s": [float("nan")]}, title="t")):
        root = parse(chart)
        assert "No data" in texts(root)
        assert "no data" in root.get("aria-label")
    assert "No data" in charts.table([], {"s": []})


def test_a_single_point():
    root = parse(charts.line_chart(["only"], {"s": [5]}, title="t"))
    circles = list(root.iter(f"{SVG}circle"))
    assert len(circles) == 1
    assert "only · s: 5" in "".join(circles[0].itertext())
    assert not list(root.iter(f"{SVG}polyline"))  # one point is no line
    assert len(list(parse(charts.bar_chart(["only"], {"s": [5]}, title="t"))
                    .iter(f"{SVG}rect"))) == 2  # the bar and its legend's swatch


def test_large_numbers_have_short_ticks():
    root = parse(charts.line_chart(["a", "b"], {"s": [0, 3_400_000_000]}, title="t"))
    ticks = [t for t in texts(root) if t.endswith("G")]
    assert ticks and all(len(t) <= 5 for t in ticks)
    assert charts.human(1234) == "1.2k"
    assert charts.human(3_400_000) == "3.4M"
    assert charts.human(999_999) == "1M"
    assert charts.human(950) == "950"
    assert charts.human(0.25, "%") == "0.25%"
    assert charts.human(-1500) == "-1.5k"
    assert charts.exact(1234567) == "1,234,567"
    assert charts.exact(None) == "–"


def test_nice_ticks_cover_the_range_with_round_steps():
    for low, high in ((0, 1), (0, 7), (0, 1234), (0, 0.3), (-5, 17), (0, 0), (3, 3)):
        ticks = charts.nice_ticks(low, high)
        assert ticks[0] <= low and ticks[-1] >= high
        assert 2 <= len(ticks) <= 7
        steps = {round(b - a, 9) for a, b in zip(ticks, ticks[1:], strict=False)}
        assert len(steps) == 1


def test_nan_inf_and_negative_values():
    series = {"s": [1, float("nan"), float("inf"), -4, None, 2]}
    root = parse(charts.line_chart(list("abcdef"), series, title="t"))
    assert len(list(root.iter(f"{SVG}circle"))) == 3  # a, d, f
    assert "-4" in texts(root) or any(t.startswith("-") for t in texts(root))
    bars = parse(charts.bar_chart(list("abcdef"), series, title="t"))
    assert len([r for r in bars.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]) == 3
    html = charts.table(list("abcdef"), series)
    assert html.count("–") == 3


def bar_geometry(svg: str) -> dict[str, list[tuple[float, float]]]:
    """Each hovered bar's (top, bottom) by its label."""
    by_label: dict[str, list[tuple[float, float]]] = {}
    for rect in parse(svg).iter(f"{SVG}rect"):
        title = rect.find(f"{SVG}title")
        if title is None:
            continue
        top = float(rect.get("y"))
        by_label.setdefault(title.text.split(" · ")[0], []).append(
            (top, top + float(rect.get("height"))))
    return by_label


def axis_scale(svg: str) -> tuple[float, float]:
    """(pixels per unit, y of zero) from the grid lines and their tick labels."""
    root = parse(svg)
    ys = [float(line.get("y1")) for line in root.iter(f"{SVG}line")
          if line.get("class") == "grid"]
    first, last = ys[0], ys[-1]
    labels = [t.text for t in root.iter(f"{SVG}text") if t.get("text-anchor") == "end"]
    low, high = float(labels[0]), float(labels[-1])
    return (first - last) / (high - low), first + low * (first - last) / (high - low)


def test_stacked_bars_sum():
    labels = ["a", "b", "c"]
    series = {"p": [10, 0, 3], "q": [5, 7, None], "r": [1, 2, 3]}
    svg = charts.bar_chart(labels, series, title="t")
    per_unit, zero = axis_scale(svg)
    bars = bar_geometry(svg)
    for i, label in enumerate(labels):
        total = sum(s[i] or 0 for s in series.values())
        top = min(t for t, _ in bars[label])
        assert math.isclose((zero - top) / per_unit, total, abs_tol=0.05)
        # the pieces touch: each one starts where the one under it ends
        pieces = sorted(bars[label], reverse=True)
        for lower, upper in zip(pieces, pieces[1:], strict=False):
            assert math.isclose(lower[0], upper[1], abs_tol=0.02)


def test_grouped_bars_stand_on_zero():
    svg = charts.bar_chart(["a"], {"p": [4], "q": [2]}, stacked=False, title="t")
    per_unit, zero = axis_scale(svg)
    for _top, bottom in bar_geometry(svg)["a"]:
        assert math.isclose(bottom, zero, abs_tol=0.02)
    heights = sorted(round((b - t) / per_unit, 1) for t, b in bar_geometry(svg)["a"])
    assert heights == [2.0, 4.0]


def test_many_labels_are_thinned_and_series_keep_their_palette():
    labels = [f"h{i}" for i in range(168)]
    svg = charts.line_chart(labels, {"a": list(range(168)), "b": [1] * 168}, title="t")
    root = parse(svg)
    x_labels = [t for t in root.iter(f"{SVG}text") if t.get("text-anchor") == "middle"]
    assert len(x_labels) <= charts.MAX_X_LABELS
    colours = re.findall(r'stroke="(#[0-9a-f]{6})" stroke-width', svg)
    assert colours == [charts.PALETTE[0], charts.PALETTE[1]]


def test_table_rows_for_templates():
    header, rows = charts.table_rows(["a", "b"], {"s": [1500, None], "t": [0.5, 2]})
    assert header == ["", "s", "t"]
    assert rows == [["a", "1,500", "0.5"], ["b", "–", "2"]]
