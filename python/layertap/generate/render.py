"""Turning a row into the token ids the engine runs and the record stores.

- ``input_ids``: the ids as given (checked: integers inside the model's vocabulary);
- ``prompt``: the text tokenized as vLLM tokenizes a text prompt (``add_special_tokens=True``);
- ``messages``: the chat rendered with the model's chat template, then tokenized without adding
  special tokens (what vLLM's ``LLM.chat`` does). A chat whose last message is the assistant's is
  rendered as is (a finished conversation, the usual drafter training data); otherwise the
  template's generation prompt is appended, so the model answers it.

A row that cannot be rendered raises ``BadRowError`` with the reason; the row is then skipped and
listed in the summary.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from layertap.generate.errors import GenerateError


class BadRowError(Exception):
    """This row cannot be used; the message says why."""


class Renderer:
    def __init__(self, tokenizer: Any, column: str, vocab_size: int, max_len: int):
        self.tokenizer = tokenizer
        self.column = column
        self.vocab_size = vocab_size
        self.max_len = max_len
        self._render = {"input_ids": self._ids, "prompt": self._text, "messages": self._chat}[column]
        if column == "messages" and not getattr(tokenizer, "chat_template", None):
            raise GenerateError(
                "the data has 'messages' but the model's tokenizer has no chat template; "
                "give token ids ('input_ids') or text ('prompt') instead"
            )

    def render(self, value: Any, loss_mask: Any = None) -> tuple[list[int], list[int] | None]:
        """The row's token ids and its loss mask (checked: one 0/1 per token), or BadRowError."""
        ids = self._render(value)
        if not ids:
            raise BadRowError("no tokens")
        if len(ids) > self.max_len:
            raise BadRowError(f"{len(ids)} tokens, more than --max-len {self.max_len}")
        if loss_mask is None:
            return ids, None
        return ids, _check_mask(loss_mask, len(ids))

    def _ids(self, value: Any) -> list[int]:
        if isinstance(value, np.ndarray):
            value = value.tolist()
        if not isinstance(value, (list, tuple)):
            raise BadRowError(f"input_ids must be a list of token ids, not {type(value).__name__}")
        try:
            ids = np.asarray(value)
        except (ValueError, TypeError):
            ids = None
        if ids is None or ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise BadRowError("input_ids must be a flat list of integers")
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = int(ids.max()) if ids.max() >= self.vocab_size else int(ids.min())
            raise BadRowError(f"input_ids holds {bad}, outside the vocabulary of {self.vocab_size} tokens")
        return ids.tolist()

    def _text(self, value: Any) -> list[int]:
        if not isinstance(value, str):
            raise BadRowError(f"prompt must be a string, not {type(value).__name__}")
        return list(self.tokenizer(value)["input_ids"])

    def _chat(self, value: Any) -> list[int]:
        if isinstance(value, np.ndarray):
            value = value.tolist()
        if (
            not isinstance(value, (list, tuple))
            or not value
            or not all(isinstance(m, dict) and "role" in m for m in value)
        ):
            raise BadRowError("messages must be a non-empty list of objects with a 'role'")
        try:
            text = self.tokenizer.apply_chat_template(
                list(value), tokenize=False, add_generation_prompt=value[-1]["role"] != "assistant"
            )
        except Exception as e:  # a template raises what its author chose (TemplateError, ...)
            raise BadRowError(f"the chat template failed: {type(e).__name__}: {e}") from None
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _check_mask(mask: Any, n: int) -> list[int]:
    if isinstance(mask, np.ndarray):
        mask = mask.tolist()
    if not isinstance(mask, (list, tuple)):
        raise BadRowError(f"loss_mask must be a list of 0 and 1, not {type(mask).__name__}")
    if len(mask) != n:
        raise BadRowError(f"loss_mask has {len(mask)} entries for {n} tokens")
    try:
        arr = np.asarray(mask)
    except (ValueError, TypeError):
        arr = None
    if arr is None or arr.ndim != 1 or arr.dtype.kind not in "biu" or ((arr != 0) & (arr != 1)).any():
        raise BadRowError("loss_mask entries must be 0 or 1")
    return arr.astype(np.uint8).tolist()
