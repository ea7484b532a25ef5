"""A DataLoader with two workers over a ``HiddenStatesDataset``, checked batch by batch
(tests/test_torch_dataset.py): run in the test's process for workers started by spawn, and as a
script in a fresh interpreter for workers started by fork.

    python tests/loader_check.py DATASET fork     prints the keys seen, as JSON

Fork runs apart because a process that has run vLLM (as a worker process of the suite may have,
before that file) holds threads that a fork copies mid-work, and its DataLoader workers could hang
on their locks; what is tested is the dataset's own fork safety."""

from __future__ import annotations

import json
import os
import sys

import torch

from layertap.torch import HiddenStatesDataset, pack_collate, pad_collate


def collate_in_worker(batch):
    """pack_collate, after checking that this worker reads through a reader it opened itself;
    with ``padded_in_shared_memory``: whether pad_collate took the batch's hidden states as the
    dataset decoded them (its rows of one tensor), and that tensor is in shared memory."""
    info = torch.utils.data.get_worker_info()
    assert info is not None and info.dataset._pid == os.getpid()
    padded = pad_collate(batch)["hidden_states"]
    taken = padded is batch[0]["hidden_states"]._base
    return {**pack_collate(batch), "padded_in_shared_memory": taken and padded.is_shared()}


def keys_through_loader(path, context: str) -> list[str]:
    """The keys of every batch a two-worker DataLoader started by ``context`` gives, each batch's
    shapes checked, with a reader already open in this process."""
    ds = HiddenStatesDataset(path)
    ds[0]  # the parent has a reader open: a forked worker must open its own
    loader = torch.utils.data.DataLoader(
        ds, batch_size=5, shuffle=True, num_workers=2, multiprocessing_context=context, collate_fn=collate_in_worker
    )
    seen, shared, batches = [], 0, 0
    for batch in loader:
        batches += 1
        seen += batch["keys"]
        shared += batch["padded_in_shared_memory"]
        n = len(batch["token_ids"])
        assert batch["hidden_states"].shape == (n, 3, 16) and batch["cu_seqlens"][-1] == n
    # Every batch decoded into shared memory, sent without a copy (a spawned worker takes the
    # rows' shape from one record it reads alone first; a forked one has the parent's).
    assert shared == batches, (shared, batches)
    return seen


if __name__ == "__main__":
    print(json.dumps(keys_through_loader(sys.argv[1], sys.argv[2])))
