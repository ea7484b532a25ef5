"""``layertap export``: a layertap dataset as the files a drafter trainer reads.

- ``--to speculators OUT``: ``OUT/hidden_states/hs_{row}.safetensors``, speculators' cached
  hidden states for row ``row`` of its prepared dataset ``OUT``;
- ``--to specforge OUT --model MODEL_DIR [--strategy eagle3|dflash] [--compress]``:
  ``OUT/rows_{g}-{g+2000}/data_{row}.ckpt`` (``.ckpt.gz`` with ``--compress``), SpecForge's
  offline features;
- ``--to modelopt OUT --model MODEL_DIR [--prenorm]``: ``OUT/{row}.pt``, NVIDIA
  Model-Optimizer's EAGLE-3 offline dumps.

Records are keyed by row index (``layertap generate``'s keys). Every record is checked (checksum,
tensors, layers) and every file read back before it takes its final name, so an interrupted
export continues where it stopped. See docs/TRAINING.md; ``layouts.py`` has the tensors.
"""

from __future__ import annotations

from layertap.export.run import FORMATS, ExportSummary, export

__all__ = ["FORMATS", "ExportSummary", "export"]
