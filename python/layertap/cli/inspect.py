"""``layertap inspect PATH...``: a dataset's or shard's summary, as a table or ``--json``; with
``--stats`` (or ``--html FILE``, ``--strict``) also what every record holds
(``layertap.dataset_stats``), in the terminal, the JSON object and an HTML page."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from typing import Any

from layertap._files import write_atomic
from layertap._spec.dtypes import TORCH_NAMES
from layertap._spec.record import HIDDEN_STATES, LAYER_IDS
from layertap._text import human_bytes, plural
from layertap.cli.common import PATHS_HELP, UsageError, add_backend_argument, open_dataset
from layertap.cli.stats_html import stats_html
from layertap.cli.stats_text import stats_text
from layertap.dataset_stats import dataset_stats
from layertap.errors import LayertapError

#: ``--stats`` shows a progress bar on a terminal past this many records.
STATS_PROGRESS_MIN_RECORDS = 10_000


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="summarise a dataset or shard")
    p.add_argument("paths", nargs="+", metavar="PATH", help=PATHS_HELP)
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.add_argument(
        "--stats",
        action="store_true",
        help="read every record once: tokens per record, loss-mask coverage, each layer's RMS, NaN and Inf "
        "counts, and warnings for layers all zero, constant, NaN or Inf (docs/TRAINING.md)",
    )
    p.add_argument("--html", metavar="FILE", help="with --stats: also write the stats and histograms as an HTML page")
    p.add_argument("--strict", action="store_true", help="with --stats: exit 1 when there is a warning")
    add_backend_argument(p)
    p.set_defaults(func=cmd_inspect)


def _first_record_shape(backend) -> dict[str, Any]:
    """layers, hidden size, dtype and layer ids of a shard, from its first record."""
    out: dict[str, Any] = {"layers": None, "hidden_size": None, "dtype": None, "layer_ids": None, "lossy": None}
    if not backend.entries:
        return out
    try:
        metadata, tensors = backend.read(0)
    except LayertapError as e:
        out["error"] = str(e)
        return out
    for name, dtype, shape, _ in tensors:
        if name == HIDDEN_STATES:
            out["dtype"] = TORCH_NAMES[dtype]
            if len(shape) == 3:
                out["layers"], out["hidden_size"] = shape[1], shape[2]
    if metadata.get("lossy"):
        # Written with lossy storage (docs/FP8.md): the first record's error, as its metadata says.
        out["lossy"] = {k: metadata[k] for k in ("lossy", "fp8_max_rel_err", "fp8_mean_rel_err") if k in metadata}
    try:
        ids = json.loads(metadata[LAYER_IDS]) if LAYER_IDS in metadata else None
        out[LAYER_IDS] = ids if isinstance(ids, list) else None
    except ValueError:
        pass
    return out


def _state(info) -> str:
    if info.complete:
        return "complete"
    return "being written" if info.being_written else "open"


def _agreed(values: list) -> Any:
    """The one value all shards with records agree on, None if none, "mixed" otherwise."""
    seen = [v for v in values if v is not None]
    if not seen:
        return None
    return seen[0] if all(v == seen[0] for v in seen) else "mixed"


def _ratio(raw: int, stored: int) -> float | None:
    return round(raw / stored, 4) if stored else None


#: What a shard's and the dataset's summary agree on or add up, in the order ``--json`` prints them.
_COUNTED = ("records", "tokens")
_SHAPE = ("layers", "hidden_size", "dtype", "layer_ids")
_BYTES = ("raw_bytes", "stored_bytes", "file_bytes")


def inspect_summary(ds) -> dict:
    """What ``layertap inspect --json`` prints."""
    shards = []
    for info, backend in zip(ds.shards, ds.backends):
        shards.append(
            {
                "path": info.path,
                "name": ds.shard_name(info.path),
                "state": _state(info).replace(" ", "_"),
                **{k: getattr(info, k) for k in ("complete", "being_written", *_COUNTED)},
                **_first_record_shape(backend),
                **{k: getattr(info, k) for k in ("codecs", *_BYTES)},
                "ratio": _ratio(info.raw_bytes, info.stored_bytes),
                "torn_tail_bytes": info.torn_tail_bytes,
                "lost_in_recovery": info.lost_in_recovery,
                "writer": info.meta.get("writer"),
                "writer_id": info.meta.get("writer_id"),
                "problems": [p._asdict() for p in backend.scan_problems],
            }
        )
    codecs: Counter[str] = Counter()
    for s in shards:
        codecs.update(s["codecs"])
    total = {
        "path": ds.path,
        **{k: sum(s[k] for s in shards) for k in _COUNTED},
        **{k: _agreed([s[k] for s in shards]) for k in _SHAPE},
        "codecs": dict(codecs),
        **{k: sum(s[k] for s in shards) for k in (*_BYTES, "lost_in_recovery")},
    }
    total.update(
        ratio=_ratio(total["raw_bytes"], total["stored_bytes"]),
        shards=shards,
        unreadable=[p._asdict() for p in ds.unreadable],
        parts=ds.parts,
        manifest=ds.manifest,
        duplicate_keys=len(ds.duplicates),
    )
    for key in _SHAPE:
        if total[key] == "mixed":
            total[key] = None  # JSON readers get null; the table says "mixed"
            total[f"{key}_mixed"] = True
    return total


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


#: ``inspect`` fits its table in this many columns: shard names are shortened in the middle
#: (``--json`` has them whole), and columns whose value all shards share move to the summary.
TABLE_WIDTH = 100
_MIN_NAME = 20


def _middle(text: str, width: int) -> str:
    """``text`` shortened to ``width`` characters by an ellipsis in the middle; of a shard name,
    the writer id is shortened and the shard number kept (``-000000.lts``)."""
    if len(text) <= width:
        return text
    keep = re.search(r"-\d{6,}\.lts$", text)
    tail = keep.group() if keep and width - len(keep.group()) >= 9 else ""
    text = text[: len(text) - len(tail)]
    room = width - len(tail) - 1
    head = (room + 1) // 2
    return text[:head] + "…" + text[len(text) - (room - head) :] + tail


def _table(rows: list[list[str]], right: set[int], width: int = TABLE_WIDTH) -> str:
    """Rows in columns two spaces apart; the first column is shortened so that the table fits
    ``width`` columns, where it can."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    room = width - sum(widths[1:]) - 2 * (len(widths) - 1)
    if widths[0] > room:
        widths[0] = max(_MIN_NAME, room)
        rows = [[_middle(r[0], widths[0]), *r[1:]] for r in rows]
    lines = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _tail(n: int) -> str:
    return human_bytes(n) if n else "-"


#: The columns said once above the table when every shard with records shows the same: (head, key).
_SHARED_COLUMNS = (("layers", "layers"), ("hidden", "hidden_size"), ("dtype", "dtype"), ("codecs", "codecs"))


def _column_cell(key: str, value: Any) -> str:
    return (",".join(sorted(value)) or "-") if key == "codecs" else _cell(value)


def inspect_table(summary: dict) -> str:
    """What ``layertap inspect`` prints: a summary, then one row per shard and a total, within
    ``TABLE_WIDTH`` columns."""
    shards = summary["shards"]
    # Columns that differ between shards stay in the table; the others are said once above it.
    varying = [
        (h, key) for h, key in _SHARED_COLUMNS if len({_column_cell(key, s[key]) for s in shards if s["records"]}) > 1
    ]
    torn = any(s["torn_tail_bytes"] for s in shards)
    lost = any(s["lost_in_recovery"] for s in shards)
    head = ["shard", "state", "records", "tokens", *(h for h, _ in varying), "raw", "stored", "ratio"]
    head += ["torn tail"] * torn + ["lost"] * lost

    def row(s: dict, first: list[str], middle: list[str], torn_bytes: int) -> list[str]:
        cells = [*first, _cell(s["records"]), _cell(s["tokens"]), *middle, human_bytes(s["raw_bytes"])]
        cells += [human_bytes(s["stored_bytes"]), f"{s['ratio']:.2f}x" if s["ratio"] else "-"]
        return cells + [_tail(torn_bytes)] * torn + [_cell(s["lost_in_recovery"] or None)] * lost

    rows = [head]
    for s in shards:
        name_state = [s["name"], s["state"].replace("_", " ")]
        rows.append(row(s, name_state, [_column_cell(k, s[k]) for _, k in varying], s["torn_tail_bytes"]))
    rows.append(row(summary, ["total", ""], ["mixed"] * len(varying), sum(s["torn_tail_bytes"] for s in shards)))
    states = [s["state"] for s in shards]
    counts = ", ".join(
        f"{states.count(k)} {k.replace('_', ' ')}" for k in ("complete", "open", "being_written") if k in states
    )
    title = (
        f"{summary['path']}: {plural(len(shards), 'shard')}{f' ({counts})' if counts else ''}, "
        f"{plural(summary['records'], 'record')}, {plural(summary['tokens'], 'token')}, "
        f"{human_bytes(summary['file_bytes'])} on disk"
    )
    shared = [
        f"{h} {'mixed' if summary.get(f'{key}_mixed') else _cell(summary[key])}"
        for h, key in _SHARED_COLUMNS[:3]
        if (h, key) not in varying
    ]
    codecs = ", ".join(f"{c} ({n:,})" for c, n in sorted(summary["codecs"].items()))
    shared.append(f"codecs {codecs or '-'}")
    out = [title]
    if len(summary.get("parts", [])) > 1 or summary.get("manifest"):
        listed = f" (manifest {summary['manifest']})" if summary.get("manifest") else ""
        out.append(f"{plural(len(summary['parts']), 'part')}{listed}")
    if summary.get("duplicate_keys"):
        out.append(
            f"{plural(summary['duplicate_keys'], 'duplicate key')}: the first record of each key in "
            "dataset order is the key's record (layertap verify lists them)"
        )
    if summary["layer_ids"] is not None:
        shared.append(f"layer ids {summary['layer_ids']}")
    out += [", ".join(shared), ""]
    out.append(_table(rows, right={i for i, h in enumerate(head) if i >= 2 and h not in ("dtype", "codecs")}))
    for s in shards:
        if lossy := s.get("lossy"):
            out.append(
                f"lossy {lossy.get('lossy')}: {s['name']}, first record's relative error "
                f"max {lossy.get('fp8_max_rel_err', '?')}, mean {lossy.get('fp8_mean_rel_err', '?')}"
            )
    out += [f"not a shard: {u['shard']}: {u['message']}" for u in summary["unreadable"]]
    if lost:
        n = summary["lost_in_recovery"]
        out.append(
            f"lost in recovery: {n} damaged part{'s' if n != 1 else ''} (corrupt records, damaged regions) "
            "left out of the index by an earlier `layertap recover` (column lost)"
        )
    return "\n".join(out)


def cmd_inspect(args) -> int:
    stats = args.stats or args.html is not None or args.strict
    if args.html is not None and os.path.isdir(args.html):
        raise UsageError(f"--html must name a file to write, not the directory {args.html}")
    if args.html is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.html))):
        # Said before every record is read, not after.
        raise UsageError(f"--html {args.html}: its directory does not exist")
    with open_dataset(args.paths, args.backend, tensors="numpy") as ds:
        summary = inspect_summary(ds)
        if stats:
            progress = len(ds) >= STATS_PROGRESS_MIN_RECORDS and sys.stderr.isatty()
            summary["stats"] = dataset_stats(ds, progress=progress).to_json()
    if args.html is not None:
        try:
            # Through a temporary file beside it, renamed when whole.
            write_atomic(args.html, stats_html(summary["stats"], f"layertap inspect --stats: {summary['path']}"))
        except OSError as e:
            raise UsageError(f"--html {args.html}: cannot write it: {e.strerror or e}") from None
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(inspect_table(summary))
        if stats:
            print(stats_text(summary["stats"]))
            if args.html is not None:
                print(f"\nhistograms: {args.html}")
    return 1 if args.strict and summary["stats"]["warnings"] else 0


__all__ = ["TABLE_WIDTH", "add_parser", "cmd_inspect", "inspect_summary", "inspect_table"]
