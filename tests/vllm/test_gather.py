"""The connector's parts below vLLM, on real tensors: the gather out of every KV-cache layout the
supported vLLM versions use (and a padded one), and the ring allocator of the host pool."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from layertap.vllm.gather import HiddenStatesCache, token_axis
from layertap.vllm.pool import ALIGN, HostPool
from vllm_support import VLLM_WARNINGS

pytestmark = VLLM_WARNINGS  # one test imports vLLM

LAYERS, HIDDEN = 3, 8


def make_cache(layout: str, num_blocks: int = 12, block: int = 4) -> tuple[torch.Tensor, callable]:
    """A cache tensor in ``layout`` and ``value(block, token, layer)``, the row that must be read."""
    values = torch.arange(num_blocks * block * LAYERS * HIDDEN, dtype=torch.float32)
    logical = values.reshape(num_blocks, block, LAYERS, HIDDEN)  # [blocks, tokens, layers, hidden]
    if layout == "0.26 token-major":  # [blocks, tokens, layers, hidden], contiguous
        kv = logical.clone()
    elif layout == "0.32 layer-major":  # [blocks, layers, tokens, hidden], contiguous (the CPU)
        kv = logical.permute(0, 2, 1, 3).contiguous()
    elif layout == "0.32 token-major view":  # [blocks, layers, tokens, hidden] over token-major memory
        kv = logical.clone().permute(0, 2, 1, 3)
    elif layout == "padded blocks":  # each block followed by 3 unused elements: rows misaligned
        page = block * LAYERS * HIDDEN
        storage = torch.full((num_blocks * (page + 3),), -1.0)
        kv = torch.as_strided(storage, (num_blocks, block, LAYERS, HIDDEN), (page + 3, LAYERS * HIDDEN, HIDDEN, 1))
        kv.copy_(logical)
    else:
        raise AssertionError(layout)
    return kv, lambda b, t, layer: logical[b, t, layer]


@pytest.mark.parametrize("layout", ["0.26 token-major", "0.32 layer-major", "0.32 token-major view", "padded blocks"])
@pytest.mark.parametrize("scheduler_block", [4, 8])  # 8: the tensor's blocks are half a scheduler block
def test_gather_reads_every_token_of_every_request(layout, scheduler_block):
    kv, value = make_cache(layout)
    cache = HiddenStatesCache(kv, LAYERS, HIDDEN, scheduler_block)
    assert cache.by_rows == (layout != "padded blocks")
    tensor_block = cache.tensor_block_size
    assert tensor_block == 4
    # Three requests: scheduler block ids (in units of scheduler_block tokens) and token counts.
    per_block = scheduler_block // tensor_block
    n_sched_blocks = kv.shape[0] // per_block
    requests = [([n_sched_blocks - 1, 0], scheduler_block + 1), ([2], 1), ([1, 3, 0], 2 * scheduler_block + 3)]
    requests = [(b, min(n, len(b) * scheduler_block)) for b, n in requests]
    total = sum(n for _, n in requests)
    index = np.empty((total, cache.index_width), dtype=np.int64)
    cache.write_indices(requests, index)
    out = torch.empty(total, LAYERS, HIDDEN)
    assert cache.gather(torch.from_numpy(index), out) == ()
    row = 0
    for blocks, n in requests:
        for t in range(n):
            slot = blocks[t // scheduler_block] * scheduler_block + t % scheduler_block
            for layer in range(LAYERS):
                want = value(slot // tensor_block, slot % tensor_block, layer)
                assert torch.equal(out[row, layer], want), (row, layer)
            row += 1


def test_token_axis_from_the_shape():
    assert token_axis((10, 16, 3, 128), 3, 128) == 1
    assert token_axis((10, 3, 16, 128), 3, 128) == 2
    with pytest.raises(ValueError, match="expected \\[blocks, 3 layers, block size, 128\\]"):
        token_axis((10, 4, 16, 128), 3, 128)
    with pytest.raises(ValueError, match="hidden-states KV cache has shape"):
        token_axis((10, 3, 16, 64), 3, 128)


@pytest.mark.vllm
def test_token_axis_when_layers_equal_the_block_size():
    # Shapes cannot tell; vLLM 0.32 views every layer cache as [blocks, heads, tokens, content].
    import vllm

    expected = 2 if vllm.__version__.startswith("0.32") else 1
    assert token_axis((10, 16, 16, 128), 16, 128) == expected


def test_block_size_must_divide():
    kv = torch.zeros(4, 3, 12, HIDDEN)
    with pytest.raises(ValueError, match="block size 16 is not a multiple of the hidden-states cache's 12"):
        HiddenStatesCache(kv, LAYERS, HIDDEN, 16)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 3000), st.integers(0, 5)), max_size=60))
def test_pool_regions_never_overlap_and_all_come_back(ops):
    pool = HostPool(10_000, pin=False)
    live = []
    for alloc, size, pick in ops:
        if alloc or not live:
            region = pool.try_alloc(size)
            if region is None:
                assert live, "an empty pool must hold any request that fits its size"
                continue
            assert region.offset % ALIGN == 0 and region.offset + region.nbytes <= pool.nbytes
            assert region.view.numel() == region.nbytes >= size
            for other in live:
                assert region.offset + region.nbytes <= other.offset or other.offset + other.nbytes <= region.offset
            live.append(region)
        else:
            pool.release(live.pop(pick % len(live)))
    for region in live:
        pool.release(region)
    assert pool.in_use == 0 and pool.live_regions == 0
    assert pool.try_alloc(pool.nbytes) is not None


def test_pool_refuses_a_double_release():
    pool = HostPool(4096, pin=False)
    region = pool.try_alloc(100)
    pool.release(region)
    with pytest.raises(RuntimeError, match="released twice"):
        pool.release(region)
