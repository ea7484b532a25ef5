"""The worker half of capture windows and reductions (``window`` is the request half): the gather
takes from the KV cache only the rows a record stores (``last``: one) or reduces (``mean``: the
window's, averaged on the cache's device in float32), so the bytes copied to the host shrink with
the window. Nothing here imports vLLM.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from layertap.vllm.gather import HiddenStatesCache


def _taken(saves: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per record: the first position the gather takes, how many, and whether they are averaged."""
    n = len(saves)
    first = np.zeros(n, np.int64)
    count = np.fromiter(saves.num_tokens, np.int64, n)
    mean = np.zeros(n, bool)
    for i, (lo, hi, reduction) in saves.windows.items():
        if reduction == "mean":
            first[i], count[i], mean[i] = lo, hi - lo, True
        elif reduction == "last":
            first[i] = hi - 1
        else:
            first[i] = lo
    return first, count, mean


def gather(cache: HiddenStatesCache, saves: Any, index: torch.Tensor, out: torch.Tensor) -> tuple:
    """``cache.gather`` of each record's stored rows. ``index`` (the sink's: every record's first
    rows) is right without windows; with them the rows are located here."""
    if not saves.windows:
        return cache.gather(index, out)
    first, count, mean = _taken(saves)
    taken = np.empty((int(count.sum()), cache.index_width), np.int64)
    cache.write_indices(list(zip(saves.block_ids, count.tolist())), taken, starts=first)
    taken_t = torch.from_numpy(taken)
    if not mean.any():
        return (taken_t, *cache.gather(taken_t, out))
    # Each stored row is the mean of a segment of the taken rows: one row long for every record
    # but the averaged ones, whose segment is their window.
    segments = np.where(mean, count, 1)
    rows_per_record = np.where(mean, 1, count)
    lengths = np.repeat(segments, rows_per_record)
    rows = cache.take(taken_t)
    # Segment ids built on the host: repeat_interleave with device repeats would make the engine
    # thread wait for the copy stream (it reads the output size back).
    seg_host = torch.from_numpy(np.repeat(np.arange(len(lengths), dtype=np.int64), lengths))
    seg = seg_host.to(rows.device, non_blocking=True)
    acc = torch.zeros((len(lengths), *rows.shape[1:]), dtype=torch.float32, device=rows.device)
    acc.index_add_(0, seg, rows.float())
    # Converted on the host and copied without blocking, as the segment ids: a blocking copy (as
    # `.to(device, float32)` was) makes the engine thread wait for the copy stream, which waits
    # for the step's forward pass.
    lengths_host = torch.from_numpy(lengths.astype(np.float32))
    lengths_t = lengths_host.to(rows.device, non_blocking=True)
    result = (acc / lengths_t[:, None, None]).to(cache.dtype)
    out.copy_(result, non_blocking=cache.is_cuda)
    return (taken_t, rows, seg_host, seg, acc, lengths_host, lengths_t, result)
