"""Reading the rows of a prompt dataset (JSONL, Parquet, or a ``datasets`` directory), streamed
so that ten million rows never sit in memory at once. The prompt is in the first of
``PROMPT_COLUMNS`` the data has; the row index (0-based, in file order) is the record's key. A row
that cannot be used is yielded as a ``BadRow``, to be counted and listed, never dropped.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from layertap._install import pip_install_keeping_torch
from layertap.generate.errors import GenerateError

#: The prompt columns, in the order one is chosen when the data has several.
PROMPT_COLUMNS = ("input_ids", "messages", "prompt")
LOSS_MASK = "loss_mask"
#: Rows read from Parquet and datasets per batch.
_BATCH_ROWS = 1024


@dataclass(frozen=True)
class Row:
    index: int
    value: Any
    """The prompt column's value: token ids, a list of messages, or a string."""
    loss_mask: Any = None


@dataclass(frozen=True)
class BadRow:
    index: int
    reason: str


def _optional_import(module: str, what: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as e:
        package = module.split(".")[0]
        raise GenerateError(
            f"reading {what} needs the '{package}' package ({e}): {pip_install_keeping_torch(package)}"
        ) from None


class RowSource:
    """The rows of a dataset file or directory."""

    format: str
    column: str
    has_loss_mask: bool
    num_rows: int

    def __init__(self, path: str, limit: int | None = None):
        self.path = path
        self.limit = limit

    def rows(self, skip: Any = None) -> Iterator[Row | BadRow]:
        """Every row in order but those whose ``skip[index]`` is true (not even parsed)."""
        raise NotImplementedError

    def pick(self, indices: list[int]) -> Iterator[Row | BadRow]:
        """The rows at ``indices`` (sorted, each below ``num_rows``), in order."""
        if not indices:
            return
        wanted = np.ones(indices[-1] + 1, dtype=bool)
        wanted[indices] = False
        for row in self.rows(wanted):
            yield row
            if row.index == indices[-1]:
                return

    def _limited(self, n: int) -> int:
        return n if self.limit is None else min(n, self.limit)


def _pick_column(columns: list[str], path: str) -> str:
    for c in PROMPT_COLUMNS:
        if c in columns:
            return c
    have = ", ".join(repr(c) for c in columns[:20]) or "none"
    raise GenerateError(f"{path}: no prompt column: expected one of {', '.join(PROMPT_COLUMNS)}; the data has {have}")


class JsonlRows(RowSource):
    """One JSON object per line; every line is a row (a blank or unparsable line is a bad row)."""

    format = "jsonl"

    def __init__(self, path: str, limit: int | None = None):
        super().__init__(path, limit)
        first = None
        lines = 0
        with open(path, "rb") as f:
            for line in f:
                lines += 1
                if first is None and line.strip():
                    try:
                        obj = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(obj, dict):
                        first = obj
        if first is None:
            raise GenerateError(f"{path}: no line holds a JSON object (expected JSON Lines, one object per line)")
        self.column = _pick_column(list(first), path)
        self.has_loss_mask = LOSS_MASK in first
        self.num_rows = self._limited(lines)

    def rows(self, skip: Any = None) -> Iterator[Row | BadRow]:
        with open(self.path, "rb") as f:
            for index, line in enumerate(f):
                if index >= self.num_rows:
                    return
                if skip is not None and skip[index]:
                    continue
                if not line.strip():
                    yield BadRow(index, "empty line")
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    yield BadRow(index, f"not JSON: {e}")
                    continue
                if not isinstance(obj, dict):
                    yield BadRow(index, f"not a JSON object but {type(obj).__name__}")
                    continue
                value = obj.get(self.column)
                if value is None:
                    yield BadRow(index, f"no {self.column!r}")
                    continue
                yield Row(index, value, obj.get(LOSS_MASK))


class _Columnar(RowSource):
    """Rows of an Arrow-backed table, read in batches of the needed columns only."""

    def _setup(self, columns: list[str], num_rows: int) -> None:
        if not num_rows:
            raise GenerateError(f"{self.path}: holds no rows")
        self.column = _pick_column(columns, self.path)
        self.has_loss_mask = LOSS_MASK in columns
        self.num_rows = self._limited(num_rows)
        self._columns = [self.column] + ([LOSS_MASK] if self.has_loss_mask else [])

    def _batches(self) -> Iterator[dict[str, list]]:
        raise NotImplementedError

    def rows(self, skip: Any = None) -> Iterator[Row | BadRow]:
        index = -1
        for batch in self._batches():
            values = batch[self.column]
            masks = batch.get(LOSS_MASK) or [None] * len(values)
            for value, mask in zip(values, masks):
                index += 1
                if index >= self.num_rows:
                    return
                if skip is not None and skip[index]:
                    continue
                yield self._row(index, value, mask)

    def _row(self, index: int, value: Any, mask: Any) -> Row | BadRow:
        return BadRow(index, f"no {self.column!r} (null)") if value is None else Row(index, value, mask)

    def _taken(self, indices: list[int]) -> dict[str, list]:
        raise NotImplementedError

    def pick(self, indices: list[int]) -> Iterator[Row | BadRow]:
        """The rows at ``indices``, read alone, not the table up to the last of them."""
        if not indices:
            return
        taken = self._taken(indices)
        masks = taken.get(LOSS_MASK) or [None] * len(indices)
        for index, value, mask in zip(indices, taken[self.column], masks):
            yield self._row(index, value, mask)


class ParquetRows(_Columnar):
    format = "parquet"

    def __init__(self, path: str, limit: int | None = None):
        super().__init__(path, limit)
        pq = _optional_import("pyarrow.parquet", "Parquet files")
        try:
            self._file = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises its own ArrowInvalid and OSError kinds
            raise GenerateError(f"{path}: not a readable Parquet file: {e}") from None
        self._setup(list(self._file.schema_arrow.names), self._file.metadata.num_rows)

    def _batches(self) -> Iterator[dict[str, list]]:
        for batch in self._file.iter_batches(batch_size=_BATCH_ROWS, columns=self._columns):
            yield batch.to_pydict()

    def _taken(self, indices: list[int]) -> dict[str, list]:
        taken: dict[str, list] = {c: [] for c in self._columns}
        meta, start, i = self._file.metadata, 0, 0
        for group in range(meta.num_row_groups):
            end = start + meta.row_group(group).num_rows
            here = []
            while i < len(indices) and indices[i] < end:
                here.append(indices[i] - start)
                i += 1
            if here:
                rows = self._file.read_row_group(group, columns=self._columns).take(here).to_pydict()
                for c in self._columns:
                    taken[c] += rows[c]
            start = end
        return taken


class HfDatasetRows(_Columnar):
    """A directory written by ``datasets.Dataset.save_to_disk`` (``load_from_disk``)."""

    format = "datasets"

    def __init__(self, path: str, limit: int | None = None):
        super().__init__(path, limit)
        datasets = _optional_import("datasets", "a Hugging Face datasets directory")
        try:
            ds = datasets.load_from_disk(path)
        except Exception as e:  # datasets raises FileNotFoundError and its own kinds
            raise GenerateError(f"{path}: not a datasets directory (load_from_disk failed: {e})") from None
        if isinstance(ds, datasets.DatasetDict):
            raise GenerateError(
                f"{path}: a DatasetDict with splits {sorted(ds)}; pass one split's directory, "
                f"e.g. {path}/{sorted(ds)[0]}"
            )
        self._ds = ds
        self._setup(list(ds.column_names), ds.num_rows)

    def _batches(self) -> Iterator[dict[str, list]]:
        # Plain Python lists whatever format the dataset was saved with: speculators' prepare-data
        # saves after set_format("torch"), and load_from_disk brings that format back, which
        # would hand the renderer a tensor per row.
        ds = self._ds.select_columns(self._columns).with_format(None)
        for start in range(0, self.num_rows, _BATCH_ROWS):
            yield ds[start : min(start + _BATCH_ROWS, self.num_rows)]

    def _taken(self, indices: list[int]) -> dict[str, list]:
        return self._ds.select_columns(self._columns).with_format(None).select(indices)[:]


def _is_anonymous_pipe(path: str) -> bool:
    """Whether ``path`` names a pipe without a name of its own (``<(zcat ...)``, ``/dev/stdin``):
    opened again it is the same pipe, drained. A named FIFO (mkfifo) is let through."""
    try:
        if not stat.S_ISFIFO(os.stat(path).st_mode):
            return False
    except OSError:
        return False
    return not os.path.exists(os.path.realpath(path))  # /proc/PID/fd/pipe:[INODE] is no path


def open_rows(path: str | os.PathLike, limit: int | None = None) -> RowSource:
    """The rows of ``path``: a directory is a ``datasets`` directory, ``*.parquet`` a Parquet
    file, anything else JSON Lines."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise GenerateError(f"{path}: no such file or directory")
    if _is_anonymous_pipe(path):
        raise GenerateError(
            f"{path}: is a pipe (as `<(...)` or stdin give), which can be read once; generate reads --data "
            "more than once (to count its rows, to stream them, to resume): write it to a file first, "
            "e.g. `zcat rows.jsonl.gz > rows.jsonl`"
        )
    if os.path.isdir(path):
        return HfDatasetRows(path, limit)
    if path.endswith((".parquet", ".pq")):
        return ParquetRows(path, limit)
    try:
        return JsonlRows(path, limit)
    except OSError as e:
        raise GenerateError(f"{path}: cannot read: {e.strerror or e}") from None
