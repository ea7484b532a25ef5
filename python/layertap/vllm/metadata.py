"""What the scheduler half tells the worker half each step: the requests to save, as a compact
set of parallel lists (one entry per record) rather than an object per request, so that building
it costs the scheduler a few list appends per request and handing it over (or pickling it, with a
multi-process executor) costs no Python object per request."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from layertap.vllm.window import Window

#: A record's additions from its client: ``record_metadata`` (checked, ``extras.py``) and the
#: ``loss_mask`` as bytes (uint8 0/1, one per recorded token), either may be None.
Extras = tuple[dict[str, str] | None, bytes | None]


class StepSaves:
    """Finished requests to write, in the order they finished: entry ``i`` of each list is one
    record's (``token_ids[i]``: the request's own list where it can be, its first
    ``num_tokens[i]`` recorded). ``extras`` and ``windows`` map the few indices that have them."""

    COLUMNS = ("keys", "req_ids", "token_ids", "num_tokens", "num_prompt_tokens", "block_ids")
    __slots__ = (*COLUMNS, "extras", "windows", "finished_at")

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.req_ids: list[str] = []
        self.token_ids: list[list[int]] = []
        self.num_tokens: list[int] = []
        self.num_prompt_tokens: list[int] = []
        self.block_ids: list[list[int]] = []
        self.extras: dict[int, Extras] = {}
        self.windows: dict[int, Window] = {}
        self.finished_at = 0.0
        """When the first of these requests ended (``time.time()``: the worker may be on another
        host), for the record delay metric; 0: unknown."""

    def add(
        self,
        key: str,
        req_id: str,
        token_ids: list[int],
        num_tokens: int,
        num_prompt_tokens: int,
        block_ids: list[int],
        extras: Extras | None = None,
        window: Window | None = None,
    ) -> None:
        if extras is not None:
            self.extras[len(self.keys)] = extras
        if window is not None:
            self.windows[len(self.keys)] = window
        self.keys.append(key)
        self.req_ids.append(req_id)
        self.token_ids.append(token_ids)
        self.num_tokens.append(num_tokens)
        self.num_prompt_tokens.append(num_prompt_tokens)
        self.block_ids.append(block_ids)

    def __len__(self) -> int:
        return len(self.keys)

    def split(self, n: int) -> StepSaves:
        """Removes the first ``n`` records and returns them."""
        head = StepSaves()
        for name in self.COLUMNS:
            column = getattr(self, name)
            setattr(head, name, column[:n])
            setattr(self, name, column[n:])
        head.finished_at = self.finished_at
        for name in ("extras", "windows"):
            by_index = getattr(self, name)
            if by_index:
                setattr(head, name, {i: e for i, e in by_index.items() if i < n})
                setattr(self, name, {i - n: e for i, e in by_index.items() if i >= n})
        return head

    def extend(self, other: StepSaves) -> None:
        base = len(self.keys)
        for name in self.COLUMNS:
            getattr(self, name).extend(getattr(other, name))
        if other.finished_at and (not self.finished_at or other.finished_at < self.finished_at):
            self.finished_at = other.finished_at
        self.extras.update({base + i: e for i, e in other.extras.items()})
        self.windows.update({base + i: w for i, w in other.windows.items()})

    def __getstate__(self) -> tuple:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setstate__(self, state: tuple) -> None:
        for name, value in zip(self.__slots__, state):
            setattr(self, name, value)


@dataclass
class LayertapMetadata(KVConnectorMetadata):
    """Scheduler to worker, once per step."""

    saves: StepSaves | None = None
    drain_wait: float = 0.0
    """Seconds the worker may wait for its writer, in a step taken only for it (no spinning)."""
    not_saved: dict[str, int] | None = None
    """The scheduler half's not-saved totals when they changed (None: unchanged)."""
