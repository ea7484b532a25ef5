"""``layertap.vllm.fetch`` against real writers in this process: it waits for a record that is not
written yet, finds records in live and in complete shards, and reports failures and timeouts."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import layertap
from layertap.errors import InvalidInputError, LayertapError
from layertap.follow import DatasetTail
from layertap.vllm import RecordLocation, fetch
from layertap.vllm import online as online_module
from layertap.vllm.online import error_marker_path, leave_error_marker

#: How long a helper thread waits for fetch to reach the point it waits for (milliseconds
#: normally): only so that a fetch that never gets there fails the test rather than hangs it.
HANDSHAKE = 60


def tensors(i: int, tokens: int = 5) -> dict:
    return {
        "hidden_states": torch.full((tokens, 2, 16), float(i), dtype=torch.bfloat16),
        "token_ids": torch.arange(tokens, dtype=torch.int64) + i,
    }


def location(path, key: str, writer_id: str = "w") -> dict:
    return {"layertap": {"dataset": str(path), "writer_id": writer_id, "key": key}}


@pytest.fixture
def fetch_waits(monkeypatch) -> threading.Event:
    """Set when a fetch goes to wait (``DatasetTail.wait``: what it looked for was not there):
    a thread that writes what the fetch waits for does so only then, so that the fetch is known
    to have waited, however the threads are scheduled."""
    event = threading.Event()
    real = DatasetTail.wait

    def wait(self, *args, **kwargs):
        event.set()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DatasetTail, "wait", wait)
    return event


def test_fetch_waits_for_a_record_written_later(tmp_path, fetch_waits):
    with layertap.ShardWriter(tmp_path, writer_id="w", codec="bp16-zstd") as w:
        w.submit("early", tensors(1))

        def later():
            fetch_waits.wait(HANDSHAKE)  # the fetch looked, did not find it, and waits
            w.submit("late", tensors(2))

        thread = threading.Thread(target=later)
        thread.start()
        record = fetch(location(tmp_path, "late"), timeout=HANDSHAKE * 2)
        thread.join()
        assert fetch_waits.is_set()
        assert record.key == "late" and record.token_ids.tolist() == [2, 3, 4, 5, 6]
        assert torch.equal(record.hidden_states, tensors(2)["hidden_states"])
        # A record already there comes back at once, from the live shard.
        assert fetch(RecordLocation(str(tmp_path), "w", "early"), timeout=5).token_ids[0] == 1


def test_fetch_finds_records_in_complete_and_live_shards(tmp_path):
    # Tiny shards: the writer moves on after every record or two.
    with layertap.ShardWriter(tmp_path, writer_id="w", codec="none", shard_size=4096) as w:
        for i in range(6):
            w.submit(f"k{i}", tensors(i, tokens=20))
        w.flush()
        assert len(list(tmp_path.glob("w-*.lts"))) >= 3
        for i in (0, 3, 5):
            assert fetch(location(tmp_path, f"k{i}"), timeout=10).token_ids[0] == i
    assert fetch(location(tmp_path, "k4"), timeout=10).hidden_states.float().mean() == 4.0


def test_fetch_only_looks_at_its_writer(tmp_path):
    with layertap.ShardWriter(tmp_path, writer_id="other") as other, layertap.ShardWriter(tmp_path, writer_id="w"):
        other.submit("k", tensors(1))
        other.flush()
        with pytest.raises(TimeoutError, match="record 'k' of writer w did not appear"):
            fetch(location(tmp_path, "k"), timeout=0.5)


def test_fetch_reports_a_failed_writer(tmp_path, fetch_waits):
    with layertap.ShardWriter(tmp_path, writer_id="w"):

        def fail():
            fetch_waits.wait(HANDSHAKE)  # the writer fails while the fetch waits
            leave_error_marker(str(tmp_path), "w", "WriterIOError: No space left on device")

        thread = threading.Thread(target=fail)
        thread.start()
        with pytest.raises(LayertapError, match="writer w failed and writes no more: WriterIOError: No space"):
            fetch(location(tmp_path, "never"), timeout=HANDSHAKE * 2)
        thread.join()
    assert fetch_waits.is_set()
    assert "w.error" in os.listdir(tmp_path)
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".partial")]


def test_fetch_waits_for_an_error_file_still_being_written(tmp_path, monkeypatch):
    """An error file seen between its creation and its write (one written in place, by hand or
    by an older worker) is not reported as a failure without a reason: fetch waits for the
    text. CI once saw "failed and writes no more: " with nothing after it."""
    marker = error_marker_path(str(tmp_path), "w")
    read_empty = threading.Event()
    real = online_module.read_error_marker

    def read_marker(path):
        text = real(path)
        if not text and os.path.exists(marker):
            read_empty.set()  # the fetch has seen the error file before its text
        return text

    monkeypatch.setattr(online_module, "read_error_marker", read_marker)
    with layertap.ShardWriter(tmp_path, writer_id="w"):

        def fail():
            with open(marker, "w") as f:
                read_empty.wait(HANDSHAKE)
                f.write("WriterIOError: No space left on device\n")

        thread = threading.Thread(target=fail)
        thread.start()
        with pytest.raises(LayertapError, match="writer w failed and writes no more: WriterIOError: No space"):
            fetch(location(tmp_path, "never"), timeout=HANDSHAKE * 2)
        thread.join()
    assert read_empty.is_set()


def test_fetch_reports_what_the_server_refused(tmp_path):
    with pytest.raises(InvalidInputError, match="did not save this request's hidden states: sample_id: key"):
        fetch({"layertap": {"error": "sample_id: key 'a/b' contains '/'", "reason": "invalid_request"}})
    with pytest.raises(FileNotFoundError):
        fetch(location(tmp_path / "missing", "k"), timeout=1)


@pytest.mark.parametrize("durable", [True, False])
def test_fetch_makes_the_record_durable_unless_asked_not_to(tmp_path, monkeypatch, durable):
    """The writer does not fsync (durability "none"); fetch fsyncs the record's shard itself."""
    import os

    synced = []
    real_fsync = os.fsync

    def spy(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.startswith(str(tmp_path.resolve())):  # not a writer an earlier test left to the collector
            synced.append(path)
        return real_fsync(fd)

    with layertap.ShardWriter(tmp_path, writer_id="w", durability="none") as w:
        w.submit("k", tensors(3))
        w.flush()
        monkeypatch.setattr(os, "fsync", spy)
        record = fetch(location(tmp_path, "k"), timeout=30, durable=durable)
        monkeypatch.undo()
    assert record.key == "k"
    assert synced == ([record.shard] if durable else [])
