"""The summary of a run: what ``layertap.generate`` returns, ``--json`` prints, and the lines
printed at the end otherwise. Its fields are described in docs/GENERATE.md, "The summary"."""

from __future__ import annotations

import re
from collections import Counter
from typing import TypedDict

from layertap._text import human_bytes

#: Bad rows the text summary lists one by one (``--json`` lists all).
LISTED_BAD_ROWS = 20


class BadRowEntry(TypedDict):
    row: int
    reason: str


class DamagedRecordEntry(TypedDict):
    row: int
    shard: str
    reason: str


class Seconds(TypedDict):
    """Where a run's time went (a run of many engines: the slowest engine's, per phase)."""

    load: float
    engine_start: float
    generate: float
    drain: float
    shutdown: float
    total: float


class EngineEntry(TypedDict, total=False):
    """One engine of a run of many: what it wrote, or its error."""

    engine: int
    part: str
    rows_assigned: int
    writer_id: str | None
    rows_written: int
    rows_bad: int
    rows_missing: int
    tokens: int
    stored_bytes: int
    seconds: Seconds
    error: str
    error_kind: str
    """``"input"`` (its inputs were refused) or ``"failed"``."""


class _SummaryFields(TypedDict):
    """The fields every summary has."""

    out: str
    data: str
    data_format: str
    column: str | None
    loss_mask: bool
    model: str
    model_revision: str | None
    layer_ids: list[int]
    layer_numbering: str
    capture: str
    dtype: str | None
    max_len: int | None
    max_tokens: int
    include_output_tokens: bool
    window: list[int | None] | None
    reduction: str | None
    run: int | None
    """None when it started no engine (or ran many)."""
    writer_id: str | None
    rows: int
    rows_done_before: int
    rows_written: int
    rows_bad: int
    rows_missing: int
    bad_rows: list[BadRowEntry]
    missing_rows: list[int]
    duplicate_records: int
    tokens: int
    raw_bytes: int
    stored_bytes: int
    ratio: float | None
    shards: int
    shards_recovered: list[str]
    files_set_aside: list[str]
    damaged_records: list[DamagedRecordEntry]
    tokens_per_second: float
    seconds: Seconds


class Summary(_SummaryFields, total=False):
    """What ``layertap.generate`` returns and ``--json`` prints: the fields of every run, and
    those of some. ``complete`` is always there once the summary is returned."""

    complete: bool
    interrupted: bool
    engine_defaults: dict
    rows_assigned: int
    """An engine of a run of many: the rows dealt to it."""
    data_parallel_size: int
    ray_address: str | None
    parts: list[str]
    engines: list[EngineEntry]
    engine_errors: list[str]
    # A run into Mooncake Store (generate/store.py, ``settle_store_run``):
    also_dir: str | None
    store_missing: int | None
    store_evicted: int | None
    store_refused: int | None


def has_records(s: Summary) -> bool:
    return s["rows_done_before"] + s["rows_written"] > 0


def is_complete(s: Summary, accounted: int) -> bool:
    """``complete``: every row (``accounted`` of them) has its record or is bad, none is missing,
    no engine failed, and there is a record at all (a dataset of bad rows holds nothing to train on)."""
    return accounted == s["rows"] and not s["rows_missing"] and not s.get("engine_errors") and has_records(s)


def every_row_bad(s: Summary) -> bool:
    """The data has no usable row: every row is bad and none has a record (exit status 2)."""
    return s["rows_bad"] > 0 and s["rows_bad"] == s["rows"] and not has_records(s)


def most_common_reason(bad_rows: list[BadRowEntry]) -> tuple[str, int]:
    """The reason most bad rows share, and how many: reasons that differ only in their numbers
    count as one, the first row's text standing for them."""
    kinds = Counter(re.sub(r"\d+", "#", b["reason"]) for b in bad_rows)
    kind, count = kinds.most_common(1)[0]
    return next(b["reason"] for b in bad_rows if re.sub(r"\d+", "#", b["reason"]) == kind), count


def _engines(s: Summary) -> str:
    where = f" on Ray at {s['ray_address']}" if s.get("ray_address") else ""
    each = ", ".join(
        f"engine-{e['engine']} {e.get('writer_id') or ('failed' if 'error' in e else 'idle')} "
        f"{e.get('rows_written', 0):,}/{e['rows_assigned']:,}"
        for e in s["engines"]
    )
    return f"{len(s['engines'])} engine(s){where} (rows written/assigned: {each or 'none needed'}); {len(s['parts'])} part(s)"


def _writer(s: Summary) -> str:
    return f"writer {s['writer_id']}" if s["writer_id"] else "no engine started (nothing to write)"


#: What ``_store_lines`` says of the spool's records the store lacks: not listed, evicted, refused.
_STORE_PROBLEMS = (
    "of the run are not in the store (their puts failed: the master was gone or the store full)",
    "were evicted from the store after their puts (it is too small for the dataset: give its nodes more memory, "
    "or pull the records out as they are written)",
    "were refused: the store held another record under their key (another run's: use a new prefix)",
)


def _store_lines(s: Summary) -> list[str]:
    missing, evicted, refused = s.get("store_missing", 0), s.get("store_evicted") or 0, s.get("store_refused") or 0
    if missing == 0 and not refused:
        return []
    if missing is None:
        told = ["the store could not be reached to check that it holds every record"]
    else:
        counts = (missing - evicted, evicted, refused)
        told = [f"{n:,} records {what}" for n, what in zip(counts, _STORE_PROBLEMS, strict=True) if n]
    return [
        f"ERROR: {'; '.join(told)}; the spool {s['also_dir']} holds them and is kept: use it as the dataset, or "
        f"run again with --also-dir {s['also_dir']} to put those never listed"
    ]


def summary_text(s: Summary) -> str:
    secs = s["seconds"]
    ratio = f"{s['ratio']:.2f}x" if s["ratio"] else "-"
    lines = [
        f"{s['out']}: {s['rows_written']:,} rows written this run ({s['tokens']:,} tokens, "
        f"{human_bytes(s['stored_bytes'])} stored, ratio {ratio}), {s['rows_done_before']:,} done before, "
        f"{s['rows_bad']:,} bad, of {s['rows']:,} rows",
        f"model {s['model']}, layers {s['layer_ids']} (vLLM numbering), {s['dtype'] or '-'}; "
        + (_writer(s) if s.get("engines") is None else _engines(s)),
        f"time: {secs['total']:.1f} s (start-up {secs['load'] + secs['engine_start']:.1f} s, "
        f"generation {secs['generate']:.1f} s at {s['tokens_per_second']:,.0f} tok/s, last records written "
        f"{secs['drain']:.1f} s, shutdown {secs['shutdown']:.1f} s)",
    ]
    if s.get("engine_defaults"):  # what the run chose for the engine (on a CPU: its KV cache)
        chosen = s["engine_defaults"]
        lines.append(
            f"engine: kv_cache_memory_bytes {human_bytes(chosen['kv_cache_memory_bytes'])} ({chosen['reason']})"
        )
    if s["shards_recovered"] or s["files_set_aside"]:
        lines.append(
            f"completed {len(s['shards_recovered'])} shard(s) left open by an earlier run; "
            f"set aside {len(s['files_set_aside'])} file(s) without a complete header"
        )
    damaged = s["damaged_records"]
    if damaged:
        first = damaged[0]
        lines.append(
            f"{len(damaged):,} record(s) of --out failed their check and were taken out of their shards' "
            f"indexes, to be written again (first: row {first['row']}: {first['reason']})"
        )
    for row in s["bad_rows"][:LISTED_BAD_ROWS]:
        lines.append(f"bad row {row['row']}: {row['reason']}")
    if s["rows_bad"] > LISTED_BAD_ROWS:
        lines.append(f"... and {s['rows_bad'] - LISTED_BAD_ROWS:,} more bad rows (--json lists them all)")
    if s["rows_missing"]:
        lines.append(
            f"ERROR: {s['rows_missing']:,} rows the connector took have no record in --out "
            f"(first: {s['missing_rows'][:10]}); run again to write them"
        )
    lines += _store_lines(s)  # a run into Mooncake Store (generate/store.py)
    for error in s.get("engine_errors", []):
        lines.append(f"ERROR: {error}; run again to resume")
    if s["duplicate_records"]:
        lines.append(f"WARNING: {s['duplicate_records']} records repeat a row found in an earlier run")
    if every_row_bad(s):
        reason, count = most_common_reason(s["bad_rows"])
        lines.append(f"dataset has no record: all {s['rows']:,} rows are bad, {count:,} of them: {reason}")
        return "\n".join(lines)
    state = "complete" if s["complete"] else "incomplete"
    lines.append(
        f"dataset {state}: {s['rows_done_before'] + s['rows_written']:,} of "
        f"{s['rows'] - s['rows_bad']:,} usable rows have their record"
    )
    return "\n".join(lines)
