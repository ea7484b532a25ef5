"""Reads from Mooncake Store decode through the Rust core (``layertap._decoder``): ``layertap.open``,
``follow`` and ``layertap.vllm.fetch`` of a ``mooncake://`` dataset never import the Python
reference's decoding, and both backends read every codec's records alike."""

from __future__ import annotations

from decoder_support import CASES, RECORDS, REFERENCE_DECODER, as_plain, read_in_child, write_case, writer_id

import layertap
from layertap.mooncake.address import parse_address
from layertap.vllm.mooncake_forwarder import Forwarder


def _put(address: str, spool) -> list[tuple[str, str]]:
    """Every case's records written into ``spool`` and forwarded into the store."""
    keys = []
    for codec, lossy in CASES:
        write_case(spool, codec, lossy).close()
    for codec, lossy in CASES:
        wid = writer_id(codec, lossy)
        f = Forwarder(parse_address(address), str(spool), wid, {}, keep_shards=True)
        f.close(timeout=60)
        assert f.error is None and f.stats["records_put"] == RECORDS
        keys += [(wid, f"{wid}-r{i}") for i in range(RECORDS)]
    return keys


def test_store_reads_decode_in_the_core_and_alike(store, tmp_path):
    address = store.address("t/decoder")
    keys = _put(address, tmp_path / "spool")
    got = read_in_child(tmp_path / "spool", keys, store=address)
    want = sorted(k for _, k in keys)
    assert {path: sorted(k) for path, k in got["read"].items()} == {"follow": want, "open": want, "fetch": want}
    assert [m for m in got["modules"] if m in REFERENCE_DECODER or m.startswith("layertap._py")] == []
    read = {}
    for backend in ("rust", "python"):
        with layertap.open(address, backend=backend, tensors="numpy") as ds:
            read[backend] = sorted(as_plain(r) for r in ds)
    with layertap.open(str(tmp_path / "spool"), tensors="numpy") as disk:
        on_disk = sorted(as_plain(r) for r in disk)
    assert len(read["rust"]) == len(want) and read["rust"] == read["python"] == on_disk
