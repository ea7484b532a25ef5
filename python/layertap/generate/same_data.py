"""Whether the rows an output directory holds records of are the rows of this run's data.

Rows are known by their index alone, so a rerun with other data (or the same file reordered)
into an existing ``--out`` would mix two datasets without a word. Each record holds
``prompt_hash``, a fingerprint of the row's prompt token ids; before a run starts, a few done
rows (never the whole directory) are rendered from the data again and their fingerprints
compared. Records written before the fingerprint existed have none: the run goes on.
"""

from __future__ import annotations

import hashlib

import numpy as np

from layertap.errors import LayertapError
from layertap.generate.data import BadRow, RowSource
from layertap.generate.errors import GenerateError
from layertap.generate.render import BadRowError, Renderer
from layertap.generate.resume import open_own_shards

#: The record metadata member that holds the fingerprint (``record_metadata`` of each request).
PROMPT_HASH = "prompt_hash"
#: How many done rows are compared: the first, the last and evenly spaced ones between.
SAMPLED_ROWS = 5


def prompt_hash(ids: list[int]) -> str:
    """BLAKE2b (8 bytes, hex) of the prompt token ids as little-endian int64."""
    return hashlib.blake2b(np.asarray(ids, dtype="<i8").tobytes(), digest_size=8).hexdigest()


def sampled_rows(done: np.ndarray, num_rows: int, count: int = SAMPLED_ROWS) -> list[int]:
    """Up to ``count`` of the ``done`` rows (sorted) that the data has, evenly spaced."""
    done = done[done < num_rows]
    if not len(done):
        return []
    picks = np.linspace(0, len(done) - 1, min(count, len(done))).round().astype(np.int64)
    return sorted({int(done[i]) for i in picks})


def check_same_data(directory: str, done: np.ndarray, rows: RowSource, renderer: Renderer, data: str) -> None:
    """GenerateError when a sampled done row's fingerprint is not that of the same row of ``rows``."""
    sample = sampled_rows(done, rows.num_rows)
    ds = open_own_shards(directory, tensors="numpy") if sample else None  # as prepare_output read ``done``
    if ds is None:
        return
    stored: dict[int, str | None] = {}
    with ds:
        for row in sample:
            try:
                record = ds.get(str(row))
            except LayertapError:  # a record written damaged (resume counts it as done): not compared
                record = None
            stored[row] = record.metadata.get(PROMPT_HASH) if record is not None else None
    wanted = [row for row, h in stored.items() if h is not None]
    if not wanted:
        return  # written before records held the fingerprint
    for row in rows.pick(wanted):
        if isinstance(row, BadRow):
            differs = f"is a bad row there ({row.reason})"
        else:
            try:
                ids = renderer.token_ids(row.value)
            except BadRowError as e:
                differs = f"is a bad row there ({e})"
            else:
                if prompt_hash(ids) == stored[row.index]:
                    continue
                differs = "has other prompt tokens there"
        raise GenerateError(
            f"--out {directory} holds records of other data: row {row.index}, done there, {differs} ({data}); "
            "rows are known by their index: give the data the dataset was written from, or another --out"
        )


__all__ = ["PROMPT_HASH", "check_same_data", "prompt_hash", "sampled_rows"]
