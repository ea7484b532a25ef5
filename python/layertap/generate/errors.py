"""The errors ``layertap generate`` stops with: bad input (before its engine starts), and an
engine that did not start."""

from __future__ import annotations

from layertap.errors import InvalidInputError


class GenerateError(InvalidInputError):
    """Bad input to ``layertap generate`` (a missing file or column, a model that cannot be
    loaded, layer ids out of range, an output directory made for another model...): the message
    is one line naming it. Raised before the engine starts; nothing is written."""


class EngineStartError(RuntimeError):
    """vLLM's engine did not start (its own error is the ``__cause__``). This run wrote
    nothing; whether the same command can succeed depends on that cause (memory another process
    held, or a setting vLLM refuses), so the command says to fix it rather than to resume."""
