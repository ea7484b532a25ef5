"""The record keys a writer (or the vLLM connector's scheduler half) has taken, so that a key
given again is refused (docs/FORMAT.md, "Keys"): every key, or with a limit (``key_memory``) the
most recent ones, so that a writer that serves for weeks keeps bounded memory. The Rust writer
has the same (``rust/core/src/writer/keys.rs``)."""

from __future__ import annotations

import collections

from layertap.errors import InvalidInputError


class KeyWindow:
    """The last ``limit`` keys added (every key when ``limit`` is None), for membership tests;
    memory is bounded by ``limit`` keys."""

    __slots__ = ("limit", "_keys", "_order")

    def __init__(self, limit: int | None):
        if limit is not None and limit < 1:
            raise InvalidInputError(f"key window limit must be a positive integer or None, not {limit!r}")
        self.limit = limit
        self._keys: set[str] = set()
        self._order: collections.deque[str] = collections.deque()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add_new(self, key: str) -> bool:
        """Remembers ``key`` and returns True, or returns False if it is in the window already.
        Beyond the limit, the oldest key is forgotten."""
        keys = self._keys
        if key in keys:
            return False
        keys.add(key)
        if self.limit is not None:
            order = self._order
            order.append(key)
            if len(order) > self.limit:
                keys.discard(order.popleft())
        return True
