"""Reading hidden states out of the hidden-states KV cache, whichever way vLLM lays it out.

``extract_hidden_states`` caches, for every token, ``[layers, hidden]`` into a KV-cache layer
whose "heads" are the layers. The per-layer cache tensor vLLM hands the connector is 4-D:

- vLLM 0.26: ``[num_blocks, block_size, layers, hidden]`` (``get_kv_cache_shape`` of the
  cache-only backend);
- vLLM 0.32: ``[num_blocks, layers, block_size, hidden]`` (the logical ``[B, H, N, C]`` view of
  every layer cache), with strides per the resolved physical layout (e.g. token-major under
  LBNHC on CUDA, layer-major on CPU).

The token axis is found from the shape when the layer count differs from the block size, and
from the version's convention when they are equal. The gather indexes blocks and in-block offsets
with one advanced-indexing call, which is correct for any strides.
"""

from __future__ import annotations

import torch


def _conventional_token_axis() -> int:
    """The token-in-block axis of the hidden-states cache by this vLLM's convention."""
    try:
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionBackend
    except ImportError:  # pragma: no cover - both supported versions have it
        return 2
    get_shape = getattr(CacheOnlyAttentionBackend, "get_kv_cache_shape", None)
    if get_shape is None:
        return 2  # vLLM >= 0.27: every layer cache is viewed as [blocks, heads, tokens, content]
    shape = tuple(get_shape(7, 11, 13, 17))  # distinct sizes show where the block size goes
    return shape.index(11) if len(shape) == 4 and 11 in shape else 1


def token_axis(shape: tuple[int, ...], num_layers: int, hidden_size: int) -> int:
    """The axis (1 or 2) of ``shape`` that indexes tokens within a block."""
    if len(shape) != 4 or shape[3] != hidden_size or num_layers not in shape[1:3]:
        raise ValueError(
            f"layertap connector: the hidden-states KV cache has shape {list(shape)}; expected "
            f"[blocks, {num_layers} layers, block size, {hidden_size}] or "
            f"[blocks, block size, {num_layers} layers, {hidden_size}]"
        )
    if shape[1] != shape[2]:
        return 2 if shape[1] == num_layers else 1
    return _conventional_token_axis()


class HiddenStatesCache:
    """The hidden-states KV-cache tensor and how to gather tokens out of it."""

    def __init__(self, kv: torch.Tensor, num_layers: int, hidden_size: int, block_size: int):
        self.kv = kv
        self.axis = token_axis(tuple(kv.shape), num_layers, hidden_size)
        self.tensor_block_size = int(kv.shape[self.axis])
        """Tokens per block of the tensor: the scheduler's ``block_size`` or a divisor of it
        (vLLM may split a scheduler block into smaller kernel blocks)."""
        self.block_size = block_size
        if block_size % self.tensor_block_size:
            raise ValueError(
                f"layertap connector: the scheduler's block size {block_size} is not a multiple of "
                f"the hidden-states cache's {self.tensor_block_size}"
            )
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.dtype = kv.dtype
        self.device = kv.device
        self.is_cuda = kv.device.type == "cuda"
        self.row_bytes = num_layers * hidden_size * kv.dtype.itemsize
        """Bytes of one token's hidden states (all saved layers)."""

    def write_indices(self, block_ids: list[int], num_tokens: int, blk: torch.Tensor, off: torch.Tensor) -> None:
        """Fills ``blk``/``off`` (int64, ``num_tokens`` long) with the tensor block and offset of
        each token of a request whose scheduler blocks are ``block_ids``."""
        blocks = torch.as_tensor(block_ids[: -(-num_tokens // self.block_size)], dtype=torch.int64)
        slots = (blocks[:, None] * self.block_size + torch.arange(self.block_size)).reshape(-1)[:num_tokens]
        torch.div(slots, self.tensor_block_size, rounding_mode="floor", out=blk)
        torch.remainder(slots, self.tensor_block_size, out=off)

    def gather(self, blk: torch.Tensor, off: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copies the tokens at (``blk``, ``off``) into ``out`` ``[tokens, layers, hidden]`` on
        the host. On the CPU the gather writes straight into ``out``. On CUDA the indices are
        copied to the device, gathered there, and the result copied into ``out`` without
        waiting: call it under the copy stream and keep the returned device tensors alive until
        the copy is done."""
        if not self.is_cuda and self.device.type == "cpu":
            index = [blk, off] if self.axis == 1 else [blk, None, off]
            torch.ops.aten.index.Tensor_out(self.kv, index, out=out)
            return ()
        blk_d = blk.to(self.device, non_blocking=True)
        off_d = off.to(self.device, non_blocking=True)
        if self.axis == 1:
            gathered = self.kv[blk_d, off_d]
        else:
            gathered = self.kv[blk_d, :, off_d]
        out.copy_(gathered, non_blocking=self.is_cuda)
        return (blk_d, off_d, gathered)
