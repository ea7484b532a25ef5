"""``layertap recover SHARD...``: complete shards whose writer died."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from layertap._backends import resolve_backend
from layertap._text import human_bytes, problem_line
from layertap.cli.common import UsageError, add_backend_argument
from layertap.errors import FormatError, LayertapError
from layertap.recover import recover as native_recover


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("recover", help="complete shards whose writer died")
    p.add_argument("shards", nargs="+", metavar="SHARD", help="shard files")
    p.add_argument("--json", action="store_true", help="print a JSON report")
    add_backend_argument(p)
    p.set_defaults(func=cmd_recover)


def _native_recover():
    from layertap._native import recover as _  # noqa: F401 - only asks whether the extension is built

    return native_recover


def _python_recover():
    from layertap._py.recover import recover

    return recover


def _recover_function(backend: str):
    """The Rust core's recovery, or the reference implementation's (``--backend python``, or
    ``auto`` without the extension built). The reference is imported only when it is chosen: the
    production path never loads ``layertap._py``."""
    return resolve_backend("--backend", backend, rust=_native_recover, python=_python_recover, unavailable=UsageError)


#: What ``--json`` says of a shard recovered, beside ``ok`` and its problems.
_REPORTED = ("was_complete", "removed", "records", "truncated_bytes")


def cmd_recover(args) -> int:
    recover = _recover_function(args.backend)
    status = 0
    results = []
    for path in args.shards:
        result: dict[str, Any] = {"path": path, "ok": False}
        try:
            if not os.path.exists(path):
                raise FileNotFoundError(2, "no such file or directory", path)
            if os.path.isdir(path):
                raise UsageError(f"{path}: is a directory; recover takes shard files")
            report = recover(path)
        except (FileNotFoundError, FormatError, UsageError) as e:
            msg = f"{path}: no such file or directory" if isinstance(e, FileNotFoundError) else str(e)
            print(f"layertap recover: {msg}", file=sys.stderr)
            result["error"] = msg
            status = 2
        except (LayertapError, OSError) as e:  # ShardLockedError: a live writer holds it
            print(f"layertap recover: {e}", file=sys.stderr)
            result["error"] = str(e)
            status = max(status, 1)
        else:
            result.update(ok=not report.problems, **{k: getattr(report, k) for k in _REPORTED})
            result["problems"] = [p._asdict() for p in report.problems]
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
                    print(
                        f"{path}: already complete ({report.records:,} records); left as it is (recover completes "
                        "shards whose writer died; `layertap verify` checks every record)"
                    )
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


__all__ = ["add_parser", "cmd_recover"]
