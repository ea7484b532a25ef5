"""What a ``layertap generate`` rerun does, before its engine starts, with a record that fails
its check (issue 34, item 4): the record counts as missing, its shard is re-indexed without it
(a copy recovered and renamed over the shard), and both readers and ``verify`` agree on the
dataset that is left. Shards written by the Rust writer as generate's connector writes them
(its shard metadata), no engine: tests/vllm/test_generate.py runs the whole command."""

from __future__ import annotations

import json
import os

import pytest

import layertap
from helpers import flip_bit, make_tensors, payload_offset, shard_files
from layertap.generate.resume import prepare_output

MODEL = "/models/tiny"
LAYERS = [1, 2, 4]


def generate_like(path, rows: range, writer_id: str = "gen-0") -> None:
    """Records keyed by row index, in shards whose metadata says generate wrote them."""
    user = {"source": "layertap.generate", "model": MODEL, "layer_ids": json.dumps(LAYERS)}
    with layertap.ShardWriter(os.fspath(path), writer_id=writer_id, metadata=user, shard_size=4096) as w:
        for i in rows:
            w.submit(str(i), make_tensors(i), {"row": str(i)})
        w.flush()


def flip_payload(shard: str, record: int) -> str:
    at, length, key = payload_offset(shard, record)
    flip_bit(shard, at + length // 2)
    return key


def prepare(path):
    state = prepare_output(os.fspath(path), MODEL, LAYERS)
    state.release()
    return state


@pytest.mark.parametrize("backend", ["rust", "python"])
def test_a_damaged_record_is_taken_out_of_its_shards_index(tmp_path, backend):
    generate_like(tmp_path, range(6))
    shard = shard_files(tmp_path)[0]
    with layertap.open(shard) as ds:
        assert len(ds) >= 3, "the damaged record must be neither the first nor the last"
        kept = {k: ds[k].tensors for k in ds.keys()}
    key = flip_payload(shard, 1)
    kept.pop(key)
    (tmp_path / f".{os.path.basename(shard)}.repair").write_bytes(b"a copy a killed repair left")

    state = prepare(tmp_path)
    assert [(p.key, p.shard, p.kind) for p in state.damaged] == [(key, shard, "corrupt_record")]
    assert "payload checksum mismatch" in state.damaged[0].message
    assert state.done.tolist() == sorted(i for i in range(6) if str(i) != key)
    assert sorted(os.listdir(tmp_path)) == sorted(
        [".layertap-generate.lock", *map(os.path.basename, shard_files(tmp_path))]
    )

    with layertap.open(tmp_path, backend=backend) as ds:
        report = ds.verify()
        assert report.ok and report.lost_in_recovery == 1 and [n.kind for n in report.notes] == ["lost_in_recovery"]
        assert key not in ds
        for k, tensors in kept.items():  # the shard's other records, byte for byte
            for name, t in tensors.items():
                assert ds[k].tensors[name].equal(t)
    # The row written again by the next run's writer: the key has one record, the new one.
    generate_like(tmp_path, [int(key)], writer_id="gen-1")
    with layertap.open(tmp_path, backend=backend) as ds:
        report = ds.verify()
        assert report.ok and not report.duplicates and len(ds) == 6
        assert ds[key].shard.endswith("gen-1-000000.lts") and ds[key].tensors["token_ids"].equal(
            make_tensors(int(key))["token_ids"]
        )
    assert prepare(tmp_path).damaged == []  # repaired once, nothing found again


def test_a_damaged_last_record_is_cut_with_the_footer(tmp_path):
    generate_like(tmp_path, range(3))
    shard = shard_files(tmp_path)[0]
    with layertap.open(shard) as ds:
        last = len(ds) - 1
    key = flip_payload(shard, last)
    state = prepare(tmp_path)
    assert [p.key for p in state.damaged] == [key] and int(key) not in state.done.tolist()
    with layertap.open(tmp_path) as ds:
        report = ds.verify()
        assert report.ok and report.lost_in_recovery == 0 and key not in ds


def shard_of_undecodable_records(path, rows: range) -> None:
    """A complete shard, made with the format's functions alone, whose records are as their
    writer wrote them (frame headers, checksums and index all right) but whose payloads are
    random bytes that no codec decodes: what a resume that decoded payloads would stop on."""
    import random

    from layertap._spec import format as fmt

    rng = random.Random(7)
    user = {"source": "layertap.generate", "model": MODEL, "layer_ids": json.dumps(LAYERS)}
    meta = {"writer_id": "gen-0", "shard_index": 0, "created_unix_ms": 0, "writer": "hand-made", "user": user}
    head, body, entries = fmt.encode_file_header(bytes(16), meta), b"", []
    for i in rows:
        key, payload = str(i).encode(), rng.randbytes(rng.randrange(40, 400))
        codec = rng.randrange(len(fmt.CODECS))
        frame = fmt.encode_frame_header(1, codec, key, len(payload), 4 * len(payload), 3, fmt.crc32c(payload))
        entries.append(
            fmt.RawEntry(len(head) + len(body), len(payload), 4 * len(payload), 3, fmt.crc32c(payload), codec, str(i))
        )
        body += frame + payload + bytes(fmt.align8(len(payload)) - len(payload))
    with open(path, "wb") as f:
        f.write(head + body + fmt.encode_footer(entries, len(head) + len(body)))


def test_resume_reads_frames_and_checksums_not_payloads(tmp_path):
    """A rerun finds what is done from the indexes and finds damage from the frame headers and
    payload checksums, without decoding a payload (decoding a dataset of terabytes at every
    rerun costs the codec's speed, not the disk's): records that match their checksums count as
    done although they do not decode, and a byte changed in a payload is still found."""
    shard = tmp_path / "gen-0-000000.lts"
    shard_of_undecodable_records(shard, range(8))
    with layertap.open(tmp_path) as ds:  # decoding would fail on every record
        assert len(ds) == 8 and ds.verify().records_bad == 8

    state = prepare(tmp_path)
    assert state.damaged == [] and state.done.tolist() == list(range(8))

    key = flip_payload(str(shard), 5)
    state = prepare(tmp_path)
    assert [(p.key, p.kind) for p in state.damaged] == [(key, "corrupt_record")]
    assert "payload checksum mismatch" in state.damaged[0].message
    assert state.done.tolist() == [i for i in range(8) if str(i) != key]
