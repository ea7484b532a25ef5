"""What ``layertap generate`` refuses before anything heavy is imported (issue 24): failures that
no rerun fixes and that vLLM would otherwise report only after its engine had started (a
traceback, exit status 1, "run the same command again to resume"), and bad input that used to
wait for vLLM's import (10-20 CPU-seconds). Each is one line on stderr, exit status 2, and the
command imports neither vLLM nor torch: it runs in a child process that reports which of them it
imported.

The models are real (tiny random transformers models, saved), so that before these checks
existed each case went as far as vLLM took it; the last test runs an architecture vLLM serves
through its Transformers backend with the ids it can record, against transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from generate_support import TINY_ENGINE_ARGS, id_rows, write_jsonl

import layertap
from layertap._install import INSTALL_VLLM
from layertap.generate.errors import GenerateError
from tiny_families import build_tiny_model
from tiny_llama import save_random_model, write_tokenizer
from vllm_support import (
    VLLM_WARNINGS,
    WORKER_IN_THE_ENGINE_PROCESS,
    Reference,
    assert_hidden_states_match,
    pytest_env,
)

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]

#: Runs the command line in a child and prints, last, which heavy modules it imported.
CHILD = """
import sys
from layertap.cli import main
{before}
status = main(sys.argv[1:])
print(sorted(m for m in ("vllm", "torch") if sys.modules.get(m) is not None))
sys.exit(status)
"""


#: Runs several command lines, one after the other, in one child: each one's exit status, what
#: it wrote to stderr (file descriptor 2, whoever wrote it) and, after it, which heavy modules the
#: process holds. Modules stay imported: a command line that imported one shows it, and so does
#: every later one. A command that raises (SystemExit included) ends the child, and the test.
CHILD_MANY = """
import json, os, sys, tempfile
from layertap.cli import main
results = []
for args in json.loads(sys.argv[1]):
    with tempfile.TemporaryFile() as err:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            status = main(args)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        said = err.read().decode()
    results.append([status, said, sorted(m for m in ("vllm", "torch") if sys.modules.get(m) is not None)])
print(json.dumps(results))
"""


def generate_args(model: str, data: str, out, *extra) -> list[str]:
    args = ["generate", model, "--data", data, "--out", str(out), "--engine-args", json.dumps(TINY_ENGINE_ARGS)]
    return [*args, *map(str, extra)]


def refused(model: str, data: str, out, *extra: str, before: str = "", env: dict | None = None):
    """Runs ``layertap generate`` in a child process; returns its exit status, its stderr lines
    and the heavy modules it imported."""
    proc = subprocess.run(
        [sys.executable, "-c", CHILD.format(before=before), *generate_args(model, data, out, *extra)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})},
    )
    imported = json.loads(proc.stdout.strip().splitlines()[-1].replace("'", '"')) if proc.stdout.strip() else None
    return proc.returncode, proc.stderr.strip().splitlines(), imported


def assert_one_early_refusal(status: int, lines: list[str], imported, message: str, case="") -> None:
    assert status == 2, f"{case}\n" + "\n".join(lines[-20:])
    assert len(lines) == 1 and lines[0].startswith("layertap generate: "), f"{case}\n" + "\n".join(lines[-20:])
    assert message in lines[0], (case, lines[0])
    assert imported == [], f"{case}: imported {imported} before refusing"


def assert_refused_early(message: str, *args, **kw) -> None:
    assert_one_early_refusal(*refused(*args, **kw), message)


def assert_each_refused_early(cases: list[tuple]) -> None:
    """``assert_refused_early`` for each ``(message, model, data, out, *extra)``, the command
    lines run one after the other in one child (``CHILD_MANY``): one import of layertap and
    Python's start instead of one a case (half a second each here, 24 cases)."""
    argv = [generate_args(*case[1:]) for case in cases]
    proc = subprocess.run(
        [sys.executable, "-c", CHILD_MANY, json.dumps(argv)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(cases)
    for (message, *case), (status, said, imported) in zip(cases, results):
        assert_one_early_refusal(status, said.strip().splitlines(), imported, message, case=case)


def tiny(path: Path, architecture: str, config_class: str) -> str:
    """A random 4-layer transformers model of ``architecture`` with the tiny tokenizer."""
    import transformers

    vocab = write_tokenizer(path)
    config = getattr(transformers, config_class)(
        vocab_size=len(vocab),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return save_random_model(getattr(transformers, architecture), config, path)


@pytest.fixture(scope="module")
def ids(tmp_path_factory) -> str:
    return write_jsonl(tmp_path_factory.mktemp("ids") / "ids.jsonl", id_rows(3, 4, 9))


@pytest.fixture(scope="module")
def phi(tmp_path_factory) -> str:
    """vLLM 0.32 runs Phi (PhiForCausalLM) through its Transformers backend."""
    return tiny(tmp_path_factory.mktemp("phi"), "PhiForCausalLM", "PhiConfig")


def test_without_vllm(tiny_model, ids, tmp_path):
    assert_refused_early(
        f"layertap generate needs vLLM, which is not installed here: {INSTALL_VLLM}",
        tiny_model,
        ids,
        tmp_path / "out",
        before="sys.modules['vllm'] = None  # as if it were not installed",
    )


def test_bad_input_before_any_import(tiny_model, ids, tmp_path):
    out = tmp_path / "out"
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"num_hidden_layers": 4,')
    nocol = write_jsonl(tmp_path / "nocol.jsonl", [{"text": "the water"}])
    assert_each_refused_early(
        [
            ("layer ids [5, 9] are out of range for a model of 4 layers", tiny_model, ids, out, "--layers", "2,5,9"),
            ("--layers must be comma-separated integers", tiny_model, ids, out, "--layers", "two"),
            (f"cannot load model '{empty}': {empty} has no config.json", str(empty), ids, out),
            (f"cannot load model '{broken}': {broken}/config.json: JSONDecodeError", str(broken), ids, out),
            ("./no-such-model: no such directory", "./no-such-model", ids, out),
            (f"{tmp_path}/none.jsonl: no such file or directory", tiny_model, str(tmp_path / "none.jsonl"), out),
            ("no prompt column", tiny_model, nocol, out),
            ("--engine-args is not JSON", tiny_model, ids, out, "--engine-args", "{x"),
        ]
    )
    assert not out.exists()


def test_an_out_that_cannot_be_the_dataset_is_refused_first(tiny_model, ids, tmp_path):
    """Issue 34, item 8: --out at a file failed after vLLM's import (10 s), and a directory of
    other files was written into silently. Both are refused first, and nothing is changed; an
    earlier run's directory, or --allow-other-files, goes on to the next check (here: layer ids
    out of range, the first check after --out's)."""
    a_file = tmp_path / "hs"
    a_file.write_text("not a directory")
    store = "mooncake://127.0.0.1:1/hs"  # no master there: the spool is refused before the store is asked
    home = tmp_path / "home"
    home.mkdir()
    for name in ("notes.txt", ".bashrc", "chats.jsonl", "old.lts.bak"):
        (home / name).write_text("mine")
    later = "layer ids [5, 9] are out of range"
    earlier = tmp_path / "earlier"  # what a run leaves (a killed one too), as docs/GENERATE.md lists it
    (earlier / "engine-0").mkdir(parents=True)
    for name in (
        ".layertap-generate.lock",
        "vllm.log",
        "layertap-dataset.json",
        "gen-0-000000.lts.torn",
        "gen-0.error",
    ):
        (earlier / name).write_text("")
    assert_each_refused_early(
        [
            (f"--out {a_file} is a file, not a directory", tiny_model, ids, a_file),
            (f"--also-dir {a_file} is a file, not a directory", tiny_model, ids, store, "--also-dir", a_file),
            (
                f"--out {home} holds files that are not a layertap dataset's (.bashrc, chats.jsonl, notes.txt and 1 "
                "more): give an empty or new directory, or pass --allow-other-files",
                tiny_model,
                ids,
                home,
            ),
            (later, tiny_model, ids, home, "--allow-other-files", "--layers", "2,5,9"),
            (later, tiny_model, ids, earlier, "--layers", "2,5,9"),
        ]
    )
    assert a_file.read_text() == "not a directory"
    assert sorted(p.name for p in home.iterdir()) == [".bashrc", "chats.jsonl", "notes.txt", "old.lts.bak"]


def test_a_window_that_holds_no_token_is_refused_first(tiny_model, ids, tmp_path):
    """Issue 34, item 7: such a window was refused only once the engine had started (40 s), and
    left an empty shard behind; the documented negative forms did not parse."""
    out = tmp_path / "out"
    later = "layer ids [5, 9] are out of range"  # the window parsed and passed; the next check refused
    assert_each_refused_early(
        [
            *(
                (f"--window {window} holds no token of any row", tiny_model, ids, out, "--window", window)
                for window in ("10:5", "5:5", "-5:-10", ":0", "-64:0")
            ),
            *(
                (later, tiny_model, ids, out, "--window", window, "--layers", "2,5,9")
                for window in ("-64:", "-64:-1", "100:", ":-1", "0:64", "10:-5")
            ),
        ]
    )
    assert not out.exists()


def test_architecture_without_the_interface(ids, tmp_path):
    """StableLM: vLLM's class has no EAGLE-3 interface and layertap's plugin none for it."""
    stablelm = tiny(tmp_path / "stablelm", "StableLmForCausalLM", "StableLmConfig")
    assert_refused_early(
        "vLLM's StablelmForCausalLM (StableLmForCausalLM) lacks the EAGLE-3 interface that --capture method "
        "(vLLM's extract_hidden_states) needs, and layertap's plugin has no class for it",
        stablelm,
        ids,
        tmp_path / "out",
    )


def test_architecture_the_plugin_covers(ids, tmp_path):
    """Gemma 2: the fix is layertap's plugin, or capture in the model."""
    from layertap.generate.capture import check_served

    gemma2 = build_tiny_model(tmp_path / "gemma2", "Gemma2ForCausalLM")
    message = "set LAYERTAP_EAGLE3=1 (layertap's plugin adds the interface to it) or pass --capture in-model"
    assert_refused_early(message, gemma2, ids, tmp_path / "out", env={"LAYERTAP_EAGLE3": "0"})
    with pytest_env({"LAYERTAP_EAGLE3": "Gemma2ForCausalLM"}):
        check_served(["Gemma2ForCausalLM"], "method", [1, 2, 4], 4, True, {})  # the plugin serves it
    with pytest_env({"LAYERTAP_EAGLE3": "Gema2ForCausalLM"}), pytest.raises(GenerateError, match="unknown archit"):
        check_served(["Gemma2ForCausalLM"], "method", [1, 2, 4], 4, True, {})


def test_issue_36_families(ids, tmp_path):
    """GLM-4.5's vLLM class lacks the interface: refused in one line before anything starts unless
    the plugin is on (which adds it); the other text families of issue 36 have vLLM's own."""
    from layertap.generate.capture import check_served

    glm = build_tiny_model(tmp_path / "glm4moe", "Glm4MoeForCausalLM")
    message = (
        "vLLM's Glm4MoeForCausalLM (Glm4MoeForCausalLM) lacks the EAGLE-3 interface that --capture method "
        "(vLLM's extract_hidden_states) needs; set LAYERTAP_EAGLE3=1"
    )
    assert_refused_early(message, glm, ids, tmp_path / "out", env={"LAYERTAP_EAGLE3": "0"})
    with pytest_env({"LAYERTAP_EAGLE3": "0"}):
        with pytest.raises(GenerateError, match="lacks the EAGLE-3 interface"):
            check_served(["Glm4MoeForCausalLM"], "method", [0, 2, 4], 4, True, {})
        for arch in [
            "GptOssForCausalLM",
            "Llama4ForCausalLM",
            "Ministral3ForCausalLM",
            "Qwen3MoeForCausalLM",
            "MiniMaxM2ForCausalLM",
        ]:
            check_served([arch], "method", [0, 2, 4], 4, True, {})
    with pytest_env({"LAYERTAP_EAGLE3": "Glm4MoeForCausalLM"}):
        check_served(["Glm4MoeForCausalLM"], "method", [0, 2, 4], 4, True, {})


def test_layer_zero_of_deepseek_with_the_method(ids, tmp_path):
    """vLLM 0.32's own capture in DeepSeek-V2/V3 fails on id 0 after start-up (a TypeError, see
    test_kernel_replaced_values.py, which records ids 1 to N there): refused first, naming both
    fixes; other ids, and capture in the model, pass."""
    from layertap.generate.capture import check_served

    deepseek = build_tiny_model(tmp_path / "deepseek", "DeepseekV3ForCausalLM")
    message = (
        "layer id 0 (the embeddings) cannot be recorded from DeepseekV3ForCausalLM with --capture method: "
        "vLLM's own capture in its model adds a residual that does not exist yet before the first layer; "
        "pass --layers without 0, or --capture in-model"
    )
    assert_refused_early(message, deepseek, ids, tmp_path / "out", "--layers", "0,2,4")
    with pytest.raises(GenerateError, match="layer id 0 .* from DeepseekV2ForCausalLM with --capture method"):
        check_served(["DeepseekV2ForCausalLM"], "method", [0, 4], 4, True, {})
    check_served(["DeepseekV3ForCausalLM"], "method", [1, 2, 4], 4, True, {})
    check_served(["DeepseekV3ForCausalLM"], "in-model", [0, 2, 4], 4, True, {})
    check_served(["LlamaForCausalLM"], "method", [0, 2, 4], 4, True, {})


def test_layer_zero_through_the_transformers_backend(phi, ids, tmp_path):
    from layertap.generate.capture import check_served

    message = (
        "layer id 0 (the embeddings) cannot be recorded from PhiForCausalLM: vLLM runs it through its "
        "Transformers backend, which records the outputs of decoder layers only (ids 1 to 4); pass --layers without 0"
    )
    assert_refused_early(message, phi, ids, tmp_path / "out", "--layers", "0,2,4")
    # Asking for vLLM's Transformers backend makes any model one.
    with pytest.raises(GenerateError, match="layer id 0 .* from LlamaForCausalLM"):
        check_served(["LlamaForCausalLM"], "method", [0, 4], 4, True, {"model_impl": "transformers"})
    check_served(["LlamaForCausalLM"], "method", [0, 4], 4, True, {})  # vLLM's own Llama records 0


@pytest.mark.slow
def test_transformers_backend_records_ids_1_to_n(phi, ids, tmp_path):
    """What docs/CONNECTOR.md says of the Transformers backend: ids 1 to N work and mean what they
    mean for vLLM's own classes (id k the input of decoder layer k, N the last layer's output
    before the final norm)."""
    out = tmp_path / "out"
    # The engine in its own process: vLLM's Transformers backend rewrites transformers' Phi
    # classes in the process that loads it, and the reference below needs them as they are.
    # Its worker in that process too (one vLLM import fewer).
    engine = {**TINY_ENGINE_ARGS, "dtype": "float32", "distributed_executor_backend": WORKER_IN_THE_ENGINE_PROCESS}
    with pytest_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}):
        summary = layertap.generate(phi, ids, out, layers="1,2,4", progress="none", engine_args=engine)
    assert summary["complete"] and summary["rows_written"] == 3
    reference = Reference(phi)
    with layertap.open(out) as ds:
        for i, row in enumerate(json.loads(line) for line in Path(ids).read_text().splitlines()):
            assert_hidden_states_match(ds[str(i)], reference, row["input_ids"], layers=[1, 2, 4])
