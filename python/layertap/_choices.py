"""The choices and limits of layertap's Python-side options, written once: the backends, the
capture modes, the readers' modes and the largest thread count. Every module that checks or
offers one of them (the readers, the connector, the command line, ``layertap generate``) takes it
from here, with the checks of ``layertap._checks``. The writer's options are the Rust core's
(``layertap.WriterOptions``); the core names the same thread limit
(``layertap_core::writer::WriterConfig::MAX_THREADS``), and a test holds the two equal."""

from __future__ import annotations

#: Reader (and recovery) implementations: the Rust core, the Python reference, or ``"auto"``:
#: Rust where the extension is built.
READER_BACKENDS = ("auto", "rust", "python")

#: How the hidden states reach the KV cache. ``"method"``: vLLM's ``extract_hidden_states``
#: speculative method (its draft "model" caches them; the layer ids come from the speculative
#: configuration). ``"in-model"``: the model class that layertap's plugin registers caches them
#: itself, without speculative decoding (the layer ids come from the ``layer_ids`` option);
#: docs/CONNECTOR.md, "Capture in the model".
CAPTURE_MODES = ("method", "in-model")
DEFAULT_CAPTURE = "method"

#: Compression threads a writer starts at most (the Rust core's ``writer::MAX_THREADS``).
MAX_THREADS = 256

#: What the readers do with a corrupt record: raise ``CorruptRecordError``, or skip it.
ERROR_MODES = ("raise", "skip")
#: What records hold: torch tensors, numpy arrays, or ``"auto"`` (torch where it can be imported).
TENSOR_KINDS = ("auto", "torch", "numpy")

__all__ = [
    "CAPTURE_MODES",
    "DEFAULT_CAPTURE",
    "ERROR_MODES",
    "MAX_THREADS",
    "READER_BACKENDS",
    "TENSOR_KINDS",
]
