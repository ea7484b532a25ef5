"""A single run's ``--out`` resumed by a run of many engines becomes part "." of a dataset of
parts: its own shards stay where they are, beside the manifest and the engines' part
directories. Reading that part as the run's resume reads it, through layertap's reader, took the
manifest's every part: a part directory not made yet stopped the run (FileNotFoundError), and
rows of the other parts were the part's too, so counted twice (``duplicate_records``)."""

from __future__ import annotations

import json

import layertap
from helpers import make_tensors
from layertap.generate.resume import SOURCE, prepare_output
from layertap.parts import write_manifest

META = {"source": SOURCE, "model": "m", "layer_ids": json.dumps([1, 2])}


def write_rows(directory, writer_id: str, rows) -> None:
    with layertap.ShardWriter(str(directory), writer_id=writer_id, metadata=META) as w:
        for i in rows:
            w.submit(str(i), make_tensors(i), {"row": str(i)})


def test_part_dot_is_its_own_shards(tmp_path):
    out = tmp_path / "out"
    write_rows(out, "gen-0", [0, 1, 2])  # the single run's
    write_rows(out / "engine-0", "gen-1", [3, 4])  # an engine's of the run of many after it
    write_manifest(out, [str(out), str(out / "engine-0"), str(out / "engine-1")], source=SOURCE)
    (out / "engine-1").mkdir()
    dot = prepare_output(str(out), "m", [1, 2], lock=False)
    assert dot.done.tolist() == [0, 1, 2] and dot.duplicates == 0 and dot.run == 1
    engine = prepare_output(str(out / "engine-0"), "m", [1, 2])
    engine.release()
    assert engine.done.tolist() == [3, 4]
