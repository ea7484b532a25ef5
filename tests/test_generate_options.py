"""``layertap generate``'s options, defined once (``GenerateOptions``, issue 35 item 2): the
function's keyword arguments, the command line's flags and defaults, and docs/GENERATE.md's table
name the same options; a bad value is one line naming the flag, the same from Python and from the
command line, before anything is read or written; the options reach an engine process intact."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import layertap
from helpers import run_python, subprocess_env
from layertap.cli import build_parser
from layertap.cli import main as layertap_cli
from layertap.generate import GenerateError, GenerateOptions
from layertap.generate.options import check_window, flag_of, from_namespace
from layertap.generate.run import record_params

DOCS = Path(__file__).resolve().parents[1] / "docs" / "GENERATE.md"


@pytest.fixture
def keep_environment():
    """The command sets vLLM's logging variables when they are unset; keep them out of other tests."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def generate_parser():
    return build_parser()._subparsers._group_actions[0].choices["generate"]  # type: ignore[union-attr]


def test_the_function_the_command_line_and_the_docs_name_the_same_options():
    fields = dataclasses.fields(GenerateOptions)
    # The function takes them, with the same defaults.
    params = inspect.signature(layertap.generate).parameters
    assert list(params) == [f.name for f in fields]
    assert all(params[f.name].default == f.default for f in fields if f.default is not dataclasses.MISSING)
    # A flag each, and nothing given takes the function's defaults.
    flags = {a.dest: a for a in generate_parser()._actions}
    for f in fields:
        assert f.name in flags, f.name
        assert flag_of(f) in (flags[f.name].option_strings or [f.name]), f.name
    args = generate_parser().parse_args(["M", "--data", "d.jsonl", "--out", "hs"])
    assert from_namespace(args) == GenerateOptions("M", "d.jsonl", "hs")
    # docs/GENERATE.md's table has a row for each flag.
    rows = re.findall(r"^\| `(MODEL|--[a-z-]+)", DOCS.read_text(), flags=re.M)
    assert {flag_of(f) if flag_of(f) != "model" else "MODEL" for f in fields} <= set(rows)


def test_every_value_given_both_ways_is_the_same_options():
    argv = ["M", "--data", "d.jsonl", "--out", "hs", "--layers", "4,0", "--max-tokens", "3"]
    argv += ["--include-output-tokens", "--window=-64:", "--reduction", "mean", "--loss-mask", "none"]
    argv += ["--engine-args", '{"dtype": "float32"}', "--sampling-args", '{"temperature": 0}']
    argv += ["--connector-args", '{"codec": "zstd"}', "--progress", "lines", "--progress-interval", "0.5"]
    argv += ["--limit", "7", "--max-len", "100", "--capture", "in-model", "--data-parallel-size", "2"]
    argv += ["--ray", "auto", "--allow-other-files"]
    given = from_namespace(generate_parser().parse_args(argv))
    want = GenerateOptions(
        "M",
        "d.jsonl",
        "hs",
        layers=[4, 0],
        max_tokens=3,
        include_output_tokens=True,
        window=[-64, None],
        reduction="mean",
        loss_mask="none",
        engine_args={"dtype": "float32"},
        sampling_args={"temperature": 0},
        connector_args={"codec": "zstd"},
        progress="lines",
        progress_interval=0.5,
        limit=7,
        max_len=100,
        capture="in-model",
        data_parallel_size=2,
        ray_address="auto",
        allow_other_files=True,
    )
    assert given == want
    # An engine process gets them as JSON; they come back equal, and are checked again there.
    assert GenerateOptions(**json.loads(json.dumps(want.as_json()))) == want
    assert record_params(want) == {"include_output_tokens": True, "window": [-64, None], "reduction": "mean"}
    assert record_params(GenerateOptions("M", "d", "hs", reduction="last")) == {"reduction": "last"}


#: Bad values: the Python keyword arguments, the same on the command line, and the line both give.
BAD = [
    ({"max_tokens": 0}, ["--max-tokens", "0"], "--max-tokens must be a positive integer, not 0"),
    ({"max_tokens": "x"}, ["--max-tokens", "x"], "--max-tokens must be a positive integer, not 'x'"),
    ({"limit": 1.5}, ["--limit", "1.5"], "--limit must be a positive integer, not 1.5"),
    ({"max_len": -3}, ["--max-len", "-3"], "--max-len must be a positive integer, not -3"),
    ({"data_parallel_size": 0}, ["--data-parallel-size", "0"], "--data-parallel-size must be a positive integer"),
    (
        {"progress_interval": -1},
        ["--progress-interval", "-1"],
        "--progress-interval must be a positive number of seconds, not -1",
    ),
    ({"capture": "model"}, ["--capture", "model"], "--capture must be one of 'method', 'in-model', not 'model'"),
    ({"progress": "dots"}, ["--progress", "dots"], "--progress must be one of 'auto', 'bar', 'lines', 'none'"),
    ({"loss_mask": "all"}, ["--loss-mask", "all"], "--loss-mask must be one of 'auto', 'assistant', 'none'"),
    ({"reduction": "max"}, ["--reduction", "max"], "--reduction must be one of 'last', 'mean', not 'max'"),
    ({"layers": "two"}, ["--layers", "two"], "--layers must be comma-separated integers, got 'two'"),
    ({"layers": "2,2"}, ["--layers", "2,2"], "--layers [2, 2] repeat an id; give each once"),
    ({"window": "1:2:3"}, ["--window", "1:2:3"], "--window must be START:END"),
    ({"window": "-5:-10"}, ["--window", "-5:-10"], "--window -5:-10 holds no token of any row"),
    ({"engine_args": "{x"}, ["--engine-args", "{x"], "--engine-args is not JSON"),
    ({"engine_args": "[1]"}, ["--engine-args", "[1]"], "--engine-args must be a JSON object, not [1]"),
    (
        {"engine_args": {"speculative_config": {}}},
        ["--engine-args", '{"speculative_config": {}}'],
        "--engine-args may not set 'speculative_config': layertap generate sets it",
    ),
    ({"sampling_args": {"n": 2}}, ["--sampling-args", '{"n": 2}'], "--sampling-args: n must be 1"),
    (
        {"connector_args": {"writer_id": "x"}},
        ["--connector-args", '{"writer_id": "x"}'],
        "--connector-args may not set 'writer_id'",
    ),
    ({"ray_address": ""}, ["--ray", ""], "--ray must be a Ray cluster's address (or 'auto'), not ''"),
    ({"also_dir": "spool"}, ["--also-dir", "spool"], "--also-dir goes with --out mooncake://..."),
]


@pytest.mark.parametrize("kwargs, argv, message", BAD, ids=[" ".join(b[1]) for b in BAD])
def test_a_bad_value_is_one_line_naming_the_flag_from_python_and_the_command_line(
    kwargs, argv, message, tmp_path, capsys, keep_environment
):
    out = tmp_path / "out"
    with pytest.raises(GenerateError) as python:
        layertap.generate("M", tmp_path / "none.jsonl", out, **kwargs)
    status = layertap_cli(["generate", "M", "--data", str(tmp_path / "none.jsonl"), "--out", str(out), *argv])
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    assert captured.err == f"layertap generate: {python.value}\n"
    assert str(python.value).startswith(message) and "\n" not in str(python.value)
    assert not out.exists()  # refused before anything was read or written


def test_window_values():
    assert check_window("100:", None) == [100, None]
    assert check_window("-64:", "mean") == [-64, None]
    assert check_window(" 2 : -1 ", None) == [2, -1]
    assert check_window(":", "last") == [None, None]
    assert check_window((1, 5), None) == [1, 5]
    assert check_window(None, "mean") is None
    for bad, reduction, why in [
        ("5", None, "--window must be START:END"),
        ("a:3", None, "--window must be START:END"),
        ([1.5, 3], None, "--window start must be an integer or null"),
        (None, "max", "--reduction must be one of 'last', 'mean'"),
        ((0, 0), None, "--window 0:0 holds no token"),
    ]:
        with pytest.raises(GenerateError, match=why):
            check_window(bad, reduction)


UNGUARDED_SCRIPT = """
import multiprocessing, sys
import layertap

if __name__ == "__main__":
    # vLLM starts its engine process so (spawn): the child imports this script again.
    child = multiprocessing.get_context("spawn").Process(target=print)
    child.start()
    child.join()
    sys.exit(child.exitcode)

# What docs/GENERATE.md's example did, written at a script's top level: in the spawned child this
# line runs again, while the child imports the script.
try:
    layertap.generate("MODEL", "missing.jsonl", "hs/")
except layertap.generate.GenerateError as e:
    print(e)
    sys.exit(3)
"""


def test_a_call_in_a_spawned_processs_import_of_the_script_says_to_guard_it(tmp_path):
    """A user's script calling ``layertap.generate`` at its top level, as the docs' example was
    written: vLLM starts its engine core with spawn, which imports the script again, so the call
    ran a second time in that process and failed with "another layertap generate is writing into
    this directory" (the first call's lock), and the first call with vLLM's "Engine core
    initialization failed". The second call now says what is wrong, before anything else."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=subprocess_env()
    )
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.strip() == (
        "layertap.generate was called while a process that multiprocessing started (vLLM's engine) imported "
        f'{script} again: call it under `if __name__ == "__main__":`'
    )


REFUSED_BEFORE_VLLM = """
import sys
from layertap.cli import main
status = main(sys.argv[1:])
print("status", status, "vllm imported", "vllm" in sys.modules, "transformers imported", "transformers" in sys.modules)
"""


def test_bad_connector_args_are_refused_before_vllm_is_imported(tmp_path):
    """A misspelled codec in --connector-args was refused after vLLM and transformers were
    imported (8 s of CPU here): the connector's options need neither, so they are checked with
    the other checks that come first."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4}))
    data = tmp_path / "rows.jsonl"
    data.write_text('{"input_ids": [5, 6, 7]}\n')
    argv = ["generate", str(model), "--data", str(data), "--out", str(tmp_path / "out")]
    proc = run_python(REFUSED_BEFORE_VLLM, *argv, "--connector-args", '{"codec": "zsdt"}')
    assert proc.stdout.strip() == "status 2 vllm imported False transformers imported False", proc.stderr
    assert proc.stderr.strip() == (
        "layertap generate: --connector-args: layertap connector: codec: must be one of 'none', 'zstd', "
        "'bp16-zstd', 'exp-huf', not 'zsdt'"
    )
