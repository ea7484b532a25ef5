"""What a run shows while it works: a progress bar on a terminal, a line every ``interval``
seconds otherwise, or nothing.

Rows count once their record is in a file (or once found bad), and bytes written are read from
the shards as they grow (``ShardFollower``), not estimated: what counts is what is in the files
(a full disk once showed "50/50 rows (100%)" with 4 records written). The follower also notices
the writer's failure (the connector's error file), which ``WriterFailedError`` carries.
"""

from __future__ import annotations

import os
import sys
import time
from functools import partial
from typing import Any, TextIO

from layertap._cursor import ShardCursor, pread_fully
from layertap._spec.format import SHARD_SUFFIX
from layertap._text import human_bytes
from layertap.errors import LayertapError
from layertap.vllm.online import error_marker_path, read_error_marker

PROGRESS_MODES = ("auto", "bar", "lines", "none")


class _GrowingShard:
    """One shard of this run, its frame headers read as the writer appends them (only counted)."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.cursor = ShardCursor(partial(pread_fully, self.fd))
        self.finished = False

    def advance(self, on_record) -> None:
        for _, frame in self.cursor.records(os.fstat(self.fd).st_size):
            on_record(frame)
        if self.cursor.at_index:  # the shard is complete
            self.close()

    def close(self) -> None:
        if not self.finished:
            os.close(self.fd)
            self.finished = True


class WriterFailedError(LayertapError, RuntimeError):
    """The engine's shard writer failed (a full disk, an I/O error): one line, the writer's own
    and what to do. The records written before the failure are intact."""

    def __init__(self, text: str) -> None:
        kind, _, message = text.partition(": ")
        self.disk_full = kind == "DiskFullError"
        self.text = text
        if self.disk_full:
            line = f"{message}; free space there (or write to another --out), then run the same command again to resume"
        else:
            line = f"the shard writer failed: {text}; run the same command again to resume"
        super().__init__(line)

    def __reduce__(self):  # an engine's process of a parallel run sends it to the orchestrator
        return type(self), (self.text,)


class ShardFollower:
    """Counts the records the run's writer has put in ``directory`` so far (``layertap.follow``
    keeps every entry for key lookups; a run of ten million rows needs only running totals)."""

    def __init__(self, directory: str, writer_id: str):
        self.directory = directory
        self.prefix = writer_id + "-"
        self._shards: dict[str, _GrowingShard] = {}
        self._marker = error_marker_path(directory, writer_id)
        self.failure: str | None = None
        """The writer's error (``"DiskFullError: ..."``), once its error file is there."""
        self.records = 0
        self.raw_bytes = 0
        self.stored_bytes = 0

    def _count(self, frame: Any) -> None:
        self.records += 1
        self.raw_bytes += frame.raw_len
        self.stored_bytes += frame.stored_len

    def poll(self) -> None:
        if self.failure is None:
            try:
                text = read_error_marker(self._marker)
            except OSError:  # unreadable now: progress never stops the run; the next poll tries again
                text = ""
            self.failure = text.splitlines()[0] if text else None
        self._poll_shards()

    def check(self) -> None:
        self.poll()
        if self.failure is not None:
            raise WriterFailedError(self.failure)

    def _poll_shards(self) -> None:
        # The directory is listed only while no shard of this writer is open: a writer completes
        # a shard (its index) before it starts the next, so none can be new before that. A
        # thousand engines on one file system then list their directories once per shard, not
        # once a second each (docs/SCALE.md).
        for shard in self._shards.values():
            if not shard.finished:
                shard.advance(self._count)
        if any(not s.finished for s in self._shards.values()):
            return
        for name in sorted(os.listdir(self.directory)):
            if name.startswith(self.prefix) and name.endswith(SHARD_SUFFIX) and name not in self._shards:
                try:
                    self._shards[name] = shard = _GrowingShard(os.path.join(self.directory, name))
                except FileNotFoundError:
                    continue
                shard.advance(self._count)

    @property
    def ratio(self) -> float | None:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else None

    def close(self) -> None:
        for shard in self._shards.values():
            shard.close()


def _sized(stream: TextIO) -> bool:
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return False
    return size.columns > 0 and size.lines > 0


def _rate(n: float, seconds: float) -> str:
    r = n / seconds if seconds > 0 else 0.0
    return f"{r / 1000:.1f}k" if r >= 10_000 else f"{r:.0f}"


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """Rows finished, tokens and bytes of a run: ``bar`` (tqdm), ``lines`` (one line every
    ``interval`` s) or ``none`` (``auto`` is resolved by ``run.check_options``)."""

    def __init__(
        self,
        total_rows: int,
        follower: ShardFollower,
        mode: str,
        interval: float = 10.0,
        stream: TextIO | None = None,
    ):
        self.stream = stream if stream is not None else sys.stderr
        self.mode = mode
        self.total = total_rows
        self.follower = follower
        self.interval = interval
        self.rows = 0
        self.bad = 0
        self.tokens = 0
        self.start = time.monotonic()
        self._last_row = self.start
        """When the last row finished: rates are measured up to it, not through the shutdown."""
        self._last_poll = 0.0
        self._last_line = self.start
        self._closed = False
        self._bar = None
        if mode == "bar":
            from tqdm import tqdm

            # A terminal that reports no size (a fresh pty's 0x0) would get no bar from tqdm.
            sized = _sized(self.stream)
            self._bar = tqdm(
                total=total_rows,
                unit="row",
                desc="generate",
                file=self.stream,
                dynamic_ncols=sized,
                ncols=None if sized else 100,
                nrows=None if sized else 20,
                mininterval=0.5,
                smoothing=0.1,
            )

    @property
    def done(self) -> int:
        """Rows done: those whose record is in a file (as the follower last read them), and the
        bad ones. Not the rows the engine finished: their records may still be in the writer,
        and never reach a file if the writer fails."""
        return self.follower.records + self.bad

    def update(self, rows: int = 0, tokens: int = 0, bad: int = 0) -> None:
        """Counts rows the engine finished (recorded or bad) and their tokens."""
        self.rows += rows + bad
        self.bad += bad
        self.tokens += tokens
        now = time.monotonic()
        if rows or bad:
            self._last_row = now
        polled = now - self._last_poll >= min(1.0, self.interval)
        if polled:
            self._last_poll = now
            self.follower.poll()
        if self._bar is not None:
            if polled or bad:
                self._draw(now)
        elif self.mode == "lines" and now - self._last_line >= self.interval:
            self._last_line = now
            self.line(now)

    def _stats(self, now: float) -> str:
        f = self.follower
        ratio = f"{f.ratio:.2f}x" if f.ratio else "-"
        bad = f", {self.bad} bad" if self.bad else ""
        rate = _rate(self.tokens, min(now, self._last_row) - self.start)
        return f"{rate} tok/s, {human_bytes(f.stored_bytes)} written, ratio {ratio}{bad}"

    def line(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        elapsed = now - self.start
        done = self.done
        pct = f" ({100 * done / self.total:.0f}%)" if self.total else ""
        eta = ""
        if 0 < done < self.total:
            eta = f", ETA {_duration(elapsed * (self.total - done) / done)}"
        print(
            f"generate: {done:,}/{self.total:,} rows{pct}, {self.tokens:,} tokens, "
            f"{self._stats(now)}, {_duration(elapsed)} elapsed{eta}",
            file=self.stream,
            flush=True,
        )

    def _draw(self, now: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(self._stats(now), refresh=False)
            self._bar.n = self.done
            self._bar.refresh()

    def show_written(self) -> None:
        """What the shards hold, while the last records go into the files after the last row."""
        self.follower.poll()
        self._draw(time.monotonic())

    def close(self) -> None:
        """Shows the final figures, once: the bytes the shards hold now, and the time and rates up
        to the last row (not the engine's stopping: the summary gives that)."""
        if self._closed:
            return
        self._closed = True
        self.follower.poll()
        if self._bar is not None:
            self._bar.set_postfix_str(self._stats(self._last_row), refresh=False)
            self._bar.n = self.done
            # tqdm shows elapsed = now - start_t and the rate over it: end both at the last row.
            # (As its unpause() does, last_print_t moves too: it draws at close only when it
            # drew after start_t.)
            since_last_row = max(0.0, time.monotonic() - self._last_row)
            self._bar.start_t += since_last_row
            self._bar.last_print_t += since_last_row
            self._bar.close()
            self._bar = None
        elif self.mode == "lines":
            self.line(self._last_row)


#: Seconds between two reports of an engine's running totals to the run that started it.
REPORT_INTERVAL = 0.5


class Totals:
    """An engine's running totals: to its ``Progress``, and to ``report`` when it is one of several
    (cumulative, so that a lost or late report loses nothing)."""

    def __init__(self, bar: Progress, follower: ShardFollower, report=None):
        self.bar = bar
        self.follower = follower
        self.report = report
        self.rows = self.tokens = self.bad = 0
        self.start = time.monotonic()
        """When the engine was ready (the reports say how long ago, for the run's rates)."""
        self._sent = 0.0
        self.send()  # the engine is ready

    def update(self, rows: int = 0, tokens: int = 0, bad: int = 0) -> None:
        self.bar.update(rows=rows, tokens=tokens, bad=bad)
        self.rows += rows
        self.tokens += tokens
        self.bad += bad
        if self.report is not None and time.monotonic() - self._sent >= REPORT_INTERVAL:
            self.send()

    def send(self, **extra) -> None:
        if self.report is None:
            return
        self._sent = time.monotonic()
        f = self.follower
        self.report(
            {
                "rows": self.rows,
                "tokens": self.tokens,
                "bad": self.bad,
                "records": f.records,
                "raw_bytes": f.raw_bytes,
                "stored_bytes": f.stored_bytes,
                "elapsed": time.monotonic() - self.start,
                **extra,
            }
        )


class EngineTotals:
    """The engines' reports, summed: the ``ShardFollower`` of a parallel run's ``Progress``; turns
    their cumulative reports into the increments ``Progress.update`` counts."""

    def __init__(self) -> None:
        self._latest: dict[int, dict] = {}

    def take(self, engine: int, snapshot: dict) -> dict:
        """Records ``engine``'s report; returns the increase of rows, tokens and bad rows."""
        before = self._latest.get(engine, {})
        after = {**before, **snapshot}
        self._latest[engine] = after
        return {k: after.get(k, 0) - before.get(k, 0) for k in ("rows", "tokens", "bad")}

    def settle(self, engine: int, summary: dict) -> dict:
        """``take`` of ``engine``'s final figures from its summary (nothing goes down)."""
        final = {
            "rows": summary["rows_written"] + summary["rows_missing"],  # the rows its connector took
            "tokens": summary["tokens"],
            "bad": summary["rows_bad"],
            "records": summary["rows_written"],
            "raw_bytes": summary["raw_bytes"],
            "stored_bytes": summary["stored_bytes"],
        }
        before = self._latest.get(engine, {})
        return self.take(engine, {k: max(v, before.get(k, 0)) for k, v in final.items()})

    def _sum(self, key: str) -> int:
        return sum(s.get(key, 0) for s in self._latest.values())

    records = property(lambda self: self._sum("records"))
    raw_bytes = property(lambda self: self._sum("raw_bytes"))
    stored_bytes = property(lambda self: self._sum("stored_bytes"))

    @property
    def ratio(self) -> float | None:
        stored = self.stored_bytes
        return self.raw_bytes / stored if stored else None

    def poll(self) -> None:  # the engines report: nothing to read
        pass

    def close(self) -> None:
        pass
