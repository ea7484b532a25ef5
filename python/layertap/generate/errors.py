"""The error ``layertap generate`` stops with before its engine starts."""

from __future__ import annotations

from layertap.errors import InvalidInputError


class GenerateError(InvalidInputError):
    """Bad input to ``layertap generate`` (a missing file or column, a model that cannot be
    loaded, layer ids out of range, an output directory made for another model...): the message
    is one line naming it. Raised before the engine starts; nothing is written."""
