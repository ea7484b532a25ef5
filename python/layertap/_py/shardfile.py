"""One shard file as a writer sees it: created exclusively, locked, appended to, closed with its
index and trailer (docs/FORMAT.md, "Datasets", "Writing").

Every system call error is raised as ``WriterIOError`` naming the file, so the writer can hand
it to the caller unchanged.
"""

from __future__ import annotations

import errno as _errno
import fcntl
import os

from layertap._spec.format import RawEntry, encode_file_header, encode_footer
from layertap.errors import WriterIOError

# Linux caps the buffers of one writev at IOV_MAX.
_IOV_MAX = 1024


def io_error(e: OSError, path: str, op: str) -> WriterIOError:
    """A WriterIOError for ``op`` failing on ``path``."""
    reason = e.strerror or str(e)
    return WriterIOError(e.errno, f"{path}: {op} failed: {reason}", path)


def fsync_dir(path: str) -> None:
    """fsyncs a directory so that a file created in it survives a crash."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise io_error(e, path, "open") from None
    try:
        os.fsync(fd)
    except OSError as e:
        raise io_error(e, path, "fsync") from None
    finally:
        os.close(fd)


class ShardFile:
    """A shard being written. Not thread-safe: one thread writes it."""

    def __init__(self, path: str, shard_id: bytes, meta: dict, sync_dir: bool):
        self.path = path
        self.entries: list[RawEntry] = []
        self.synced_to = 0
        header = encode_file_header(shard_id, meta)
        try:
            # O_EXCL: a writer never overwrites or appends to a shard it did not create.
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno == _errno.EEXIST:
                e.strerror = "shard already exists (another writer with the same writer id?)"
            raise io_error(e, path, "create") from None
        try:
            # Blocking: a reader probing the lock holds it only for an instant.
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError as e:
            os.close(self.fd)
            raise io_error(e, path, "flock") from None
        self.offset = 0
        self.write([header])
        if sync_dir:
            fsync_dir(os.path.dirname(path) or ".")

    def write(self, buffers: list) -> None:
        """Appends ``buffers`` at the end of the shard."""
        buffers = [b for b in buffers if len(b)]
        while buffers:
            chunk = buffers[:_IOV_MAX]
            want = sum(memoryview(b).nbytes for b in chunk)
            try:
                done = os.pwritev(self.fd, chunk, self.offset)
            except OSError as e:
                raise io_error(e, self.path, "write") from None
            self.offset += done
            if done == want:
                buffers = buffers[_IOV_MAX:]
                continue
            if done == 0:
                raise WriterIOError(_errno.EIO, f"{self.path}: write failed: wrote 0 bytes", self.path)
            # A short write: drop what was written and go on with the rest.
            rest = []
            for b in buffers:
                n = memoryview(b).nbytes
                if done >= n:
                    done -= n
                    continue
                rest.append(memoryview(b).cast("B")[done:] if done else b)
                done = 0
            buffers = rest

    def fsync(self) -> None:
        try:
            os.fsync(self.fd)
        except OSError as e:
            raise io_error(e, self.path, "fsync") from None
        self.synced_to = self.offset

    def finish(self, sync: bool) -> None:
        """Writes the index frame and trailer, releases the lock, fsyncs if asked, and closes the
        file. The lock says a live writer may still change the shard; no byte of a complete one
        changes again, so readers and ``recover`` need not wait for the fsync (as the Rust
        writer, which fsyncs on another thread)."""
        self.write([encode_footer(self.entries, self.offset)])
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        if sync:
            self.fsync()
        self.release()

    def release(self) -> None:
        """Closes the file, which releases the lock (the shard stays as it is)."""
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
