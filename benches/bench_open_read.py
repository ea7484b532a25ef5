"""Reading every record through ``layertap.open`` in a fresh process, in GB of decoded bytes per
CPU-second (best of ``--reps``): what a script that opens a dataset and iterates over it pays,
where bench_codecs.py measures the same reads in a process that has written the records first
(whose allocator has grown its heap by then, so that new buffers fault in fewer pages).

    python benches/bench_open_read.py write --dir /dev/shm/open-read     # once: 192 records a codec
    python benches/bench_open_read.py read --dir /dev/shm/open-read      # in turns with another build:
    PYTHONPATH=/tmp/other-build python benches/bench_open_read.py read --dir /dev/shm/open-read

The records are bench_codecs.py's: 512 tokens of the MiniLM bf16 activations each (2.6 MiB),
written three times over.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CODECS = ["bp16-zstd", "exp-huf", "zstd"]
RECORD_TOKENS = 512


def write(root: Path) -> None:
    from bench_writer import load_activations

    import layertap

    acts = load_activations("bf16")[: 64 * RECORD_TOKENS].contiguous()
    n = acts.shape[0] // RECORD_TOKENS
    for codec in CODECS:
        shutil.rmtree(root / codec, ignore_errors=True)
        with layertap.ShardWriter(root / codec, codec=codec, level=1, durability="none") as w:
            for p in range(3):
                for i in range(n):
                    w.submit(f"r{p}-{i}", {"hidden_states": acts[i * RECORD_TOKENS : (i + 1) * RECORD_TOKENS]})


def read(root: Path, reps: int) -> None:
    import layertap

    for codec in CODECS:
        best = 0.0
        for _ in range(reps):
            raw, c0 = 0, time.process_time()
            with layertap.open(root / codec, backend="rust") as ds:
                for rec in ds:
                    h = rec.hidden_states
                    h.view(-1)[0].item()  # touch the data
                    raw += h.numel() * h.element_size()
            best = max(best, raw / (time.process_time() - c0) / 1e9)
        print(f"{codec}: {best:.2f} GB per CPU-second ({layertap.__file__})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["write", "read"])
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm/layertap-open-read"))
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if args.what == "write":
        write(args.dir)
    else:
        read(args.dir, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
