"""Reading hidden states out of the hidden-states KV cache, whichever way vLLM lays it out.

The cache stores ``[layers, hidden]`` per token (the layers are its "heads"), as a 4-D tensor:
``[blocks, block_size, layers, hidden]`` in vLLM 0.26, ``[blocks, layers, block_size, hidden]``
in 0.32 with strides per the physical layout (token-major on CUDA, layer-major on CPU). The token
axis comes from the shape, or from the version's convention when layers equal the block size.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch

from layertap.vllm.errors import CacheLayoutError


def _conventional_token_axis() -> int:
    from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionBackend

    get_shape = getattr(CacheOnlyAttentionBackend, "get_kv_cache_shape", None)
    if get_shape is None:
        return 2  # vLLM >= 0.27: every layer cache is viewed as [blocks, heads, tokens, content]
    shape = tuple(get_shape(7, 11, 13, 17))  # distinct sizes show where the block size goes
    return shape.index(11) if len(shape) == 4 and 11 in shape else 1


def token_axis(shape: tuple[int, ...], num_layers: int, hidden_size: int) -> int:
    """The axis (1 or 2) of ``shape`` that indexes tokens within a block."""
    if len(shape) != 4 or shape[3] != hidden_size or num_layers not in shape[1:3]:
        raise CacheLayoutError(
            f"layertap connector: the hidden-states KV cache has shape {list(shape)}; expected "
            f"[blocks, {num_layers} layers, block size, {hidden_size}] or "
            f"[blocks, block size, {num_layers} layers, {hidden_size}]"
        )
    if shape[1] != shape[2]:
        return 2 if shape[1] == num_layers else 1
    return _conventional_token_axis()


class HiddenStatesCache:
    """The hidden-states KV-cache tensor and how to gather tokens out of it.

    Every (token, layer) is ``hidden`` contiguous elements, a *row*. When every row starts at a
    multiple of ``hidden`` (all vLLM layouts so far) a batch is one ``index_select`` of row
    numbers, whatever the axes' order; otherwise (a padded layout) blocks and in-block offsets
    are advanced-indexed, slower on the CPU."""

    def __init__(self, kv: torch.Tensor, num_layers: int, hidden_size: int, block_size: int):
        self.kv = kv
        self.axis = token_axis(tuple(kv.shape), num_layers, hidden_size)
        self.tensor_block_size = int(kv.shape[self.axis])
        """Tokens per block of the tensor: the scheduler's ``block_size`` or a divisor of it
        (vLLM may split a scheduler block into smaller kernel blocks)."""
        self.block_size = block_size
        if block_size % self.tensor_block_size:
            raise CacheLayoutError(
                f"layertap connector: the scheduler's block size {block_size} is not a multiple of "
                f"the hidden-states cache's {self.tensor_block_size}"
            )
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.dtype = kv.dtype
        self.device = kv.device
        self.is_cuda = kv.device.type == "cuda"
        self.row_bytes = num_layers * hidden_size * kv.dtype.itemsize  # one token, all layers
        strides = kv.stride()
        block_stride, token_stride, layer_stride = strides[0], strides[self.axis], strides[3 - self.axis]
        self.by_rows = strides[3] == 1 and all(s % hidden_size == 0 for s in (block_stride, token_stride, layer_stride))
        if self.by_rows:
            # Row numbers of (block, token) and of each layer, in rows of `hidden` elements.
            self._row_steps = (block_stride // hidden_size, token_stride // hidden_size)
            self._layer_rows = np.arange(num_layers, dtype=np.int64) * (layer_stride // hidden_size)
            last = (kv.shape[0] - 1) * block_stride + (self.tensor_block_size - 1) * token_stride
            last += (num_layers - 1) * layer_stride
            self._rows = torch.as_strided(kv, (last // hidden_size + 1, hidden_size), (hidden_size, 1))
        self.index_width = num_layers if self.by_rows else 2  # int64 indices per token

    def row_layout(self) -> tuple[tuple[int, int] | None, list[int]]:
        """For the Rust sink's indices: ``((rows per tensor block, rows per token), row of each
        layer)``, or ``(None, [])`` without row numbers."""
        if not self.by_rows:
            return None, []
        return self._row_steps, self._layer_rows.tolist()

    def write_indices(
        self, requests: list[tuple[list[int], int]], index: np.ndarray, starts: np.ndarray | None = None
    ) -> None:
        """Fills ``index`` (int64 ``[tokens, index_width]``) with where each token of ``requests``
        (``(scheduler block ids, number of tokens)``, from position ``starts[i]`` with a window)
        is in the cache, in one vectorised pass."""
        counts = np.fromiter((n for _, n in requests), dtype=np.int64, count=len(requests))
        nblocks = np.fromiter((len(b) for b, _ in requests), dtype=np.int64, count=len(requests))
        blocks = np.fromiter(
            itertools.chain.from_iterable(b for b, _ in requests), dtype=np.int64, count=int(nblocks.sum())
        )
        token_starts = np.cumsum(counts) - counts
        block_starts = np.cumsum(nblocks) - nblocks
        # Position of each token within its request, then its scheduler block and slot.
        t = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(token_starts, counts)
        if starts is not None:
            t += np.repeat(starts, counts)
        slots = blocks[np.repeat(block_starts, counts) + t // self.block_size] * self.block_size + t % self.block_size
        blk, off = np.divmod(slots, self.tensor_block_size)
        if self.by_rows:
            per_block, per_token = self._row_steps
            np.add((blk * per_block + off * per_token)[:, None], self._layer_rows[None, :], out=index)
        else:
            index[:, 0] = blk
            index[:, 1] = off

    def take(self, index: torch.Tensor) -> torch.Tensor:
        """The tokens ``index`` locates, as a new ``[tokens, layers, hidden]`` on the cache's device."""
        return self._take(index)[1]

    def _take(self, index: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """``take``, and the indices it copied to the device."""
        if self.by_rows:
            rows = index.reshape(-1).to(self.device, non_blocking=True)
            return rows, torch.index_select(self._rows, 0, rows).view(-1, self.num_layers, self.hidden_size)
        blk, off = index[:, 0].to(self.device, non_blocking=True), index[:, 1].to(self.device, non_blocking=True)
        return (blk, off), self.kv[blk, off] if self.axis == 1 else self.kv[blk, :, off]

    def gather(self, index: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copies the tokens ``index`` locates into ``out`` on the host. On CUDA the copy does not
        wait: call it under the copy stream and keep the returned tensors alive until it is done."""
        if self.device.type == "cpu":  # straight into ``out``
            if self.by_rows:
                torch.index_select(self._rows, 0, index.reshape(-1), out=out.view(-1, self.hidden_size))
            else:
                blk, off = index[:, 0], index[:, 1]
                torch.ops.aten.index.Tensor_out(self.kv, [blk, off] if self.axis == 1 else [blk, None, off], out=out)
            return ()
        rows, gathered = self._take(index)
        out.view(gathered.shape).copy_(gathered, non_blocking=self.is_cuda)
        return (rows, gathered)
