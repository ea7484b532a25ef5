"""The host buffer pool: one block of (pinned, on CUDA) memory allocated at start-up, handed out
in regions, first in first out.

Each engine step that finishes requests takes one region for all of them; the records written
from it are views into the region, given to the writer without a copy. A region comes back when
the writer reports all of its records done. Records complete in submission order, so regions
mostly come back in the order they were taken, and a ring allocator fits: it allocates at the
head and reclaims at the tail; a region that is released out of order waits until those before
it are released too.
"""

from __future__ import annotations

import collections

import torch

from layertap.vllm.errors import ConnectorError

#: Every region starts at a multiple of this (covers int64 views and DMA alignment).
ALIGN = 256


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Region:
    """A byte range ``[offset, offset + nbytes)`` of the pool, and ``view`` of it."""

    __slots__ = ("id", "offset", "nbytes", "view", "released", "records")

    def __init__(self, id: int, offset: int, nbytes: int, view: torch.Tensor):
        self.id = id
        """Unique in the pool's lifetime (the writer's sink reports regions back by id)."""
        self.offset = offset
        self.nbytes = nbytes
        self.view = view
        self.released = False
        self.records = 0
        """Records written from this region that the writer has not reported done yet."""

    def carve(self, start: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor of ``dtype`` and ``shape`` over bytes ``[start, start + nbytes)`` of the
        region (``start`` aligned to the dtype)."""
        return self.view[start : start + nbytes].view(dtype).view(shape)


class HostPool:
    """A ring allocator over one uint8 tensor of ``nbytes`` (pinned when ``pin``)."""

    def __init__(self, nbytes: int, pin: bool):
        nbytes = align_up(nbytes)
        try:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        except RuntimeError as e:
            raise ConnectorError(
                f"layertap connector: cannot allocate the {'pinned ' if pin else ''}host buffer pool "
                f"of {nbytes} bytes ({e}); lower pool_bytes"
            ) from e
        if not pin:
            # Fault the pages in now rather than on the first gather of the engine thread.
            self.buffer.zero_()
        self.nbytes = nbytes
        self.pinned = pin
        self._live: collections.deque[Region] = collections.deque()
        self._next_id = 0
        self._head = 0
        self.in_use = 0
        self.high_water = 0

    def try_alloc(self, nbytes: int) -> Region | None:
        """A region of ``nbytes`` (rounded up to ``ALIGN``), or None when the pool has no room
        for it now."""
        nbytes = align_up(max(nbytes, 1))
        if nbytes > self.nbytes:
            return None
        if not self._live:
            self._head = 0
            start = 0
        else:
            tail = self._live[0].offset
            if self._head > tail:
                # Free space is [head, end) and [0, tail).
                if self.nbytes - self._head >= nbytes:
                    start = self._head
                elif tail >= nbytes:
                    start = 0
                else:
                    return None
            elif tail - self._head >= nbytes:  # free space is [head, tail)
                start = self._head
            else:  # includes head == tail: the ring is full
                return None
        region = Region(self._next_id, start, nbytes, self.buffer[start : start + nbytes])
        self._next_id += 1
        self._live.append(region)
        self._head = start + nbytes
        if self._head == self.nbytes:
            self._head = 0
        self.in_use += nbytes
        self.high_water = max(self.high_water, self.in_use)
        return region

    def largest_free(self) -> int:
        """The largest ``try_alloc`` that succeeds now, in bytes."""
        if not self._live:
            return self.nbytes
        tail = self._live[0].offset
        if self._head > tail:
            return max(self.nbytes - self._head, tail)
        return tail - self._head

    def release(self, region: Region) -> None:
        """Gives ``region`` back; its memory is reused once every older region is back too."""
        if region.released:
            raise ConnectorError("layertap connector: a pool region was released twice")
        region.released = True
        self.in_use -= region.nbytes
        while self._live and self._live[0].released:
            self._live.popleft()

    @property
    def live_regions(self) -> int:
        """Regions handed out and not yet reclaimed."""
        return sum(not r.released for r in self._live)
