"""Records of an output directory that fail their check, taken out of their shards' indexes so
that a rerun writes their rows again (docs/GENERATE.md, "Resume, exactly once").

A record damaged after it was written (a flipped bit on the disk) must not count as done, and
writing its row again is not enough: a key's record is its first in dataset order (docs/FORMAT.md,
"Datasets"). So each shard holding one is re-indexed as ``layertap recover`` indexes an open
shard: its bytes up to its index are copied beside it (not under a shard name), the copy is
recovered (the damaged records left unindexed, counted in ``lost_in_recovery``) and renamed over
the shard. A run killed at any moment leaves the old shard or the new one, and at most a copy
(``.NAME.repair``) that the next run removes.
"""

from __future__ import annotations

import errno
import os
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from layertap._cursor import pread_fully
from layertap._files import fsync_dir
from layertap._spec.format import (
    CODECS,
    TRAILER_LEN,
    FormatProblem,
    RawEntry,
    decode_trailer,
    payload_crc,
    read_frame_header,
)
from layertap._types import IndexEntry, Problem, ProblemKind
from layertap.errors import FormatError
from layertap.generate.errors import GenerateError
from layertap.reader import record_problem
from layertap.recover import recover

#: The copy of a shard being repaired: a dot file without ``.lts``, so no reader takes it for a shard.
_COPY = ".{}.repair"


def damaged_records(ds) -> list[Problem]:
    """Every record of ``ds`` whose bytes changed since it was written (``layertap verify``'s
    checks but the decoding: a rerun costs the disk's read speed, not the codec's). Shards are
    checked in parallel (``pread`` and the CRC run without the GIL)."""
    backends = [b for b in ds.backends if b.entries]
    if not backends:
        return []
    with ThreadPoolExecutor(max_workers=min(len(backends), os.cpu_count() or 1)) as pool:
        return [p for found in pool.map(_damaged_in, backends) for p in found]


def _damaged_in(shard) -> list[Problem]:
    if not os.path.isfile(shard.path):  # a shard that is no file here (a store's): its own check
        return _damaged_by_check(shard)
    out = []
    fd = os.open(shard.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        for e in shard.entries:
            reason = _frame_problem(fd, size, e)
            if reason is not None:
                out.append(Problem(shard.path, e.frame_offset, e.key, ProblemKind.CORRUPT_RECORD, reason))
    finally:
        os.close(fd)
    return out


def _frame_problem(fd: int, size: int, e: IndexEntry) -> str | None:
    """Why the record of index entry ``e`` is not as its writer wrote it, or None (in
    ``PyShardReader.check``'s words, but without decoding)."""
    pread = partial(pread_fully, fd)
    try:
        h = read_frame_header(pread, e.frame_offset, size)
    except FormatProblem as problem:
        return f"no valid frame header at the indexed offset: {problem}"
    raw = RawEntry(e.frame_offset, e.stored_len, e.raw_len, e.num_tokens, e.payload_crc, CODECS.index(e.codec), e.key)
    if not raw.matches(h):
        return "the frame header does not agree with the index entry"
    crc = payload_crc(pread, e.frame_offset + h.header_len, e.stored_len)
    if crc != e.payload_crc:
        return f"payload checksum mismatch (frame says {e.payload_crc:#010x}, payload has {crc:#010x})"
    return None


def _damaged_by_check(shard) -> list[Problem]:
    out = []
    for i, e in enumerate(shard.entries):
        try:
            shard.check(i)
        except FormatError as err:
            out.append(record_problem(err, shard.path, e.frame_offset, e.key))
    return out


def remove_stale_copies(path: str) -> None:
    """Removes the copies a repair killed before its rename left (they hold no record of the dataset)."""
    for name in os.listdir(path):
        if name.startswith(".") and name.endswith(".lts.repair"):
            os.unlink(os.path.join(path, name))


def reindex_without_damaged(shard: str) -> None:
    """Replaces ``shard`` with a copy whose index leaves out the damaged records. The caller holds
    the directory's lock and has closed its readers of the shard."""
    directory, name = os.path.split(shard)
    copy = os.path.join(directory, _COPY.format(name))
    try:
        with open(shard, "rb") as src:
            src.seek(-TRAILER_LEN, os.SEEK_END)
            trailer = decode_trailer(src.read(TRAILER_LEN))
            if trailer is None:
                raise GenerateError(f"{shard}: cannot repair this shard: its trailer is not valid")
            with open(copy, "wb") as dst:
                _copy_prefix(src.fileno(), dst.fileno(), trailer.index_offset)
        recover(copy)  # indexes the records that match their checksums, and fsyncs
        os.replace(copy, shard)
        fsync_dir(directory)
    except (OSError, FormatError) as e:
        raise GenerateError(f"{shard}: cannot repair this shard: {getattr(e, 'strerror', None) or e}") from None
    finally:
        if os.path.exists(copy):
            os.unlink(copy)


def _copy_prefix(src: int, dst: int, length: int) -> None:
    """Bytes ``[0, length)`` of ``src`` to ``dst``, by ``copy_file_range`` (a reflink where the
    file system has them) where it works."""
    done = 0
    try:
        while done < length:
            n = os.copy_file_range(src, dst, length - done, done, done)
            if n == 0:
                raise OSError(errno.EIO, "the shard ended while it was copied")
            done += n
        return
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
    while done < length:
        chunk = os.pread(src, min(length - done, 1 << 24), done)
        if not chunk:
            raise OSError(errno.EIO, "the shard ended while it was copied")
        done += os.pwrite(dst, chunk, done)


def damaged_entries(problems: list[Problem]) -> list[dict]:
    """The summary's ``damaged_records``: each record taken out of its shard's index, by row."""
    return [
        {"row": int(p.key) if p.key.isdigit() else p.key, "shard": p.shard, "reason": p.message}
        for p in problems
        if p.key is not None
    ]
