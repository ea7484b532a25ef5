"""Per-request ``record_metadata`` and ``loss_mask`` (kv_transfer_params): stored in the record
when good, the save refused with a reason when bad; through a real engine (in this process) and
the Rust writer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import layertap
from layertap.vllm.extras import CONNECTOR_METADATA, loss_mask_array, record_metadata_problem
from vllm_support import (
    VLLM_WARNINGS,
    assert_hidden_states_match,
    engine_args,
    read_stats,
    running_llm,
    shutdown,
)

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]


def prompt_ids(n: int, start: int) -> list[int]:
    return [3 + (start + 29 * i) % 490 for i in range(n)]


def test_loss_mask_array_rules():
    mask, problem = loss_mask_array([0, 1, 1], 3, 0)
    assert problem is None and mask.dtype == np.uint8 and mask.tolist() == [0, 1, 1]
    mask, problem = loss_mask_array((True, False), 2, 3)
    assert problem is None and mask.tolist() == [1, 0, 1, 1, 1]
    for bad, why in [
        ([0, 1], "needs one per prompt token (3)"),
        ([0, 2, 1], "must be 0 or 1"),
        ([0.0, 1.0, 1.0], "must be 0 or 1"),
        ([0, "1", 1], "must be 0 or 1"),
        ([[0], [1], [1]], "must be 0 or 1"),
        ("011", "must be a list"),
        ({"a": 1}, "must be a list"),
    ]:
        mask, problem = loss_mask_array(bad, 3, 0)
        assert mask is None and why in problem, (bad, problem)


def test_record_metadata_rules():
    assert record_metadata_problem({"row": "3", "split": "train"}) is None
    assert "must be an object" in record_metadata_problem(["row", "3"])
    assert "must be strings" in record_metadata_problem({"row": 3})
    for name in CONNECTOR_METADATA:
        assert "the connector writes it" in record_metadata_problem({name: "x"})
    assert "the limit is" in record_metadata_problem({"big": "x" * (65 << 10)})


def test_extras_through_the_engine(tiny_model, reference, tmp_path):
    from vllm import SamplingParams

    out = tmp_path / "hs"
    stats = tmp_path / "stats.json"
    args = engine_args(tiny_model, out, connector={"writer": "rust", "stats_path": str(stats)})
    good = {
        "a": ({"sample_id": "a", "record_metadata": {"row": "0", "note": "é"}, "loss_mask": [0] * 4 + [1] * 6}, 10),
        "b": ({"sample_id": "b", "loss_mask": [True] * 3 + [False] * 5, "include_output_tokens": True}, 8),
        "c": ({"sample_id": "c", "record_metadata": {"row": "2"}}, 5),
    }
    bad = {
        "d": ({"sample_id": "d", "loss_mask": [1] * 5}, 6, "needs one per prompt token (6)"),
        "e": ({"sample_id": "e", "loss_mask": [0, 1, 2]}, 3, "must be 0 or 1"),
        "f": ({"sample_id": "f", "record_metadata": {"model": "x"}}, 4, "may not set 'model'"),
        "g": ({"sample_id": "g", "record_metadata": "row=3"}, 4, "must be an object"),
    }
    declined = {"h": ({"sample_id": "h", "save": False, "record_metadata": {"row": "7"}}, 4)}  # not_requested
    requests = [(k, p, n) for k, (p, n) in {**good, **declined}.items()]
    requests += [(k, p, n) for k, (p, n, _) in bad.items()]
    with running_llm(False, **args) as llm:
        outputs = llm.generate(
            [{"prompt_token_ids": prompt_ids(n, start=i)} for i, (_, _, n) in enumerate(requests)],
            [
                SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, extra_args={"kv_transfer_params": p})
                for _, p, _ in requests
            ],
            use_tqdm=False,
        )
        shutdown(llm)
    answers = {k: o.kv_transfer_params["layertap"] for (k, _, _), o in zip(requests, outputs)}
    for key, (_, _, why) in bad.items():
        assert answers[key]["reason"] == "invalid_request" and why in answers[key]["error"], answers[key]
    assert answers["h"]["reason"] == "not_requested"
    # An engine in this process: the counts of its last step reach the statistics at shutdown.
    assert read_stats(stats)["requests_not_saved"] == {"invalid_request": 4, "not_requested": 1}
    with layertap.open(out) as ds:
        assert sorted(ds.keys()) == ["a", "b", "c"] and ds.verify().ok
        a, b, c = ds["a"], ds["b"], ds["c"]
    assert a.metadata["row"] == "0" and a.metadata["note"] == "é" and a.metadata["request_id"]
    assert list(a.tensors) == ["hidden_states", "token_ids", "loss_mask"]
    assert a.tensors["loss_mask"].dtype == torch.uint8 and a.tensors["loss_mask"].tolist() == [0] * 4 + [1] * 6
    assert_hidden_states_match(a, reference, prompt_ids(10, start=0))
    # include_output_tokens: the prompt's mask, then 1 for each recorded output (4 outputs, 3 recorded).
    assert b.num_tokens == 8 + 3
    assert b.tensors["loss_mask"].tolist() == [1] * 3 + [0] * 5 + [1] * 3
    assert "row" not in b.metadata
    assert c.metadata["row"] == "2" and "loss_mask" not in c.tensors
