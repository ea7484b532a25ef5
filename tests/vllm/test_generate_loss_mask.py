"""``layertap generate`` computes the assistant loss mask of chats itself (``--loss-mask``): with
a chat template that marks the assistant's turns with ``{% generation %}``, every record's
``loss_mask`` is transformers' ``return_assistant_tokens_mask`` for its row, token for token;
asked for with a template without the markers, the run is refused in one line before any engine
starts."""

from __future__ import annotations

import json
import shutil

import pytest
from generate_support import TINY_ENGINE_ARGS, chat_rows, write_jsonl

import layertap
from layertap.cli import main as layertap_cli
from vllm_support import VLLM_WARNINGS

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS, pytest.mark.usefixtures("in_process_command")]


@pytest.fixture(scope="module")
def marked_model(tiny_model, tmp_path_factory) -> str:
    """The tiny model with a chat template that renders the same text and marks the assistant's
    turns."""
    from tiny_llama import CHAT_TEMPLATE_WITH_GENERATION

    path = tmp_path_factory.mktemp("marked") / "model"
    shutil.copytree(tiny_model, path)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE_WITH_GENERATION)
    return str(path)


def generate(capsys, model: str, data: str, out, *extra: str) -> tuple[int, str, str]:
    args = ["generate", model, "--data", data, "--out", str(out), "--layers", "1,4", "--progress", "none"]
    status = layertap_cli([*args, "--engine-args", json.dumps(TINY_ENGINE_ARGS), *extra])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_assistant_masks_are_transformers(capsys, marked_model, tmp_path):
    from transformers import AutoTokenizer

    rows = chat_rows(9, seed=3)  # some end with the user: the generation prompt, unmasked
    data = write_jsonl(tmp_path / "chats.jsonl", rows)
    status, out, err = generate(capsys, marked_model, data, tmp_path / "hs", "--json")
    summary = json.loads(out)
    assert status == 0, err[-3000:]
    assert (summary["column"], summary["loss_mask"], summary["rows_written"]) == ("messages", True, 9)

    tokenizer = AutoTokenizer.from_pretrained(marked_model)
    with layertap.open(str(tmp_path / "hs")) as ds:
        for i, row in enumerate(rows):
            chat = row["messages"]
            want = tokenizer.apply_chat_template(
                chat,
                add_generation_prompt=chat[-1]["role"] != "assistant",
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
            )
            rec = ds[str(i)]
            assert rec["token_ids"].tolist() == want["input_ids"], i
            assert rec["loss_mask"].tolist() == want["assistant_masks"], i
            answers = sum(len(m["content"].split()) + 1 for m in chat if m["role"] == "assistant")
            assert int(rec["loss_mask"].sum()) == answers, i  # each answer's words and its <|end|>


def test_assistant_mask_without_markers_is_refused_before_the_engine(capsys, tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "chats.jsonl", chat_rows(3))
    out = tmp_path / "hs"
    status, stdout, err = generate(capsys, tiny_model, data, out, "--loss-mask", "assistant")
    assert status == 2 and stdout == ""
    assert err.strip().splitlines() == [
        "layertap generate: --loss-mask assistant needs a chat template that marks the assistant's turns with "
        "{% generation %} ... {% endgeneration %}, and the model's has no such markers: use a template with "
        "them, or give the mask in a loss_mask column"
    ]
    assert not out.exists() or not list(out.rglob("*.lts"))
