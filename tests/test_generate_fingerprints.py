"""A rerun of ``layertap generate`` into an ``--out`` written from other data is refused: rows are
known by their index, and a run with another file (or the same file reordered or edited) took
the new rows for done ("24 done before") and mixed two datasets. Shards written here as a run
writes them (its shard metadata, each record's ``row`` and ``prompt_hash``); the engine's side,
that records hold the fingerprint, is tests/vllm/test_generate_same_data.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

import layertap
from helpers import make_tensors
from layertap.generate.data import open_rows
from layertap.generate.errors import GenerateError
from layertap.generate.render import Renderer
from layertap.generate.resume import prepare_output
from layertap.generate.same_data import PROMPT_HASH, check_same_data, prompt_hash, sampled_rows

ROWS = [[5 + i, 6 + i, 7 + i][: 1 + i % 3] for i in range(12)]
META = {"source": "layertap.generate", "model": "m", "layer_ids": json.dumps([1, 2])}


def write_data(path, rows) -> str:
    path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    return str(path)


def write_run(out, rows, done, fingerprints: bool = True) -> None:
    """Records of ``done`` rows of ``rows``, as a run of layertap generate writes them."""
    with layertap.ShardWriter(str(out), writer_id="gen-0", metadata=META) as w:
        for i in done:
            meta = {"row": str(i), **({PROMPT_HASH: prompt_hash(rows[i])} if fingerprints else {})}
            w.submit(str(i), make_tensors(i), meta)


def check(out, data) -> None:
    state = prepare_output(str(out), "m", [1, 2])
    try:
        rows = open_rows(data)
        check_same_data(str(out), state.done, rows, Renderer(None, rows.column, 1000, 100), data)
    finally:
        state.release()


def test_the_rows_compared_are_few_and_span_the_done_rows():
    assert sampled_rows(np.arange(1000), 2000) == [0, 250, 500, 749, 999]
    assert sampled_rows(np.array([3, 7]), 2000) == [3, 7]
    assert sampled_rows(np.array([3, 7, 9]), 8) == [3, 7]  # rows past --limit are not the data's
    assert sampled_rows(np.array([], dtype=np.int64), 8) == []


def test_the_same_data_resumes(tmp_path):
    write_run(tmp_path / "out", ROWS, range(9))
    check(tmp_path / "out", write_data(tmp_path / "d.jsonl", ROWS))


@pytest.mark.parametrize(
    "change, row, differs",
    [
        (lambda rows: rows[::-1], 0, "has other prompt tokens there"),
        (lambda rows: [[3, 3], *rows], 0, "has other prompt tokens there"),  # a row inserted at the top
        (lambda rows: [*rows[:8], [9, 9], *rows[9:]], 8, "has other prompt tokens there"),  # the last done row
        (lambda rows: [*rows[:4], "oops", *rows[5:]], 4, "is a bad row there (not JSON"),
        (lambda rows: [*rows[:2], [5000], *rows[3:]], 2, "is a bad row there (input_ids holds 5000, outside"),
    ],
)
def test_other_data_is_refused_naming_a_row_and_the_fix(tmp_path, change, row, differs):
    write_run(tmp_path / "out", ROWS, range(9))
    lines = [json.dumps({"input_ids": r}) if isinstance(r, list) else r for r in change(ROWS)]
    data = tmp_path / "other.jsonl"
    data.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(GenerateError) as e:
        check(tmp_path / "out", str(data))
    assert str(e.value).startswith(
        f"--out {tmp_path / 'out'} holds records of other data: row {row}, done there, {differs}"
    ), e.value
    assert str(e.value).endswith(
        f"({data}); rows are known by their index: give the data the dataset was written from, or another --out"
    )
    assert "\n" not in str(e.value)


def test_a_row_edited_between_the_sampled_ones_is_not_looked_at(tmp_path):
    """A handful of rows, not a rescan: row 1 is not among the rows compared (0, 2, 4, 6, 8)."""
    write_run(tmp_path / "out", ROWS, range(9))
    check(tmp_path / "out", write_data(tmp_path / "d.jsonl", [ROWS[0], [99], *ROWS[2:]]))


def test_records_without_the_fingerprint_resume_unchecked(tmp_path):
    """A dataset written before records held ``prompt_hash``: nothing to compare."""
    write_run(tmp_path / "out", ROWS, range(9), fingerprints=False)
    check(tmp_path / "out", write_data(tmp_path / "d.jsonl", ROWS[::-1]))


def test_the_rows_compared_are_read_alone_from_every_format(tmp_path):
    """``pick``: the rows at some indices, as ``rows`` gives them (a null one a bad row); Parquet
    reads their row groups only, a datasets directory selects them."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([{"input_ids": r} for r in ROWS[:6]] + [{"input_ids": None}] + [{"input_ids": [1]}])
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=3)
    datasets.Dataset(table).save_to_disk(str(tmp_path / "hf"))
    jsonl = write_data(tmp_path / "d.jsonl", [*ROWS[:6], None, [1]])
    for path in (jsonl, tmp_path / "d.parquet", tmp_path / "hf"):
        source = open_rows(path)
        every = list(source.rows())
        assert list(source.pick([0, 4, 6, 7])) == [every[0], every[4], every[6], every[7]], path
        assert list(source.pick([])) == []
