"""The export driver: picks the records, builds the layout, and writes one file per row on a
pool of threads (the Rust reader and torch release the GIL while they decode and convert), with a
progress bar, resuming where an earlier run stopped."""

from __future__ import annotations

import errno
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from layertap._install import pip_install_keeping_torch
from layertap._spec.record import HIDDEN_STATES
from layertap._version import __version__
from layertap.errors import InvalidInputError, LayertapError
from layertap.export import files
from layertap.export.layouts import (
    ModelOptLayout,
    RecordProblem,
    Skip,
    SpecForgeLayout,
    SpeculatorsLayout,
    check_record,
    stored_float_dtype,
)
from layertap.export.rows import Selection, select
from layertap.fp8 import SCALE_NAME
from layertap.reader import open as open_dataset
from layertap.reader import progress_bar

FORMATS = ("speculators", "specforge", "modelopt")
#: Problems listed one by one in the summary; the rest are counted.
MAX_LISTED = 20


@dataclass
class ExportSummary:
    """What an export did. ``ok`` is True when every selected row has its file or was skipped
    (``skipped``: rows the trainer would refuse, which its own capture leaves out too)."""

    source: str
    out: str
    format: str
    describe: str
    settings: dict
    selected: int = 0
    written: int = 0
    existing: int = 0
    """Rows whose file an earlier run had written (left as they were)."""
    skipped: int = 0
    """Rows the trainer would refuse (see ``skip_reasons``): no file."""
    failed: int = 0
    """Rows whose record could not be read or used: no file (see ``problems``)."""
    not_rows: int = 0
    missing: int = 0
    duplicates: int = 0
    no_loss_mask: int = 0
    """Rows exported with a loss mask of ones because their record had none (SpecForge,
    Model-Optimizer)."""
    stale_temporaries: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    skip_reasons: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.missing == 0

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def _first_record(ds: Any, sel: Selection) -> Any:
    """The first selected record that reads (and holds hidden states): it sets the layers every
    record must have. Damaged ones before it are reported with the others later."""
    error: Exception | None = None
    for row in sel.rows:
        try:
            record = ds[sel.positions[row]]
        except LayertapError as e:
            error = e
            continue
        if HIDDEN_STATES not in record.tensors:
            raise InvalidInputError(f"record {record.key!r} has no hidden_states tensor: not a hidden-states dataset")
        return record
    if error is not None:
        raise InvalidInputError(f"no selected record could be read; the last error: {error}")
    return None


def _check_hidden(model: str, hidden: int, first: Any) -> None:
    stored = first.tensors[HIDDEN_STATES].shape[-1]
    if stored != hidden:
        raise InvalidInputError(f"--model {model}: hidden size {hidden}, the dataset's is {stored}")


def _layout(
    fmt: str,
    out: str,
    first: Any,
    model: str | None,
    strategy: str,
    layers: list[int] | None,
    dtype: str | None,
    prenorm: bool,
    compress: int | None,
) -> Any:
    """The layout of trainer ``fmt`` for a dataset whose first record is ``first``, with the
    final norm of ``model`` (checked against the dataset's hidden size) where it writes one."""
    from layertap.export.final_norm import FinalNorm, model_dims

    layer_ids = first.layer_ids
    if not layer_ids:
        raise InvalidInputError(f"record {first.key!r} has no layer_ids metadata: cannot tell which layers it holds")
    if fmt not in FORMATS:
        raise InvalidInputError(f"--to must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if fmt == "specforge" and strategy == "eagle3" and not model:
        raise InvalidInputError("--to specforge --strategy eagle3 needs --model MODEL_DIR (for the final norm)")
    if fmt == "modelopt" and not model:
        raise InvalidInputError(
            "--to modelopt needs --model MODEL_DIR: hidden_states is layer N after the verifier's final "
            "norm (with --prenorm, before it, the norm left to Model-Optimizer)"
        )
    norm = n = None
    if (fmt, strategy) == ("specforge", "eagle3") or (fmt == "modelopt" and not prenorm):
        norm = FinalNorm(model)
        n = norm.num_hidden_layers
        _check_hidden(model, norm.hidden_size, first)
    elif model:
        n, hidden = model_dims(model)
        if fmt == "modelopt":
            _check_hidden(model, hidden, first)
    stored = stored_float_dtype(first)
    if fmt == "speculators":
        fp8_stored = SCALE_NAME in first.tensors
        return SpeculatorsLayout(
            out, layer_ids, stored, layers=layers, dtype=dtype or "stored", num_layers=n, fp8_stored=fp8_stored
        )
    if fmt == "specforge":
        return SpecForgeLayout(
            out,
            layer_ids,
            stored,
            strategy=strategy,
            layers=layers,
            dtype=dtype or "bfloat16",
            norm=norm,
            num_layers=n,
            compress=compress,
        )
    return ModelOptLayout(
        out, layer_ids, stored, num_layers=n, layers=layers, dtype=dtype or "stored", norm=norm, prenorm=prenorm
    )


def _export_row(ds: Any, layout: Any, row: int, pos: int, layer_ids: list[int], fsync: bool) -> tuple[int, bool]:
    """Writes row ``row``'s file: (bytes written, whether the record lacked a loss mask).
    Raises RecordProblem, Skip, or OSError."""
    try:
        record = ds[pos]  # checks the record's checksum
    except LayertapError as e:
        raise RecordProblem(str(e)) from None
    checked = check_record(row, record, layer_ids)
    data = layout.serialize(layout.build(checked), row)
    files.write_file(os.path.join(layout.root, layout.relpath(row)), data, fsync)
    return len(data), checked.loss_mask is None


def export(
    source: str | list[str],
    out: str,
    to: str,
    *,
    model: str | None = None,
    strategy: str = "eagle3",
    layers: list[int] | None = None,
    dtype: str | None = None,
    keys: list[int] | None = None,
    limit: int | None = None,
    workers: int | None = None,
    fsync: bool = True,
    progress: bool = False,
    backend: str = "auto",
    prenorm: bool = False,
    compress: int | None = None,
) -> ExportSummary:
    """Exports the layertap dataset ``source`` to ``out`` in the layout of trainer ``to``
    (``"speculators"``, ``"specforge"`` or ``"modelopt"``), one file per row; see
    docs/TRAINING.md. ``prenorm`` (Model-Optimizer): the last layer as stored, before the final
    norm, flagged ``hidden_states_prenorm`` for Model-Optimizer to apply the norm. ``compress``
    (SpecForge): a gzip level, 1 to 9, to write ``data_{row}.ckpt.gz`` files as its
    ``prepare_hidden_states.py --compress`` does (``SPECFORGE_GZIP_LEVEL``, 6, is its default). Rows whose
    file exists are left as they are, so a rerun continues an interrupted export. Raises
    ``InvalidInputError`` (or ``FileNotFoundError``/``FormatError`` for the source) when it
    cannot start; problems with single records are counted in the summary."""
    try:
        import safetensors  # noqa: F401 - asked here to fail before any work, with one line
        import torch  # noqa: F401
    except ImportError as e:
        missing = e.name if e.name in ("torch", "safetensors") else "torch safetensors"
        raise ImportError(
            f"layertap export needs torch and safetensors ({e}): {pip_install_keeping_torch(missing)}"
        ) from None
    if prenorm and to != "modelopt":
        raise InvalidInputError("--prenorm is for --to modelopt")
    if compress is not None and to != "specforge":
        raise InvalidInputError(f"--compress is for --to specforge (its .ckpt.gz files), not --to {to}")
    if compress is not None and (isinstance(compress, bool) or compress not in range(1, 10)):
        raise InvalidInputError(f"--compression-level must be 1 to 9 (gzip's levels), not {compress!r}")
    if limit is not None and limit < 0:
        raise InvalidInputError(f"--limit must be >= 0, not {limit}")
    workers = workers or min(8, os.cpu_count() or 1)
    if workers < 1:
        raise InvalidInputError(f"--workers must be >= 1, not {workers}")
    started = time.monotonic()
    with open_dataset(source, backend=backend, tensors="torch") as ds:
        sel = select(ds.keys(), keys, limit)
        if not sel.rows and not sel.missing:
            raise InvalidInputError(
                f"{source}: no record is keyed by a row index (keys like '0', '17'): export needs a dataset "
                "written by layertap generate, or by a server whose client set sample_id to the row index"
            )
        first = _first_record(ds, sel)
        if first is None:
            raise InvalidInputError(f"{source}: none of the rows asked for with --keys has a record")
        layout = _layout(to, out, first, model, strategy, layers, dtype, prenorm, compress)
        sources = source if isinstance(source, (list, tuple)) else [source]
        summary = ExportSummary(
            ", ".join(os.path.abspath(p) for p in sources),
            os.path.abspath(out),
            to,
            layout.describe,
            layout.settings,
            selected=len(sel.rows),
            not_rows=sel.not_rows,
            missing=len(sel.missing),
            duplicates=len(sel.duplicates),
        )
        if sel.missing:
            shown = ", ".join(map(str, sel.missing[:MAX_LISTED]))
            summary.problems.append(f"no record for {len(sel.missing)} row(s) asked for: {shown}")
        with files.ExportLock(layout.root):
            summary.stale_temporaries = files.remove_stale_temporaries(layout.root)
            info = {
                "source": summary.source,
                "model": os.path.abspath(model) if model else None,
                "layertap_version": __version__,
            }
            files.check_manifest(layout.root, layout.settings, info, fsync)
            todo = []
            made_dirs: set[str] = set()
            for row in sel.rows:
                path = os.path.join(layout.root, layout.relpath(row))
                if os.path.exists(path):
                    summary.existing += 1
                    continue
                parent = os.path.dirname(path)
                if parent not in made_dirs:
                    os.makedirs(parent, exist_ok=True)
                    made_dirs.add(parent)
                todo.append((row, sel.positions[row]))
            write = partial(_export_row, ds, layout, layer_ids=first.layer_ids, fsync=fsync)
            with progress_bar(progress, summary.selected, "export", initial=summary.existing) as bar:
                _run(write, todo, workers, summary, bar, layout.fills_loss_mask)
            if fsync:
                for d in sorted(made_dirs | {layout.root}):
                    files.fsync_dir(d)
    summary.seconds = round(time.monotonic() - started, 3)
    return summary


def _run(write: Any, todo: list[tuple[int, int]], workers: int, summary: ExportSummary, bar: Any, fills: bool) -> None:
    """Calls ``write(row, pos)`` for each of ``todo`` on ``workers`` threads, at most 2 x workers
    records in memory at once; ``fills``: the layout writes a loss mask of ones where none was."""

    def settle(row: int, fut: Future) -> None:
        try:
            nbytes, no_mask = fut.result()
        except Skip as e:
            summary.skipped += 1
            summary.skip_reasons[str(e)] = summary.skip_reasons.get(str(e), 0) + 1
        except (RecordProblem, OSError) as e:
            summary.failed += 1
            if len(summary.problems) < MAX_LISTED:
                summary.problems.append(f"row {row}: {e}")
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise
        else:
            summary.written += 1
            summary.bytes_written += nbytes
            summary.no_loss_mask += no_mask and fills
        bar.update(1)

    window: deque[tuple[int, Future]] = deque()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="layertap-export") as pool:
        try:
            for row, pos in todo:
                window.append((row, pool.submit(write, row, pos)))
                if len(window) >= 2 * workers:
                    settle(*window.popleft())
            while window:
                settle(*window.popleft())
        except BaseException:
            for _, fut in window:
                fut.cancel()
            raise


__all__ = ["ExportSummary", "FORMATS", "export"]
