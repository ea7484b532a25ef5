"""``layertap inspect --html FILE``: the same stats as one self-contained HTML page, its
histograms drawn as inline SVG (no script, no file beside it, nothing fetched), so that it opens
in any browser and can be mailed or attached to an issue."""

from __future__ import annotations

import html

from layertap._text import plural
from layertap.cli.stats_text import layer_cells, number

_W, _H, _PAD = 420, 150, 28

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1100px; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
.warn { background: #fff1f0; border: 1px solid #d9363e; padding: 8px 16px; }
.warn h2 { color: #b1141c; margin-top: 4px; }
.ok { background: #f0fff4; border: 1px solid #2f9e44; padding: 8px 16px; }
table { border-collapse: collapse; } td, th { padding: 3px 10px; text-align: right; }
th { border-bottom: 1px solid #999; } td:first-child, th:first-child { text-align: left; }
tr.flag td { background: #ffe3e3; }
.charts { display: flex; flex-wrap: wrap; gap: 18px; }
figure { margin: 0; } figcaption { font-size: 13px; color: #444; max-width: 420px; }
svg text { font: 10px system-ui, sans-serif; fill: #444; }
"""


def _svg(hist: dict, kind: str, color: str) -> str:
    """A bar chart of one histogram (``kind``: ``"integer"``, ``"percent"`` or ``"float"``):
    bars, their counts above, the axis's first, middle and last edge."""
    fmt = (lambda v: f"{v:.0%}") if kind == "percent" else number
    edges, counts = hist["edges"], hist["counts"]
    if not counts:
        return "<p>(no values)</p>"
    top = max(counts) or 1
    n = len(counts)
    inner_w, inner_h = _W - 2 * _PAD, _H - 2 * _PAD
    bw = inner_w / n if n > 1 else inner_w / 8  # one bar (all values equal): narrow, in the middle
    left = _PAD + (inner_w - bw * n) / 2
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" role="img">']
    parts.append(f'<line x1="{_PAD}" y1="{_H - _PAD}" x2="{_W - _PAD}" y2="{_H - _PAD}" stroke="#888"/>')
    for i, c in enumerate(counts):
        h = inner_h * c / top
        x, y = left + i * bw, _H - _PAD - h
        lo, hi = edges[i], edges[i + 1]
        tip = f"{fmt(lo)} to {fmt(hi - 1 if kind == 'integer' else hi)}: {c:,}"
        parts.append(
            f'<rect class="bar" x="{x + 1:.1f}" y="{y:.1f}" width="{max(bw - 2, 1):.1f}" height="{h:.1f}" '
            f'fill="{color}"><title>{html.escape(tip)}</title></rect>'
        )
        if c:
            parts.append(f'<text x="{x + bw / 2:.1f}" y="{y - 3:.1f}" text-anchor="middle">{c:,}</text>')
    last = edges[-1] - 1 if kind == "integer" else edges[-1]  # integer bars are [edge, next edge)
    y = _H - _PAD + 14
    if n == 1:
        parts.append(f'<text x="{_W / 2:.1f}" y="{y}" text-anchor="middle">{fmt(edges[0])}</text></svg>')
        return "".join(parts)
    parts.append(f'<text x="{_PAD}" y="{y}">{fmt(edges[0])}</text>')
    if n % 2 == 0:
        parts.append(f'<text x="{_W / 2:.1f}" y="{y}" text-anchor="middle">{fmt(edges[n // 2])}</text>')
    parts.append(f'<text x="{_W - _PAD}" y="{y}" text-anchor="end">{fmt(last)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _figure(title: str, hist: dict, kind: str = "float", color: str = "#4c6ef5") -> str:
    return f"<figure><figcaption>{html.escape(title)}</figcaption>{_svg(hist, kind, color)}</figure>"


def _layer_table(layers: list[dict]) -> str:
    head = ["layer", "RMS", "min", "max", "NaN", "Inf", "all zero (records)", "constant (records)", "zero rows"]
    rows = ["<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for layer in layers:
        flagged = (
            layer["nan"]
            or layer["inf"]
            or layer["all_zero"]["count"]
            or layer["constant"]["count"]
            or layer["zero_rows"]
        )
        cls = ' class="flag"' if flagged else ""
        rows.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(c)}</td>" for c in layer_cells(layer)) + "</tr>")
    return "<table>" + "".join(rows) + "</table>"


def stats_html(stats: dict, title: str) -> str:
    """The page (``stats``: ``to_json()`` of ``layertap.dataset_stats.DatasetStats``)."""
    esc = html.escape
    body = [f"<h1>{esc(title)}</h1>"]
    body.append(
        f"<p>{plural(stats['records'], 'record')}, {plural(stats['tokens'], 'token')}"
        + ("; " + ", ".join(f"{esc(d)} ({n:,})" for d, n in sorted(stats["dtypes"].items())) if stats["dtypes"] else "")
        + "</p>"
    )
    warnings = stats["warnings"]
    if warnings:
        items = "".join(f"<li>{esc(w)}</li>" for w in warnings)
        body.append(
            f'<div class="warn"><h2>WARNING: {plural(len(warnings), "finding")} to look at before training</h2>'
            f"<ul>{items}</ul></div>"
        )
    else:
        body.append(
            '<div class="ok">No warnings: no layer all zero, constant, NaN or Inf; every record has tokens.</div>'
        )
    charts = []
    lengths = stats["lengths"]
    if lengths:
        said = ", ".join(f"{k} {number(lengths[k])}" for k in ("min", "median", "mean", "p90", "max"))
        charts.append(_figure(f"tokens per record ({said})", stats["length_histogram"], "integer"))
    mask = stats["loss_mask"]
    if mask["records"]:
        charts.append(
            _figure(
                f"loss-mask coverage per record: {mask['ones']:,} of {mask['tokens']:,} tokens "
                f"({mask['coverage']:.1%}) in {mask['records']:,} records with a mask",
                mask["coverage_histogram"],
                "percent",
                color="#2f9e44",
            )
        )
    body.append('<h2>Records</h2><div class="charts">' + "".join(charts) + "</div>")
    if not mask["records"]:
        body.append("<p>No record carries a loss mask.</p>")
    if stats["layers"]:
        body.append("<h2>Layers</h2>" + _layer_table(stats["layers"]))
        figures = [
            _figure(f"layer {layer['layer']}: RMS per record", layer["rms_histogram"], color="#e8590c")
            for layer in stats["layers"]
        ]
        body.append('<h2>RMS per record, by layer</h2><div class="charts">' + "".join(figures) + "</div>")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{esc(title)}</title><style>{_STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


__all__ = ["stats_html"]
