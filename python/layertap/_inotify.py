"""Waiting for files of one directory to change, with inotify through ctypes (no extra package):
what ``layertap.follow`` and ``layertap.vllm.fetch`` wait with, instead of polling.

Linux only, and only for changes this kernel sees (a local file system; NFS does not report
writes made on another machine).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import struct
import time
from collections.abc import Callable

_IN_MODIFY, _IN_ATTRIB, _IN_CLOSE_WRITE = 0x002, 0x004, 0x008
_IN_MOVED_TO, _IN_CREATE, _IN_Q_OVERFLOW = 0x080, 0x100, 0x4000
_EVENT = struct.Struct("iIII")
_libc_handle = None


def _libc():
    global _libc_handle
    if _libc_handle is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.inotify_init1.argtypes = [ctypes.c_int]
        lib.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        _libc_handle = lib
    return _libc_handle


class DirectoryWatch:
    """An inotify watch on one directory: ``wait`` returns when a file in it changed. Made
    before the first look at the files, so that a change between the look and the wait is
    still seen.

    A directory watch names a changed file by the name it was opened under, and the writers
    create each shard unnamed (``O_TMPFILE``, or a temporary name) and link it under its final
    name once its header is in: their writes are reported as ``#<inode>`` or the temporary name.
    So the files being followed are also watched themselves (``watch_file``: a watch on the
    inode, whatever name the writer opened it by), and their changes reported by their names."""

    _MASK = _IN_MODIFY | _IN_ATTRIB | _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE
    _FILE_MASK = _IN_MODIFY | _IN_ATTRIB | _IN_CLOSE_WRITE

    def __init__(self, directory: str):
        self._fd = -1
        lib = _libc()
        fd = lib.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        if lib.inotify_add_watch(fd, os.fsencode(directory), self._MASK) < 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise OSError(err, f"cannot watch the dataset directory: {os.strerror(err)}", directory)
        self._fd = fd
        self._files: dict[int, str] = {}
        """Watch descriptor of each watched file -> its name in the directory."""
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    def watch_file(self, path: str) -> None:
        """Watches the file at ``path`` (in the directory) itself; best effort: a file that is
        gone, or a watch the kernel refuses (``max_user_watches``), is left to the directory's
        watch."""
        wd = _libc().inotify_add_watch(self._fd, os.fsencode(path), self._FILE_MASK)
        if wd >= 0:
            self._files[wd] = os.path.basename(path)

    def wait(self, timeout: float | None, concerns: Callable[[str], bool]) -> None:
        """Blocks until a file whose name ``concerns`` accepts changed (or events were lost),
        or for ``timeout`` seconds (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000) + 1)
            if not self._poll.poll(ms):
                return
            for mask, name in self._events():
                if mask & _IN_Q_OVERFLOW or concerns(name):
                    return

    def _events(self) -> list[tuple[int, str]]:
        out = []
        while True:
            try:
                buf = os.read(self._fd, 64 << 10)
            except BlockingIOError:
                return out
            at = 0
            while at + _EVENT.size <= len(buf):
                wd, mask, _, length = _EVENT.unpack_from(buf, at)
                if wd in self._files:
                    out.append((mask, self._files[wd]))
                else:
                    name = buf[at + _EVENT.size : at + _EVENT.size + length].split(b"\0", 1)[0]
                    out.append((mask, os.fsdecode(name)))
                at += _EVENT.size + length

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    __del__ = close

    def __enter__(self) -> DirectoryWatch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
