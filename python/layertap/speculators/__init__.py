"""layertap as a hidden-states backend of speculators (vLLM's drafter trainer).

speculators reads the verifier's hidden states through a *hidden-states backend* of
``hs_connectors`` (``HiddenStatesBackend``, chosen with ``--hidden-states-backend``). This package
adds one named ``layertap``:

- training (``speculators train --hidden-states-backend layertap``) reads the cached hidden states
  of row ``i`` of the prepared dataset from the layertap record with key ``"i"`` (a dataset
  written by ``layertap generate`` over that prepared dataset, or by a server whose client set
  ``sample_id`` to the row index), and the hidden states it asks a running vLLM for (rows
  without a record) with ``layertap.vllm.fetch``;
- ``scripts/launch_vllm.py --hidden-states-backend layertap`` starts that vLLM with layertap's
  connector (``layertap.speculators.connector``).

speculators reads its backend registry once, when ``speculators.train.config.resolution`` is
imported, and has no entry points: the backend must be registered before. ``python -m
layertap.speculators ...`` does that and then runs speculators' own command line (or a
speculators script); ``register()`` does it for code that calls speculators directly.
See docs/TRAINING.md.
"""

from __future__ import annotations

from layertap.errors import LayertapError

#: The name speculators' ``--hidden-states-backend`` takes.
BACKEND_NAME = "layertap"


class BackendNameTakenError(LayertapError, RuntimeError):
    """hs_connectors already has another hidden-states backend under ``BACKEND_NAME``."""


def register() -> type:
    """Registers the ``layertap`` backend with ``hs_connectors.HiddenStatesBackend`` (once;
    later calls return the registered class) and returns it. Must run before
    ``speculators.train.config.resolution`` is imported, which reads the registry."""
    from hs_connectors import HiddenStatesBackend

    from layertap.speculators.backend import LayertapBackend

    registered = HiddenStatesBackend.registry.get(BACKEND_NAME)
    if registered is None:
        HiddenStatesBackend.register(BACKEND_NAME)(LayertapBackend)
        return LayertapBackend
    if registered is not LayertapBackend:
        raise BackendNameTakenError(
            f"hs_connectors already has a hidden-states backend named {BACKEND_NAME!r} "
            f"({registered.__module__}.{registered.__qualname__}), not layertap's"
        )
    return registered


__all__ = ["BACKEND_NAME", "BackendNameTakenError", "register"]
