"""Numbers and problems as the command line and ``layertap generate``'s progress and summary
write them. A module of its own, below both: ``import layertap`` loads no command line."""

from __future__ import annotations

from layertap._types import Problem


def human_bytes(n: int | None) -> str:
    """``n`` bytes in B, KiB, MiB, GiB or TiB."""
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def plural(n: int, word: str) -> str:
    """``n`` and ``word``, with an s unless ``n`` is 1: ``1 shard``, ``1,200 records``."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def problem_line(p: Problem) -> str:
    """One line naming a problem: kind, shard, offset, key and reason."""
    where = p.shard
    if p.offset is not None:
        where += f" offset {p.offset}"
    if p.key is not None:
        where += f" key {p.key!r}"
    return f"{p.kind}: {where}: {p.message}"


__all__ = ["human_bytes", "plural", "problem_line"]
