"""The choices and limits of layertap's options, written once: the backends, the capture modes,
the writers' modes and the largest thread count. Every module that checks or offers one of them
(the writers' options, the readers, the connector, the command line, ``layertap generate``)
takes it from here, with the checks of ``layertap._checks``; the Rust core names the same
limits (``layertap_core::writer::MAX_THREADS``), and a test holds the two equal."""

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

#: Values of the writers' ``io``; ``"io_uring"`` is taken for ``"uring"`` (the name
#: ``stats["backend"]`` uses).
IO_MODES = ("auto", "uring", "pwrite")
#: Named values of the writers' ``durability`` (or a positive number of bytes).
DURABILITY_MODES = ("none", "close")
#: Values of the writers' ``lossy`` besides None (docs/FP8.md).
LOSSY_MODES = ("fp8-e4m3",)
#: Compression threads a writer starts at most (the Rust core's ``writer::MAX_THREADS``).
MAX_THREADS = 256

#: What the readers do with a corrupt record: raise ``CorruptRecordError``, or skip it.
ERROR_MODES = ("raise", "skip")
#: What records hold: torch tensors, numpy arrays, or ``"auto"`` (torch where it can be imported).
TENSOR_KINDS = ("auto", "torch", "numpy")

__all__ = [
    "CAPTURE_MODES",
    "DEFAULT_CAPTURE",
    "DURABILITY_MODES",
    "ERROR_MODES",
    "IO_MODES",
    "LOSSY_MODES",
    "MAX_THREADS",
    "READER_BACKENDS",
    "TENSOR_KINDS",
]
