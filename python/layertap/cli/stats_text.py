"""``layertap inspect --stats`` in the terminal: the lengths and the loss mask's coverage as
histograms of bars, one row per layer with its RMS across records as a line of bars, and the
warnings last, where they are seen."""

from __future__ import annotations

import math

from layertap._text import plural

#: The longest bar of a histogram, in characters.
BAR_WIDTH = 40
_SPARKS = "▁▂▃▄▅▆▇█"


def number(v: float | None) -> str:
    """A value in four significant digits (``-`` for none)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:.4g}"


def _range(lo, hi, kind: str) -> str:
    if kind == "integer":  # [lo, hi)
        return f"{lo:,}" if hi - 1 <= lo else f"{lo:,}-{hi - 1:,}"
    if kind == "percent":
        return f"{lo:.0%}-{hi:.0%}"
    return f"{number(lo)}-{number(hi)}"


def bars(hist: dict, kind: str = "float", indent: str = "  ") -> list[str]:
    """One line per bar: its range (``kind``: ``"integer"``, ``"percent"`` or ``"float"``), the
    bar, the count."""
    edges, counts = hist["edges"], hist["counts"]
    if not counts:
        return []
    top = max(counts)
    ranges = [_range(edges[i], edges[i + 1], kind) for i in range(len(counts))]
    if kind == "float" and len(counts) == 1:
        ranges = [number(edges[0])]
    width = max(map(len, ranges))
    out = []
    for r, c in zip(ranges, counts):
        n = round(BAR_WIDTH * c / top) if top else 0
        out.append(f"{indent}{r.rjust(width)}  {'█' * (n or (1 if c else 0))} {c:,}".rstrip())
    return out


def layer_cells(layer: dict) -> list[str]:
    """A layer's row of the table, as the terminal and the page show it: its id, RMS, min, max,
    NaN and Inf counts, records all zero and constant, and token rows all zero."""
    counts = (layer["nan"], layer["inf"], layer["all_zero"]["count"], layer["constant"]["count"], layer["zero_rows"])
    return [str(layer["layer"]), *(number(layer[k]) for k in ("rms", "min", "max")), *(number(c) for c in counts)]


def sparkline(hist: dict) -> str:
    """The histogram in one line: one character per bar, ``·`` for an empty one."""
    counts = hist["counts"]
    if not counts:
        return ""
    top = max(counts)
    return "".join(_SPARKS[min(7, (c * 8 - 1) // top)] if c else "·" for c in counts)


def _columns(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]


def stats_text(stats: dict) -> str:
    """What ``layertap inspect --stats`` adds below the summary (``stats``: ``to_json()`` of
    ``layertap.dataset_stats.DatasetStats``)."""
    out = ["", f"stats: {plural(stats['records'], 'record')} read, {plural(stats['tokens'], 'token')}"]
    if stats["dtypes"]:
        out[-1] += "; " + ", ".join(f"{d} ({n:,})" for d, n in sorted(stats["dtypes"].items()))
    lengths = stats["lengths"]
    if lengths:
        out.append(
            "tokens per record: "
            + ", ".join(f"{k} {number(lengths[k])}" for k in ("min", "median", "mean", "p90", "p99", "max"))
        )
        out += bars(stats["length_histogram"], "integer")
    if stats["windows"] or stats["reductions"]:
        reduced = ", ".join(f"{n:,} {how}" for how, n in sorted(stats["reductions"].items()))
        out.append(
            f"capture windows: {plural(stats['windows'], 'record')} of a window"
            + (f" ({reduced} reduced to one row)" if reduced else "")
            + "; their lengths are the rows they store"
        )
    if stats["lossy_records"]:
        out.append(f"lossy: {plural(stats['lossy_records'], 'record')} in fp8, counted dequantized")
    mask = stats["loss_mask"]
    if mask["records"]:
        out.append(
            f"loss mask: {mask['records']:,} of {plural(stats['records'], 'record')} carry one; "
            f"{mask['ones']:,} of {plural(mask['tokens'], 'token')} learned from ({mask['coverage']:.1%})"
        )
        out.append("  records by the share of their tokens learned from:")
        out += bars(mask["coverage_histogram"], "percent", indent="    ")
    else:
        out.append("loss mask: none of the records carries one")
    if stats["layers"]:
        rows = [["layer", "rms", "min", "max", "NaN", "Inf", "all zero", "constant", "zero rows", "RMS per record"]]
        for layer in stats["layers"]:
            hist = layer["rms_histogram"]
            spread = (
                f"{number(hist['edges'][0])} {sparkline(hist)} {number(hist['edges'][-1])}" if hist["edges"] else ""
            )
            rows.append([*layer_cells(layer), spread])
        out += ["", *_columns(rows)]
        out.append("(all zero, constant: records; zero rows: tokens whose row is all zero in the other records)")
    warnings = stats["warnings"]
    if warnings:
        out += ["", f"WARNING: {plural(len(warnings), 'finding')} to look at before training:"]
        out += [f"  {w}" for w in warnings]
    else:
        out += ["", "no warnings: no layer all zero, constant, NaN or Inf; every record has tokens"]
    return "\n".join(out)


__all__ = ["BAR_WIDTH", "bars", "number", "sparkline", "stats_text"]
