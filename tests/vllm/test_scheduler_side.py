"""The scheduler half on its own, fed real vLLM ``Request`` objects (no engine): what it hands
the worker per step, and the bound on the keys it remembers over an engine's lifetime (a server
runs for weeks; benches/soak_keys.py drives 200,000+ requests through both halves)."""

from __future__ import annotations

import pickle

import pytest

from vllm_support import VLLM_WARNINGS

pytestmark = VLLM_WARNINGS

BLOCK = 16


def scheduler(tmp_path, **options):
    from layertap.vllm.config import parse_options
    from layertap.vllm.engine_facts import EngineFacts
    from layertap.vllm.scheduler import SchedulerSide

    facts = EngineFacts(
        layer_ids=(1, 2),
        requested_layer_ids=(2, 1),
        num_model_layers=4,
        hidden_size=8,
        model="tiny",
        max_model_len=64,
        max_num_batched_tokens=64,
        group_id=0,
        block_size=BLOCK,
        engine_id="e",
        writer_id="w",
        tensor_parallel_size=1,
    )
    return SchedulerSide.from_facts(facts, parse_options({"output_dir": str(tmp_path), **options}))


def finished(req_id: str, tokens: int, kv_params: dict | None = None, outputs: int = 0):
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    params = SamplingParams(
        max_tokens=max(1, outputs), extra_args={"kv_transfer_params": kv_params} if kv_params else None
    )
    req = Request(req_id, list(range(10, 10 + tokens)), params, None)
    if outputs:
        req.append_output_token_ids(list(range(500, 500 + outputs)))
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    return req


def test_a_step_is_handed_over_as_parallel_lists(tmp_path):
    """Per request a few list entries (the request's own token list where it can), per step one
    object: nothing per request to build, hand over or pickle."""
    side = scheduler(tmp_path)
    a = finished("a-1", 20)
    keep, params = side.request_finished(a, ([3, 4],))
    location = {"dataset": str(tmp_path), "writer_id": "w", "key": "a-1", "num_tokens": 20, "request_id": "a-1"}
    assert keep and params == {"layertap": location}
    b = finished("b-1", 5, {"sample_id": "s", "include_output_tokens": True, "record_metadata": {"x": "y"}}, outputs=3)
    keep, params = side.request_finished(b, ([7],))
    assert keep and (params["layertap"]["key"], params["layertap"]["request_id"]) == ("s", "b-1")
    assert side.has_pending_block_frees()
    saves = side.build_connector_meta().saves
    assert saves.keys == ["a-1", "s"] and saves.req_ids == ["a-1", "b-1"]
    assert saves.token_ids[0] is a.prompt_token_ids  # not copied
    assert saves.token_ids[1] == [*range(10, 15), 500, 501]  # prompt and outputs but the last
    assert saves.num_tokens == [20, 7] and saves.num_prompt_tokens == [20, 5] and saves.block_ids == [[3, 4], [7]]
    assert saves.extras == {1: ({"x": "y"}, None)}
    copy = pickle.loads(pickle.dumps(saves))  # a multi-process executor sends it to the workers
    assert copy.keys == saves.keys and copy.extras == saves.extras
    head = copy.split(1)
    assert head.keys == ["a-1"] and copy.keys == ["s"] and copy.extras == {0: ({"x": "y"}, None)}
    assert side.build_connector_meta().saves is None  # nothing new
    side.update_connector_output({"a-1", "b-1"})
    assert not side.has_pending_block_frees()


def test_the_keys_remembered_are_bounded(tmp_path):
    """With ``key_memory=50``, 1,000 requests leave 50 keys in memory; a sample id among the
    last 50 is refused (the client learns it in its response), an older one is taken again."""
    side = scheduler(tmp_path, key_memory=50)
    for i in range(1000):
        keep, _ = side.request_finished(finished(f"r{i}", 4, {"sample_id": f"s{i}"}), ([i],))
        assert keep
        side.build_connector_meta()
    assert len(side.keys) == 50
    keep, params = side.request_finished(finished("again", 4, {"sample_id": "s990"}), ([1],))
    assert not keep and params["layertap"]["reason"] == "invalid_request"
    assert "was used by an earlier request" in params["layertap"]["error"]
    keep, _ = side.request_finished(finished("old", 4, {"sample_id": "s3"}), ([1],))
    assert keep and len(side.keys) == 50


@pytest.mark.parametrize("value", [0, -1, "many", 1.5])
def test_a_bad_key_memory_is_refused(tmp_path, value):
    from layertap.vllm.config import ConfigError

    with pytest.raises(ConfigError, match="key_memory"):
        scheduler(tmp_path, key_memory=value)


def test_save_requested_saves_only_the_requests_that_ask(tmp_path):
    """``save="requested"`` (a shared endpoint): a request that sends nothing is not saved and
    gets nothing back; one that sends kv_transfer_params without asking is told how to ask; one
    with ``"save": true`` or a ``sample_id`` (every row ``layertap generate`` submits) is saved.
    Each one not saved is counted ``not_requested``, for /metrics and the worker's statistics."""
    from vllm.v1.request import RequestStatus

    side = scheduler(tmp_path, save="requested")
    assert side.request_finished(finished("plain-1", 8), ([1],)) == (False, None)
    keep, params = side.request_finished(finished("outputs-1", 8, {"include_output_tokens": True}, outputs=2), ([2],))
    assert not keep and params["layertap"]["reason"] == "not_requested"
    assert '"save": true or a "sample_id"' in params["layertap"]["error"]
    keep, params = side.request_finished(finished("no-1", 8, {"save": False, "sample_id": "no"}), ([3],))
    assert not keep and params["layertap"] == {
        "error": 'the request\'s kv_transfer_params say "save": false',
        "reason": "not_requested",
    }
    ignored = finished("long-1", 8)
    ignored.status = RequestStatus.FINISHED_IGNORED  # not asked: not_requested, not a warning
    assert side.request_finished(ignored, ([4],)) == (False, None)
    keep, params = side.request_finished(finished("flag-1", 8, {"save": True}), ([5],))
    assert keep and params["layertap"]["key"] == "flag-1"
    generate_row = {"sample_id": "7", "record_metadata": {"row": "7"}}  # what generate sends
    keep, params = side.request_finished(finished("row-7", 8, generate_row), ([6],))
    assert keep and params["layertap"]["key"] == "7"
    keep, params = side.request_finished(finished("bad-1", 8, {"save": "yes"}), ([7],))
    assert not keep and params["layertap"] == {
        "error": "save must be true or false, got 'yes'",
        "reason": "invalid_request",
    }

    metadata = side.build_connector_meta()
    assert metadata.saves.keys == ["flag-1", "7"]
    assert metadata.not_saved == {"not_requested": 4, "invalid_request": 1}  # for the worker's statistics
    assert side.build_connector_meta().not_saved is None  # unchanged since
    assert side.stats.report() == {"not_saved": {"not_requested": 4, "invalid_request": 1}}


def test_save_all_is_the_default_and_a_request_may_decline(tmp_path):
    """The default (``save="all"``) saves a request that sends nothing, as before the option;
    a request's own ``"save": false`` declines, and a flag that is not a bool is refused."""
    side = scheduler(tmp_path)
    assert side.options.save == "all"
    keep, params = side.request_finished(finished("plain-1", 8), ([1],))
    assert keep and params["layertap"]["key"] == "plain-1"
    keep, params = side.request_finished(finished("no-1", 8, {"save": False}), ([2],))
    assert not keep and params["layertap"]["reason"] == "not_requested"
    keep, params = side.request_finished(finished("bad-1", 8, {"save": 1}), ([3],))
    assert not keep and "save must be true or false, got 1" in params["layertap"]["error"]
    assert side.build_connector_meta().saves.keys == ["plain-1"]
    assert side.stats.report() == {"not_saved": {"not_requested": 1, "invalid_request": 1}}
