"""Which records an export writes: records keyed by row index (``"0"``, ``"17"``: the key
``layertap generate`` gives each row of its input, and the ``sample_id`` a server's client sets to
the row index), chosen with ``--keys`` and ``--limit``, in row order."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from layertap.errors import InvalidInputError

_ROW = re.compile(r"0|[1-9][0-9]*")


def row_of(key: str) -> int | None:
    """The row index a key names (a decimal without sign or padding), or None."""
    return int(key) if _ROW.fullmatch(key) else None


def parse_keys(spec: str) -> list[int]:
    """Rows from ``--keys``: comma-separated row indices and inclusive ranges (``0-99,150``),
    or ``@FILE`` with one row index per line. Raises ``InvalidInputError`` naming the bad part."""
    if spec.startswith("@"):
        try:
            with open(spec[1:], encoding="utf-8") as f:
                parts = [line.strip() for line in f if line.strip()]
        except OSError as e:
            raise InvalidInputError(f"--keys {spec}: {e.strerror or e}") from None
    else:
        parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise InvalidInputError(f"--keys {spec!r}: no row indices")
    rows: list[int] = []
    for part in parts:
        lo, sep, hi = part.partition("-")
        a, b = row_of(lo.strip()), row_of(hi.strip()) if sep else None
        if a is None or (sep and (b is None or b < a)):
            raise InvalidInputError(f"--keys: {part!r} is not a row index or a range of them (e.g. 0-99,150)")
        rows.extend(range(a, (b if sep else a) + 1))
    return sorted(set(rows))


@dataclass
class Selection:
    """The records to export, by row, and what was left out."""

    rows: list[int]
    """Rows to export, ascending."""
    positions: dict[int, int]
    """Row -> position of its record in the dataset (the first one, if the key repeats)."""
    not_rows: int = 0
    """Records whose key is not a row index (left out)."""
    duplicates: list[int] = field(default_factory=list)
    """Rows with more than one record (the first in dataset order is exported)."""
    missing: list[int] = field(default_factory=list)
    """Rows asked for with --keys that have no record."""


def select(keys: list[str], wanted: list[int] | None = None, limit: int | None = None) -> Selection:
    """Chooses the records of a dataset whose keys are ``keys`` (in dataset order)."""
    positions: dict[int, int] = {}
    duplicates: set[int] = set()
    not_rows = 0
    for pos, key in enumerate(keys):
        row = row_of(key)
        if row is None:
            not_rows += 1
        elif row in positions:
            duplicates.add(row)
        else:
            positions[row] = pos
    missing: list[int] = []
    if wanted is None:
        rows = sorted(positions)
    else:
        rows = [r for r in wanted if r in positions]
        missing = [r for r in wanted if r not in positions]
    if limit is not None:
        rows = rows[:limit]
    return Selection(rows, positions, not_rows, sorted(duplicates), missing)


__all__ = ["Selection", "parse_keys", "row_of", "select"]
