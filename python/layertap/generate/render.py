"""Turning a row into the token ids the engine runs and the record stores.

- ``input_ids``: the ids as given (checked: integers inside the model's vocabulary);
- ``prompt``: the text tokenized as vLLM tokenizes a text prompt (``add_special_tokens=True``);
- ``messages``: the chat rendered with the model's chat template, then tokenized without adding
  special tokens (as vLLM's ``LLM.chat``). A chat whose last message is the assistant's is
  rendered as is (a finished conversation, the usual drafter training data); otherwise the
  template's generation prompt is appended.

The loss mask stored (``--loss-mask``) is the data's ``loss_mask`` column, or, for chats, the
assistant mask transformers computes from the template's ``{% generation %}`` markers. A row
that cannot be rendered raises ``BadRowError``; it is skipped and listed in the summary.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from layertap._checks import one_of
from layertap.generate.errors import GenerateError

#: ``--loss-mask``: ``auto`` stores the data's ``loss_mask`` column when it has one, else, for
#: chats whose template marks the assistant's turns, the assistant mask (else none); ``assistant``
#: the assistant mask, refused when the template has no markers; ``none`` no mask (a
#: ``loss_mask`` column is ignored).
LOSS_MASK_MODES = ("auto", "assistant", "none")
#: How transformers tells that a template marks the assistant's turns (its own test, in
#: ``render_jinja_template``; without it, it warns and returns a mask of zeros).
_GENERATION_MARKER = re.compile(r"\{\%-?\s*generation\s*-?\%\}")


class BadRowError(Exception):
    """This row cannot be used; the message says why."""


def check_loss_mask(mode: Any, column: str, data_has_mask: bool, reduction: str | None) -> None:
    """The checks of ``--loss-mask`` that need no tokenizer, made before vLLM is imported."""
    one_of("--loss-mask", mode, LOSS_MASK_MODES, GenerateError)
    if mode == "assistant":
        if column != "messages":
            raise GenerateError(
                f"--loss-mask assistant masks the assistant's turns of chats, and the data has {column!r}, "
                "not 'messages': give chats, or the mask in a loss_mask column"
            )
        if data_has_mask:
            raise GenerateError(
                "--loss-mask assistant and the data's loss_mask column: drop one of them "
                "(--loss-mask none stores no mask; the default stores the column's)"
            )
    if reduction and (mode == "assistant" or (mode == "auto" and data_has_mask)):
        raise GenerateError(
            f"--reduction {reduction} stores one vector per row, which a loss mask cannot mask; "
            + (
                "drop --loss-mask assistant or the reduction"
                if mode == "assistant"
                else "the data has a loss_mask column: drop it or the reduction (or pass --loss-mask none)"
            )
        )


def marks_assistant_turns(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template has ``{% generation %}`` markers."""
    try:
        template = tokenizer.get_chat_template()
    except Exception:  # no template (ValueError), or several without a default
        return False
    return bool(_GENERATION_MARKER.search(template))


class Renderer:
    """Renders rows of one ``column`` into token ids and the loss mask to store. ``mask_from``:
    ``"data"`` (the row's ``loss_mask``), ``"assistant"`` (the chat template's markers) or None."""

    def __init__(
        self,
        tokenizer: Any,
        column: str,
        vocab_size: int,
        max_len: int,
        loss_mask: str = "auto",
        data_has_mask: bool = False,
        reduction: str | None = None,
    ):
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
        check_loss_mask(loss_mask, column, data_has_mask, reduction)
        self.mask_from = _mask_from(loss_mask, column, data_has_mask, reduction, tokenizer)
        #: Whether the records hold a loss mask (the summary's ``loss_mask``).
        self.stores_mask = self.mask_from == "assistant" or (self.mask_from == "data" and data_has_mask)

    def render(self, value: Any, loss_mask: Any = None) -> tuple[list[int], list[int] | None]:
        """The row's token ids and the loss mask to store, or BadRowError."""
        ids, assistant_mask = self._render(value)
        if not ids:
            raise BadRowError("no tokens")
        if len(ids) > self.max_len:
            raise BadRowError(f"{len(ids)} tokens, more than --max-len {self.max_len}")
        if self.mask_from == "assistant":
            return ids, assistant_mask
        if self.mask_from is None or loss_mask is None:
            return ids, None
        return ids, _check_mask(loss_mask, len(ids))

    def token_ids(self, value: Any) -> list[int]:
        """The row's token ids as ``render`` gives them, without its check of the length (an earlier
        run may have had another --max-len)."""
        return self._render(value)[0]

    def _ids(self, value: Any) -> tuple[list[int], None]:
        ids = _flat(value, "input_ids", "a list of token ids")
        if ids is None or (ids.size and ids.dtype.kind not in "iu"):
            raise BadRowError("input_ids must be a flat list of integers")
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = int(ids.max()) if ids.max() >= self.vocab_size else int(ids.min())
            raise BadRowError(f"input_ids holds {bad}, outside the vocabulary of {self.vocab_size} tokens")
        return ids.tolist(), None

    def _text(self, value: Any) -> tuple[list[int], None]:
        if not isinstance(value, str):
            raise BadRowError(f"prompt must be a string, not {type(value).__name__}")
        return list(self.tokenizer(value)["input_ids"]), None

    def _chat(self, value: Any) -> tuple[list[int], list[int] | None]:
        if isinstance(value, np.ndarray):
            value = value.tolist()
        if (
            not isinstance(value, (list, tuple))
            or not value
            or not all(isinstance(m, dict) and "role" in m for m in value)
        ):
            raise BadRowError("messages must be a non-empty list of objects with a 'role'")
        prompt = value[-1]["role"] != "assistant"
        try:
            if self.mask_from == "assistant":
                # transformers renders, tokenizes (without special tokens, as below) and maps the
                # markers' characters to tokens in one call: its mask is the one stored.
                out = self.tokenizer.apply_chat_template(
                    list(value),
                    add_generation_prompt=prompt,
                    tokenize=True,
                    return_dict=True,
                    return_assistant_tokens_mask=True,
                )
                return list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
            text = self.tokenizer.apply_chat_template(list(value), tokenize=False, add_generation_prompt=prompt)
        except Exception as e:  # a template raises what its author chose (TemplateError, ...)
            raise BadRowError(f"the chat template failed: {type(e).__name__}: {e}") from None
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), None


def _mask_from(mode: str, column: str, data_has_mask: bool, reduction: str | None, tokenizer: Any) -> str | None:
    """``Renderer.mask_from``; GenerateError when ``--loss-mask assistant`` cannot be honoured."""
    if mode == "none":
        return None
    if mode == "auto" and (data_has_mask or reduction or column != "messages"):
        return "data"
    markers = marks_assistant_turns(tokenizer)
    if mode == "auto" and not (markers and getattr(tokenizer, "is_fast", False)):
        return "data"
    if not markers:
        raise GenerateError(
            "--loss-mask assistant needs a chat template that marks the assistant's turns with "
            "{% generation %} ... {% endgeneration %}, and the model's has no such markers: "
            "use a template with them, or give the mask in a loss_mask column"
        )
    if not getattr(tokenizer, "is_fast", False):
        # transformers maps the markers' characters to tokens with the fast tokenizer's offsets.
        raise GenerateError(
            f"--loss-mask assistant needs a fast tokenizer (transformers maps the template's markers to "
            f"tokens through it); the model's is {type(tokenizer).__name__}: give the mask in a loss_mask column"
        )
    return "assistant"


def _flat(value: Any, column: str, what: str) -> np.ndarray | None:
    """A column's list as a 1-d array; None when it is not flat (BadRowError: not a list)."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise BadRowError(f"{column} must be {what}, not {type(value).__name__}")
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError):
        return None
    return arr if arr.ndim == 1 else None


def _check_mask(mask: Any, n: int) -> list[int]:
    arr = _flat(mask, "loss_mask", "a list of 0 and 1")
    if len(mask) != n:
        raise BadRowError(f"loss_mask has {len(mask)} entries for {n} tokens")
    if arr is None or arr.dtype.kind not in "biu" or ((arr != 0) & (arr != 1)).any():
        raise BadRowError("loss_mask entries must be 0 or 1")
    return arr.astype(np.uint8).tolist()
