"""The errors of the connector and the plugin's model classes, beside ``config.ConfigError`` (a
refused option): each also the built-in class it replaced (``RuntimeError``, ``ValueError``), so
that code catching those still catches them."""

from __future__ import annotations

from layertap.errors import InvalidInputError, LayertapError


class ConnectorError(LayertapError, RuntimeError):
    """The connector cannot go on: the host pool could not be allocated, vLLM restored its KV
    caches without the hidden-states one, a pool region came back twice. The message starts with
    ``layertap connector:`` and says what to change where something can be."""


class CacheLayoutError(InvalidInputError):
    """The hidden-states KV cache vLLM allocated has a shape or block size the connector cannot
    gather from; the message gives the shapes it takes."""


class PluginError(InvalidInputError):
    """The plugin's model classes cannot do what they were asked: an architecture they do not
    cover (``LAYERTAP_EAGLE3``, ``LAYERTAP_IN_MODEL``, ``register()``), layer ids the model does
    not have, pipeline parallelism."""


class CaptureError(LayertapError, RuntimeError):
    """A forward pass did not record the hidden states the plugin's hooks expected (the model did
    not run its decoder layers as its family does)."""


__all__ = ["CacheLayoutError", "CaptureError", "ConnectorError", "PluginError"]
