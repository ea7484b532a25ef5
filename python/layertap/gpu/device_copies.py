"""Small copies between the host and the GPU that never leave the host thread spinning: to the
device through a pinned ring (``_PinnedRing``), back with a blocking event (the encoder's and the
decoder's, issues 21 and 32)."""

from __future__ import annotations

import threading

import numpy as np
import torch


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` without the host waiting: a copy from pageable memory makes
    the thread wait (spinning) for everything queued on the stream before it, the packing's
    kernels among them; from pinned memory it is queued like a kernel. The pinned memory is
    this thread's ring (``_PinnedRing``), not a block pinned per array."""
    if not (a.flags.writeable and a.flags.c_contiguous):
        a = np.array(a)  # torch takes only writable arrays (the core's tables come read-only)
    t = torch.from_numpy(a)
    if device.type != "cuda":
        return t
    return _ring(device).to_device(t)


class _PinnedRing:
    """One thread's pinned host buffer for its copies to one device, allocated once (grown when
    a copy does not fit) and used as a ring: each copy takes the next bytes, and the ring starts
    over once the copies queued from it are done (an event recorded after each copy).

    Why: ``tensor.pin_memory()`` per table cost the compressing thread more than the copies
    themselves on the H100 (py-spy: 14.5 s pinning, 2.9 s freeing against 7.9 s copying, 1b at 4x,
    benches/RESULTS.md "fourteenth session"): torch's pinned allocator takes a process-wide lock,
    which the engine thread's own pinned copies take too, and polls the events of its blocks."""

    _ALIGN = 64
    _MIN_BYTES = 32 << 20

    def __init__(self, device: torch.device):
        self.device = device
        self.buf = torch.empty(0, dtype=torch.uint8)
        self.at = 0
        self.done = torch.cuda.Event(blocking=True)  # the last copy queued; a blocking wait sleeps
        self.stream: torch.cuda.Stream | None = None  # the stream of the copies since the last wait

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        stream = torch.cuda.current_stream(self.device)
        if self.at + nbytes > self.buf.numel() or stream != self.stream:
            # Bytes of the ring may still be read by a queued copy: wait for the last one (the
            # copies since the last wait are queued in order on one stream), once per turn of the
            # ring or change of stream.
            self.done.synchronize()
            self.stream = stream
            if nbytes > self.buf.numel():
                self.buf = torch.empty(max(2 * nbytes, self._MIN_BYTES), dtype=torch.uint8, pin_memory=True)
            self.at = 0
        staged = self.buf[self.at : self.at + nbytes].view(t.dtype).view(t.shape)
        staged.copy_(t)
        out = staged.to(self.device, non_blocking=True)
        self.done.record(stream)
        self.at += -(-nbytes // self._ALIGN) * self._ALIGN
        return out


_RINGS = threading.local()


def _ring(device: torch.device) -> _PinnedRing:
    """This thread's pinned ring for ``device`` (a thread's copies are ordered on its current
    stream; two threads' are not, so each has its own ring)."""
    rings = _RINGS.__dict__.setdefault("rings", {})
    ring = rings.get(device)
    if ring is None:
        ring = rings[device] = _PinnedRing(device)
    return ring


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Copies of small device tensors on the host, waited for with a blocking event (the thread
    sleeps rather than spins, so the wait costs the host no CPU)."""
    if not tensors or tensors[0].device.type != "cuda":
        return [t.cpu() for t in tensors]
    out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for o, t in zip(out, tensors):
        o.copy_(t, non_blocking=True)
    wait_sleeping()
    return out


def wait_sleeping(stream: torch.cuda.Stream | None = None) -> None:
    """Waits for the work queued on ``stream`` (default: the current one) with the thread asleep.
    ``stream.synchronize()`` spins a core at 100% for as long as the GPU works when the process
    has fewer CUDA contexts than cores (CUDA's default scheduling): on the H200 that spinning was
    most of the compressing thread's host CPU time. A blocking event's wait sleeps."""
    done = torch.cuda.Event(blocking=True)
    done.record(stream)
    done.synchronize()
