"""``layertap generate`` refuses, before vLLM and transformers are imported and before --out is
created, a --max-len beyond the context of a model in a local directory (vLLM refused it as its
engine started: exit status 1, after 10-20 s and with --out created) and an --out whose shards
hold other layers (refused after the imports: 8.8 s). Each refusal in a fresh interpreter, which
imports none of vLLM, transformers and torch, as
tests/test_generate_options.py checks --connector-args."""

from __future__ import annotations

import json
import os

import pytest

import layertap
from helpers import make_tensors, run_python
from layertap.generate.model import local_max_positions

REFUSED_BEFORE_VLLM = """
import sys
from layertap.cli import main
status = main(sys.argv[1:])
print("status", status, "vllm imported", "vllm" in sys.modules, "transformers imported", "transformers" in sys.modules,
      "torch imported", "torch" in sys.modules)
"""

NOT_IMPORTED = "status 2 vllm imported False transformers imported False torch imported False"


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4, "max_position_embeddings": 512}
    (path / "config.json").write_text(json.dumps(config))
    return path


def generate(model, tmp_path, *extra: str):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"input_ids": [5, 6, 7]}\n')
    argv = ["generate", str(model), "--data", str(data), "--out", str(tmp_path / "out"), *extra]
    return run_python(REFUSED_BEFORE_VLLM, *argv)


def test_a_max_len_beyond_the_models_context_is_refused_before_vllm(model, tmp_path):
    proc = generate(model, tmp_path, "--max-len", "600")
    assert proc.stdout.strip() == NOT_IMPORTED, proc.stderr
    assert proc.stderr.strip() == (
        "layertap generate: --max-len 600 plus --max-tokens 1 exceeds the model's context of 512 tokens "
        "(max_position_embeddings in its config.json): pass --max-len 511 or less"
    )
    assert not (tmp_path / "out").exists()


def test_a_max_model_len_beyond_the_models_context_is_refused_before_vllm(model, tmp_path):
    proc = generate(model, tmp_path, "--engine-args", '{"max_model_len": 1024}')
    assert proc.stdout.strip() == NOT_IMPORTED, proc.stderr
    assert proc.stderr.strip() == (
        "layertap generate: --engine-args max_model_len 1024 exceeds the model's context of 512 tokens "
        "(max_position_embeddings in its config.json): give 512 or less"
    )
    assert not (tmp_path / "out").exists()


def test_an_out_of_other_layers_is_refused_before_vllm(model, tmp_path):
    out = tmp_path / "out"
    meta = {"source": "layertap.generate", "model": str(model), "layer_ids": json.dumps([1, 2])}
    with layertap.ShardWriter(str(out), writer_id="gen-0", metadata=meta) as w:
        w.submit("0", make_tensors(0))
    before = sorted(p.name for p in out.iterdir())
    proc = generate(model, tmp_path, "--layers", "1,3")
    assert proc.stdout.strip() == NOT_IMPORTED, proc.stderr
    assert proc.stderr.strip() == (
        "layertap generate: --out holds gen-0-000000.lts with layers [1, 2], not [1, 3]; use another --out"
    )
    assert sorted(p.name for p in out.iterdir()) == before  # not locked, nothing written


def test_the_context_is_told_early_only_where_the_configuration_settles_it(model, monkeypatch):
    """Where vLLM could derive a longer context than the keys say (RoPE scaling, the override of
    ``model_max_length``, settings of the user's) or the model is not a local directory, the
    engine checks it, as before."""
    config = json.loads((model / "config.json").read_text())
    name = str(model)
    assert local_max_positions(name, config, {}) == (512, "max_position_embeddings")
    assert local_max_positions(name, {**config, "n_positions": 256}, {}) == (256, "n_positions")
    assert local_max_positions(name, {"text_config": {"seq_length": 300}}, {}) == (300, "seq_length")
    assert local_max_positions("org/model", config, {}) is None  # a hub name
    assert local_max_positions(name, None, {}) is None
    assert local_max_positions(name, {"num_hidden_layers": 4}, {}) is None  # no key: vLLM's default
    assert local_max_positions(name, {**config, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}, {}) is None
    assert local_max_positions(name, {**config, "rope_parameters": {"full": {"factor": 2.0}}}, {}) is None
    assert local_max_positions(name, {**config, "model_max_length": 8192}, {}) is None
    assert local_max_positions(name, config, {"hf_overrides": {"max_position_embeddings": 4096}}) is None
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert local_max_positions(name, config, {}) is None


def test_data_from_a_pipe_is_refused_before_vllm(model, tmp_path):
    """``--data <(zcat rows.jsonl.gz)`` hands generate a pipe it can read once: it counted the rows
    in it, then streamed none (the pipe was drained) and resumed none. Refused, naming the fix."""
    read, write = os.pipe()
    os.write(write, b'{"input_ids": [5, 6, 7]}\n')
    os.close(write)
    try:
        argv = ["generate", str(model), "--data", f"/dev/fd/{read}", "--out", str(tmp_path / "out")]
        proc = run_python(REFUSED_BEFORE_VLLM, *argv, pass_fds=(read,))
    finally:
        os.close(read)
    assert proc.stdout.strip() == NOT_IMPORTED, proc.stderr
    assert proc.stderr.strip() == (
        f"layertap generate: /dev/fd/{read}: is a pipe (as `<(...)` or stdin give), which can be read once; "
        "generate reads --data more than once (to count its rows, to stream them, to resume): write it to a "
        "file first, e.g. `zcat rows.jsonl.gz > rows.jsonl`"
    )
    assert not (tmp_path / "out").exists()
