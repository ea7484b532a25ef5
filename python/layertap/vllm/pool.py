"""The host buffer pool: one block of (pinned, on CUDA) memory allocated at start-up, handed out
in regions, one per step, whose records the writer takes without a copy. Records complete in
submission order, so a ring allocator fits: a region released out of order is reused once those
before it are released too.
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
    __slots__ = ("id", "offset", "nbytes", "view", "released", "records")

    def __init__(self, id: int, offset: int, nbytes: int, view: torch.Tensor):
        self.id = id  # unique in the pool's lifetime: the sink reports regions back by id
        self.offset = offset
        self.nbytes = nbytes
        self.view = view
        self.released = False
        self.records = 0  # records the writer has not reported done yet

    def carve(self, start: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
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
        """A region of ``nbytes`` (rounded up), or None when there is no room now."""
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
        return sum(not r.released for r in self._live)
