"""Capture windows and reductions (docs/CONNECTOR.md, "Windows and reductions"): the request
half, without torch or vLLM (``layertap generate`` checks rows with it before loading them). The
scheduler resolves a window when the request finishes, so that the pool, the sink and the writer
see an ordinary record of that many rows; ``window_gather`` gathers only those rows.
"""

from __future__ import annotations

from typing import Any

from layertap._spec.record import REDUCTION, WINDOW_END, WINDOW_START

#: A record's capture window: the positions ``[start, end)`` of the request's recorded tokens
#: it covers, and its reduction (one of ``REDUCTIONS``) or None.
Window = tuple[int, int, str | None]

#: What a reduction stores, one vector per layer: the window's last position, or the mean of its
#: positions.
REDUCTIONS = ("last", "mean")


def _bound(value: Any, name: str) -> tuple[int | None, str | None]:
    if value is None:
        return None, None
    if isinstance(value, bool) or not isinstance(value, int):
        return None, f"window {name} must be an integer or null, got {value!r:.40}"
    return value, None


def check(params: dict) -> tuple[tuple[Any, Any, str | None] | None, str | None]:
    """``((start, end, reduction), None)`` from ``kv_transfer_params`` (None bounds: the ends),
    ``(None, None)`` if it asks for no window, or ``(None, problem)``."""
    window, reduction = params.get("window"), params.get("reduction")
    if window is None and reduction is None:
        return None, None
    if reduction is not None and reduction not in REDUCTIONS:
        return None, f"reduction must be one of {', '.join(map(repr, REDUCTIONS))}, got {reduction!r:.40}"
    start = end = None
    if window is not None:
        if not isinstance(window, (list, tuple)) or len(window) != 2:
            return (
                None,
                f"window must be [start, end] (integers or null; negative counts from the end), got {window!r:.60}",
            )
        start, problem = _bound(window[0], "start")
        if problem is None:
            end, problem = _bound(window[1], "end")
        if problem:
            return None, problem
    return (start, end, reduction), None


def resolve(spec: tuple[Any, Any, str | None], num_tokens: int) -> tuple[Window | None, str | None]:
    """The positions ``[start, end)`` that ``spec`` selects, as Python slices do, or the problem."""
    start, end, reduction = spec
    lo, hi, _ = slice(start, end).indices(num_tokens)
    if hi <= lo:
        return None, (
            f"window [{start}, {end}) of the {num_tokens} recorded tokens holds no token "
            f"(positions {lo} to {hi}); nothing to save"
        )
    return (lo, hi, reduction), None


def stored_token_ids(token_ids: list[int], window: Window) -> list[int]:
    """The token ids a windowed record holds, one per stored row (a reduction's: the last)."""
    lo, hi, reduction = window
    return token_ids[hi - 1 : hi] if reduction else token_ids[lo:hi]


def metadata(window: Window) -> dict[str, str]:
    """The record metadata that says which positions a record holds (docs/FORMAT.md)."""
    lo, hi, reduction = window
    meta = {WINDOW_START: str(lo), WINDOW_END: str(hi)}
    if reduction:
        meta[REDUCTION] = reduction
    return meta
