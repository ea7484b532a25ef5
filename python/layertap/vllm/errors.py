"""The errors of the connector and the plugin's model classes, beside ``config.ConfigError`` (a
refused option): each also the built-in class it replaced (``RuntimeError``, ``ValueError``), so
that code catching those still catches them."""

from __future__ import annotations

from layertap.errors import InvalidInputError, LayertapError


class ConnectorError(LayertapError, RuntimeError):
    """The connector cannot go on; the message says what to change where something can be."""


class CacheLayoutError(InvalidInputError):
    """The hidden-states KV cache has a shape or block size the connector cannot gather from."""


class PluginError(InvalidInputError):
    """The plugin's model classes were asked for an architecture, layer ids or parallelism they lack."""


class CaptureError(LayertapError, RuntimeError):
    """A forward pass did not record the hidden states the plugin's hooks expected."""


__all__ = ["CacheLayoutError", "CaptureError", "ConnectorError", "PluginError"]
