"""The record keys an engine has given out lately, so that a key is refused when it comes back.

A writer refuses a key it has already taken (docs/FORMAT.md, "Keys"), and the scheduler half
refuses it first, so that the client learns it in its response. Remembering every key of a
server that runs for weeks takes memory without bound, so the connector remembers the most
recent ``key_memory`` keys (an option; the writer is opened with the same bound): a key is
refused when it repeats one of those. Nothing here imports vLLM.
"""

from __future__ import annotations

import collections


class KeyWindow:
    """The last ``limit`` keys added (every key when ``limit`` is None), for membership tests;
    memory is bounded by ``limit`` keys."""

    __slots__ = ("limit", "_keys", "_order")

    def __init__(self, limit: int | None):
        if limit is not None and limit < 1:
            raise ValueError(f"key window limit must be at least 1, not {limit}")
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
