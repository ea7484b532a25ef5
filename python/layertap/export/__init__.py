"""``layertap export``: a layertap dataset keyed by row index (``layertap generate``'s keys) as the
files a drafter trainer reads, one per row: speculators', SpecForge's or NVIDIA Model-Optimizer's
(``layouts.py`` has each layout's files and tensors, docs/TRAINING.md the commands). Every record
is checked (checksum, tensors, layers) and every file read back before it takes its final name,
so an interrupted export continues where it stopped."""

from __future__ import annotations

from layertap.export.run import FORMATS, ExportSummary, export

__all__ = ["FORMATS", "ExportSummary", "export"]
