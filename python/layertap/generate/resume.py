"""What an output directory already holds, so that a rerun writes each row exactly once.

The state is the shards themselves: a row is done when a record keyed by its index is in a shard.
Before a run, the run takes ``.layertap-generate.lock`` (``flock``: the kernel drops it however
the process dies); recovers every shard a killed run left open (``layertap.recover``), after
waiting a little for a writer still shutting down; removes or sets aside as ``NAME.torn`` a file
whose header was never complete; checks that every shard is generate's, with the same model and
layers; and re-indexes without them the records that fail their checks (``repair``), so that
their rows are written again. Each run writes as a fresh writer ``gen-{run}``, so it never
appends to another run's shard.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from dataclasses import dataclass, field

import numpy as np

from layertap._spec.record import GENERATE_SOURCE, LAYER_IDS
from layertap._types import Problem
from layertap.errors import FormatError, ShardLockedError
from layertap.generate.errors import GenerateError
from layertap.generate.holders import describe_holders
from layertap.generate.repair import damaged_records, reindex_without_damaged, remove_stale_copies
from layertap.generate.vllm_log import LOG_NAME
from layertap.parts import MANIFEST_NAME
from layertap.reader import open as open_dataset
from layertap.recover import recover

LOCK_NAME = ".layertap-generate.lock"
SOURCE = GENERATE_SOURCE  # every shard's metadata user["source"]
#: Shard names of generate runs: ``gen-{run}-{n:06}.lts``.
_RUN_SHARD = re.compile(r"^gen-(\d+)-\d{6}\.lts(\.torn)?$")
#: How long to wait for a shard still locked by a dying writer (io_uring teardown takes a moment).
LOCK_WAIT_SECONDS = 10.0


@dataclass
class OutputState:
    """The output directory, locked for this run."""

    path: str
    run: int
    done: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Rows with a record (sorted, distinct)."""
    recovered: list[str] = field(default_factory=list)
    """Shards of killed runs completed by this run."""
    set_aside: list[str] = field(default_factory=list)
    """Files of killed runs without a complete header (no records), removed or renamed."""
    damaged: list[Problem] = field(default_factory=list)
    """Records that failed their check, taken out of their shards' indexes (``repair``)."""
    duplicates: int = 0
    """Records whose row already had one (should never happen; counted, not hidden)."""
    dtype: str | None = None
    _lock_fd: int | None = None

    @property
    def writer_id(self) -> str:
        return f"gen-{self.run}"

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor drops the flock
            self._lock_fd = None


def lock_directory(path: str) -> int:
    fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise GenerateError(f"{path}: another layertap generate is writing into this directory") from None
    return fd


def open_own_shards(path: str, **options):
    """The shards of directory ``path`` as a dataset (None: none), its own only: with a manifest
    it is part "." of a dataset of parts, which a reader would open whole."""
    names = sorted(n for n in os.listdir(path) if n.endswith(".lts"))
    if not names:
        return None
    if not os.path.exists(os.path.join(path, MANIFEST_NAME)):
        return open_dataset(path, **options)
    return open_dataset([os.path.join(path, n) for n in names], **options)


def recover_shard(shard: str) -> bool:
    """Completes ``shard``; False when it was a torn empty shard, which ``recover`` removes."""
    deadline = time.monotonic() + LOCK_WAIT_SECONDS
    while True:
        try:
            return not recover(shard).removed
        except ShardLockedError:
            if time.monotonic() > deadline:
                holders, pids = describe_holders(shard)
                held_by = f" ({holders})" if holders else ""
                kill = f" (kill {' '.join(map(str, pids))})" if pids else ""
                raise GenerateError(
                    f"{shard}: a live writer holds this shard{held_by}; is a process of an earlier run still "
                    f"running? Stop it{kill}, then run again"
                ) from None
            time.sleep(0.2)


def _check_meta(info, model: str, layer_ids: list[int]) -> None:
    # A shard's metadata is any JSON object to a reader (docs/FORMAT.md): what another tool
    # wrote may hold other types where layertap's writers put an object and strings.
    user = info.meta.get("user", {})
    user = user if isinstance(user, dict) else {}
    name = os.path.basename(info.path)
    if user.get("source") != SOURCE:
        raise GenerateError(
            f"{info.path}: not written by layertap generate (source {user.get('source')!r}); use an empty or new --out"
        )
    if user.get("model") != model:
        raise GenerateError(
            f"--out holds {name} made with model {user.get('model')!r}, not {model!r}; use another --out"
        )
    try:
        theirs = json.loads(user.get(LAYER_IDS, "null"))
    except (TypeError, ValueError):
        theirs = None
    if theirs != sorted(layer_ids):
        raise GenerateError(f"--out holds {name} with layers {theirs}, not {sorted(layer_ids)}; use another --out")


def _check_shards_meta(ds, model: str, layer_ids: list[int]) -> None:
    """``_check_meta`` for each shard of ``ds`` that may hold records (a live writer's header may
    not be there yet; a torn empty shard has none)."""
    for info in ds.shards:
        if info.complete or info.torn_tail_bytes != info.file_bytes:
            _check_meta(info, model, layer_ids)


def check_earlier_runs(path: str, model: str, layer_ids: list[int]) -> None:
    """Refuses, before vLLM is imported (8-20 s) and anything is written, an output directory whose
    shards were made with another model or layers (``prepare_output`` checks again, locked). A
    directory the reader cannot open is left to those later checks, which say what is wrong."""
    if not os.path.isdir(path):
        return
    if not any(n.endswith(".lts") or n == MANIFEST_NAME for n in os.listdir(path)):
        return
    try:
        ds = open_dataset(path)
    except (FormatError, OSError):
        return
    with ds:
        _check_shards_meta(ds, model, layer_ids)


#: What a dataset directory of ``layertap generate`` holds besides its shards (docs/GENERATE.md,
#: "The dataset"): the lock, vLLM's log, a manifest of parts and the parts' directories
#: (``parallel.PART_PREFIX``), files set aside by an earlier run, the error file a writer that
#: failed left (``vllm/online.py``: a full disk, after which the run says to run it again).
_DATASET_NAMES = (LOCK_NAME, LOG_NAME, MANIFEST_NAME)
_DATASET_PATTERN = re.compile(
    r"^(.+\.lts(\.torn)?"  # shards, and files of killed runs set aside
    r"|\..*\.lts.*"  # shards being created or repaired under a temporary name (writers, repair)
    r"|.+\.error(\.\d+\.partial)?"  # a failed writer's error file (and one being written)
    rf"|{re.escape(MANIFEST_NAME)}\.tmp-\d+)$"  # a manifest being replaced
)
_PART_DIRECTORY = re.compile(r"^engine-\d+$")


def check_output_directory(path: str, option: str = "--out", allow_other_files: bool = False) -> None:
    """Refuses, before anything is imported or written, an output directory that is a file, or
    holds files no layertap dataset holds (a mistyped path?) unless ``allow_other_files``."""
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise GenerateError(
            f"{option} {path} is a file, not a directory: give the dataset's directory (created if missing)"
        )
    if allow_other_files:
        return
    try:
        names = os.listdir(path)
    except OSError as e:
        raise GenerateError(f"{option} {path}: cannot read the directory: {e.strerror or e}") from None
    other = sorted(n for n in names if not _is_dataset_entry(path, n))
    if other:
        shown = ", ".join(other[:3]) + (f" and {len(other) - 3} more" if len(other) > 3 else "")
        raise GenerateError(
            f"{option} {path} holds files that are not a layertap dataset's ({shown}): give an empty or new "
            "directory, or pass --allow-other-files to write the dataset beside them"
        )


def _is_dataset_entry(path: str, name: str) -> bool:
    if name in _DATASET_NAMES or _DATASET_PATTERN.match(name):
        return True
    return bool(_PART_DIRECTORY.match(name)) and os.path.isdir(os.path.join(path, name))


def make_output_directory(path: str) -> None:
    """Creates ``path`` if missing; GenerateError when it cannot be created or written to."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise GenerateError(f"{path}: cannot create the output directory: {e.strerror or e}") from None
    if not os.access(path, os.W_OK):
        raise GenerateError(f"{path}: the output directory is not writable")


def prepare_output(path: str, model: str, layer_ids: list[int], lock: bool = True, first_run: int = 0) -> OutputState:
    """Locks ``path`` (created if missing), completes what killed runs left, and reads which rows
    are done. ``lock=False``: the caller holds the lock (a parallel run's part "."). ``first_run``:
    the lowest run number this run may take (a parallel run's engine takes one no part used)."""
    path = os.path.abspath(path)
    make_output_directory(path)
    state = OutputState(path, run=0, _lock_fd=lock_directory(path) if lock else None)
    try:
        remove_stale_copies(path)
        _complete_shards(state, model, layer_ids)
        runs = [int(m.group(1)) + 1 for n in os.listdir(path) if (m := _RUN_SHARD.match(n))]
        state.run = max([first_run, *runs])
        ds = open_own_shards(path)
        if ds is not None:
            with ds:
                for info in ds.shards:
                    _check_meta(info, model, layer_ids)
                    state.dtype = state.dtype or info.meta.get("user", {}).get("dtype")
                state.damaged = damaged_records(ds)
            for shard in dict.fromkeys(p.shard for p in state.damaged):
                reindex_without_damaged(shard)  # every reader of it closed above
            with open_own_shards(path) as ds:
                _check_repaired(ds, state.damaged)
                rows = np.fromiter((_row_of(e.key, path) for b in ds.backends for e in b.entries), dtype=np.int64)
                state.done = np.unique(rows)
                state.duplicates = len(rows) - len(state.done)
    except BaseException:
        state.release()
        raise
    return state


def _check_repaired(ds, damaged: list[Problem]) -> None:
    """A damaged record whose payload still matches its checksum was written damaged (its
    shard's re-indexing keeps it): writing its row again would not replace it."""
    indexed = {(b.path, e.frame_offset) for b in ds.backends for e in b.entries}
    for p in damaged:
        if (p.shard, p.offset) in indexed:
            raise GenerateError(
                f"{p.message}; the record matches its checksum, so it was written so and cannot be taken out of "
                f"its shard's index: move {p.shard} out of --out to write its rows again"
            )


def _complete_shards(state: OutputState, model: str, layer_ids: list[int]) -> None:
    open_shards: list[str] = []
    unreadable: list[tuple[str, str]] = []
    try:
        ds = open_own_shards(state.path)
    except FormatError:
        # None of the directory's *.lts files is a shard: each is judged on its own below.
        ds, unreadable = None, _not_shards(state.path)
    if ds is not None:
        # Everything is checked before anything is changed: a directory of another kind is left as it is.
        with ds:
            _check_shards_meta(ds, model, layer_ids)
            open_shards = [i.path for i in ds.shards if not i.complete]
            unreadable = [(p.shard, f"{p.shard}: {p.message}") for p in ds.unreadable]
    for shard, message in unreadable:
        if not _RUN_SHARD.match(os.path.basename(shard)):
            raise GenerateError(f"{message}; --out must hold only layertap generate's shards")
    for shard in open_shards + [shard for shard, _ in unreadable]:
        try:
            completed = recover_shard(shard)
        except FormatError:
            # No complete header: the writer died writing it (no record follows), or it was damaged
            # later (its frames may hold records): kept as NAME.torn, its rows are written again.
            os.replace(shard, shard + ".torn")
            completed = False
        (state.recovered if completed else state.set_aside).append(shard)


def _not_shards(path: str) -> list[tuple[str, str]]:
    """The ``*.lts`` files of a directory that holds no shard, each with why it is not one."""
    out = []
    for name in sorted(n for n in os.listdir(path) if n.endswith(".lts")):
        shard = os.path.join(path, name)
        try:
            open_dataset(shard).close()
        except FormatError as e:
            out.append((shard, str(e)))
    return out


def _row_of(key: str, path: str) -> int:
    if not key.isdigit() or str(int(key)) != key:
        raise GenerateError(f"{path}: holds a record with key {key!r}, not a row index; use another --out")
    return int(key)
