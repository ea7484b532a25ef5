"""Checks of ``HiddenStatesDataset(..., decode_on=...)`` (layertap.torch): exp-huf records decoded
by the Triton decoder (layertap.gpu.exphuf_decode), in Triton's interpreter on CPU tensors
(``decode_on="cpu"``), give batches bit for bit equal to the CPU path's, those coded by element
(block mode 1, ``compress_on="gpu"``'s) and the Rust writer's, coded by column (block mode 2),
alike; a damaged record raises CorruptRecordError or is skipped as the CPU path skips it. Not collected by pytest: vLLM's CPU
build must never see triton, so tests/test_triton_torch_decode.py runs this script in a
subprocess with ``PYTHONPATH=.venv/triton:python TRITON_INTERPRET=1``.

    PYTHONPATH=.venv/triton:python TRITON_INTERPRET=1 python tests/triton_kernels/check_torch_gpu_decode.py CASE...
    PYTHONPATH=python python3 tests/triton_kernels/check_torch_gpu_decode.py --device cuda all   # on a GPU

With no CASE it lists the cases. Prints ``ok CASE`` per case that passes, ``FAIL CASE: why`` per
one that does not, and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

import layertap  # noqa: E402
from helpers import payload_offset, shard_files  # noqa: E402
from layertap._py.write import write_shard  # noqa: E402
from layertap._spec.exphuf import MODE_CODED, MODE_COLUMNS  # noqa: E402
from layertap.errors import CorruptRecordError, InvalidInputError  # noqa: E402
from layertap.torch import HiddenStatesDataset, pack_collate, pad_collate  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":  # its frontend cheaper a step, same results: faster_interpreter.py
    import faster_interpreter

    faster_interpreter.install()

LAYER_IDS = [2, 8, 13]
#: Rows 0-9 in an exp-huf shard coded by element (block mode 1, what compress_on="gpu" writes;
#: coded blocks and raw ones), 10-13 in a codec-none one, 14-17 in an exp-huf shard by the Rust
#: writer (coded by column, block mode 2).
CODED_ROWS, RAW_ROWS, ROWS = 10, 14, 18
BATCH = [[3, 11, 0, 7], [12, 1, 9, 5], [2, 4, 6, 8], [10, 13], [15, 2, 17, 10, 14, 16]]


def record(row: int) -> dict:
    """Row ``row``'s tensors. Hidden states of 3 tokens are stored raw, of 4 coded (both block
    modes): standard normal values, whose few exponents make 4 tokens the fewest the encoders
    code (activations_like's spread needs 5), so that the kernels run 192 steps a batch (the
    interpreter's few milliseconds a step are the check's time)."""
    n = (3, 4, 4, 4)[row % 4]
    g = torch.Generator().manual_seed(row)
    tensors = {
        "hidden_states": torch.randn((n, len(LAYER_IDS), 64), generator=g).to(torch.bfloat16),
        "token_ids": torch.arange(n, dtype=torch.int64) + 100 * row,
    }
    if row % 2 == 0:
        tensors["loss_mask"] = (torch.arange(n) % 3 != 0).to(torch.uint8)
    return tensors


def write_dataset(path: Path) -> None:
    path.mkdir(parents=True)
    # The Rust writer codes exp-huf by column; the reference writer by element as the GPU encoder does.
    write_shard(
        path / "huf-000000.lts",
        [(str(r), record(r), {"layer_ids": "[2, 8, 13]"}) for r in range(CODED_ROWS)],
        writer_id="huf",
        shard_id=bytes(range(16)),
        created_unix_ms=0,
        software="reference",
        codec="exp-huf",
        exphuf_by="element",
    )
    for writer_id, codec, rows in (
        ("raw", "none", range(CODED_ROWS, RAW_ROWS)),
        ("col", "exp-huf", range(RAW_ROWS, ROWS)),
    ):
        with layertap.ShardWriter(str(path), writer_id=writer_id, codec=codec) as w:
            for r in rows:
                w.submit(str(r), record(r), {"layer_ids": "[2, 8, 13]"})


def exphuf_shard(path: Path, writer_id: str = "huf") -> str:
    (shard,) = [s for s in shard_files(path) if Path(s).name.startswith(f"{writer_id}-")]
    return shard


def stored_payloads(shard: str) -> dict[str, bytes]:
    """Each record's stored payload, by key."""
    keys = [e.key for e in layertap.open(shard).backends[0].entries]
    out = {}
    with open(shard, "rb") as f:
        for i in range(len(keys)):
            offset, stored_len, key = payload_offset(shard, i)
            out[key] = os.pread(f.fileno(), stored_len, offset)
    return out


def stream_lengths(stored: bytes) -> int:
    """Where the stream lengths of a payload's first tensor's block are (it must be coded)."""
    head_len = 8 + int.from_bytes(stored[:8], "little")
    assert stored[head_len] == MODE_CODED, "the first tensor's block is not coded"
    at = head_len + 1 + 8 + 256
    for _ in range(stored[head_len + 1]):
        at += 4 + (int.from_bytes(stored[at + 2 : at + 4], "little") + 1) // 2
    return at


def same(a, b, what: str) -> None:
    """``a`` (the CPU path's) and ``b`` (decode_on's) are equal, bit for bit, tensors moved to the CPU."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{what}: {sorted(a)} != {sorted(b)}"
        for k in a:
            same(a[k], b[k], f"{what}[{k!r}]")
    elif isinstance(a, list):
        assert len(a) == len(b), f"{what}: {len(a)} != {len(b)} items"
        for j, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{what}[{j}]")
    elif isinstance(a, torch.Tensor):
        assert a.device.type == "cpu", f"{what}: the CPU path's tensor is on {a.device}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype} {tuple(a.shape)} != {b.dtype} {tuple(b.shape)}"  # fmt: skip
        assert torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8)), f"{what}: different bytes"
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def case_batches_equal(path: Path, device: str) -> str:
    """Every batch of the dataset (exp-huf and codec-none records mixed) through __getitems__,
    pad_collate and pack_collate, and single items, equal to the CPU path's."""
    shard = exphuf_shard(path)
    keys = [e.key for e in layertap.open(shard).backends[0].entries]
    offset, stored_len, _ = payload_offset(shard, keys.index("3"))
    with open(shard, "rb") as f:  # the kernel has coded streams to decode (rows 1-3, 5-7, 9)
        stream_lengths(os.pread(f.fileno(), stored_len, offset))
    assert "layertap.gpu.exphuf_decode" not in sys.modules
    cpu, dev = HiddenStatesDataset(path), HiddenStatesDataset(path, decode_on=device)
    assert "layertap.gpu.exphuf_decode" not in sys.modules, "imported before a batch asked for it"
    for indices in BATCH:
        want, got = cpu.__getitems__(indices), dev.__getitems__(indices)
        hidden = {b["hidden_states"].device.type for b in got}
        assert hidden == {torch.device(device).type}, f"hidden states on {hidden}"
        assert "layertap.gpu.exphuf_decode" in sys.modules, "the Triton decoder was not used"
        same(want, got, f"items {indices}")
        padded = pad_collate(got)
        base = got[0]["hidden_states"]._base
        assert padded["hidden_states"] is base, "pad_collate copied the device batch"
        same(pad_collate(want), padded, f"pad_collate {indices}")
        same(pack_collate(want), pack_collate(got), f"pack_collate {indices}")
    same(cpu[5], dev[5], "item 5")
    same(cpu[12], dev[12], "item 12")
    return f"{len(BATCH)} batches of {ROWS} records"


def case_by_column(path: Path, device: str) -> str:
    """The Rust writer's exp-huf records (coded by column, block mode 2) go to the Triton decoder
    (no host fallback: every payload of a batch, mixed with records coded by element, reaches
    ``decode_records``), decode bit for bit as the core decodes them, and give batches equal to
    the CPU path's, with hidden states on the device."""
    from layertap.gpu import exphuf_decode

    by_column = stored_payloads(exphuf_shard(path, "col"))
    first_block = {k: p[8 + int.from_bytes(p[:8], "little")] for k, p in by_column.items()}
    assert MODE_COLUMNS in first_block.values(), f"no block coded by column: {first_block}"
    keys = sorted(by_column)
    got = exphuf_decode.decode_records([by_column[k] for k in keys], torch.device(device))
    for k, tensors in zip(keys, got):
        same(record(int(k)), tensors, f"record {k} by decode_records")
    seen: list[int] = []  # payloads of each call of the Triton decoder
    real = exphuf_decode.decode_records

    def counting(payloads, *args, **kwargs):
        seen.append(len(payloads))
        return real(payloads, *args, **kwargs)

    exphuf_decode.decode_records = counting
    try:
        cpu, dev = HiddenStatesDataset(path), HiddenStatesDataset(path, decode_on=device)
        for indices in ([14, 15, 16, 17], BATCH[-1]):
            want, got = cpu.__getitems__(indices), dev.__getitems__(indices)
            assert {b["hidden_states"].device.type for b in got} == {torch.device(device).type}
            same(want, got, f"items {indices}")
            same(pad_collate(want), pad_collate(got), f"pad_collate {indices}")
        same(cpu[15], dev[15], "item 15")
    finally:
        exphuf_decode.decode_records = real
    # rows 14-17 by column; BATCH[-1] = 15, 2, 17, 10, 14, 16: five exp-huf rows (10 is codec none)
    assert seen == [4, 5, 1], f"payloads the Triton decoder was given: {seen}"
    return f"{sum(m == MODE_COLUMNS for m in first_block.values())} records coded by column, decoded on {device}"


def case_staged(path: Path, device: str) -> str:
    """Payloads placed in a ``Staging`` (one host buffer, as a reader fills it with preadv) decode
    as the same payloads given as bytes do, and as the writer wrote them, both block modes mixed;
    the buffer's gaps and tail are zero; the Dataset reads a batch's payloads straight into one
    (no buffer a payload) and hands it to the decoder as it is."""
    from layertap.gpu import exphuf_decode

    payloads = {**stored_payloads(exphuf_shard(path)), **stored_payloads(exphuf_shard(path, "col"))}
    keys = ["3", "15", "0", "14", "7"]  # by element (coded and raw blocks) and by column
    staging = exphuf_decode.Staging([len(payloads[k]) for k in keys], torch.device(device))
    for k, view in zip(keys, staging.views):
        assert not view.readonly and len(view) == len(payloads[k])
        view[:] = payloads[k]
    host = staging.host.numpy()
    ends = [b + n for b, n in zip(staging.bases, staging.lengths)]
    assert all(b % 8 == 0 for b in staging.bases), staging.bases
    assert not any(host[e:b].any() for e, b in zip(ends, [*staging.bases[1:], len(host)])), "gaps not zero"
    got = exphuf_decode.decode_records(staging)
    listed = exphuf_decode.decode_records([payloads[k] for k in keys], torch.device(device))
    for k, a, b in zip(keys, got, listed):
        same(record(int(k)), a, f"record {k} staged")
        same(record(int(k)), b, f"record {k} as bytes")
    given: list = []
    real = exphuf_decode.decode_records

    def recording(payloads, *args, **kwargs):
        given.append(payloads)
        return real(payloads, *args, **kwargs)

    exphuf_decode.decode_records = recording
    try:
        cpu, dev = HiddenStatesDataset(path), HiddenStatesDataset(path, decode_on=device)
        indices = BATCH[-1]
        same(cpu.__getitems__(indices), dev.__getitems__(indices), f"items {indices}")
    finally:
        exphuf_decode.decode_records = real
    assert [type(g).__name__ for g in given] == ["Staging"], f"the Dataset gave the decoder {given}"
    return f"{len(keys)} payloads staged, both block modes; the Dataset stages a batch of {len(given[0])}"


def case_layers(path: Path, device: str) -> str:
    cpu = HiddenStatesDataset(path, layers=[13, 2])
    dev = HiddenStatesDataset(path, layers=[13, 2], decode_on=device)
    indices = BATCH[0]
    same(pad_collate(cpu.__getitems__(indices)), pad_collate(dev.__getitems__(indices)), "layers [13, 2]")
    return "layers [13, 2]"


def case_damaged_record(path: Path, device: str) -> str:
    """Stream 0 of row 3's hidden states one byte longer, stream 1 one shorter: the checksum
    catches it; without it the kernel does; with errors="skip" both paths skip row 3 alone."""
    damaged = Path(tempfile.mkdtemp(dir=path.parent)) / "ds"
    shutil.copytree(path, damaged)
    shard = exphuf_shard(damaged)
    keys = [e.key for e in layertap.open(shard).backends[0].entries]
    offset, stored_len, key = payload_offset(shard, keys.index("3"))
    assert key == "3"
    with open(shard, "r+b") as f:
        stored = os.pread(f.fileno(), stored_len, offset)
        at = stream_lengths(stored)
        sizes = [int.from_bytes(stored[at + 8 * k : at + 8 * k + 8], "little") for k in (0, 1)]
        os.pwrite(f.fileno(), (sizes[0] + 1).to_bytes(8, "little") + (sizes[1] - 1).to_bytes(8, "little"), offset + at)
    indices = BATCH[0]  # rows 3, 11, 0, 7
    messages = []
    for verify, word in ((True, "checksum mismatch"), (False, "stream 0 holds more bytes")):
        dev = HiddenStatesDataset(damaged, verify=verify, decode_on=device)
        with no_tensors_left_to_the_cycle_collector(f"a CorruptRecordError raised, verify={verify}"):
            try:
                dev.__getitems__(indices)
            except CorruptRecordError as e:
                assert e.key == "3" and word in str(e) and shard in str(e), f"verify={verify}: {e}"
                messages.append(str(e))
            else:
                raise AssertionError(f"verify={verify}: no CorruptRecordError")
        cpu = HiddenStatesDataset(damaged, verify=verify, errors="skip")
        dev = HiddenStatesDataset(damaged, verify=verify, errors="skip", decode_on=device)
        with no_tensors_left_to_the_cycle_collector(f"a record skipped, verify={verify}"):
            want, got = cpu.__getitems__(indices), dev.__getitems__(indices)
        assert got[0] is None and all(b is not None for b in got[1:]) and dev.skipped == 1, got
        same(want, got, f"skipped, verify={verify}")
        same(pad_collate(want), pad_collate(got), f"pad_collate skipped, verify={verify}")
    return " | ".join(messages)


@contextlib.contextmanager
def no_tensors_left_to_the_cycle_collector(what: str):
    """Fails when what runs inside leaves a tensor in a reference cycle (a raised error's
    traceback holding the frame that holds the error): such a batch's pinned and device memory
    stays until the garbage collector runs, and where that is a DataLoader worker forked
    afterwards, freeing the parent's CUDA memory aborts the worker (seen on an H100: this case
    before "refused" in one process)."""
    gc.collect()
    gc.disable()
    try:
        yield
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not left, f"{what}: {len(left)} tensors left to the cycle collector"


def case_damaged_by_column(path: Path, device: str) -> str:
    """Stream 0 of row 14's hidden states (the Rust writer's, coded by column) one byte longer,
    stream 1 one shorter, checksum not checked: the mode-2 kernel catches it and names the
    record; with errors="skip" row 14 alone is skipped, as the CPU path skips it."""
    damaged = Path(tempfile.mkdtemp(dir=path.parent)) / "ds"
    shutil.copytree(path, damaged)
    shard = exphuf_shard(damaged, "col")
    keys = [e.key for e in layertap.open(shard).backends[0].entries]
    offset, stored_len, _ = payload_offset(shard, keys.index("14"))
    with open(shard, "r+b") as f:
        stored = os.pread(f.fileno(), stored_len, offset)
        head_len = 8 + int.from_bytes(stored[:8], "little")
        assert stored[head_len] == MODE_COLUMNS, "row 14's hidden states are not coded by column"
        at = head_len + 1 + 12 + 256  # the code-length tables, then the stream lengths
        for _ in range(stored[head_len + 1]):
            at += 4 + (int.from_bytes(stored[at + 2 : at + 4], "little") + 1) // 2
        sizes = [int.from_bytes(stored[at + 8 * k : at + 8 * k + 8], "little") for k in (0, 1)]
        os.pwrite(f.fileno(), (sizes[0] + 1).to_bytes(8, "little") + (sizes[1] - 1).to_bytes(8, "little"), offset + at)
    indices = [15, 14, 2, 10]
    dev = HiddenStatesDataset(damaged, verify=False, decode_on=device)
    try:
        dev.__getitems__(indices)
    except CorruptRecordError as e:
        assert e.key == "14" and "stream 0 holds more bytes" in str(e) and shard in str(e), e
        message = str(e)
    else:
        raise AssertionError("no CorruptRecordError")
    cpu = HiddenStatesDataset(damaged, verify=False, errors="skip")
    dev = HiddenStatesDataset(damaged, verify=False, errors="skip", decode_on=device)
    want, got = cpu.__getitems__(indices), dev.__getitems__(indices)
    assert got[1] is None and all(b is not None for i, b in enumerate(got) if i != 1) and dev.skipped == 1, got
    same(want, got, "skipped")
    return message


def case_refused(path: Path, device: str) -> str:
    """No CUDA device here: decode_on="cuda" says what it needs; DataLoader workers are refused."""
    if not torch.cuda.is_available():
        try:
            HiddenStatesDataset(path, decode_on="cuda")
        except InvalidInputError as e:
            assert str(e).startswith("decode_on='cuda' needs a CUDA device and triton; torch sees no CUDA device"), e
        else:
            raise AssertionError("decode_on='cuda' accepted without a CUDA device")
    try:
        HiddenStatesDataset(path, decode_on="tpu")
    except InvalidInputError as e:
        assert "decode_on must be None, 'cuda'" in str(e), e
    else:
        raise AssertionError("decode_on='tpu' accepted")
    ds = HiddenStatesDataset(path, decode_on=device)
    loader = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=1, collate_fn=pad_collate)
    try:
        next(iter(loader))
    except Exception as e:  # the worker's InvalidInputError, re-raised by the DataLoader
        assert "decodes in the main process" in str(e) and "num_workers=0" in str(e), e
    else:
        raise AssertionError("a DataLoader worker decoded with decode_on")
    return "cuda without a device, an unknown device, workers"


CASES = {
    "batches-equal": case_batches_equal,
    "by-column": case_by_column,
    "staged": case_staged,
    "layers": case_layers,
    "damaged-record": case_damaged_record,
    "damaged-by-column": case_damaged_by_column,
    "refused": case_refused,
}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", help="case names, or all")
    ap.add_argument("--device", default="cpu", help="cpu (the interpreter) or cuda (compiled kernels)")
    args = ap.parse_args(argv)
    if not args.cases:
        print("\n".join(CASES))
        return 0
    names = list(CASES) if args.cases == ["all"] else args.cases
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown cases {unknown}: run with no argument for the list", flush=True)
        return 2
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ds"
        write_dataset(path)
        for name in names:
            try:
                print(f"ok {name}: {CASES[name](path, args.device)}", flush=True)
            except Exception as e:
                print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
                traceback.print_exc(file=sys.stdout)
                failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
