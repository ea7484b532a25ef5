"""``layertap.torch.HiddenStatesDataset`` and its collate functions: items by row, layer
selection, DataLoader workers started by fork and by spawn, corrupt records skipped or raised."""

from __future__ import annotations

import json
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import layertap
from helpers import flip_bit, run_python, subprocess_env
from layertap.errors import CorruptRecordError, RecordNotFoundError
from layertap.torch import HiddenStatesDataset, pack_collate, pad_collate
from loader_check import keys_through_loader

LOADER_CHECK = Path(__file__).with_name("loader_check.py")
ROWS = 24
LAYER_IDS = [2, 8, 13]


def record(row: int) -> dict:
    g = torch.Generator().manual_seed(row)
    n = 3 + row % 7
    tensors = {
        "hidden_states": torch.randn(n, len(LAYER_IDS), 16, generator=g).to(torch.bfloat16),
        "token_ids": torch.arange(n, dtype=torch.int64) + 100 * row,
    }
    if row % 2 == 0:
        tensors["loss_mask"] = (torch.arange(n) % 3 != 0).to(torch.uint8)
    return tensors


@pytest.fixture(scope="module")
def dataset_path(tmp_path_factory):
    """Rows written out of order by two writers (as resumed runs leave them)."""
    path = tmp_path_factory.mktemp("torch-ds") / "ds"
    rows = list(range(ROWS))
    random.Random(0).shuffle(rows)
    for writer_id, part in (("gen-0", rows[:10]), ("gen-1", rows[10:])):
        with layertap.ShardWriter(str(path), writer_id=writer_id, codec="bp16-zstd") as w:
            for r in part:
                w.submit(str(r), record(r), {"layer_ids": "[2, 8, 13]", "row": str(r)})
    return path


def test_items_in_row_order(dataset_path):
    ds = HiddenStatesDataset(dataset_path)
    assert len(ds) == ROWS and ds.keys == [str(i) for i in range(ROWS)]
    for i in (0, 5, 23):
        item, want = ds[i], record(i)
        assert item["key"] == str(i)
        assert torch.equal(item["hidden_states"], want["hidden_states"])
        assert torch.equal(item["token_ids"], want["token_ids"])
        mask = want.get("loss_mask", torch.ones(len(want["token_ids"]), dtype=torch.uint8))
        assert item["loss_mask"].dtype == torch.uint8 and torch.equal(item["loss_mask"], mask)


def test_layers_and_keys(dataset_path):
    ds = HiddenStatesDataset(dataset_path, layers=[13, 2], keys=["7", "3"])
    assert len(ds) == 2 and ds.keys == ["7", "3"]
    item = ds[0]
    assert torch.equal(item["hidden_states"], record(7)["hidden_states"][:, [2, 0]])
    with pytest.raises(layertap.LayertapError, match=r"holds layers \[2, 8, 13\], not all of \[4\]"):
        HiddenStatesDataset(dataset_path, layers=[4])[0]
    with pytest.raises(RecordNotFoundError, match="no record with key '99'"):
        HiddenStatesDataset(dataset_path, keys=["1", "99"])


def test_pickles_as_its_arguments(dataset_path):
    ds = HiddenStatesDataset(dataset_path, layers=[8])
    blob = pickle.dumps(ds)
    assert len(blob) < 1000, len(blob)  # no keys, no reader
    copy = pickle.loads(blob)
    assert copy.keys == ds.keys and torch.equal(copy[4]["hidden_states"], ds[4]["hidden_states"])


def test_dataloader_workers_started_by_fork(dataset_path):
    """In a fresh interpreter (tests/loader_check.py says why)."""
    proc = subprocess.run(
        [sys.executable, str(LOADER_CHECK), str(dataset_path), "fork"],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(json.loads(proc.stdout), key=int) == HiddenStatesDataset(dataset_path).keys


def test_dataloader_workers_started_by_spawn(dataset_path):
    assert sorted(keys_through_loader(dataset_path, "spawn"), key=int) == HiddenStatesDataset(dataset_path).keys


def test_collates():
    items = [
        {
            "hidden_states": torch.ones(2, 3, 4),
            "token_ids": torch.tensor([5, 6]),
            "loss_mask": torch.tensor([0, 1], dtype=torch.uint8),
            "key": "a",
        },
        None,  # a skipped record
        {
            "hidden_states": torch.full((3, 3, 4), 2.0),
            "token_ids": torch.tensor([7, 8, 9]),
            "loss_mask": torch.tensor([1, 1, 0], dtype=torch.uint8),
            "key": "b",
        },
    ]
    pad = pad_collate(items, pad_token_id=-1)
    assert pad["hidden_states"].shape == (2, 3, 3, 4) and pad["keys"] == ["a", "b"]
    assert pad["token_ids"].tolist() == [[5, 6, -1], [7, 8, 9]]
    assert pad["loss_mask"].tolist() == [[0, 1, 0], [1, 1, 0]]
    assert pad["attention_mask"].tolist() == [[True, True, False], [True, True, True]]
    assert pad["hidden_states"][0, 2].abs().sum() == 0 and pad["lengths"].tolist() == [2, 3]
    pack = pack_collate(items)
    assert pack["hidden_states"].shape == (5, 3, 4) and pack["token_ids"].tolist() == [5, 6, 7, 8, 9]
    assert pack["loss_mask"].tolist() == [0, 1, 1, 1, 0] and pack["position_ids"].tolist() == [0, 1, 0, 1, 2]
    assert pack["cu_seqlens"].tolist() == [0, 2, 5] and pack["cu_seqlens"].dtype == torch.int32
    with pytest.raises(ValueError, match="no readable record"):
        pad_collate([None])


def test_corrupt_records_skipped_or_raised(tmp_path):
    path = tmp_path / "ds"
    with layertap.ShardWriter(str(path), writer_id="gen-0", codec="none") as w:
        for r in range(4):
            w.submit(str(r), record(r), {"layer_ids": "[2, 8, 13]"})
    with layertap.open(path) as reader:
        entry = reader.backends[0].entries[2]
    flip_bit(reader.shards[0].path, entry.frame_offset + entry.stored_len // 2 + 64)
    skipping = HiddenStatesDataset(path, errors="skip")
    items = [skipping[i] for i in range(4)]
    assert items[2] is None and skipping.skipped == 1 and [b["key"] for b in items if b] == ["0", "1", "3"]
    assert pad_collate(items)["keys"] == ["0", "1", "3"]
    with pytest.raises(CorruptRecordError):
        HiddenStatesDataset(path)[2]
    # Without the checksum pass, a flipped bit of an uncompressed record goes unnoticed.
    unchecked = HiddenStatesDataset(path, verify=False)
    assert unchecked[2]["key"] == "2" and torch.equal(unchecked[3]["hidden_states"], record(3)["hidden_states"])


@pytest.mark.parametrize("codec", ["none", "zstd", "bp16-zstd", "exp-huf"])
def test_a_batch_is_decoded_into_one_padded_tensor_that_pad_collate_takes(tmp_path, codec):
    """``__getitems__`` (what a DataLoader asks for): the records' hidden states decoded into the
    rows of one padded tensor, which pad_collate returns as it is; the same batch as items read
    one by one and copied. Memory of a dropped batch is reused, so the zeros after each record
    are written, not inherited: a batch of long records, dropped, then one of short records."""
    path = tmp_path / "ds"
    with layertap.ShardWriter(str(path), writer_id="gen-0", codec=codec) as w:
        for r in range(ROWS):
            w.submit(str(r), record(r), {"layer_ids": "[2, 8, 13]"})
    fresh = HiddenStatesDataset(path)  # its first batch too (rows shaped as one record read first)
    items = fresh.__getitems__([3, 4])
    assert pad_collate(items)["hidden_states"] is items[0]["hidden_states"]._base and fresh.skipped == 0
    ds = HiddenStatesDataset(path)
    for batch in ([6, 13, 20, 5], [7, 0, 14, 21], [1, 7]):  # 8 or 9 tokens, then 3 to 4
        one_by_one = [ds[i] for i in batch]
        items = ds.__getitems__(batch)
        for got, want in zip(items, one_by_one):
            assert got.keys() == want.keys() and got["key"] == want["key"]
            for name in ("hidden_states", "token_ids", "loss_mask"):
                assert torch.equal(got[name], want[name]), name
        padded = pad_collate(items)
        assert padded["hidden_states"] is items[0]["hidden_states"]._base  # not copied
        copied = pad_collate(one_by_one)
        for name in ("hidden_states", "token_ids", "loss_mask", "attention_mask", "lengths"):
            assert torch.equal(padded[name], copied[name]), name
        del items, padded
    loader = torch.utils.data.DataLoader(ds, batch_size=5, collate_fn=pad_collate)
    assert [k for b in loader for k in b["keys"]] == ds.keys


#: A Dataset that raises reads records 0, 3 (damaged) and 4 of the dataset at argv[1] with the
#: garbage collector off; then the tensors that only the cycle collector would have freed.
NO_CYCLE_LEFT = """
import gc, sys, torch
from layertap.errors import CorruptRecordError
from layertap.torch import HiddenStatesDataset
raising = HiddenStatesDataset(sys.argv[1])
raising[0]
gc.collect()
gc.disable()
try:
    raising.__getitems__([0, 3, 4])
except CorruptRecordError:
    pass
else:
    sys.exit("no CorruptRecordError")
gc.set_debug(gc.DEBUG_SAVEALL)
gc.collect()
left = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
print(len(left), "tensors left to the cycle collector")
"""


def test_a_batch_with_records_of_another_shape_or_damaged(tmp_path):
    """Rows are shaped as the first record read: a record whose hidden states have as many
    bytes but another shape, or other bytes, is served as it is stored (pad_collate then
    copies); a corrupt one is skipped or raised as one by one."""
    path = tmp_path / "ds"
    odd = {
        "1": torch.randn(4, 6, 8).to(torch.bfloat16),  # the bytes of [4, 3, 16] in another shape
        "2": torch.randn(5, 3, 8).to(torch.bfloat16),  # fewer bytes a token
    }
    with layertap.ShardWriter(str(path), writer_id="gen-0", codec="bp16-zstd") as w:
        for r in range(5):
            rec = (
                record(r)
                if str(r) not in odd
                else {"hidden_states": odd[str(r)], "token_ids": torch.arange(len(odd[str(r)]))}
            )
            w.submit(str(r), rec, {"layer_ids": "[2, 8, 13]"})
    ds = HiddenStatesDataset(path, errors="skip")
    ds[0]
    items = ds.__getitems__([1, 2, 3])
    assert torch.equal(items[0]["hidden_states"], odd["1"]) and torch.equal(items[1]["hidden_states"], odd["2"])
    assert torch.equal(items[2]["hidden_states"], record(3)["hidden_states"])
    with layertap.open(path) as reader:
        entry = reader.backends[0].entries[3]
    flip_bit(reader.shards[0].path, entry.frame_offset + entry.stored_len // 2 + 64)
    skipping = HiddenStatesDataset(path, errors="skip")
    skipping[0]
    items = skipping.__getitems__([0, 3, 4])
    assert items[1] is None and skipping.skipped == 1
    assert pad_collate(items)["keys"] == ["0", "4"]
    fresh = HiddenStatesDataset(path, errors="skip")  # the corrupt record first: counted once
    assert [b and b["key"] for b in fresh.__getitems__([3, 0])] == [None, "0"] and fresh.skipped == 1
    # The raised error leaves no cycle holding the batch's memory (see torch._taken): freed at
    # once, not when the garbage collector runs. Checked in a fresh interpreter: in this one,
    # objects of earlier tests can become garbage meanwhile (a vLLM model's weights, once).
    r = run_python(NO_CYCLE_LEFT, str(path))
    assert r.returncode == 0 and r.stdout == "0 tensors left to the cycle collector\n", r.stdout + r.stderr


class _ThreadsSeen(torch.utils.data.Dataset):
    """Items: the threads a batch read would take where the item is made."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> int:
        from layertap.torch import _decode_threads

        return _decode_threads(None, None)


def test_threads_read_the_same_batches_and_are_checked(tmp_path):
    """``threads`` caps the threads that read a batch: the same items with one and with three
    (the core spreads a batch of fewer records over the threads left: rust/core's
    reader_batch.rs checks those bytes); the default is one a CPU (one a record for stored
    payloads), shared out among DataLoader workers; a bad value is refused with the option's
    name."""
    import os

    from layertap.errors import InvalidInputError
    from layertap.torch import _decode_threads

    path = tmp_path / "ds"
    with layertap.ShardWriter(str(path), writer_id="gen-0", codec="exp-huf") as w:
        for r in range(ROWS):
            w.submit(str(r), record(r), {"layer_ids": "[2, 8, 13]"})
    want = [HiddenStatesDataset(path)[i] for i in (5, 2)]
    for threads in (1, 3):
        got = HiddenStatesDataset(path, threads=threads).__getitems__([5, 2])
        for g, w in zip(got, want):
            assert torch.equal(g["hidden_states"], w["hidden_states"]), threads
    cpus = len(os.sched_getaffinity(0))
    assert (_decode_threads(None, None), _decode_threads(None, 3), _decode_threads(2, 3), _decode_threads(9, None)) == (
        min(cpus, 256),
        3,
        2,
        min(9, cpus),
    )
    # In a DataLoader's workers the CPUs are shared out among them (at least one each).
    for workers in (1, 2):
        seen = torch.utils.data.DataLoader(
            _ThreadsSeen(), batch_size=None, num_workers=workers, multiprocessing_context="fork"
        )
        assert list(seen) == [max(1, min(cpus // workers, 256))] * 2, workers
    assert pickle.loads(pickle.dumps(HiddenStatesDataset(path, threads=2))).threads == 2
    for bad in (0, 257, 1.5, "2"):
        with pytest.raises(InvalidInputError, match=r"threads must be a positive integer below 257, not "):
            HiddenStatesDataset(path, threads=bad)
