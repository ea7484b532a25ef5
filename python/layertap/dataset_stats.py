"""What a drafter's trainer checks in a dataset before training on it, in one pass over its
records (``layertap inspect --stats``, docs/TRAINING.md): how long the records are, how much of
them the loss mask keeps, and, per saved layer, the hidden states' RMS, their NaN and Inf values,
and the records in which a layer is all zero or constant.

Drafters trained on hidden states that were silently all zero (vLLM's hybrid models after a
block-size change) or NaN reached about no acceptance; nothing in a shard's index shows either,
so every record is decoded (by the reader's core, GIL released) and its values looked at here,
in numpy (torch is not needed). Each record's layer is summed in float32 row by row (a row is one
token's hidden vector) and the rows in float64, so the RMS of long records keeps its digits.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from layertap._spec.record import HIDDEN_STATES, LAYER_IDS, LOSS_MASK, REDUCTION, WINDOW_START
from layertap._text import plural
from layertap.fp8 import SCALE_NAME
from layertap.reader import progress_bar

#: How many keys each finding keeps (the count is always whole).
KEYS_KEPT = 20
#: How many keys a warning line names.
KEYS_SHOWN = 5
#: Bars of each histogram.
BINS = 12


@dataclass
class KeyList:
    """The records a finding applies to: how many, and the first ``KEYS_KEPT`` keys."""

    count: int = 0
    keys: list[str] = field(default_factory=list)

    def add(self, key: str) -> None:
        self.count += 1
        if len(self.keys) < KEYS_KEPT:
            self.keys.append(key)

    def named(self) -> str:
        """``keys a, b, c`` and how many more."""
        shown = ", ".join(self.keys[:KEYS_SHOWN])
        more = self.count - min(self.count, KEYS_SHOWN)
        return f"key{'s' if self.count != 1 else ''} {shown}" + (f" and {more:,} more" if more else "")

    def said(self, text: str, **values: object) -> list[str]:
        """``text`` with ``{records}`` (``3 records``), ``{count}`` and ``{keys}`` (``named``) and
        ``values`` filled in, when the finding applies to a record; else nothing."""
        if not self.count:
            return []
        return [text.format(records=plural(self.count, "record"), count=f"{self.count:,}", keys=self.named(), **values)]

    def to_json(self) -> dict:
        return {"count": self.count, "keys": list(self.keys)}


@dataclass
class LayerStats:
    """One saved layer over every record that holds it."""

    layer: int | str
    """The layer's id (``layer_ids``), or ``"#N"``, its position, where records have none."""
    records: int = 0
    values: int = 0
    finite: int = 0
    sum_sq: float = 0.0
    nan: int = 0
    inf: int = 0
    min: float = math.inf
    max: float = -math.inf
    zero_rows: int = 0
    """Tokens whose row is all zero, in records whose layer is not all zero."""
    all_zero: KeyList = field(default_factory=KeyList)
    constant: KeyList = field(default_factory=KeyList)
    with_nan: KeyList = field(default_factory=KeyList)
    with_inf: KeyList = field(default_factory=KeyList)
    with_zero_rows: KeyList = field(default_factory=KeyList)
    """Records with a token whose row is all zero, the record's layer not all zero."""
    record_rms: list[float] = field(default_factory=list)

    @property
    def rms(self) -> float | None:
        """The RMS of the layer's finite values over all records."""
        return math.sqrt(self.sum_sq / self.finite) if self.finite else None

    @property
    def name(self) -> str:
        return f"layer {self.layer}"

    def add(self, key: str, x: np.ndarray) -> None:
        """Counts one record's ``[tokens, hidden]`` float32 values of this layer."""
        self.records += 1
        self.values += x.size
        row_sq = np.einsum("th,th->t", x, x)
        if np.isfinite(row_sq).all():
            finite, sum_sq = x.size, float(row_sq.sum(dtype=np.float64))
            lo, hi = float(x.min()), float(x.max())
        else:
            nan, inf = int(np.isnan(x).sum()), int(np.isinf(x).sum())
            self.nan, self.inf = self.nan + nan, self.inf + inf
            if nan:
                self.with_nan.add(key)
            if inf:
                self.with_inf.add(key)
            ok = np.isfinite(x)
            finite = int(ok.sum())
            kept = np.where(ok, x, np.float32(0))
            row_sq = np.einsum("th,th->t", kept, kept)
            sum_sq = float(row_sq.sum(dtype=np.float64))
            lo = float(x[ok].min()) if finite else math.nan
            hi = float(x[ok].max()) if finite else math.nan
        self.finite += finite
        self.sum_sq += sum_sq
        self.record_rms.append(math.sqrt(sum_sq / finite) if finite else math.nan)
        if not finite:
            return
        self.min, self.max = min(self.min, lo), max(self.max, hi)
        if finite < x.size:
            return  # NaN or Inf said already; not also "constant"
        if lo == hi == 0:
            self.all_zero.add(key)
        elif lo == hi:
            self.constant.add(key)
        else:
            zero_rows = int((np.count_nonzero(x, axis=1) == 0).sum())
            if zero_rows:
                self.zero_rows += zero_rows
                self.with_zero_rows.add(key)

    def warnings(self, records: int) -> list[str]:
        of = {"name": self.name, "total": f"{records:,}"}
        return [
            *self.all_zero.said("{name}: all zero in {count} of {total} records ({keys})", **of),
            *self.constant.said(
                "{name}: constant (every value equal, not zero) in {count} of {total} records ({keys})", **of
            ),
            *self.with_nan.said("{name}: NaN in {records} ({values}; {keys})", values=plural(self.nan, "value"), **of),
            *self.with_inf.said("{name}: Inf in {records} ({values}; {keys})", values=plural(self.inf, "value"), **of),
            *self.with_zero_rows.said(
                "{name}: {tokens} whose row is all zero in {records} ({keys})",
                tokens=plural(self.zero_rows, "token"),
                **of,
            ),
        ]

    def to_json(self) -> dict:
        return {
            "layer": self.layer,
            "records": self.records,
            "values": self.values,
            "rms": self.rms,
            "min": self.min if self.finite else None,
            "max": self.max if self.finite else None,
            "nan": self.nan,
            "inf": self.inf,
            "zero_rows": self.zero_rows,
            **{
                k: getattr(self, k).to_json()
                for k in ("all_zero", "constant", "with_nan", "with_inf", "with_zero_rows")
            },
            "rms_histogram": histogram([r for r in self.record_rms if not math.isnan(r)]),
        }


def histogram(
    values: list[float] | list[int], bins: int = BINS, integer: bool = False, span: tuple[float, float] | None = None
) -> dict:
    """``{"edges": [...], "counts": [...]}``: ``bins`` equal bars from the smallest value to the
    largest (or over ``span``; one bar when all values are equal), each bar ``[edge, next edge)``
    and the last one closed; of integers, bars of whole width, each ``[edge, next edge)``."""
    if not values:
        return {"edges": [], "counts": []}
    a = np.asarray(values, dtype=np.float64)
    lo, hi = span or (float(a.min()), float(a.max()))
    if integer:
        width = max(1, math.ceil((hi - lo + 1) / bins))
        n = math.ceil((hi - lo + 1) / width)
        edges = [lo + i * width for i in range(n + 1)]
        counts = np.bincount(((a - lo) // width).astype(np.int64), minlength=n)
        return {"edges": [int(e) for e in edges], "counts": [int(c) for c in counts]}
    if lo == hi:
        return {"edges": [lo, hi], "counts": [len(values)]}
    counts, edges = np.histogram(a, bins=bins, range=(lo, hi))
    return {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]}


def _quantile(sorted_values: list[int], q: float) -> int:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


@dataclass
class DatasetStats:
    """What one pass over a dataset found (``dataset_stats``)."""

    path: str
    records: int = 0
    lengths: list[int] = field(default_factory=list)
    """Tokens (rows of ``hidden_states``) of each record read, in dataset order."""
    corrupt: list = field(default_factory=list)
    """``Problem``s of the corrupt records left out."""
    windows: int = 0
    reductions: dict[str, int] = field(default_factory=dict)
    lossy: int = 0
    dtypes: dict[str, int] = field(default_factory=dict)
    no_tokens: KeyList = field(default_factory=KeyList)
    no_hidden_states: KeyList = field(default_factory=KeyList)
    masked_records: int = 0
    masked_tokens: int = 0
    mask_ones: int = 0
    mask_coverage: list[float] = field(default_factory=list)
    """Each masked record's fraction of tokens with mask 1."""
    mask_all_zero: KeyList = field(default_factory=KeyList)
    mask_not_binary: KeyList = field(default_factory=KeyList)
    layers: dict[Any, LayerStats] = field(default_factory=dict)

    def add(self, record) -> None:
        """Counts one ``Record`` (tensors as numpy arrays)."""
        key, tensors = record.key, record.tensors
        self.records += 1
        hs = tensors.get(HIDDEN_STATES)
        if hs is None or hs.ndim != 3:
            self.no_hidden_states.add(key)
            self.lengths.append(record.num_tokens)
            return
        tokens, layers = hs.shape[0], hs.shape[1]
        self.lengths.append(tokens)
        self.dtypes[str(hs.dtype)] = self.dtypes.get(str(hs.dtype), 0) + 1
        if WINDOW_START in record.metadata:
            self.windows += 1
        if REDUCTION in record.metadata:
            how = record.metadata[REDUCTION]
            self.reductions[how] = self.reductions.get(how, 0) + 1
        mask = tensors.get(LOSS_MASK)
        if mask is not None:
            self._add_mask(key, np.asarray(mask))
        if tokens == 0:
            self.no_tokens.add(key)
            return
        x = hs.astype(np.float32)
        scale = tensors.get(SCALE_NAME)
        if scale is not None:  # a lossy record (docs/FP8.md): the values are q * its token's scale
            self.lossy += 1
            x *= np.asarray(scale, dtype=np.float32).reshape(-1, 1, 1)
        labels = _layer_labels(record.metadata.get(LAYER_IDS), layers)
        for i, label in enumerate(labels):
            layer = self.layers.get(label)
            if layer is None:
                layer = self.layers[label] = LayerStats(label)
            layer.add(key, np.ascontiguousarray(x[:, i, :]))

    def _add_mask(self, key: str, mask: np.ndarray) -> None:
        self.masked_records += 1
        ones = int(np.count_nonzero(mask == 1))
        if np.count_nonzero((mask != 0) & (mask != 1)):
            self.mask_not_binary.add(key)
        self.masked_tokens += mask.size
        self.mask_ones += ones
        if mask.size:
            self.mask_coverage.append(ones / mask.size)
        if not ones:
            self.mask_all_zero.add(key)

    # -- what is said ---------------------------------------------------------------------------

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def length_summary(self) -> dict | None:
        if not self.lengths:
            return None
        s = sorted(self.lengths)
        return {
            "min": s[0],
            "median": _quantile(s, 0.5),
            "mean": round(sum(s) / len(s), 2),
            "p90": _quantile(s, 0.9),
            "p99": _quantile(s, 0.99),
            "max": s[-1],
        }

    def warnings(self) -> list[str]:
        """One line for each thing a trainer should look at before training."""
        out = []
        if self.corrupt:
            out.append(
                f"{plural(len(self.corrupt), 'corrupt record')} left out "
                f"(keys {', '.join(p.key or '?' for p in self.corrupt[:KEYS_SHOWN])}; `layertap verify` lists them)"
            )
        out += self.no_hidden_states.said(
            "{records} without {name} [tokens, layers, hidden] ({keys})", name=HIDDEN_STATES
        )
        return out + self.value_warnings()

    def value_warnings(self) -> list[str]:
        """The warnings about the values of records of hidden states: ``warnings`` less the
        corrupt records (which ``layertap verify`` reports as problems of its own) and the
        records without ``hidden_states`` (the format holds any tensors; verify does not warn of
        a dataset that is not the connector's)."""
        out = self.no_tokens.said("{records} with no token ({keys})")
        out += self.mask_all_zero.said("{mask} all 0 (nothing to learn from) in {records} ({keys})", mask=LOSS_MASK)
        out += self.mask_not_binary.said("{mask} values other than 0 and 1 in {records} ({keys})", mask=LOSS_MASK)
        for layer in self.layers.values():
            out += layer.warnings(self.records)
        return out

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "records": self.records,
            "tokens": self.tokens,
            "lengths": self.length_summary(),
            "length_histogram": histogram(self.lengths, integer=True),
            "corrupt_records": [p.key for p in self.corrupt],
            "windows": self.windows,
            "reductions": dict(self.reductions),
            "lossy_records": self.lossy,
            "dtypes": dict(self.dtypes),
            "no_tokens": self.no_tokens.to_json(),
            "no_hidden_states": self.no_hidden_states.to_json(),
            "loss_mask": {
                "records": self.masked_records,
                "records_without": self.records - self.masked_records,
                "tokens": self.masked_tokens,
                "ones": self.mask_ones,
                "coverage": self.mask_ones / self.masked_tokens if self.masked_tokens else None,
                "coverage_histogram": histogram(self.mask_coverage, bins=10, span=(0.0, 1.0)),
                "all_zero": self.mask_all_zero.to_json(),
                "not_binary": self.mask_not_binary.to_json(),
            },
            "layers": [layer.to_json() for layer in self.layers.values()],
            "warnings": self.warnings(),
        }


def _layer_labels(layer_ids: str | None, layers: int) -> list:
    """Each position's label: the record's layer ids where it has a list of the right length,
    else ``"#0"``, ``"#1"``, ..."""
    if layer_ids is not None:
        try:
            ids = json.loads(layer_ids)
        except ValueError:
            ids = None
        if isinstance(ids, list) and len(ids) == layers and all(isinstance(i, int) for i in ids):
            return ids
    return [f"#{i}" for i in range(layers)]


def dataset_stats(ds, progress: bool = False) -> DatasetStats:
    """Reads every record of ``ds`` (a ``Dataset`` opened with ``tensors="numpy"``) once and
    returns what it found; corrupt records are left out and listed in ``corrupt``."""
    stats = DatasetStats(ds.path)
    records = ds.iter(errors="skip")
    with progress_bar(progress, len(ds), "stats") as bar:
        for record in records:
            stats.add(record)
            bar.update(1)
    stats.corrupt = list(records.problems)
    return stats


__all__ = ["BINS", "KEYS_KEPT", "DatasetStats", "KeyList", "LayerStats", "dataset_stats", "histogram"]
