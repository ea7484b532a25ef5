"""A short run of the readers' fuzzer (tests/fuzz/fuzz_readers.py, atheris over tests/vectors):
the pure-Python reader and the Rust reader through the bindings never fail, hang or grow past
their memory bound, and agree. Long runs: benches/fuzz/README.md."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from helpers import REPO, VECTORS, subprocess_env
from layertap._py.reader import PyShardReader
from layertap._rust_reader import RustShardReader
from layertap._spec.exphuf import MODE_CODED, MODE_COLUMNS
from layertap._spec.format import frame_header_len

HARNESS = REPO / "tests" / "fuzz" / "fuzz_readers.py"


#: The same inputs on every machine: libFuzzer's seed and the hash seed fixed, and a count of
#: inputs instead of a time (which would make the count, and so the inputs, depend on the
#: machine's speed). A gate that found a new input by chance on one run in three would stop
#: unrelated work; new inputs come from the long runs of benches/fuzz/README.md, and what they
#: find becomes a vector (tests/vectors) that every reader's tests read.
SEED, RUNS = 1, 2000


def test_a_short_fuzz_run_finds_nothing(tmp_path):
    """``--reader both``: each input goes through the Python reader's checks, then the Rust
    reader's (each opens, reads, recovers and reopens it as ``--reader python`` and ``--reader
    rust`` do alone), then they must agree. The runs of one reader alone, which this suite also
    made (2,000 inputs each, 100 of its 190 s on the 2-core machine), checked nothing that this
    run does not check on each of its inputs; they are the long runs' (benches/fuzz/README.md)."""
    proc = subprocess.run(
        [
            sys.executable,
            str(HARNESS),
            *("--reader", "both", "--seconds", "200", "--out", str(tmp_path)),
            *(f"-seed={SEED}", f"-runs={RUNS}"),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env={**subprocess_env(), "PYTHONHASHSEED": "0"},
    )
    # The uncaught exception (a disagreement, with what each reader found) comes before
    # libFuzzer's last lines of progress and statistics: show the end of both streams.
    tail = f"libFuzzer -seed={SEED} -runs={RUNS}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-8000:]}"
    assert proc.returncode == 0, tail
    assert "stat::number_of_executed_units" in proc.stderr, tail
    runs = int(proc.stderr.split("stat::number_of_executed_units:")[1].split()[0])
    assert runs >= RUNS, tail
    assert list(tmp_path.iterdir()) == [], "failing inputs were written"


@pytest.mark.parametrize("cls", [PyShardReader, RustShardReader], ids=["python", "rust"])
def test_the_seeds_hold_blocks_of_both_coded_modes(tmp_path, cls):
    """libFuzzer takes the first ``MAX_LEN`` bytes of each vector: there, exp-huf.lts must still
    hold whole records with blocks coded by element (mode 1) and by column (mode 2, in several
    streams), so that mutations of both reach both readers' block decoders."""
    max_len = int(re.search(r"^MAX_LEN = (\d+)$", HARNESS.read_text(), re.M).group(1))
    seed = (VECTORS / "exp-huf.lts").read_bytes()[:max_len]
    (tmp_path / "seed.lts").write_bytes(seed)
    modes = {}
    with cls(str(tmp_path / "seed.lts"), probe_lock=False) as r:
        for i, e in enumerate(r.entries):
            r.read(i)  # every record the scan finds reads
            at = e.frame_offset + frame_header_len(len(e.key.encode("utf-8")))
            block = at + 8 + int.from_bytes(seed[at : at + 8], "little")  # the first tensor's
            modes[e.key] = (seed[block], int.from_bytes(seed[block + 9 : block + 13], "little"))
    assert modes["by-element"][0] == MODE_CODED
    assert modes["five-streams"] == (MODE_COLUMNS, 5)
