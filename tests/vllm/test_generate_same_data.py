"""``layertap generate`` rerun with other data into an existing ``--out``: a new user reran the
command with another input file and it resumed ("24 done before"), mixing two datasets, since
rows are known by their index. Records now hold the fingerprint of their row's prompt token ids
(``prompt_hash``) and the rerun compares a few of them with the new data before any engine
starts, each part's in a run of many (tests/test_generate_fingerprints.py covers the comparison without an engine)."""

from __future__ import annotations

import pytest
from generate_support import TINY_ENGINE_ARGS, id_rows, write_jsonl

import layertap
from layertap.generate import GenerateError, GenerateOptions
from layertap.generate.parallel import prepare_parts
from layertap.generate.run import check_options
from layertap.generate.same_data import PROMPT_HASH, prompt_hash
from vllm_support import VLLM_WARNINGS, pytest_env

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]


def options(model, data, out) -> GenerateOptions:
    return GenerateOptions(model, data, out, reduction="last", engine_args=TINY_ENGINE_ARGS)


def generate(model, data, out, **options):
    with pytest_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}):
        return layertap.generate(model, data, out, progress="none", engine_args=TINY_ENGINE_ARGS, **options)


def test_a_rerun_with_other_data_is_refused_before_its_engine(tiny_model, tmp_path):
    rows = id_rows(6, 3, 12, seed=21)
    data = write_jsonl(tmp_path / "ids.jsonl", rows)
    out = tmp_path / "out"
    # A window and a reduction keep one id of the prompt: the fingerprint is the whole prompt's.
    first = generate(tiny_model, data, out, reduction="last")
    assert first["complete"] and first["rows_written"] == 6, first
    with layertap.open(out) as ds:
        assert {r.key: r.metadata.get(PROMPT_HASH) for r in ds} == {
            str(i): prompt_hash(r["input_ids"]) for i, r in enumerate(rows)
        }
        assert all(r.num_tokens == 1 for r in ds)
    other = write_jsonl(tmp_path / "other.jsonl", rows[::-1])
    with pytest.raises(GenerateError, match=r"holds records of other data: row 0, done there, has other prompt"):
        generate(tiny_model, other, out, reduction="last")
    again = generate(tiny_model, data, out, reduction="last")  # the data it was written from resumes
    assert again["complete"] and again["rows_done_before"] == 6 and again["run"] is None, again
    # A run of many engines checks each part (this run's shards become its part "."), before any engine.
    state = prepare_parts(check_options(options(tiny_model, data, out)), 2)
    state.release()
    assert state.parts == [str(out), str(out / "engine-0"), str(out / "engine-1")]
    assert state.done.sum() == 6 and state.duplicates == 0
    with pytest.raises(GenerateError, match=r"holds records of other data: row 0, done there, has other prompt"):
        prepare_parts(check_options(options(tiny_model, other, out)), 2)
