"""The errors ``layertap generate`` stops with: bad input (before its engine starts), an
engine that did not start, and an interrupt."""

from __future__ import annotations

from layertap.errors import InvalidInputError


def first_line(e: BaseException) -> str:
    """An error in one line: its type and its message's first line."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


class GenerateError(InvalidInputError):
    """Bad input to ``layertap generate`` (a missing file or column, a model that cannot be
    loaded, layer ids out of range, an output directory made for another model...): the message
    is one line naming it. Raised before the engine starts; nothing is written."""


class EngineStartError(RuntimeError):
    """vLLM's engine did not start: the message is vLLM's own error, one line (perhaps read from
    the run's ``log``). This run wrote nothing, and the command says to fix the cause rather
    than to resume."""

    def __init__(self, message: str, log: str | None = None) -> None:
        super().__init__(message)
        self.log = log


class GenerateInterrupted(KeyboardInterrupt):
    """The run was interrupted (SIGINT, Ctrl-C) while its engine ran: the engine was stopped and
    what it wrote read back; ``summary`` says what is there (``complete`` false). A
    ``KeyboardInterrupt``, so that a caller that does not look for it stops as on any other."""

    def __init__(self, summary: dict) -> None:
        super().__init__("interrupted")
        self.summary = summary
