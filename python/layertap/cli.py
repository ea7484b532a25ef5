"""The ``layertap`` command: ``generate`` a dataset with vLLM, ``inspect``, ``verify`` and ``recover``
datasets and shards, ``export`` them to a drafter trainer's files.

Exit status: 0 all good; 1 problems found (corrupt records, torn tails, a shard that could not
be recovered); 2 the command could not run (missing path, not a shard, bad arguments); 141 the
reader of its output went away (``layertap inspect --json DIR | head``), quietly, as for any Unix
tool ended by SIGPIPE.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from layertap._text import human_bytes, plural, problem_line
from layertap._types import Problem
from layertap.errors import LayertapError

#: verify shows a progress bar on a terminal past this many records (or with --progress).
PROGRESS_MIN_RECORDS = 10_000
PROGRESS_MIN_BYTES = 1 << 30


class _Usage(Exception):
    """The command cannot run; the message is printed and the exit status is 2."""


def _listed_in(e: FileNotFoundError) -> str:
    """ " (a part listed in MANIFEST)" when the missing path was a manifest's part."""
    text = e.strerror or ""
    return text[text.index(" (") :] if " (a part listed in" in text else ""


def _problem_json(p: Problem) -> dict:
    return p._asdict()


def _open(paths: list[str], backend: str):
    """The dataset that one path, or several (parts of one dataset), name."""
    import layertap

    try:
        return layertap.open(paths[0] if len(paths) == 1 else paths, backend=backend)
    except FileNotFoundError as e:
        raise _Usage(f"{e.filename}: no such file or directory{_listed_in(e)}") from None
    except (LayertapError, OSError, ImportError) as e:
        raise _Usage(str(e)) from None


# ---------------------------------------------------------------------------------------------
# inspect


def _first_record_shape(backend) -> dict[str, Any]:
    """layers, hidden size, dtype and layer ids of a shard, from its first record."""
    from layertap._spec.dtypes import TORCH_NAMES

    out: dict[str, Any] = {"layers": None, "hidden_size": None, "dtype": None, "layer_ids": None, "lossy": None}
    if not backend.entries:
        return out
    try:
        metadata, tensors = backend.read(0)
    except LayertapError as e:
        out["error"] = str(e)
        return out
    for name, dtype, shape, _ in tensors:
        if name == "hidden_states":
            out["dtype"] = TORCH_NAMES[dtype]
            if len(shape) == 3:
                out["layers"], out["hidden_size"] = shape[1], shape[2]
    if metadata.get("lossy"):
        # Written with lossy storage (docs/FP8.md): the first record's error, as its metadata says.
        out["lossy"] = {k: metadata[k] for k in ("lossy", "fp8_max_rel_err", "fp8_mean_rel_err") if k in metadata}
    try:
        ids = json.loads(metadata["layer_ids"]) if "layer_ids" in metadata else None
        out["layer_ids"] = ids if isinstance(ids, list) else None
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


def inspect_summary(ds) -> dict:
    """What ``layertap inspect --json`` prints."""
    shards = []
    for info, backend in zip(ds.shards, ds.backends):
        shape = _first_record_shape(backend)
        shards.append(
            {
                "path": info.path,
                "name": ds.shard_name(info.path),
                "state": _state(info).replace(" ", "_"),
                "complete": info.complete,
                "being_written": info.being_written,
                "records": info.records,
                "tokens": info.tokens,
                **shape,
                "codecs": info.codecs,
                "raw_bytes": info.raw_bytes,
                "stored_bytes": info.stored_bytes,
                "file_bytes": info.file_bytes,
                "ratio": round(info.raw_bytes / info.stored_bytes, 4) if info.stored_bytes else None,
                "torn_tail_bytes": info.torn_tail_bytes,
                "lost_in_recovery": info.lost_in_recovery,
                "writer": info.meta.get("writer"),
                "writer_id": info.meta.get("writer_id"),
                "problems": [_problem_json(p) for p in backend.scan_problems],
            }
        )
    codecs: dict[str, int] = {}
    for s in shards:
        for c, n in s["codecs"].items():
            codecs[c] = codecs.get(c, 0) + n
    raw = sum(s["raw_bytes"] for s in shards)
    stored = sum(s["stored_bytes"] for s in shards)
    total = {
        "path": ds.path,
        "records": sum(s["records"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "layers": _agreed([s["layers"] for s in shards]),
        "hidden_size": _agreed([s["hidden_size"] for s in shards]),
        "dtype": _agreed([s["dtype"] for s in shards]),
        "layer_ids": _agreed([s["layer_ids"] for s in shards]),
        "codecs": codecs,
        "raw_bytes": raw,
        "stored_bytes": stored,
        "file_bytes": sum(s["file_bytes"] for s in shards),
        "lost_in_recovery": sum(s["lost_in_recovery"] for s in shards),
        "ratio": round(raw / stored, 4) if stored else None,
        "shards": shards,
        "unreadable": [_problem_json(p) for p in ds.unreadable],
        "parts": ds.parts,
        "manifest": ds.manifest,
        "duplicate_keys": len(ds.duplicates),
    }
    for key in ("layers", "hidden_size", "dtype", "layer_ids"):
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


def inspect_table(summary: dict) -> str:
    """What ``layertap inspect`` prints: a summary, then one row per shard and a total, within
    ``TABLE_WIDTH`` columns."""

    def ratio(r):
        return f"{r:.2f}x" if r else "-"

    def codecs(c):
        return ",".join(sorted(c)) or "-"

    def total(key):
        return "mixed" if summary.get(f"{key}_mixed") else _cell(summary[key])

    shards = summary["shards"]
    # Columns that differ between shards stay in the table; the others are said once above it.
    varying = [
        (head, key, fmt)
        for head, key, fmt in (
            ("layers", "layers", _cell),
            ("hidden", "hidden_size", _cell),
            ("dtype", "dtype", _cell),
            ("codecs", "codecs", codecs),
        )
        if len({fmt(s[key]) for s in shards if s["records"]}) > 1
    ]
    torn = any(s["torn_tail_bytes"] for s in shards)
    lost = any(s["lost_in_recovery"] for s in shards)
    head = ["shard", "state", "records", "tokens", *(h for h, _, _ in varying), "raw", "stored", "ratio"]
    head += ["torn tail"] * torn + ["lost"] * lost
    rows = [head]
    for s in shards:
        row = [s["name"], s["state"].replace("_", " "), _cell(s["records"]), _cell(s["tokens"])]
        row += [fmt(s[key]) for _, key, fmt in varying]
        row += [human_bytes(s["raw_bytes"]), human_bytes(s["stored_bytes"]), ratio(s["ratio"])]
        rows.append(row + [_tail(s["torn_tail_bytes"])] * torn + [_cell(s["lost_in_recovery"] or None)] * lost)
    states = [s["state"] for s in shards]
    counts = ", ".join(
        f"{states.count(k)} {k.replace('_', ' ')}" for k in ("complete", "open", "being_written") if k in states
    )
    row = ["total", "", _cell(summary["records"]), _cell(summary["tokens"])]
    row += ["mixed" for _ in varying]
    row += [human_bytes(summary["raw_bytes"]), human_bytes(summary["stored_bytes"]), ratio(summary["ratio"])]
    rows.append(
        row + [_tail(sum(s["torn_tail_bytes"] for s in shards))] * torn + [_cell(summary["lost_in_recovery"])] * lost
    )
    title = (
        f"{summary['path']}: {plural(len(shards), 'shard')}{f' ({counts})' if counts else ''}, "
        f"{plural(summary['records'], 'record')}, {plural(summary['tokens'], 'token')}, "
        f"{human_bytes(summary['file_bytes'])} on disk"
    )
    shared = [
        f"{h} {total(key)}"
        for h, key in (("layers", "layers"), ("hidden", "hidden_size"), ("dtype", "dtype"))
        if h not in {v[0] for v in varying}
    ]
    shared.append(
        "codecs " + ", ".join(f"{c} ({n:,})" for c, n in sorted(summary["codecs"].items()))
        if summary["codecs"]
        else "codecs -"
    )
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
    if shared:
        out.append(", ".join(shared))
    out += [
        "",
        _table(
            rows,
            right=set(range(2, len(head))) - {4 + i for i, (h, _, _) in enumerate(varying) if h in ("dtype", "codecs")},
        ),
    ]
    for s in shards:
        if s.get("lossy"):
            lossy = s["lossy"]
            out.append(
                f"lossy {lossy.get('lossy')}: {s['name']}, first record's relative error "
                f"max {lossy.get('fp8_max_rel_err', '?')}, mean {lossy.get('fp8_mean_rel_err', '?')}"
            )
    for u in summary["unreadable"]:
        out.append(f"not a shard: {u['shard']}: {u['message']}")
    if lost:
        n = summary["lost_in_recovery"]
        out.append(
            f"lost in recovery: {n} damaged part{'s' if n != 1 else ''} (corrupt records, damaged regions) "
            "left out of the index by an earlier `layertap recover` (column lost)"
        )
    return "\n".join(out)


def cmd_inspect(args) -> int:
    with _open(args.paths, args.backend) as ds:
        summary = inspect_summary(ds)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(inspect_table(summary))
    return 0


# ---------------------------------------------------------------------------------------------
# verify


def cmd_verify(args) -> int:
    with _open(args.paths, args.backend) as ds:
        large = len(ds) >= PROGRESS_MIN_RECORDS or sum(s.raw_bytes for s in ds.shards) >= PROGRESS_MIN_BYTES
        progress = args.progress or (large and sys.stderr.isatty() and not args.quiet)
        report = ds.verify(progress=progress, allow_duplicates=args.allow_duplicates)
        shards = len(ds.backends)
        name, parts = ds.path, len(ds.parts)
    for p in report.problems:
        print(problem_line(p), file=sys.stderr)
    for p in report.notes:
        print(f"note: {problem_line(p)}", file=sys.stderr)
    if args.json:
        print(
            json.dumps(
                {
                    "path": name,
                    "ok": report.ok,
                    "parts": parts,
                    "shards": shards,
                    "records_ok": report.records_ok,
                    "records_bad": report.records_bad,
                    "lost_in_recovery": report.lost_in_recovery,
                    "problems": [_problem_json(p) for p in report.problems],
                    "duplicate_keys": len(report.duplicates),
                    "notes": [_problem_json(p) for p in report.notes],
                },
                indent=2,
            )
        )
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
    return 0 if report.ok else 1


# ---------------------------------------------------------------------------------------------
# recover


def _recover_function(backend: str):
    if backend == "python":
        from layertap._py.recover import recover

        return recover
    if backend == "auto":
        try:
            import layertap._native  # noqa: F401 - only asks whether the extension is built
        except ImportError:
            from layertap._py.recover import recover

            return recover
    from layertap.recover import recover

    return recover


def cmd_recover(args) -> int:
    from layertap.errors import FormatError, ShardLockedError

    recover = _recover_function(args.backend)
    status = 0
    results = []
    for path in args.shards:
        result: dict[str, Any] = {"path": path, "ok": False}
        try:
            if not os.path.exists(path):
                raise FileNotFoundError(2, "no such file or directory", path)
            if os.path.isdir(path):
                raise _Usage(f"{path}: is a directory; recover takes shard files")
            report = recover(path)
        except (FileNotFoundError, FormatError, _Usage) as e:
            msg = f"{path}: no such file or directory" if isinstance(e, FileNotFoundError) else str(e)
            print(f"layertap recover: {msg}", file=sys.stderr)
            result["error"] = msg
            status = 2
        except (ShardLockedError, LayertapError, OSError) as e:
            print(f"layertap recover: {e}", file=sys.stderr)
            result["error"] = str(e)
            status = max(status, 1)
        else:
            result.update(
                ok=not report.problems,
                was_complete=report.was_complete,
                removed=report.removed,
                records=report.records,
                truncated_bytes=report.truncated_bytes,
                problems=[_problem_json(p) for p in report.problems],
            )
            for p in report.problems:
                print(problem_line(p), file=sys.stderr)
            if report.problems:
                status = max(status, 1)
            if not args.json:
                if report.removed:
                    print(
                        f"{path}: removed: a torn empty shard ({human_bytes(report.truncated_bytes)}, shorter than "
                        "its header: its writer died before writing it); it held no records"
                    )
                elif report.was_complete:
                    print(f"{path}: already complete ({report.records:,} records); left as it is")
                else:
                    line = (
                        f"{path}: recovered: {report.records:,} records indexed, "
                        f"{human_bytes(report.truncated_bytes)} of torn tail cut"
                    )
                    if report.problems:
                        line += f", {len(report.problems)} damaged part(s) left unindexed"
                    print(line)
        results.append(result)
    if args.json:
        print(json.dumps({"shards": results}, indent=2))
    return status


# ---------------------------------------------------------------------------------------------


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("layertap")
    except PackageNotFoundError:  # a source tree without installed metadata
        return "0+unknown"


_PATHS_HELP = (
    "dataset directory (with or without a layertap-dataset.json manifest), manifest or shard file; "
    "several paths are parts of one dataset, in that order"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="layertap",
        description="Generate hidden-states datasets with vLLM, inspect, verify and recover them, and export them "
        "for the drafter trainers speculators and SpecForge.",
    )
    parser.add_argument("--version", action="version", version=f"layertap {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    from layertap.generate.command import add_parser as add_generate_parser  # its own package

    add_generate_parser(sub)  # first: the command that makes a dataset
    backend = {
        "choices": ["auto", "rust", "python"],
        "default": "auto",
        "help": "reader implementation (default: Rust when built)",
    }

    p = sub.add_parser("inspect", help="summarise a dataset or shard")
    p.add_argument("paths", nargs="+", metavar="PATH", help=_PATHS_HELP)
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.add_argument("--backend", **backend)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("verify", help="check every record; exit 1 if anything is wrong")
    p.add_argument("paths", nargs="+", metavar="PATH", help=_PATHS_HELP)
    p.add_argument(
        "--allow-duplicates",
        action="store_true",
        help="a key written by several writers is not a problem: its first record in dataset order counts",
    )
    p.add_argument("--json", action="store_true", help="print a JSON report")
    p.add_argument("--quiet", "-q", action="store_true", help="print only the problems (on stderr)")
    p.add_argument("--progress", action="store_true", help="always show a progress bar")
    p.add_argument("--backend", **backend)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("recover", help="complete shards whose writer died")
    p.add_argument("shards", nargs="+", metavar="SHARD", help="shard files")
    p.add_argument("--json", action="store_true", help="print a JSON report")
    p.add_argument("--backend", **backend)
    p.set_defaults(func=cmd_recover)

    from layertap.export.cli import add_parser as add_export  # issue 9: the trainers' exports

    add_export(sub)
    return parser


#: The exit status of a command whose reader closed its pipe: a shell's for a process ended by
#: SIGPIPE (128 + 13), as ``inspect | head`` reports for any Unix tool.
CLOSED_PIPE_STATUS = 141


def _closed_pipe() -> int:
    """stdout's reader has gone: point stdout at /dev/null, so that the interpreter's last flush
    at exit does not fail again (and print "Exception ignored"), and end quietly."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return CLOSED_PIPE_STATUS


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        status = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe can still be caught
        return status
    except BrokenPipeError:
        # Python ignores SIGPIPE (so a closed socket in vLLM cannot kill a run); a closed stdout
        # then raises here instead of ending the process as it ends other tools.
        return _closed_pipe()
    except _Usage as e:
        print(f"layertap {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
