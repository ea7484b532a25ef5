"""``layertap generate``'s progress without vLLM: ``ShardFollower`` counts a writer's records
across shards as they are written, listing the directory only when the writer has left its
shard; ``EngineTotals`` sums engines' cumulative reports into increments; ``Progress`` shows
the bytes as they reach the files and ends with figures timed to the last row."""

from __future__ import annotations

import io
import os
import types

import pytest
import tqdm.std

import layertap
from helpers import HandClock, make_tensors
from layertap._text import human_bytes
from layertap.generate import progress as progress_module
from layertap.generate.options import GenerateOptions
from layertap.generate.progress import EngineTotals, Progress, ShardFollower


def test_follower_counts_across_shards_and_lists_once_per_shard(tmp_path, monkeypatch):
    listed, polling = [], []
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda path: (polling and listed.append(path)) or real(path))
    follower = ShardFollower(str(tmp_path), "gen-0")

    def poll():
        polling.append(1)
        follower.poll()
        polling.clear()

    with layertap.ShardWriter(tmp_path, writer_id="gen-0", codec="none", shard_size=1200) as w:
        with layertap.ShardWriter(tmp_path, writer_id="gen-1", codec="none") as other:
            other.submit("x", make_tensors(0))  # another run's shard: not counted
        for i in range(12):
            w.submit(str(i), make_tensors(i))
            w.flush()
            poll()
            assert follower.records == i + 1
    poll()
    shards = sorted(n for n in real(tmp_path) if n.startswith("gen-0-"))
    assert len(shards) >= 3 and follower.records == 12
    assert follower.raw_bytes > 0 and follower.stored_bytes >= follower.raw_bytes
    # One listing per shard the writer started (and the first), not one per poll.
    assert len(listed) <= len(shards) + 1 < 12
    follower.close()


def test_engine_totals_turn_reports_into_increments():
    t = EngineTotals()
    assert t.take(0, {"rows": 3, "tokens": 30, "bad": 0, "raw_bytes": 100, "stored_bytes": 50}) == {
        "rows": 3,
        "tokens": 30,
        "bad": 0,
    }
    assert t.take(1, {"rows": 2, "tokens": 10, "bad": 1, "raw_bytes": 60, "stored_bytes": 30})["rows"] == 2
    assert t.take(0, {"rows": 3, "tokens": 30, "bad": 0}) == {"rows": 0, "tokens": 0, "bad": 0}  # repeated
    assert t.take(0, {"rows": 5, "tokens": 44}) == {"rows": 2, "tokens": 14, "bad": 0}
    assert (t.raw_bytes, t.stored_bytes, t.ratio) == (160, 80, 2.0)


@pytest.fixture
def clock(monkeypatch) -> HandClock:
    """The clock of ``Progress`` (its ``time.monotonic``) and of its tqdm bar, moved by the test:
    what the figures show does not depend on how long the machine takes between two calls."""
    hand = HandClock()
    monkeypatch.setattr(progress_module, "time", types.SimpleNamespace(monotonic=hand))
    monkeypatch.setattr(tqdm.std, "time", hand)  # read by each bar as it starts
    return hand


def _final(text: str) -> str:
    """The last thing drawn or printed: a bar redraws its line after a carriage return."""
    return text.replace("\r", "\n").strip().splitlines()[-1]


@pytest.mark.parametrize("mode", ["bar", "lines"])
def test_the_last_figures_time_the_rows_not_the_drain_and_shutdown(tmp_path, mode, clock):
    """Rows done, then their records reach the files later and the engine takes a while to stop
    (100 s here; seconds with a real engine): the final bar or line shows every record's bytes,
    but the time and rate up to the last row only (issue 24: the bar's time included the drain
    and shutdown)."""
    stream = io.StringIO()
    follower = ShardFollower(str(tmp_path), "gen-0")
    bar = Progress(3, follower, mode, interval=10.0, stream=stream)
    bar.update(rows=3, tokens=9)
    clock.advance(100)  # the records still in the writer, then the engine stopping
    with layertap.ShardWriter(tmp_path, writer_id="gen-0", codec="none") as w:
        for i in range(3):
            w.submit(str(i), make_tensors(i))
    bar.close()
    bar.close()  # a second close (the run's finally) draws nothing more
    last = _final(stream.getvalue())
    assert f"{human_bytes(follower.stored_bytes)} written" in last, last
    assert ("3/3 [00:00<" if mode == "bar" else "0:00:00 elapsed") in last, last
    if mode == "lines":
        assert stream.getvalue().count("generate: 3/3 rows") == 1
    follower.close()


def test_the_bar_shows_new_bytes_without_waiting_for_a_row(tmp_path, clock):
    """A step that finishes no row (a long prefill) still shows the bytes written meanwhile: the
    bar drew them only with the next finished row (issue 24: "21.0 KiB written" shown when far
    more was stored)."""
    stream = io.StringIO()
    follower = ShardFollower(str(tmp_path), "gen-0")
    bar = Progress(4, follower, "bar", interval=0.0625, stream=stream)
    bar.update(rows=1, tokens=3)
    with layertap.ShardWriter(tmp_path, writer_id="gen-0", codec="none") as w:
        w.submit("0", make_tensors(0))
    clock.advance(0.0625)  # the interval (a power of 2: exact on a clock at 1,000 s)
    bar.update()  # an engine step without a finished row
    assert follower.stored_bytes > 0  # the update read the shard again
    assert f"{human_bytes(follower.stored_bytes)} written" in _final(stream.getvalue())
    bar.close()
    follower.close()


def test_a_parallel_runs_progress_ends_with_the_engines_summaries(capsys):
    """The engines' last reports can be lost (a Ray actor's may arrive after the task's result):
    the progress ends with the figures of each engine's summary, not its last report."""
    from layertap.generate.parallel import _follow

    def summary(rows: int, stored: int) -> dict:
        return {
            "rows_written": rows,
            "rows_missing": 0,
            "rows_bad": 0,
            "tokens": 10 * rows,
            "raw_bytes": 2 * stored,
            "stored_bytes": stored,
            "seconds": {"generate": 0.5},
        }

    def events():
        yield "report", 0, {"rows": 2, "tokens": 20, "bad": 0, "raw_bytes": 200, "stored_bytes": 100, "elapsed": 0.1}
        yield "summary", 0, summary(5, 40 << 10)  # its final report (5 rows) never came
        yield "summary", 1, summary(3, 20 << 10)  # nor did any report of engine 1

    run = types.SimpleNamespace(progress="lines", options=GenerateOptions("m", "d", "o", progress_interval=10.0))
    results = _follow(events(), 8, run)
    assert sorted(results) == [0, 1]
    last = _final(capsys.readouterr().err)
    assert last.startswith("generate: 8/8 rows (100%), 80 tokens, "), last
    assert "60.0 KiB written, ratio 2.00x" in last, last


def test_progress_counts_records_in_files_not_rows_the_engine_finished(tmp_path):
    """Rows count once their record is in a file (issue 34: a full disk showed "50/50 rows
    (100%)" with 4 records written); bad rows count as done; the writer's error file, once
    there, is what ``check`` raises."""
    from layertap.generate.progress import WriterFailedError
    from layertap.vllm.online import leave_error_marker

    stream = io.StringIO()
    follower = ShardFollower(str(tmp_path), "gen-0")
    bar = Progress(5, follower, "lines", interval=0.0, stream=stream)
    bar.update(rows=4, tokens=12, bad=1)  # the engine finished four rows; none is in a file yet
    assert _final(stream.getvalue()).startswith("generate: 1/5 rows (20%), 12 tokens, "), stream.getvalue()
    with layertap.ShardWriter(tmp_path, writer_id="gen-0", codec="none") as w:
        for i in range(2):
            w.submit(str(i), make_tensors(i))
    follower.check()  # no error file: nothing raised
    leave_error_marker(str(tmp_path), "gen-0", "DiskFullError: /d: disk full, 8.0 KiB free (write of x failed)")
    with pytest.raises(WriterFailedError) as info:
        follower.check()
    assert info.value.disk_full and str(info.value).startswith("/d: disk full, 8.0 KiB free (write of x failed); ")
    bar.close()
    assert _final(stream.getvalue()).startswith("generate: 3/5 rows (60%), 12 tokens, "), stream.getvalue()
    follower.close()


def test_an_unreadable_error_file_does_not_stop_the_progress(tmp_path):
    """The progress reads the writer's error file on every poll; one it cannot read now (here a
    directory in its place) is no failure and no exception: the next poll tries again."""
    from layertap.generate.progress import WriterFailedError
    from layertap.vllm.online import error_marker_path

    follower = ShardFollower(str(tmp_path), "gen-0")
    marker = error_marker_path(str(tmp_path), "gen-0")
    os.mkdir(marker)
    follower.check()  # nothing raised, nothing reported
    assert follower.failure is None
    os.rmdir(marker)
    with open(marker, "w") as f:
        f.write("WriterIOError: /d: write failed\n")
    with pytest.raises(WriterFailedError, match="write failed"):
        follower.check()
    follower.close()
