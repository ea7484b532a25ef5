"""One shard file as a writer sees it: created exclusively, locked, appended to, closed with its
index and trailer (docs/FORMAT.md, "Datasets", "Writing"). ``layertap mooncake pull`` writes the
shards it pulls with it.

Every system call error is raised as ``WriterIOError`` naming the file, so the caller can hand
it on unchanged.
"""

from __future__ import annotations

import errno as _errno
import fcntl
import os

from layertap import _files
from layertap._spec.format import RawEntry, encode_file_header, encode_footer
from layertap._text import human_bytes
from layertap.errors import DiskFullError, WriterIOError


def io_error(e: OSError, path: str, op: str) -> WriterIOError:
    """A WriterIOError for ``op`` failing on ``path``; a DiskFullError, as the Rust core's, when
    the file system is full."""
    reason = e.strerror or str(e)
    if e.errno in (_errno.ENOSPC, _errno.EDQUOT):
        directory = path if os.path.isdir(path) else os.path.dirname(path) or "."
        try:
            st = os.statvfs(directory)
            free: int | None = st.f_bavail * st.f_frsize
        except OSError:
            free = None
        text = human_bytes(free) if free is not None else "an unknown amount"
        message = (
            f"{directory}: disk full, {text} free ({op} of {os.path.basename(path) or path} failed: {reason}); "
            "the records written before it are intact"
        )
        return DiskFullError(e.errno, message, path, directory, free)
    return WriterIOError(e.errno, f"{path}: {op} failed: {reason}", path)


def fsync_dir(path: str) -> None:
    """``_files.fsync_dir``, its errors raised as ``WriterIOError`` naming the directory."""
    try:
        _files.fsync_dir(path)
    except OSError as e:
        raise io_error(e, path, "fsync") from None


def _refused(e: OSError) -> bool:
    """Whether an error means "this way of creating files is not available here"."""
    return e.errno in (_errno.EOPNOTSUPP, _errno.EISDIR, _errno.EINVAL, _errno.ENOSYS)


def _exists(e: OSError, path: str) -> WriterIOError:
    e.strerror = "shard already exists (another writer with the same writer id?)"
    return io_error(e, path, "create")


def _lock(fd: int, path: str) -> None:
    # Blocking: the file is new; only readers probing a named file's lock hold it, for an instant.
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as e:
        raise io_error(e, path, "flock") from None


def _write_all(fd: int, data: bytes, path: str, offset: int = 0) -> None:
    view = memoryview(data).cast("B")
    try:
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n
    except OSError as e:
        raise io_error(e, path, "write") from None


def _unnamed(directory: str, path: str, header: bytes) -> int | None:
    """``O_TMPFILE``, header and lock, then ``linkat`` to ``path``; None where refused."""
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if _refused(e):
            return None
        raise io_error(e, path, "create") from None
    try:
        _lock(fd, path)
        _write_all(fd, header, path)
        try:
            _link_following(f"/proc/self/fd/{fd}", path)
        except FileExistsError as e:
            raise _exists(e, path) from None
        except OSError as e:
            if e.errno in (_errno.ENOENT, _errno.EXDEV, _errno.EPERM, _errno.EOPNOTSUPP, _errno.EACCES):
                os.close(fd)  # no /proc, or linking refused: the unnamed file goes away
                return None
            raise io_error(e, path, "link") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _link_following(src: str, dst: str) -> None:
    """``linkat(src, dst, AT_SYMLINK_FOLLOW)``. ``os.link`` calls plain ``link(2)`` unless given a
    directory descriptor, and Linux's ``link`` does not follow the ``/proc/self/fd`` link."""
    dst = os.path.abspath(dst)
    dfd = os.open(os.path.dirname(dst), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        # Absolute names ignore the descriptor, and tools that watch paths (strace -P, in
        # tests/test_torn_shards.py) see the shard's own.
        os.link(src, dst, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=True)
    finally:
        os.close(dfd)


def _under_temporary_name(directory: str, path: str, header: bytes) -> int | None:
    """The header under a temporary name that is not a shard's, then ``link`` to ``path``;
    None where hard links are refused."""
    temp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        os.unlink(temp)  # left by a dead process with this pid: never linked, nobody's shard
    except FileNotFoundError:
        pass
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise io_error(e, temp, "create") from None
    linked = False
    try:
        _lock(fd, path)
        _write_all(fd, header, path)
        try:
            os.link(temp, path)
            linked = True
        except FileExistsError as e:
            raise _exists(e, path) from None
        except OSError as e:
            if not (_refused(e) or e.errno == _errno.EPERM):
                raise io_error(e, path, "link") from None
    finally:
        try:
            os.unlink(temp)
        except OSError:
            pass
        if not linked:
            os.close(fd)
    return fd if linked else None


def _directly(path: str, header: bytes) -> int:
    """Created under its name, then locked and its header written (file systems without links)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except FileExistsError as e:
        raise _exists(e, path) from None
    except OSError as e:
        raise io_error(e, path, "create") from None
    try:
        _lock(fd, path)
        _write_all(fd, header, path)
    except BaseException:
        os.close(fd)
        os.unlink(path)  # it holds no record: remove it rather than leave a headerless shard
        raise
    return fd


def create_shard_file(path: str, header: bytes) -> int:
    """Creates the shard ``path`` holding ``header``, locked, and returns its descriptor: the
    name appears only with the header in the file and the lock held, so that a writer killed at
    any moment never leaves a headerless shard (the Rust writer does the same, in
    rust/core/src/writer/create.rs). Like ``O_CREAT|O_EXCL``, fails if ``path`` exists."""
    directory = os.path.dirname(path) or "."
    for way in (_unnamed, _under_temporary_name):
        fd = way(directory, path, header)
        if fd is not None:
            return fd
    return _directly(path, header)


class ShardFile:
    """A shard being written. Not thread-safe: one thread writes it."""

    def __init__(self, path: str, shard_id: bytes, meta: dict, sync_dir: bool):
        self.path = path
        self.entries: list[RawEntry] = []
        header = encode_file_header(shard_id, meta)
        # A writer never overwrites or appends to a shard it did not create.
        self.fd = create_shard_file(path, header)
        self.offset = len(header)
        if sync_dir:
            fsync_dir(os.path.dirname(path) or ".")

    def write(self, buffers: list) -> None:
        """Appends ``buffers`` at the end of the shard."""
        for b in buffers:
            _write_all(self.fd, b, self.path, self.offset)
            self.offset += memoryview(b).nbytes

    def finish(self, sync: bool) -> None:
        """Writes the index frame and trailer, releases the lock, fsyncs if asked, and closes the
        file. The lock says a live writer may still change the shard; no byte of a complete one
        changes again, so readers and ``recover`` need not wait for the fsync (as the Rust
        writer, which fsyncs on another thread)."""
        self.write([encode_footer(self.entries, self.offset)])
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        try:
            if sync:
                os.fsync(self.fd)
        except OSError as e:
            raise io_error(e, self.path, "fsync") from None
        finally:
            os.close(self.fd)
