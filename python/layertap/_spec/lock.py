"""Whether a live writer holds a shard (docs/FORMAT.md, "Writing": a writer holds an exclusive
``flock`` on each shard it writes until the shard is closed)."""

from __future__ import annotations

import fcntl
import os


def is_locked(path: str) -> bool:
    """Whether another open file holds an exclusive ``flock`` on ``path`` (a live writer)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:  # EWOULDBLOCK
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)
