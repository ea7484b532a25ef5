"""``layertap verify PATH...``: every record checked; exit status 1 if anything is wrong. Then
every record's values are looked at once more (``layertap.dataset_stats``): a layer all zero,
constant, NaN or Inf is a warning, not a failure (issue 36), so that hidden states a broken
engine wrote as zeros do not pass unseen."""

from __future__ import annotations

import argparse
import json
import sys

from layertap._spec.record import GENERATE_SOURCE
from layertap._text import plural, problem_line
from layertap.cli.common import PATHS_HELP, add_backend_argument, open_dataset
from layertap.dataset_stats import dataset_stats
from layertap.errors import LayertapError

#: verify shows a progress bar on a terminal past this many records (or with --progress).
PROGRESS_MIN_RECORDS = 10_000
PROGRESS_MIN_BYTES = 1 << 30


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check every record; exit 1 if anything is wrong")
    p.add_argument("paths", nargs="+", metavar="PATH", help=PATHS_HELP)
    p.add_argument(
        "--allow-duplicates",
        action="store_true",
        help="a key written by several writers is not a problem: its first record in dataset order counts",
    )
    p.add_argument("--json", action="store_true", help="print a JSON report")
    p.add_argument("--quiet", "-q", action="store_true", help="print only the problems (on stderr)")
    p.add_argument("--progress", action="store_true", help="always show a progress bar")
    p.add_argument(
        "--no-values",
        action="store_true",
        help="skip the second pass that warns of layers all zero, constant, NaN or Inf (it reads every record again)",
    )
    add_backend_argument(p)
    p.set_defaults(func=cmd_verify)


def _value_warnings(ds, progress: bool) -> list[str]:
    """The warnings of the values pass; one saying it could not finish where reading failed
    (the check before it has said what is wrong with the records)."""
    try:
        return dataset_stats(ds, progress=progress).value_warnings()
    except LayertapError as e:
        return [f"the records' values were not all looked at: {e}"]


def _repair_hints(report, shards) -> list[str]:
    """What to do about damaged records, by who wrote their shards: ``layertap generate``'s rerun
    re-indexes a shard without its damaged records and writes their rows again (generate/resume.py);
    ``recover`` leaves complete shards as they are, so nothing else rewrites a record."""
    damaged = {p.shard for p in report.problems if p.kind == "corrupt_record"}
    if not damaged:
        return []
    meta = {s.path: s.meta.get("user") for s in shards}
    by_generate = sum(
        1 for path in damaged if isinstance(meta.get(path), dict) and meta[path].get("source") == GENERATE_SOURCE
    )
    hints = []
    if by_generate:
        hints.append(
            f"{plural(by_generate, 'shard')} with damaged records came from `layertap generate`: run the same "
            "command again (same --out) and it writes those rows again"
        )
    if by_generate < len(damaged):
        hints.append(
            f"{plural(len(damaged) - by_generate, 'shard')} with damaged records came from another writer: "
            "reading a damaged record raises CorruptRecordError; write those records again from their source "
            "(`layertap recover` leaves complete shards as they are)"
        )
    return hints


def cmd_verify(args) -> int:
    with open_dataset(args.paths, args.backend, tensors="numpy") as ds:
        large = len(ds) >= PROGRESS_MIN_RECORDS or sum(s.raw_bytes for s in ds.shards) >= PROGRESS_MIN_BYTES
        progress = args.progress or (large and sys.stderr.isatty() and not args.quiet)
        report = ds.verify(progress=progress, allow_duplicates=args.allow_duplicates)
        warnings = None if args.no_values else _value_warnings(ds, progress)
        shards = len(ds.backends)
        name, parts = ds.path, len(ds.parts)
        hints = _repair_hints(report, ds.shards)
    for p in report.problems:
        print(problem_line(p), file=sys.stderr)
    for p in report.notes:
        print(f"note: {problem_line(p)}", file=sys.stderr)
    for h in [] if args.quiet else hints:
        print(f"hint: {h}", file=sys.stderr)
    if args.json:
        said = {
            "path": name,
            "ok": report.ok,
            "parts": parts,
            "shards": shards,
            **{k: getattr(report, k) for k in ("records_ok", "records_bad", "lost_in_recovery")},
            "problems": [p._asdict() for p in report.problems],
            "duplicate_keys": len(report.duplicates),
            "notes": [p._asdict() for p in report.notes],
            "warnings": warnings,
            "hints": hints,
        }
        print(json.dumps(said, indent=2))
    elif not args.quiet:
        verdict = "OK" if report.ok else "FAILED"
        where = f" of {parts} parts" if parts > 1 else ""
        allowed = ""
        if report.duplicates:
            allowed = f"; {plural(len(report.duplicates), 'duplicate key')} allowed (the first record of each counts)"
        lost = report.lost_in_recovery
        print(
            f"{verdict}: {name}: {report.records_ok:,} records ok, {report.records_bad:,} bad, "
            f"{len(report.problems)} problem{'s' if len(report.problems) != 1 else ''} in {shards} "
            f"shard{'s' if shards != 1 else ''}{where}{allowed}"
            + (f"; {plural(lost, 'damaged part')} lost in an earlier recovery" if lost else "")
        )
        if warnings:
            print(
                f"WARNING: {plural(len(warnings), 'finding')} in the records' values (not a failure; "
                "`layertap inspect --stats` shows the numbers):"
            )
            print("\n".join(f"  {w}" for w in warnings))
    return 0 if report.ok else 1


__all__ = ["PROGRESS_MIN_BYTES", "PROGRESS_MIN_RECORDS", "add_parser", "cmd_verify"]
