"""``layertap generate`` without an engine: reading rows (JSONL, Parquet, datasets directories),
rendering them with the tiny model's tokenizer, and what an output directory left by earlier
(killed) runs resumes from."""

from __future__ import annotations

import fcntl
import json
import os
import sys
import types

import numpy as np
import pytest

import layertap
from helpers import Holder, cut_footer, make_tensors
from layertap._spec import format as fmt
from layertap._spec.format import FILE_MAGIC
from layertap.generate.data import BadRow, Row, open_rows
from layertap.generate.errors import GenerateError
from layertap.generate.model import config_num_layers, default_layers, parse_layers
from layertap.generate.options import GenerateOptions
from layertap.generate.render import BadRowError, Renderer
from layertap.generate.resume import LOCK_NAME, prepare_output

ROWS = [
    {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
    {"input_ids": [8], "loss_mask": [1]},
    {"input_ids": None},
    {"input_ids": [9, 10], "loss_mask": [1, 0]},
]


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def read_all(source, skip=None) -> list:
    return list(source.rows(skip))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from tiny_llama import build_tiny_llama

    return AutoTokenizer.from_pretrained(build_tiny_llama(tmp_path_factory.mktemp("tiny")))


def test_jsonl_parquet_and_datasets_give_the_same_rows(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = write_jsonl(tmp_path / "d.jsonl", ROWS)
    table = pa.Table.from_pylist(ROWS)
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=2)
    datasets.Dataset(table).save_to_disk(str(tmp_path / "hf"))
    want = [Row(0, [5, 6, 7], [0, 1, 1]), Row(1, [8], [1]), None, Row(3, [9, 10], [1, 0])]
    for path in (jsonl, tmp_path / "d.parquet", tmp_path / "hf"):
        source = open_rows(path)
        assert (source.column, source.has_loss_mask, source.num_rows) == ("input_ids", True, 4), path
        got = read_all(source)
        assert isinstance(got[2], BadRow) and got[2].index == 2 and "input_ids" in got[2].reason, path
        assert [r for i, r in enumerate(got) if i != 2] == [w for w in want if w is not None], path
        # Rows done before are skipped (not even parsed); --limit keeps the first rows.
        assert [r.index for r in read_all(source, skip=np.array([True, False, True, False]))] == [1, 3]
        assert [r.index for r in read_all(open_rows(path, limit=2))] == [0, 1]
    assert open_rows(tmp_path / "hf").format == "datasets" and open_rows(tmp_path / "d.parquet").format == "parquet"


def test_jsonl_bad_lines_are_rows_too(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl", ['{"prompt": "a b"}', "", "{not json", "[1, 2]", '{"other": 1}', '{"prompt": "c"}']
    )
    got = read_all(open_rows(path))
    assert [type(r).__name__ for r in got] == ["Row", "BadRow", "BadRow", "BadRow", "BadRow", "Row"]
    assert [r.reason.split(":")[0] for r in got if isinstance(r, BadRow)] == [
        "empty line",
        "not JSON",
        "not a JSON object but list",
        "no 'prompt'",
    ]


def test_column_choice_and_input_errors(tmp_path):
    import datasets

    both = write_jsonl(tmp_path / "both.jsonl", [{"prompt": "x", "messages": [], "input_ids": [1]}])
    assert open_rows(both).column == "input_ids"
    assert open_rows(write_jsonl(tmp_path / "m.jsonl", [{"prompt": "x", "messages": []}])).column == "messages"
    cases = [
        (tmp_path / "missing.jsonl", "no such file or directory"),
        (
            write_jsonl(tmp_path / "nocol.jsonl", [{"text": "x"}]),
            "no prompt column: expected one of input_ids, messages, prompt",
        ),
        (write_jsonl(tmp_path / "empty.jsonl", []), "no line holds a JSON object"),
        (write_jsonl(tmp_path / "bad.parquet", ["nope"]), "not a readable Parquet file"),
    ]
    dd = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "x"}])}).save_to_disk(str(dd))
    cases += [
        (dd, "a DatasetDict with splits ['train']; pass one split's directory"),
        (tmp_path, "not a datasets directory"),
    ]
    for path, message in cases:
        with pytest.raises(GenerateError, match=message.replace("[", r"\[").replace("]", r"\]")):
            open_rows(path)


def test_render_rows(tokenizer):
    r = Renderer(tokenizer, "messages", vocab_size=len(tokenizer), max_len=20)
    chat = [{"role": "user", "content": "the water"}, {"role": "assistant", "content": "is hot"}]
    ids, mask = r.render(chat)
    assert tokenizer.convert_ids_to_tokens(ids) == [
        "<|user|>",
        "the",
        "water",
        "<|end|>",
        "<|assistant|>",
        "is",
        "hot",
        "<|end|>",
    ]
    assert mask is None
    # A chat that ends with the user gets the generation prompt.
    ids, _ = r.render(chat[:1])
    assert tokenizer.convert_ids_to_tokens(ids)[-1] == "<|assistant|>"
    assert r.render(chat, loss_mask=[0] * 5 + [1] * 3)[1] == [0] * 5 + [1] * 3
    for value, mask, why in [
        (chat, [1] * 7, "loss_mask has 7 entries for 8 tokens"),
        (chat, [0, 1, 2, 1, 1, 1, 1, 1], "must be 0 or 1"),
        ([{"role": "user", "content": " ".join(["the"] * 30)}], None, "more than --max-len 20"),
        ("hello", None, "messages must be a non-empty list"),
        ([], None, "messages must be a non-empty list"),
    ]:
        with pytest.raises(BadRowError, match=why):
            r.render(value, mask)
    ids_renderer = Renderer(tokenizer, "input_ids", vocab_size=100, max_len=20)
    assert ids_renderer.render([3, 4, 99])[0] == [3, 4, 99]
    for value, why in [
        ([3, 100], "holds 100, outside the vocabulary of 100"),
        ([-1], "holds -1"),
        ([1.5], "flat list of integers"),
        ("3 4", "must be a list"),
        ([], "no tokens"),
    ]:
        with pytest.raises(BadRowError, match=why):
            ids_renderer.render(value)
    text = Renderer(tokenizer, "prompt", vocab_size=len(tokenizer), max_len=20)
    assert text.render("the water")[0] == tokenizer("the water")["input_ids"]


CHATS = [
    [{"role": "user", "content": "the water"}, {"role": "assistant", "content": "is hot"}],
    [
        {"role": "system", "content": "you are a dog"},
        {"role": "user", "content": "who are you"},
        {"role": "assistant", "content": "a good dog"},
        {"role": "user", "content": "what do you eat"},
        {"role": "assistant", "content": "food and more food"},
    ],
    # Ends with the user: the generation prompt is appended, and only the earlier answer is masked.
    [
        {"role": "user", "content": "the sun"},
        {"role": "assistant", "content": "is hot"},
        {"role": "user", "content": "and the moon"},
    ],
    [{"role": "user", "content": "only a question"}],
]


@pytest.fixture(scope="module")
def marked_tokenizer(tokenizer):
    """The tiny tokenizer with a chat template that marks the assistant's turns."""
    import copy

    from tiny_llama import CHAT_TEMPLATE_WITH_GENERATION

    marked = copy.deepcopy(tokenizer)
    marked.chat_template = CHAT_TEMPLATE_WITH_GENERATION
    return marked


def test_assistant_loss_mask_is_transformers(tokenizer, marked_tokenizer):
    r = Renderer(marked_tokenizer, "messages", vocab_size=len(tokenizer), max_len=100)
    assert (
        r.mask_from == "assistant" and r.stores_mask
    )  # the default (auto): the template has the markers, the data no mask
    plain = Renderer(tokenizer, "messages", vocab_size=len(tokenizer), max_len=100)
    assert plain.mask_from == "data" and not plain.stores_mask  # no markers: a row's loss_mask, if any
    for chat in CHATS:
        want = marked_tokenizer.apply_chat_template(
            chat,
            add_generation_prompt=chat[-1]["role"] != "assistant",
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        ids, mask = r.render(chat)
        assert (ids, mask) == (want["input_ids"], want["assistant_masks"])
        assert ids == plain.render(chat)[0]  # the same tokens as without a mask
    ids, mask = r.render(CHATS[0])
    tokens = marked_tokenizer.convert_ids_to_tokens(ids)
    assert [t for t, m in zip(tokens, mask) if m] == ["is", "hot", "<|end|>"]
    assert sum(r.render(CHATS[1])[1]) == 4 + 5  # both answers, each with its <|end|>
    assert sum(r.render(CHATS[3])[1]) == 0  # no answer: nothing to train on, stored as such
    # A row's own loss_mask is not used when the mask comes from the template.
    assert r.render(CHATS[0], loss_mask=[1] * 8)[1] == mask


def test_where_the_loss_mask_comes_from(tokenizer, marked_tokenizer):
    n = len(tokenizer)
    chat = CHATS[0]
    assert Renderer(marked_tokenizer, "messages", n, 100, "none").render(chat, [1] * 8)[1] is None
    assert Renderer(tokenizer, "messages", n, 100, "none").render(chat, [1] * 8)[1] is None
    data = Renderer(marked_tokenizer, "messages", n, 100, "auto", data_has_mask=True)
    assert data.mask_from == "data" and data.render(chat, [0] * 7 + [1])[1] == [0] * 7 + [1]
    assert Renderer(marked_tokenizer, "messages", n, 100, "assistant").mask_from == "assistant"
    assert data.stores_mask
    # One vector per row: no assistant mask unless asked for (refused below); other columns: the rows'.
    for column, reduction in [("messages", "mean"), ("prompt", None)]:
        r = Renderer(marked_tokenizer, column, n, 100, "auto", reduction=reduction)
        assert r.mask_from == "data" and not r.stores_mask


def test_loss_mask_refusals(tokenizer, marked_tokenizer):
    n = len(tokenizer)
    template = marked_tokenizer.chat_template
    # What a tokenizer without offsets looks like to the renderer (transformers maps the markers
    # to tokens through a fast tokenizer's offsets).
    slow = types.SimpleNamespace(chat_template=template, get_chat_template=lambda: template, is_fast=False)
    assert Renderer(slow, "messages", n, 100).mask_from == "data"  # auto: no assistant mask from it
    for args, why in [
        (
            (tokenizer, "messages", n, 100, "assistant"),
            "--loss-mask assistant needs a chat template that marks the assistant's turns with "
            "{% generation %} ... {% endgeneration %}, and the model's has no such markers: "
            "use a template with them, or give the mask in a loss_mask column",
        ),
        ((marked_tokenizer, "input_ids", n, 100, "assistant"), "the data has 'input_ids', not 'messages'"),
        ((marked_tokenizer, "messages", n, 100, "assistant", True), "and the data's loss_mask column: drop one"),
        ((marked_tokenizer, "messages", n, 100, "assistant", False, "last"), "drop --loss-mask assistant or the"),
        ((marked_tokenizer, "messages", n, 100, "auto", True, "last"), "drop it or the reduction"),
        ((marked_tokenizer, "messages", n, 100, "yes"), "--loss-mask must be one of 'auto', 'assistant', 'none'"),
        ((slow, "messages", n, 100, "assistant"), "--loss-mask assistant needs a fast tokenizer"),
    ]:
        with pytest.raises(GenerateError) as e:
            Renderer(*args)
        assert why in str(e.value) and "\n" not in str(e.value)


def test_layers():
    assert default_layers(32) == [2, 16, 29, 32]
    assert default_layers(4) == [1, 2, 4]  # 2, 4//2, 4-3, 4: distinct ones
    assert parse_layers(GenerateOptions("m", "d", "o", layers="16, 2,32").layers, 32) == [2, 16, 32]
    assert parse_layers(None, 4) == [1, 2, 4]
    for layers, why in [
        ("2,2", "--layers \\[2, 2\\] repeat an id"),
        ("a,b", "comma-separated integers"),
        ([], "non-empty list"),
    ]:
        with pytest.raises(GenerateError, match=why):
            GenerateOptions("m", "d", "o", layers=layers)  # before the model is looked at
    for layers, why in [([2, 33], r"\[33\] are out of range for a model of 32 layers"), ([-1], "out of range")]:
        with pytest.raises(GenerateError, match=why):
            parse_layers(GenerateOptions("m", "d", "o", layers=layers).layers, 32)


def test_layer_count_of_raw_configs():
    # What generate checks layer ids against before anything loads: a count, in the text part
    # of a multimodal config too, or the length of a hybrid's per-layer list where that is all
    # the config gives (Nemotron-H's config.json: transformers derives num_hidden_layers).
    assert config_num_layers({"num_hidden_layers": 28}) == 28
    assert config_num_layers({"text_config": {"num_hidden_layers": 36}, "vision_config": {}}) == 36
    assert config_num_layers({"n_layer": 12}) == 12
    nemotron_h = {"layers_block_type": ["mamba", "mlp", "mamba", "attention", "mlp", "mamba"]}
    assert config_num_layers(nemotron_h) == 6
    assert config_num_layers({"hybrid_override_pattern": "M-M*-M"}) == 6
    assert config_num_layers({"num_hidden_layers": 4, "layer_types": ["a"] * 4}) == 4
    assert config_num_layers({"hidden_size": 8}) is None
    assert config_num_layers({"num_hidden_layers": True}) is None


def shard_meta(model="m", layers=(1, 2)) -> dict:
    return {"source": "layertap.generate", "model": model, "layer_ids": json.dumps(list(layers))}


def test_resume_completes_what_killed_runs_left(tmp_path):
    out = tmp_path / "out"
    with layertap.ShardWriter(str(out), writer_id="gen-0", metadata=shard_meta()) as w:
        for i in (0, 1, 2):
            w.submit(str(i), make_tensors(i))
    with layertap.ShardWriter(str(out), writer_id="gen-1", metadata=shard_meta()) as w:
        for i in (3, 4):
            w.submit(str(i), make_tensors(i))
    [killed] = [p for p in out.iterdir() if p.name.startswith("gen-1-")]
    cut_footer(killed, extra=b"\x07" * 100)  # an open shard with a torn tail, as after a SIGKILL
    (out / "gen-2-000000.lts").write_bytes(b"")  # killed before the header was written
    (out / "gen-3-000000.lts").write_bytes(FILE_MAGIC + b"\0" * 20)  # inside it
    state = prepare_output(str(out), "m", [2, 1])
    try:
        assert state.done.tolist() == [0, 1, 2, 3, 4] and state.duplicates == 0
        assert state.recovered == [str(killed)]
        assert sorted(os.path.basename(p) for p in state.set_aside) == ["gen-2-000000.lts", "gen-3-000000.lts"]
        assert state.run == 4 and state.writer_id == "gen-4"
        # The lock keeps a second run out.
        with pytest.raises(GenerateError, match="another layertap generate is writing into this directory"):
            prepare_output(str(out), "m", [1, 2])
    finally:
        state.release()
    assert sorted(p.name for p in out.iterdir()) == [
        LOCK_NAME,
        "gen-0-000000.lts",
        "gen-1-000000.lts",
        "gen-3-000000.lts.torn",
    ]
    with layertap.open(out) as ds:
        assert ds.verify().ok and all(s.complete for s in ds.shards)
    with pytest.raises(GenerateError, match=r"made with model 'm', not 'other'"):
        prepare_output(str(out), "other", [1, 2])
    with pytest.raises(GenerateError, match=r"with layers \[1, 2\], not \[1, 3\]"):
        prepare_output(str(out), "m", [1, 3])


def test_resume_keeps_a_shard_whose_header_was_damaged(tmp_path):
    """A run's shard whose meta_len was damaged after its frames were written (one bit) looks
    shorter than its header; it is not a torn empty shard (recover would remove it and its
    records): set aside as NAME.torn, bytes unchanged, its rows written again."""
    out = tmp_path / "out"
    with layertap.ShardWriter(str(out), writer_id="gen-0", metadata=shard_meta()) as w:
        for i in (0, 1):
            w.submit(str(i), make_tensors(i))
    with layertap.ShardWriter(str(out), writer_id="gen-1", metadata=shard_meta()) as w:
        w.submit("2", make_tensors(2))
    [damaged] = out.glob("gen-1-*.lts")
    data = bytearray(damaged.read_bytes())
    k = len(data).bit_length()  # one bit of meta_len: a header longer than the file, under 1 MiB
    data[12 + k // 8] ^= 1 << (k % 8)
    assert len(data) < int.from_bytes(data[12:16], "little") <= 1 << 20
    damaged.write_bytes(bytes(data))
    state = prepare_output(str(out), "m", [1, 2])
    try:
        assert state.done.tolist() == [0, 1] and state.set_aside == [str(damaged)]
    finally:
        state.release()
    assert (out / (damaged.name + ".torn")).read_bytes() == bytes(data)


def _empty_shard(path, meta: dict) -> None:
    """A complete shard of no records whose metadata is ``meta`` (any JSON object is a shard's
    metadata to a reader: another tool may write what layertap's writers do not)."""
    out = bytearray(fmt.encode_file_header(bytes(16), meta))
    index = fmt.encode_index([])
    at = len(out)
    out += fmt.encode_frame_header(fmt.KIND_INDEX, 0, b"", len(index), len(index), 0, fmt.crc32c(index))
    out += index + bytes(-len(index) % 8) + fmt.encode_trailer(at, 0)
    path.write_bytes(bytes(out))


@pytest.mark.parametrize(
    "user, problem",
    [
        ("not an object", "not written by layertap generate"),
        ({**shard_meta(), "layer_ids": 5}, r"with layers None, not \[1, 2\]"),
    ],
)
def test_resume_refuses_shard_metadata_of_other_types_with_one_line(tmp_path, user, problem):
    out = tmp_path / "out"
    out.mkdir()
    _empty_shard(out / "gen-0-000000.lts", {"writer_id": "gen-0", "user": user})
    with pytest.raises(GenerateError, match=problem):
        prepare_output(str(out), "m", [1, 2])


def test_resume_refuses_foreign_content(tmp_path):
    out = tmp_path / "out"
    with layertap.ShardWriter(str(out), writer_id="vllm-x", metadata={"source": "layertap.vllm"}) as w:
        w.submit("0", make_tensors(0))
    [foreign] = out.glob("*.lts")
    cut_footer(foreign)  # left open: refused before anything is changed, so it stays open
    with pytest.raises(GenerateError, match="not written by layertap generate"):
        prepare_output(str(out), "m", [1, 2])
    with layertap.open(foreign) as ds:
        assert not ds.shards[0].complete and len(ds) == 1
    other = tmp_path / "other"
    with layertap.ShardWriter(str(other), writer_id="gen-0", metadata=shard_meta()) as w:
        w.submit("row-7", make_tensors(0))
    with pytest.raises(GenerateError, match="key 'row-7', not a row index"):
        prepare_output(str(other), "m", [1, 2])
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.lts").write_bytes(b"hello")
    with pytest.raises(GenerateError, match="notes.lts: not a layertap shard.*must hold only layertap generate"):
        prepare_output(str(junk), "m", [1, 2])
    # A live writer's shard: waited for, then refused (the test holds its lock).
    held = tmp_path / "held"
    with layertap.ShardWriter(str(held), writer_id="gen-0", metadata=shard_meta()) as w:
        w.submit("0", make_tensors(0))
    [shard] = held.glob("*.lts")
    cut_footer(shard)
    fd = os.open(shard, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        import layertap.generate.resume as resume

        old, resume.LOCK_WAIT_SECONDS = resume.LOCK_WAIT_SECONDS, 0.3
        with pytest.raises(GenerateError, match="a live writer holds this shard"):
            prepare_output(str(held), "m", [1, 2])
    finally:
        resume.LOCK_WAIT_SECONDS = old
        os.close(fd)


HOLD_AS_VLLM_WORKER = (
    "import fcntl, sys, setproctitle\n"
    "setproctitle.setproctitle('VLLM::Worker')\n"  # as vLLM names its worker process
    "f = open(sys.argv[1], 'rb')\n"
    "fcntl.flock(f, fcntl.LOCK_EX)\n"
    "print('locked', flush=True)\n"
    "sys.stdin.readline()\n"
)


def test_a_held_shard_names_the_process_that_holds_it(tmp_path, monkeypatch):
    """After ``kill -9`` of the command alone, vLLM's engine processes go on (vLLM 0.32 does not
    watch its parent) and hold the shard; the rerun said "is a process of an earlier run still
    running? Stop it" without saying which. It names the holder and the kill that frees it."""
    import layertap.generate.resume as resume

    held = tmp_path / "held"
    with layertap.ShardWriter(str(held), writer_id="gen-0", metadata=shard_meta()) as w:
        w.submit("0", make_tensors(0))
    [shard] = held.glob("*.lts")
    cut_footer(shard)
    monkeypatch.setattr(resume, "LOCK_WAIT_SECONDS", 0.3)
    with Holder(HOLD_AS_VLLM_WORKER, str(shard)) as holder:
        assert holder.ready == "locked"
        pid = holder.proc.pid
        with pytest.raises(GenerateError) as e:
            prepare_output(str(held), "m", [1, 2])
    assert str(e.value) == (
        f"{shard}: a live writer holds this shard (process {pid} VLLM::Worker); is a process of an earlier "
        f"run still running? Stop it (kill {pid}), then run again"
    )


def test_optional_packages_missing(tmp_path, monkeypatch):
    """Parquet needs pyarrow and datasets directories need datasets, imported only then: without
    them, one line saying which package to install."""
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    (tmp_path / "hf").mkdir()
    for name in ("pyarrow", "pyarrow.parquet", "datasets"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    with pytest.raises(GenerateError, match="reading Parquet files needs the 'pyarrow' package"):
        open_rows(tmp_path / "d.parquet")
    with pytest.raises(GenerateError, match="reading a Hugging Face datasets directory needs the 'datasets' package"):
        open_rows(tmp_path / "hf")
