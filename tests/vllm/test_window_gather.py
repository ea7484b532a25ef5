"""The worker's gather of capture windows (``layertap.vllm.window_gather.gather``) on a hidden-states
cache tensor laid out as vLLM lays it out (layer-major as on the CPU, token-major as LBNHC on
CUDA, and a padded layout that takes the advanced-indexing path), on the CPU and, where there is
one, on CUDA (the copy stream's device: the rows are taken and averaged there, then copied into
pinned host memory): each record gets exactly its window's rows, its last row, or its window's
mean. The end-to-end values through vLLM are tests/vllm/test_windows.py's; this test runs without
vLLM, so it also runs on the GPU machine (``python3 -m pytest tests/vllm/test_window_gather.py``).
"""

from __future__ import annotations

import pytest
import torch

from layertap.vllm.gather import HiddenStatesCache
from layertap.vllm.window_gather import gather

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
BLOCKS, LAYERS, BLOCK, HIDDEN = 9, 3, 16, 8


class Saves:
    """The columns of ``metadata.StepSaves`` that the gather reads (that module imports vLLM)."""

    def __init__(self, records: list[tuple[list[int], int, tuple | None]]):
        self.block_ids = [blocks for blocks, _, _ in records]
        self.windows = {i: w for i, (_, _, w) in enumerate(records) if w is not None}
        self.num_tokens = [n if w is None else (1 if w[2] else w[1] - w[0]) for i, (_, n, w) in enumerate(records)]

    def __len__(self) -> int:
        return len(self.block_ids)


def cache_tensor(layout: str, device: str, dtype: torch.dtype) -> torch.Tensor:
    """A ``[blocks, layers, block size, hidden]`` view of random values, strided as ``layout``."""
    g = torch.Generator().manual_seed(0)
    if layout == "layer-major":
        return torch.randn(BLOCKS, LAYERS, BLOCK, HIDDEN, generator=g).to(device, dtype)
    if layout == "token-major":
        return torch.randn(BLOCKS, BLOCK, LAYERS, HIDDEN, generator=g).to(device, dtype).transpose(1, 2)
    return torch.randn(BLOCKS, LAYERS, BLOCK, HIDDEN + 3, generator=g).to(device, dtype)[..., :HIDDEN]


def rows_of(kv: torch.Tensor, blocks: list[int], positions: range) -> torch.Tensor:
    """What the cache holds for ``positions`` of a request with ``blocks``: ``[n, layers, hidden]``."""
    return torch.stack([kv[blocks[t // BLOCK], :, t % BLOCK] for t in positions]).cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["layer-major", "token-major", "padded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_record_gets_its_window(device, layout, dtype):
    kv = cache_tensor(layout, device, dtype)
    cache = HiddenStatesCache(kv, LAYERS, HIDDEN, BLOCK)
    assert cache.by_rows == (layout != "padded")
    records = [
        ([4, 0, 7], 40, None),  # a whole request beside windowed ones
        ([2, 5, 8, 1], 60, (13, 50, None)),  # across three blocks
        ([6, 3], 30, (0, 30, "last")),
        ([1, 8, 2], 45, (5, 41, "mean")),
        ([0], 10, (9, 10, None)),
        ([7, 6], 20, (15, 17, "mean")),  # across a block's end
    ]
    saves = Saves(records)
    total = sum(saves.num_tokens)
    out = torch.empty(total, LAYERS, HIDDEN, dtype=dtype, pin_memory=device == "cuda")
    unused = torch.zeros(total, cache.index_width, dtype=torch.int64)  # the sink's indices: not read
    if device == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            keep = gather(cache, saves, unused, out)
        stream.synchronize()
        assert keep  # the device tensors, kept until the copy is done
    else:
        gather(cache, saves, unused, out)
    at = 0
    for blocks, n, window in records:
        lo, hi, reduction = window if window else (0, n, None)
        if reduction == "mean":
            want = rows_of(kv, blocks, range(lo, hi)).float().mean(0, keepdim=True)
            got = out[at : at + 1].float()
            # One rounding to the dtype after a float32 mean.
            tol = 1e-6 if dtype == torch.float32 else 2**-8
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        else:
            want = rows_of(kv, blocks, range(hi - 1, hi) if reduction else range(lo, hi))
            assert torch.equal(out[at : at + len(want)], want)
        at += 1 if reduction else hi - lo
    assert at == total
