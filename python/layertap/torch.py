"""A ``torch.utils.data.Dataset`` over a layertap dataset, for training loops (docs/GENERATE.md,
"Training on the dataset"), and ``pad_collate`` / ``pack_collate`` to batch its records.

It works with ``DataLoader`` workers started by fork or spawn: it pickles as its arguments only,
and each worker opens the shards itself (its own memory maps) at its first item. A batch asked for
at once (``__getitems__``) is read by the Rust core together, each record's ``hidden_states``
decoded straight into its row of one padded tensor, which ``pad_collate`` takes as it is.
``decode_on="cuda"`` decodes exp-huf records on the GPU instead (issue 32, goal 3).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from layertap._checks import one_of, positive_int
from layertap._choices import ERROR_MODES, MAX_THREADS
from layertap._spec.format import crc32c, frame_header_len
from layertap._spec.record import HIDDEN_STATES, LAYER_IDS, LOSS_MASK, TOKEN_IDS
from layertap._tensors import TORCH_DTYPES, to_torch
from layertap.errors import CorruptRecordError, InvalidInputError, LayertapError, RecordNotFoundError
from layertap.reader import open as open_dataset


def _row_order(keys: list[str]) -> list[str]:
    """Row indices ascending when every key is one (a generate dataset), else dataset order."""
    if keys and all(k.isdigit() and (k == "0" or not k.startswith("0")) for k in keys):
        return sorted(keys, key=int)
    return keys


class HiddenStatesDataset(torch.utils.data.Dataset):
    """The records of the layertap dataset at ``path`` (a directory or one shard).

    - ``layers``: layer ids (as the records' ``layer_ids`` name them, vLLM numbering for datasets
      made by layertap) to keep, in this order; None keeps every stored layer.
    - ``keys``: the records to serve, in order; None: every record, by row index when the keys
      are row indices, else in dataset order.
    - ``errors``: ``"raise"`` (a corrupt record raises) or ``"skip"`` (it is served as None, which
      the collate functions drop, and counted in ``skipped``, per process).
    - ``verify``: check each record's checksum as it is read (the default). ``False`` skips that
      pass over the record's bytes (a record that does not decode still raises or is skipped).
    - ``decode_on``: None (decode on the CPU), or ``"cuda"`` / ``"cuda:N"``: exp-huf records'
      stored bytes go to that device and are decoded there by the Triton kernel
      (``layertap.gpu.exphuf_decode``), blocks coded by element (mode 1, what
      ``compress_on="gpu"`` writes) and by column (mode 2, what the Rust writer writes) alike;
      records of other codecs decode on the CPU and their hidden states are moved there
      (``token_ids`` and ``loss_mask`` stay on the CPU). Only in the main process: CUDA in forked ``DataLoader``
      workers is unsafe, so a worker's first item raises (use ``num_workers=0``). ``"cpu"`` runs
      the same kernel on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``): for tests.
    - ``threads``: threads that read a batch in this process (1 to 256): by default one a CPU
      this process may run on, the CPUs shared out among a ``DataLoader``'s workers. A
      batch of fewer records than threads spreads each record's checksum and its large exp-huf
      tensors over the rest. A number caps it, for a training loop that keeps CPUs for itself.

    An item is ``{"hidden_states": [T, L, H], "token_ids": int64 [T], "loss_mask": uint8 [T],
    "key": str}``; ``loss_mask`` is all ones for a record stored without one.
    """

    def __init__(
        self,
        path: str | os.PathLike | Sequence[str | os.PathLike],
        layers: Sequence[int] | None = None,
        keys: Sequence[str] | None = None,
        *,
        errors: str = "raise",
        backend: str = "auto",
        verify: bool = True,
        decode_on: str | None = None,
        threads: int | None = None,
    ):
        one_of("errors", errors, ERROR_MODES)
        self.threads = None if threads is None else positive_int("threads", threads, below=MAX_THREADS + 1)
        self.decode_on = _decode_device(decode_on)
        # A list of paths (parts of one dataset) stays a list: layertap.open takes it as it is.
        self.path = [os.fspath(p) for p in path] if isinstance(path, (list, tuple)) else os.fspath(path)
        self.layers = None if layers is None else [int(i) for i in layers]
        self.errors = errors
        self.backend = backend
        self.verify = bool(verify)
        self._given_keys = None if keys is None else list(keys)
        self.skipped = 0
        """Corrupt records served as None in this process (``errors="skip"``)."""
        self._ds = None
        self._pid = None
        self._row: tuple[tuple[int, ...], torch.dtype] | None = None
        self._open()

    # -- the shards, once per process ----------------------------------------------------------

    def _open(self) -> Any:
        """The reader of this process; opened again in a worker that inherited the parent's by
        fork, so that each process reads through its own memory maps and file descriptors."""
        if self._ds is not None and self._pid == os.getpid():
            return self._ds
        self._ds = open_dataset(self.path, backend=self.backend, tensors="torch")
        self._pid = os.getpid()
        self._files: dict[str, Any] = {}  # shard path -> file, for decode_on's stored payloads
        # Where each key's record is: (shard backend, its position there); the first record of a
        # key in dataset order, as ``Dataset[key]`` finds it.
        where: dict[str, tuple[Any, int]] = {}
        for shard in self._ds.backends:
            for i, entry in enumerate(shard.entries):
                where.setdefault(entry.key, (shard, i))
        if self._given_keys is None:
            self._keys = _row_order(list(where))
        else:
            missing = [k for k in self._given_keys if k not in where]
            if missing:
                raise RecordNotFoundError(
                    f"{self.path}: no record with key {missing[0]!r} ({len(missing)} keys missing)"
                )
            self._keys = self._given_keys
        self._where = [where[k] for k in self._keys]
        return self._ds

    def __getstate__(self) -> dict:
        # Only the arguments travel to a spawned worker (and default keys are found again there).
        state = self.__dict__.copy()
        state.update(_ds=None, _pid=None, _keys=None, _where=None, _row=None, _files=None)
        return state

    # -- items --------------------------------------------------------------------------------

    @property
    def keys(self) -> list[str]:
        """The key of each item, in order."""
        self._open()
        return self._keys

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> dict | None:
        if self.decode_on is not None:
            return self._device_items([i])[0]
        self._open()
        shard, at = self._where[i]
        return self._or_skipped(lambda: self._item(self._keys[i], shard.path, *shard.read(at, verify=self.verify)))

    def _or_skipped(self, item: Callable[[], dict]) -> dict | None:
        """``item()`` (called at once: a closure over a loop's variables is safe), or None for a
        corrupt record with ``errors="skip"``."""
        try:
            return item()
        except LayertapError:
            if self.errors == "raise":
                raise
            self.skipped += 1
            return None

    def __getitems__(self, indices: Sequence[int]) -> list[dict | None]:
        """``[self[i] for i in indices]``, what ``DataLoader`` asks for. With the Rust backend
        each ``hidden_states`` is decoded into its row of one zero-padded ``[B, T, L, H]`` (in a
        ``DataLoader`` worker, in shared memory, as the worker sends it), rows shaped as the first
        record read in this process."""
        if self.decode_on is not None:
            return self._device_items(indices)
        self._open()
        where = [self._where[i] for i in indices]
        if self.layers is not None or not where or not all(hasattr(s, "read_batch_into") for s, _ in where):
            return [self[i] for i in indices]
        if self._row is None:
            self._learn_row(*where[0])
        if self._row is None:
            return [self[i] for i in indices]
        shape, dtype = self._row
        lengths = [shard.entries[at].num_tokens for shard, at in where]
        backend = type(where[0][0])
        batch = _padded_batch(backend, (len(indices), max(lengths, default=0), *shape), dtype)
        rows = list(batch)  # each record decoded at the start of its row, zeros after it
        reads = [(shard, at, row.view(torch.uint8).numpy()) for (shard, at), row in zip(where, rows)]
        results = backend.read_batch_into(
            reads, HIDDEN_STATES, verify=self.verify, threads=_decode_threads(None, self.threads)
        )
        return [
            self._or_skipped(lambda: self._item(self._keys[i], shard.path, *_taken(results, n), row))  # noqa: B023
            for n, (i, (shard, _), row) in enumerate(zip(indices, where, rows))
        ]

    def _learn_row(self, shard: Any, at: int) -> None:
        """Sets this process's batch rows' shape from one record (one that cannot be read is left
        to its batch to raise or skip)."""
        try:
            metadata, tensors = shard.read(at, verify=False)
            self._item(shard.entries[at].key, shard.path, metadata, tensors)
        except LayertapError:
            pass

    # -- decode_on: exp-huf records decoded on the device ----------------------------------------

    def _device_items(self, indices: Sequence[int]) -> list[dict | None]:
        """The items of a batch with their hidden states on ``decode_on``: the exp-huf records'
        stored payloads decoded there in one call of the Triton decoder, the others read as
        ``self[i]`` reads them and moved there; as rows of one padded tensor (``_as_rows``)."""
        if torch.utils.data.get_worker_info() is not None:
            raise InvalidInputError(
                f"decode_on={self.decode_on!r} decodes in the main process (CUDA in forked DataLoader "
                "workers is unsafe): use num_workers=0, or leave decode_on unset to decode in the workers"
            )
        self._open()
        device = torch.device(self.decode_on)
        where = [self._where[i] for i in indices]
        results: list[tuple[str, dict, dict] | LayertapError | None] = []
        coded: list[int] = []  # positions in the batch of the exp-huf records
        for shard, at in where:
            entry = shard.entries[at]
            if entry.codec == "exp-huf":  # both block modes (by element, by column): below
                coded.append(len(results))
                results.append(None)
                continue
            try:
                metadata, tensors = shard.read(at, verify=self.verify)
                found = {name: to_torch(buf, dtype, shape) for name, dtype, shape, buf in tensors}
                if HIDDEN_STATES in found:
                    found[HIDDEN_STATES] = found[HIDDEN_STATES].to(device)
                results.append((shard.path, metadata, found))
            except LayertapError as e:
                results.append(e.with_traceback(None))  # see _taken
        if coded:
            # The stored payloads read from the shards straight into the one (pinned) buffer
            # that goes to the device: written once on the host, not into a buffer each and
            # then copied into the staging one.
            from layertap.gpu.exphuf_decode import Staging  # triton: imported on this path only

            staging = Staging([where[j][0].entries[where[j][1]].stored_len for j in coded], device)
            read, bad = [], False
            for j, problem in zip(coded, self._read_stored([where[j] for j in coded], staging.views)):
                if problem is None:
                    read.append(j)
                else:
                    results[j], bad = problem, True
            # A payload that could not be read leaves a hole: the others go as a list (copied).
            payloads = [staging.views[coded.index(j)] for j in read] if bad else staging
            for j, decoded in zip(read, _decode_payloads(payloads, [where[j] for j in read], device)):
                results[j] = decoded
        assemble = self._assemble
        items = [self._or_skipped(lambda: assemble(self._keys[i], *_taken(results, n))) for n, i in enumerate(indices)]  # noqa: B023
        return _as_rows(items) if self.layers is None else items

    def _read_stored(self, where: list[tuple[Any, int]], views: list[memoryview]) -> list[LayertapError | None]:
        """Reads the stored payloads of records ``where`` into ``views``, by the Rust core on
        several threads, else one at a time; for each, None or the CorruptRecordError raised."""
        backend = type(where[0][0])
        if all(type(shard) is backend for shard, _ in where) and hasattr(backend, "read_stored_into"):
            reads = [(shard, at, view) for (shard, at), view in zip(where, views)]
            results = backend.read_stored_into(
                reads, verify=self.verify, threads=_decode_threads(len(reads), self.threads)
            )
            for result in results:
                if result is not None and not isinstance(result, LayertapError):
                    raise result
            return results
        problems: list[LayertapError | None] = []
        for (shard, at), view in zip(where, views):
            try:
                self._stored(shard, shard.entries[at], view)
                problems.append(None)
            except LayertapError as e:
                problems.append(e.with_traceback(None))  # see _taken
        return problems

    def _stored(self, shard: Any, entry: Any, view: memoryview) -> None:
        """Reads ``entry``'s stored payload into ``view``, its checksum checked (with ``verify``)."""
        file = self._files.get(shard.path)
        if file is None:
            file = self._files[shard.path] = open(shard.path, "rb", buffering=0)  # noqa: SIM115
        offset = entry.frame_offset + frame_header_len(len(entry.key.encode("utf-8")))
        got = 0
        while got < len(view):
            n = os.preadv(file.fileno(), [view[got:]], offset + got)
            if n == 0:
                break
            got += n
        if got < len(view):
            raise _corrupt(shard.path, entry, "payload is cut off by the end of the file")
        if self.verify and crc32c(view) != entry.payload_crc:
            raise _corrupt(shard.path, entry, "payload checksum mismatch")

    def _item(self, key: str, shard: str, metadata: dict, tensors: list, row: torch.Tensor | None = None) -> dict:
        found = {
            name: to_torch(buf, dtype, shape) if buf is not None else _placed(row, dtype, shape)
            for name, dtype, shape, buf in tensors
        }
        return self._assemble(key, shard, metadata, found)

    def _assemble(self, key: str, shard: str, metadata: dict, found: dict[str, torch.Tensor]) -> dict:
        """The item of a record's tensors: its layers picked, a loss mask of ones where it has none."""
        hidden, token_ids = found.get(HIDDEN_STATES), found.get(TOKEN_IDS)
        if hidden is None or token_ids is None:
            raise LayertapError(f"{shard}: record {key!r} has no hidden_states or token_ids tensor")
        if self.layers is not None:
            try:
                stored = json.loads(metadata.get(LAYER_IDS, "null")) or []
                index = [stored.index(i) for i in self.layers]
            except (ValueError, AttributeError):
                raise LayertapError(
                    f"{shard}: record {key!r} holds layers {metadata.get(LAYER_IDS)}, not all of {self.layers}"
                ) from None
            if index != list(range(len(stored))):
                hidden = hidden[:, index]
        elif self._row is None:  # the rows of this process's batches (see __getitems__)
            self._row = (tuple(hidden.shape[1:]), hidden.dtype)
        mask = found.get(LOSS_MASK)
        if mask is None:
            mask = torch.ones(len(token_ids), dtype=torch.uint8)
        return {HIDDEN_STATES: hidden, TOKEN_IDS: token_ids, LOSS_MASK: mask, "key": key}

    def __repr__(self) -> str:
        return f"HiddenStatesDataset({self.path!r}, {len(self)} records, layers={self.layers})"


def _decode_device(decode_on: str | None) -> str | None:
    """``decode_on`` checked: None, or the device the Triton decoder can run on here."""
    if decode_on is None:
        return None
    try:
        device = torch.device(decode_on)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cuda", "cpu"):
        raise InvalidInputError(f"decode_on must be None, 'cuda' or 'cuda:N' (or 'cpu' for tests), not {decode_on!r}")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise InvalidInputError(
            "decode_on='cpu' runs the Triton kernel on CPU tensors in Triton's interpreter, for tests: "
            "set TRITON_INTERPRET=1, or leave decode_on unset to decode on the CPU"
        )
    missing = []
    if device.type == "cuda" and not torch.cuda.is_available():
        missing.append("torch sees no CUDA device")
    if importlib.util.find_spec("triton") is None:
        missing.append("triton is not installed (it comes with torch's CUDA builds)")
    if importlib.util.find_spec("layertap._native") is None:  # it parses the records' heads
        missing.append("the native extension is not built (make build)")
    if missing:
        raise InvalidInputError(
            f"decode_on={decode_on!r} needs a CUDA device and triton; {' and '.join(missing)}: "
            "leave decode_on unset to decode on the CPU"
        )
    return str(device)


def _corrupt(path: str, entry: Any, reason: str) -> CorruptRecordError:
    return CorruptRecordError.at(path, entry.frame_offset, entry.key, reason)


def _taken(results: list, n: int) -> Any:
    """``results[n]``, left None there; raised when it is an error. A raised error's traceback
    holds the frames it passes through, so a frame that still held it (in a list or a variable)
    would make a reference cycle, which keeps the batch's memory (pinned and on the device, with
    ``decode_on``) until the garbage collector runs; a ``DataLoader`` worker forked before then
    frees the parent's CUDA memory there, and aborts."""
    taken, results[n] = results[n], None
    if isinstance(taken, Exception):
        try:
            raise taken
        finally:
            del taken  # this frame is in the traceback: holding the error would be a cycle
    return taken


def _decode_payloads(
    payloads: Any, where: list[tuple[Any, int]], device: torch.device
) -> list[tuple[str, dict, dict] | LayertapError]:
    """``(shard path, metadata, tensors by name)`` of each exp-huf payload (host buffers, or a
    ``Staging`` holding them), decoded on ``device`` in one call; the tensors other than
    ``hidden_states`` come back to the CPU in one copy. A batch with a damaged payload is decoded
    again a record at a time, so that only the damaged ones fail."""
    if not len(payloads):
        return []
    from layertap.gpu.exphuf_decode import Staging, decode_records  # triton: this path only

    views = payloads.views if isinstance(payloads, Staging) else payloads
    metadata: list = []
    try:
        decoded: list = decode_records(payloads, device, metadata=metadata)
    except CorruptRecordError:
        decoded, metadata = [], []
        for payload, (shard, at) in zip(views, where):
            try:
                decoded.append(decode_records([payload], device, metadata=metadata)[0])
            except CorruptRecordError as e:
                metadata.append(None)
                reason = str(e).removeprefix("record 0 of the batch, ").removeprefix("record 0 of the batch is ")
                decoded.append(_corrupt(shard.path, shard.entries[at], reason))
    # the small tensors of every record in one copy to the host
    small = [(r, name) for r, d in enumerate(decoded) if isinstance(d, dict) for name in d if name != HIDDEN_STATES]
    flat = [decoded[r][name].reshape(-1).view(torch.uint8) for r, name in small]
    host = torch.cat(flat).cpu() if flat else None
    at_byte = 0
    out: list[tuple[str, dict, dict] | LayertapError] = []
    for payload, (shard, at), d, meta in zip(views, where, decoded, metadata):
        if isinstance(d, LayertapError):
            out.append(d)
            continue
        entry = shard.entries[at]
        head_len = 8 + int.from_bytes(payload[:8], "little")
        found = {}
        for name, t in d.items():
            if name != HIDDEN_STATES:  # a copy: its bytes may start anywhere in the host buffer
                n = t.numel() * t.element_size()
                t = host[at_byte : at_byte + n].clone().view(t.dtype).reshape(t.shape)
                at_byte += n
            found[name] = t
        raw_len = head_len + sum(t.numel() * t.element_size() for t in found.values())
        if raw_len != entry.raw_len:
            out.append(
                _corrupt(shard.path, entry, f"decodes to {raw_len} bytes, not the {entry.raw_len} its index says")
            )
            continue
        out.append((shard.path, meta, found))
    return out


def _as_rows(items: list[dict | None]) -> list[dict | None]:
    """The items with their hidden states copied into the rows of one zero-padded tensor
    ``[B, T, L, H]`` for ``pad_collate`` to take as it is, when they all have one shape of a
    token and dtype; else the items as they are."""
    present = [b for b in items if b is not None]
    if not present:
        return items
    first = present[0][HIDDEN_STATES]
    if any(b[HIDDEN_STATES].shape[1:] != first.shape[1:] or b[HIDDEN_STATES].dtype != first.dtype for b in present):
        return items
    t = max(len(b[HIDDEN_STATES]) for b in present)
    batch = torch.zeros((len(present), t, *first.shape[1:]), dtype=first.dtype, device=first.device)
    batch._layertap_padded = True
    for row, b in zip(batch, present):
        n = len(b[HIDDEN_STATES])
        row[:n] = b[HIDDEN_STATES]
        b[HIDDEN_STATES] = row[:n]
    return items


def _decode_threads(records: int | None, given: int | None) -> int:
    """Threads that read a batch: ``given``, else the CPUs this process may run on shared out
    among a ``DataLoader``'s workers; at most one a record where a record is one thread's work
    (``records``; None for a decode, which spreads a record's work over spare threads)."""
    if given is None:
        worker = torch.utils.data.get_worker_info()
        given = min(len(os.sched_getaffinity(0)) // (worker.num_workers if worker else 1), MAX_THREADS)
    return max(1, min(records or given, given))


def _padded_batch(backend: Any, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor for a batch's rows, marked for ``pad_collate``. In a
    ``DataLoader`` worker, shared memory from the start (as ``default_collate`` makes its
    batches), so that sending the batch does not copy it; else memory of an earlier batch no
    longer used (``backend.batch_memory``), whose pages need no faulting in."""
    elem = torch.empty(0, dtype=dtype)
    nbytes = math.prod(shape) * elem.element_size()
    if torch.utils.data.get_worker_info() is not None:
        storage = elem._typed_storage()._new_shared(math.prod(shape), device=elem.device)
        batch = elem.new(storage).resize_(shape)
    elif nbytes == 0:
        batch = torch.empty(shape, dtype=dtype)
    else:
        # A tensor of its own over the memory (not a view of it), so that the rows' base is it.
        memory = torch.frombuffer(backend.batch_memory(nbytes), dtype=torch.uint8)
        batch = elem.set_(memory.untyped_storage(), 0, shape)
    batch._layertap_padded = True
    return batch


def _placed(row: torch.Tensor | None, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor the core decoded at the start of ``row``: that part of the row, or a copy of
    its bytes for a tensor of another dtype or shape of a token."""
    assert row is not None, "a tensor was placed without a row"
    torch_dtype = TORCH_DTYPES[dtype]
    if torch_dtype == row.dtype and len(shape) == row.dim() and tuple(shape[1:]) == tuple(row.shape[1:]):
        return row[: shape[0]]
    nbytes = math.prod(shape) * torch.empty(0, dtype=torch_dtype).element_size()
    return to_torch(row.view(torch.uint8).reshape(-1)[:nbytes].clone().numpy(), dtype, shape)


def _padded_base(items: list[dict], t: int) -> torch.Tensor | None:
    """The padded tensor the items' hidden states were decoded into, when they are exactly its
    rows, in order, of ``t`` tokens; else None."""
    first = items[0][HIDDEN_STATES]
    base = first._base
    if base is None or not getattr(base, "_layertap_padded", False) or tuple(base.shape[:2]) != (len(items), t):
        return None
    for j, b in enumerate(items):
        h = b[HIDDEN_STATES]
        if (
            h._base is not base
            or h.data_ptr() != base[j].data_ptr()
            or tuple(h.shape) != (len(b[TOKEN_IDS]), *base.shape[2:])
        ):
            return None
    return base


class EmptyBatchError(LayertapError, ValueError):
    """Every record of a batch was corrupt and skipped (``errors="skip"``)."""


def _present(batch: list[dict | None]) -> list[dict]:
    items = [b for b in batch if b is not None]
    if not items:
        raise EmptyBatchError("a batch with no readable record (all were corrupt and skipped)")
    return items


def pad_collate(batch: list[dict | None], pad_token_id: int = 0) -> dict:
    """Pads a batch to its longest record: ``hidden_states [B, T, L, H]`` (zeros after each
    record), ``token_ids [B, T]`` (``pad_token_id`` after), ``loss_mask [B, T]`` (0 after),
    ``attention_mask [B, T]`` (bool), ``lengths [B]`` and ``keys``. Skipped records (None) are
    left out."""
    items = _present(batch)
    lengths = torch.tensor([len(b[TOKEN_IDS]) for b in items])
    n, t = len(items), int(lengths.max())
    first = items[0][HIDDEN_STATES]
    hidden = _padded_base(items, t)
    placed = hidden is not None
    if not placed:
        hidden = first.new_zeros((n, t, *first.shape[1:]))
    token_ids = torch.full((n, t), pad_token_id, dtype=torch.int64)
    loss_mask = torch.zeros((n, t), dtype=torch.uint8)
    for j, b in enumerate(items):
        k = len(b[TOKEN_IDS])
        if not placed:
            hidden[j, :k] = b[HIDDEN_STATES]
        token_ids[j, :k] = b[TOKEN_IDS]
        loss_mask[j, :k] = b[LOSS_MASK]
    attention_mask = torch.arange(t)[None, :] < lengths[:, None]
    return {
        HIDDEN_STATES: hidden,
        TOKEN_IDS: token_ids,
        LOSS_MASK: loss_mask,
        "attention_mask": attention_mask,
        "lengths": lengths,
        "keys": [b["key"] for b in items],
    }


def pack_collate(batch: list[dict | None]) -> dict:
    """Packs a batch end to end without padding: ``hidden_states [N, L, H]``, ``token_ids [N]``,
    ``loss_mask [N]``, ``position_ids [N]`` (from 0 in each record), ``cu_seqlens [B + 1]``
    (int32 offsets, as varlen attention kernels take them) and ``keys``. Skipped records (None)
    are left out."""
    items = _present(batch)
    lengths = torch.tensor([len(b[TOKEN_IDS]) for b in items])
    cu = torch.zeros(len(items) + 1, dtype=torch.int32)
    torch.cumsum(lengths, 0, out=cu[1:])
    starts = torch.repeat_interleave(cu[:-1].long(), lengths)
    return {
        HIDDEN_STATES: torch.cat([b[HIDDEN_STATES] for b in items]),
        TOKEN_IDS: torch.cat([b[TOKEN_IDS] for b in items]),
        LOSS_MASK: torch.cat([b[LOSS_MASK] for b in items]),
        "position_ids": torch.arange(int(cu[-1])) - starts,
        "cu_seqlens": cu,
        "keys": [b["key"] for b in items],
    }


__all__ = ["EmptyBatchError", "HiddenStatesDataset", "pad_collate", "pack_collate"]
