"""Exceptions raised by layertap.

Both the Rust core (through ``layertap._native``) and the pure-Python reference implementation
raise these classes, so callers catch the same thing whichever backend is in use. Each carries
the details as attributes, not only in its message.
"""

from __future__ import annotations

import json


class LayertapError(Exception):
    """Base class of every layertap error."""


class InvalidInputError(LayertapError, ValueError):
    """A value given to the API is not acceptable: a bad key, dtype, shape, buffer or option."""


class OptionError(InvalidInputError):
    """A writer option is not acceptable: ``option`` names it, ``problem`` says why (the message
    is both: ``f"{option} {problem}"``)."""

    def __init__(self, option: str, problem: str):
        super().__init__(f"{option} {problem}")
        self.option = option
        self.problem = problem

    def __reduce__(self):  # pickles with both arguments (vLLM sends errors between processes)
        return type(self), (self.option, self.problem)


class DuplicateKeyError(InvalidInputError):
    """A writer was given a key it has already written."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


class FormatError(LayertapError):
    """A file is not a layertap shard, or its structure (header, index) is damaged."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


class CorruptRecordError(FormatError):
    """A record failed its checksum or could not be decoded; its data is never returned."""

    def __init__(
        self,
        message: str,
        path: str | None = None,
        offset: int | None = None,
        key: str | None = None,
    ):
        super().__init__(message, path)
        self.offset = offset
        self.key = key

    @classmethod
    def at(cls, path: str, offset: int, key: str | None, reason: str) -> CorruptRecordError:
        """The readers' one message for a corrupt record, whichever reader or path found it:
        ``PATH: corrupt record at offset N (key "K"): REASON``, the key as ``quote_key`` writes it
        (None: a frame header that could not be read, no key part), as the Rust core words it."""
        where = "" if key is None else f" (key {quote_key(key)})"
        return cls(f"{path}: corrupt record at offset {offset}{where}: {reason}", path, offset, key)


def quote_key(key: str) -> str:
    """A record key in a message: a JSON string (control characters escaped, other characters
    as they are), as the Rust core quotes keys (``error.rs``)."""
    return json.dumps(key, ensure_ascii=False)


class CodecError(LayertapError):
    """A codec's library failed on data layertap handed it (compressing a record, or a zstd
    context it could not allocate): ``codec`` names the codec, ``reason`` is the library's
    message. Damaged stored data is a ``CorruptRecordError`` instead."""

    def __init__(self, message: str, codec: str | None = None, reason: str | None = None):
        super().__init__(message)
        self.codec = codec
        self.reason = reason

    def __reduce__(self):
        return type(self), (str(self), self.codec, self.reason)


class RecordMissingError(CorruptRecordError):
    """A record its index lists is not in the store that should hold it (Mooncake Store: evicted,
    lost with the node that held it, or never put); its data is never read as another's."""


class StoreUnavailableError(LayertapError):
    """The store (a Mooncake master and its clients) cannot be reached or refused the client."""


class RecordNotFoundError(LayertapError, KeyError):
    """No record has this key (or position)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class ShardLockedError(LayertapError):
    """The shard is locked by a live writer; it is not modified."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


class WriterClosedError(LayertapError):
    """The writer was closed, or failed earlier and takes no more work."""


class WriterIOError(LayertapError, OSError):
    """A system call failed while writing; ``filename`` names the file and ``errno`` the cause.

    Records reported done before the error stay readable.
    """

    def __init__(self, errno: int | None, message: str, filename: str | None = None):
        OSError.__init__(self, errno, message, filename)


class DiskFullError(WriterIOError):
    """The file system holding the dataset is full (``ENOSPC``, or ``EDQUOT`` over a quota).

    ``directory`` is the dataset directory, ``free_bytes`` what is free there once the writer
    cut off the record that did not fit and completed its shard (None if it could not tell),
    ``filename`` the file being written. The message is one line naming both; every record
    reported written before the error is intact and readable."""

    def __init__(
        self,
        errno: int | None,
        message: str,
        filename: str | None = None,
        directory: str | None = None,
        free_bytes: int | None = None,
    ):
        super().__init__(errno, message, filename)
        self.message = message
        self.directory = directory
        self.free_bytes = free_bytes

    def __str__(self) -> str:  # the message already names the directory and the file
        return self.message

    def __reduce__(self):  # pickles with every detail (vLLM sends errors between processes)
        return type(self), (self.errno, self.message, self.filename, self.directory, self.free_bytes)


__all__ = [
    "LayertapError",
    "InvalidInputError",
    "OptionError",
    "DuplicateKeyError",
    "FormatError",
    "CorruptRecordError",
    "CodecError",
    "RecordMissingError",
    "RecordNotFoundError",
    "StoreUnavailableError",
    "ShardLockedError",
    "WriterClosedError",
    "WriterIOError",
    "DiskFullError",
]
