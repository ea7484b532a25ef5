"""Configuration: every option is checked and a bad one stops the engine at start-up with an error
naming it; the connector costs nothing, and imports nothing, when it is not configured."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import pytest

from layertap import WriterOptions
from layertap.vllm.config import (
    DEFAULT_KEY_MEMORY,
    DEFAULT_MAX_POOL_BYTES,
    DEFAULT_MIN_POOL_BYTES,
    OPTION_NAMES,
    WRITER_KEYS,
    WRITER_ONLY_FIELDS,
    ConfigError,
    default_pool_bytes,
    in_model_layer_ids,
    parse_options,
    sample_id_problem,
    writer_options_for,
)
from layertap.vllm.online import record_location
from layertap.vllm.threads import default_writer_threads
from vllm_support import VLLM_WARNINGS, collections_of_young_objects, engine_args, pytest_env, speculative_config

pytestmark = VLLM_WARNINGS  # the engine tests below are marked vllm one by one

GOOD = {"output_dir": "hs"}


@pytest.mark.parametrize(
    ("extra", "option", "message"),
    [
        ({"output_dir": "hs", "bogus": 1}, "bogus", "unknown option; the options are: output_dir, writer"),
        ({}, "output_dir", "required"),
        ({"output_dir": ""}, "output_dir", "must be a non-empty path, not ''"),
        ({**GOOD, "writer": "c++"}, "writer", "must be one of 'rust', not 'c++'"),
        (
            {**GOOD, "writer": "python"},
            "writer",
            "writer='python' was removed in 0.1.0: the Rust writer is the only writer; drop the option",
        ),
        ({**GOOD, "pool_bytes": -1}, "pool_bytes", "must be a positive integer, not -1"),
        ({**GOOD, "stats_path": 3}, "stats_path", "must be a non-empty path"),
        # The writer's options, checked by layertap.WriterOptions, named by the connector's key:
        ({**GOOD, "codec": "lz4"}, "codec", "must be one of 'none', 'zstd', 'bp16-zstd', 'exp-huf', not 'lz4'"),
        ({**GOOD, "level": 99}, "level", "must be a zstd level from -131072 to 22, not 99"),
        ({**GOOD, "level": "3"}, "level", "must be an integer, not '3'"),
        ({**GOOD, "shard_size": 0}, "shard_size", "must be a positive integer below 2**64, not 0"),
        ({**GOOD, "shard_size": 1.5}, "shard_size", "must be a positive integer"),
        ({**GOOD, "durability": "sometimes"}, "durability", "must be 'none', 'close' or a positive number"),
        ({**GOOD, "durability": True}, "durability", "must be 'none', 'close'"),
        ({**GOOD, "writer_threads": 0}, "writer_threads", "must be None or an integer from 1 to 256, not 0"),
        ({**GOOD, "max_inflight_bytes": "1G"}, "max_inflight_bytes", "must be a positive integer"),
        ({**GOOD, "batch_bytes": 0}, "batch_bytes", "must be a positive integer"),
        ({**GOOD, "io": "mmap"}, "io", "must be one of 'auto', 'uring', 'pwrite', not 'mmap'"),
        ({**GOOD, "direct": "yes"}, "direct", "must be True or False, not 'yes'"),
        ({**GOOD, "direct": 1}, "direct", "must be True or False, not 1"),
        ({**GOOD, "writer_id": "rank/0"}, "writer_id", "must be None or 1 to 64 characters"),
        ({**GOOD, "writer_id": ".hidden"}, "writer_id", "not starting with '.'"),
        ({**GOOD, "shard_metadata": {"run": 1}}, "shard_metadata", "entry 'run': 1: keys and values must be str"),
        ({**GOOD, "shard_metadata": [1]}, "shard_metadata", "must be a mapping of str to str"),
        ({**GOOD, "key_memory": 0}, "key_memory", "must be a positive integer"),
        ({**GOOD, "lossy": "fp8"}, "lossy", "must be None or 'fp8-e4m3', not 'fp8'"),
        ({**GOOD, "capture": "spec"}, "capture", "must be one of 'method', 'in-model', not 'spec'"),
        ({**GOOD, "capture": "in-model"}, "layer_ids", 'required with capture="in-model"'),
        ({**GOOD, "layer_ids": [1, 2]}, "layer_ids", 'only with capture="in-model"; with vLLM\'s'),
        ({**GOOD, "capture": "in-model", "layer_ids": [2, 2]}, "layer_ids", "[2, 2] repeats a layer"),
        ({**GOOD, "capture": "in-model", "layer_ids": []}, "layer_ids", "must be a non-empty list of layer ids"),
        ({**GOOD, "capture": "in-model", "layer_ids": [True]}, "layer_ids", "must be a non-empty list"),
        ({**GOOD, "capture": "in-model", "layer_ids": "2,3"}, "layer_ids", "must be a non-empty list"),
        ({**GOOD, "capture": "in-model", "layer_ids": [3, -1]}, "layer_ids", "[-1] are negative"),
        ({**GOOD, "save": "some"}, "save", "must be one of 'all', 'requested', not 'some'"),
        ({**GOOD, "save": True}, "save", "must be one of 'all', 'requested', not True"),
        ({**GOOD, "compress_on": "cuda"}, "compress_on", "must be one of 'host', 'gpu', not 'cuda'"),
        ({**GOOD, "compress_on": "gpu", "codec": "bp16-zstd"}, "codec", "'bp16-zstd' with compress_on=\"gpu\""),
        ({**GOOD, "compress_on": "gpu", "lossy": "fp8-e4m3"}, "lossy", 'not with compress_on="gpu"'),
    ],
)
def test_bad_option_is_named(extra, option, message):
    with pytest.raises(ConfigError, match="layertap connector: ") as info:
        parse_options(extra)
    assert info.value.option == option
    assert f"layertap connector: {option}: " in str(info.value) and message in str(info.value)
    assert isinstance(info.value, ValueError)
    # vLLM may send it to another process.
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is ConfigError and str(again) == str(info.value) and again.option == option


def test_every_option_parses(tmp_path):
    options = parse_options(
        {
            "output_dir": str(tmp_path),
            "writer": "rust",
            "codec": "zstd",
            "level": 5,
            "shard_size": 1 << 20,
            "durability": 1 << 20,
            "pool_bytes": 1 << 24,
            "writer_threads": 2,
            "max_inflight_bytes": 1 << 25,
            "batch_bytes": 1 << 16,
            "io": "pwrite",
            "direct": False,
            "writer_id": "rank-0",
            "stats_path": str(tmp_path / "s.json"),
            "shard_metadata": {"run": "7"},
            "capture": "in-model",
            "layer_ids": [4, 0, 2],
            "save": "requested",
        }
    )
    assert options.output_dir == str(tmp_path) and options.writer == "rust" and options.pool_bytes == 1 << 24
    assert options.capture == "in-model" and options.layer_ids == (4, 0, 2) and options.save == "requested"
    assert parse_options(GOOD).capture == "method" and parse_options(GOOD).layer_ids is None
    assert parse_options(GOOD).save == "all" and parse_options({**GOOD, "save": None}).save == "all"
    assert options.writer_options == WriterOptions(
        codec="zstd",
        level=5,
        shard_size=1 << 20,
        durability=1 << 20,
        threads=2,
        max_inflight_bytes=1 << 25,
        batch_bytes=1 << 16,
        io="pwrite",
        direct=False,
        writer_id="rank-0",
        metadata={"run": "7"},
    )
    assert options.writer_id == "rank-0" and options.stats_path == str(tmp_path / "s.json")
    assert parse_options({**GOOD, "direct": True}).writer_options.direct is True
    assert set(OPTION_NAMES) == {f for f in options.__dataclass_fields__ if f not in ("writer_options", "given")} | set(
        WRITER_KEYS
    )
    assert set(WRITER_KEYS.values()) | set(WRITER_ONLY_FIELDS) == set(WriterOptions.FIELDS)
    assert parse_options({"output_dir": "rel/dir"}).output_dir == os.path.abspath("rel/dir")


def test_compression_on_the_gpu_takes_codec_exp_huf():
    for extra in ({"compress_on": "gpu"}, {"compress_on": "gpu", "codec": "exp-huf"}):
        options = parse_options({**GOOD, **extra})
        assert options.compress_on == "gpu" and options.writer_options.codec == "exp-huf"
        assert "codec" in options.given
    assert (
        parse_options(GOOD).compress_on == "host" and parse_options({**GOOD, "compress_on": None}).compress_on == "host"
    )


def test_the_model_reads_only_the_capture_options():
    """Any connector's configuration may ask a layertap model class to cache its hidden states."""
    assert in_model_layer_ids(None) is None
    assert in_model_layer_ids({"shared_storage_path": "x"}) is None
    assert in_model_layer_ids({"capture": "method", "layer_ids": "ignored"}) is None
    assert in_model_layer_ids({"capture": "in-model", "layer_ids": [4, 0, 2], "other": 1}) == (4, 0, 2)
    with pytest.raises(ConfigError, match='layertap connector: layer_ids: required with capture="in-model"'):
        in_model_layer_ids({"capture": "in-model"})


def test_the_worker_completes_the_writer_options():
    """The worker's writer gets the configured options, its writer id and shard metadata, and the
    connector's own defaults for what was not configured; null means not configured."""
    defaults = writer_options_for(parse_options(GOOD), "w0", 1 << 20, {"source": "layertap.vllm", "model": "m"})
    assert defaults == WriterOptions(
        threads=default_writer_threads(),
        max_inflight_bytes=2 << 20,
        writer_id="w0",
        metadata={"source": "layertap.vllm", "model": "m"},
        key_memory=DEFAULT_KEY_MEMORY,
    )
    given = parse_options(
        {
            **GOOD,
            "writer_threads": 3,
            "max_inflight_bytes": 7,
            "shard_metadata": {"model": "x"},
            "codec": "none",
            "writer_id": None,
        }
    )
    opts = writer_options_for(given, "w0", 1 << 20, {"source": "layertap.vllm", "model": "m"})
    assert (opts.threads, opts.max_inflight_bytes, opts.codec) == (3, 7, "none")
    assert dict(opts.metadata) == {"source": "layertap.vllm", "model": "x"}
    assert given.writer_id is None


@pytest.mark.parametrize(
    ("largest", "step", "expected"),
    [
        (1 << 20, 200 << 20, 800 << 20),  # 4 full steps (Llama-1B on an H200: 16384 tokens x 12 KiB)
        (1 << 20, 1 << 20, DEFAULT_MIN_POOL_BYTES),  # a tiny model: the floor
        (1 << 20, 4 << 30, DEFAULT_MAX_POOL_BYTES),  # huge steps: the ceiling...
        (3 << 30, 4 << 30, 6 << 30),  # ... unless two of the longest requests need more
    ],
)
def test_default_pool_holds_steps_within_bounds(largest, step, expected):
    assert default_pool_bytes(largest, step) == expected


def test_default_writer_threads_follow_the_cpus(monkeypatch):
    for cpus, threads in [(1, 1), (2, 2), (4, 4), (6, 4), (8, 4), (16, 8), (64, 16)]:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)))
        assert default_writer_threads() == threads, cpus


@pytest.mark.parametrize(
    ("sample_id", "message"),
    [
        ("../etc/passwd", "contains '/'"),
        ("a\\b", "contains '\\\\'"),
        ("line\nbreak", "contains '\\n'"),
        ("", "empty"),
        ("x" * 1025, "1025 bytes long"),
        (7, "must be a str"),
    ],
)
def test_bad_sample_id_is_explained(sample_id, message):
    problem = sample_id_problem(sample_id)
    assert problem is not None and problem.startswith("sample_id: ") and message in problem


def test_good_sample_ids():
    for ok in ("row 17", "prompt:42#3", "ünïcode ✓", "x" * 1024):
        assert sample_id_problem(ok) is None


def test_record_location_reports_the_server_error():
    from layertap.errors import InvalidInputError, LayertapError

    with pytest.raises(InvalidInputError, match="did not save .*: sample_id: bad"):
        record_location({"layertap": {"error": "sample_id: bad", "reason": "invalid_request"}})
    with pytest.raises(LayertapError, match="only 3 of 9 tokens"):
        record_location({"layertap": {"error": "only 3 of 9 tokens are in the KV cache", "reason": "not_saved"}})
    with pytest.raises(LayertapError, match='did not save .*: the request\'s kv_transfer_params say "save": false'):
        record_location(
            {"layertap": {"error": 'the request\'s kv_transfer_params say "save": false', "reason": "not_requested"}}
        )
    with pytest.raises(InvalidInputError, match='no kv_transfer_params: .*send "save": true or a "sample_id"'):
        record_location(None)
    with pytest.raises(InvalidInputError, match="not valid"):
        record_location({"layertap": {"dataset": "/d", "writer_id": "../x", "key": "k"}})
    loc = record_location({"layertap": {"dataset": "/d", "writer_id": "w", "key": "k", "num_tokens": 3}})
    assert (loc.dataset, loc.writer_id, loc.key, loc.num_tokens, loc.request_id) == ("/d", "w", "k", 3, None)
    loc = record_location({"layertap": {"dataset": "/d", "writer_id": "w", "key": "k", "request_id": "k-1"}})
    assert loc.request_id == "k-1"


# -- real engines --------------------------------------------------------------------------------


def start_and_fail(args: dict) -> str:
    from vllm import LLM
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    try:
        with (
            collections_of_young_objects(),
            pytest_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
            pytest.raises(Exception) as info,
        ):
            LLM(**args)
    finally:
        # An in-process engine that fails after creating its worker connector leaves it as the
        # process's connector, and the next engine would reuse it.
        ensure_kv_transfer_shutdown()
    # vLLM may wrap the connector's error; it must be in the chain.
    texts = []
    err: BaseException | None = info.value
    while err is not None:
        texts.append(str(err))
        err = err.__cause__ or err.__context__
    return "\n".join(texts)


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            lambda a: a["kv_transfer_config"]["kv_connector_extra_config"].update(bogus=1),
            "layertap connector: bogus: unknown option",
        ),
        (
            lambda a: a["kv_transfer_config"]["kv_connector_extra_config"].update(pool_bytes=1 << 16),
            "layertap connector: pool_bytes: 65536 bytes cannot hold the largest possible request: max_model_len 512",
        ),
        (
            lambda a: a.update(speculative_config=speculative_config([1, 1])),
            "eagle_aux_hidden_state_layer_ids: [1, 1] repeats a layer",
        ),
    ],
    ids=["unknown-option", "pool-too-small", "repeated-layer"],
)
def test_bad_configuration_stops_the_engine(change, expected, tiny_model, tmp_path):
    args = engine_args(tiny_model, tmp_path / "hs")
    change(args)
    assert expected in start_and_fail(args)
    assert not any(tmp_path.glob("hs/*.lts"))


@pytest.mark.vllm
def test_no_cost_without_the_connector(tiny_model, tmp_path):
    """An engine without kv_transfer_config imports nothing of layertap, even with the package
    installed; and the online API imports nothing of vLLM."""
    code = textwrap.dedent(f"""
        import sys
        import layertap.vllm
        assert "vllm" not in sys.modules, "layertap.vllm imported vLLM"
        for name in [m for m in sys.modules if m == "layertap" or m.startswith("layertap.")]:
            del sys.modules[name]
        from vllm import LLM, SamplingParams
        llm = LLM(model={tiny_model!r}, dtype="float32", enforce_eager=True, max_model_len=256,
                  block_size=32, kv_cache_memory_bytes=16 << 20)
        llm.generate([{{"prompt_token_ids": [5, 6, 7]}}], SamplingParams(max_tokens=2), use_tqdm=False)
        loaded = sorted(m for m in sys.modules if m == "layertap" or m.startswith("layertap."))
        assert not loaded, loaded
        print("NO-LAYERTAP-OK")
    """)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0 and "NO-LAYERTAP-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
