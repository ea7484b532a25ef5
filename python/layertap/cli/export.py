"""``layertap export DIR --to speculators|specforge|modelopt OUT [--compress] ...``: the command line of
``layertap.export.export``. Exit status: 0 every selected row has its file or was skipped (rows
the trainer refuses, e.g. DFlash's without two consecutive supervised tokens: a rerun would skip
them again); 1 some other rows have none (bad records, rows asked for without a record); 2 the
export could not run (bad input, another dataset or other settings in OUT)."""

from __future__ import annotations

import argparse
import json
import sys

from layertap.cli.common import UsageError, add_backend_argument
from layertap.errors import LayertapError
from layertap.export.layouts import DTYPES, SPECFORGE_GZIP_LEVEL
from layertap.export.rows import parse_keys
from layertap.export.run import FORMATS, ExportSummary, export


def _layer_list(text: str) -> list[int]:
    try:
        ids = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer ids") from None
    if not ids:
        raise argparse.ArgumentTypeError("no layer ids")
    return ids


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a dataset as speculators', SpecForge's or Model-Optimizer's training files",
        description="Write a dataset keyed by row index (layertap generate's) as the files a drafter trainer "
        "reads, one per row. Layer ids are vLLM's (SpecForge's and Model-Optimizer's are one lower). Rerunning continues "
        "an interrupted export. See docs/TRAINING.md.",
    )
    p.add_argument("path", metavar="DIR", help="the layertap dataset (directory or shard)")
    p.add_argument("--to", required=True, choices=FORMATS, help="the trainer whose layout to write")
    p.add_argument(
        "out",
        metavar="OUT",
        help="speculators: its --data-path (files go to OUT/hidden_states); specforge: the hidden-states "
        "directory; modelopt: its offline_data_path",
    )
    p.add_argument(
        "--model",
        metavar="MODEL_DIR",
        help="the verifier (config and safetensors weights): needed for SpecForge's EAGLE-3 and for "
        "Model-Optimizer (final norm); elsewhere it checks the layer ids",
    )
    p.add_argument("--strategy", choices=["eagle3", "dflash"], default="eagle3", help="SpecForge's (default eagle3)")
    p.add_argument(
        "--layers",
        type=_layer_list,
        metavar="IDS",
        help="vLLM layer ids to export, comma-separated (EAGLE-3: the auxiliary ones, 3 for SpecForge; "
        "default: every stored layer, and for EAGLE-3 every one but N)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help="dtype of the exported hidden states (default: speculators and modelopt stored, specforge bfloat16; "
        "float8_e4m3fn: speculators' fp8 backend layout, with per-token scales; a dataset stored as fp8 is "
        "dequantized for the other layouts)",
    )
    p.add_argument(
        "--prenorm",
        action="store_true",
        help="modelopt: write layer N as stored, before the final norm, with hidden_states_prenorm=True "
        "(Model-Optimizer 0.46 and later then apply the norm, for the model types it knows)",
    )
    p.add_argument(
        "--compress",
        action="store_true",
        help="specforge: write data_{row}.ckpt.gz (gzip), as prepare_hidden_states.py --compress does; "
        "SpecForge's loaders read them",
    )
    p.add_argument(
        "--compression-level",
        type=int,
        metavar="N",
        help=f"gzip level of --compress, 1 to 9 (default {SPECFORGE_GZIP_LEVEL}, SpecForge's)",
    )
    p.add_argument(
        "--keys",
        metavar="ROWS",
        help="rows to export: row indices and inclusive ranges (0-99,150) or @FILE (one per line)",
    )
    p.add_argument("--limit", type=int, metavar="N", help="export at most the first N selected rows")
    p.add_argument("--workers", type=int, metavar="N", help="threads (default min(8, CPUs))")
    p.add_argument(
        "--no-fsync",
        dest="fsync",
        action="store_false",
        help="do not fsync each file before it takes its name (faster; a power loss may then lose files "
        "that a rerun would not redo)",
    )
    p.add_argument("--progress", action="store_true", help="always show a progress bar (default: on a terminal)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_backend_argument(p)
    p.set_defaults(func=cmd_export)


def summary_text(s: ExportSummary) -> str:
    lines = [
        f"{'OK' if s.ok else 'INCOMPLETE'}: {s.source} -> {s.out} ({s.format}): {s.selected:,} rows selected, "
        f"{s.written:,} written, {s.existing:,} already there, {s.skipped:,} skipped, {s.failed:,} failed "
        f"in {s.seconds:.1f} s",
        f"  {s.describe}",
    ]
    if s.not_rows:
        lines.append(f"  {s.not_rows:,} record(s) not keyed by a row index were left out")
    if s.duplicates:
        lines.append(f"  {s.duplicates:,} row(s) have more than one record: the first in dataset order was exported")
    if s.no_loss_mask:
        lines.append(f"  {s.no_loss_mask:,} record(s) had no loss_mask: exported with a loss_mask of ones")
    for reason, n in sorted(s.skip_reasons.items()):
        lines.append(f"  skipped {n:,}: {reason}")
    if s.stale_temporaries:
        lines.append(f"  removed {s.stale_temporaries} temporary file(s) of an interrupted export")
    lines += [f"  problem: {p}" for p in s.problems]
    return "\n".join(lines)


#: export()'s keyword arguments that are the options of the same name.
_PASSED_ON = ("model", "strategy", "layers", "dtype", "limit", "workers", "fsync", "backend", "prenorm")


def cmd_export(args: argparse.Namespace) -> int:
    if args.compression_level is not None and not args.compress:
        raise UsageError("--compression-level needs --compress")
    level = SPECFORGE_GZIP_LEVEL if args.compression_level is None else args.compression_level
    try:
        summary = export(
            args.path,
            args.out,
            args.to,
            keys=parse_keys(args.keys) if args.keys else None,
            progress=args.progress or (sys.stderr.isatty() and not args.json),
            compress=level if args.compress else None,
            **{name: getattr(args, name) for name in _PASSED_ON},
        )
    except FileNotFoundError as e:
        raise UsageError(f"{e.filename or args.path}: no such file or directory") from None
    except (LayertapError, OSError, ImportError) as e:
        raise UsageError(str(e)) from None
    print(json.dumps(summary.as_dict(), indent=2) if args.json else summary_text(summary))
    return 0 if summary.ok else 1


__all__ = ["add_parser", "cmd_export", "summary_text"]
