"""speculators' real trainer on a layertap dataset, on a machine with a GPU:
``python tests/trainers/gpu_train_check.py WORK_DIR``.

Not a pytest module. speculators' Trainer moves the draft to accelerator 0, so the CPU suite
(tests/trainers/test_speculators.py) runs its entry point with the Trainer replaced; this runs
the whole ``python -m layertap.speculators train --hidden-states-backend layertap`` command:

1. builds the tiny verifier (4 layers, hidden 128) and 48 prepared rows (speculators' format);
2. writes their hidden states of vLLM layers [1, 2, 3, 4] with transformers into a layertap
   dataset keyed by row index, at the default ``DATA/hidden_states``;
3. trains an EAGLE-3 draft for a few steps with the layertap backend (speculators' Trainer,
   DataLoader workers spawned, checkpoint saved), then once more from
   ``layertap export --to speculators`` with the file backend, for comparison.

Needs speculators 0.9.0 with its dependencies and layertap importable; prints one JSON line and
exits non-zero if a run fails or leaves no checkpoint.

On this project's GPU machine (Python 3.12, torch 2.11, transformers 5.17, no network), carry
the wheels it lacks, downloaded here with ``pip download --no-deps --only-binary=:all:
--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform
manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu NAME==VERSION`` for speculators
0.9.0, hs-connectors 0.9.0, datasets 5.1.0, multiprocess, dill, loguru, openai, jiter, distro,
sniffio, pydantic, pydantic-core, annotated-types, typing-inspection, pydantic-settings,
python-dotenv, zstandard and crc32c (13 MB), plus the built extension, and run::

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/*.whl &&
    PYTHONPATH=/tmp/site:python python3 tests/trainers/gpu_train_check.py /tmp/gpu-train-check

with ``carry`` naming ``.gpu`` and ``python/layertap/_native.abi3.so``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from trainers_support import Truth, build_verifier, prepared_rows, save_prepared, write_dataset


def train(data: Path, backend: str, save: Path, steps: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "layertap.speculators",
        "train",
        "--verifier-name-or-path",
        str(data.parent / "verifier"),
        "--data-path",
        str(data),
        "--hidden-states-backend",
        backend,
        "--speculator-type",
        "eagle3",
        "--target-layer-ids",
        "1",
        "2",
        "3",
        "--total-seq-len",
        "256",
        "--num-workers",
        "2",
        "--save-path",
        str(save),
        "--on-missing",
        "raise",
        "--train-data-ratio",
        "0.75",
        "--max-steps",
        str(steps),
        "--epochs",
        "1",
        "--mask-token-id",
        "2",
        "--log-freq",
        "1",
    ]
    if backend == "file":
        cmd += ["--hidden-states-path", str(data.parent / "exported" / "hidden_states")]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    (save.parent / f"train-{backend}.log").write_text(log)
    return {
        "backend": backend,
        "rc": proc.returncode,
        "seconds": round(time.monotonic() - started, 1),
        "checkpoint": sorted(p.name for p in save.rglob("*.safetensors"))[:4],
        "tail": log[-1500:],
    }


def main() -> int:
    work = Path(sys.argv[1] if len(sys.argv) > 1 else "gpu-train-check").resolve()
    work.mkdir(parents=True, exist_ok=True)
    verifier = build_verifier(work / "verifier")
    truth = Truth(verifier)
    rows = prepared_rows(48)
    data = Path(save_prepared(work / "data", rows))
    write_dataset(data / "hidden_states", rows, truth)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "layertap",
            "export",
            str(data / "hidden_states"),
            "--to",
            "speculators",
            str(work / "exported"),
        ],
        check=True,
    )
    results = {
        "cuda": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "runs": [train(data, b, work / f"ckpt-{b}", 6) for b in ("layertap", "file")],
    }
    print(json.dumps(results))
    ok = all(r["rc"] == 0 and r["checkpoint"] for r in results["runs"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
