"""The errors ``layertap generate`` stops with: bad input (before its engine starts), an
engine that did not start, and an interrupt."""

from __future__ import annotations

from layertap.errors import InvalidInputError


class GenerateError(InvalidInputError):
    """Bad input to ``layertap generate`` (a missing file or column, a model that cannot be
    loaded, layer ids out of range, an output directory made for another model...): the message
    is one line naming it. Raised before the engine starts; nothing is written."""


class EngineStartError(RuntimeError):
    """vLLM's engine did not start: the message is vLLM's own error, one line (read from the
    run's log, ``log``, when what ``LLM(...)`` raised only says that a process of vLLM's
    failed; that exception is the ``__cause__``). This run wrote nothing; whether the same
    command can succeed depends on that cause (memory another process held, or a setting vLLM
    refuses), so the command says to fix it rather than to resume."""

    def __init__(self, message: str, log: str | None = None) -> None:
        super().__init__(message)
        self.log = log
        """vLLM's log of the run (None when it logs elsewhere: ``--verbose``, the user's settings)."""


class GenerateInterrupted(KeyboardInterrupt):
    """The run was interrupted (SIGINT, Ctrl-C) while its engine ran: the engine was stopped and
    what it wrote read back; ``summary`` says what is there (``complete`` false). A
    ``KeyboardInterrupt``, so that a caller that does not look for it stops as on any other."""

    def __init__(self, summary: dict) -> None:
        super().__init__("interrupted")
        self.summary = summary
