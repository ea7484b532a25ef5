"""Coverage-guided fuzzing of the shard readers with atheris (libFuzzer for Python), seeded from
tests/vectors.

    python tests/fuzz/fuzz_readers.py --reader python|rust|both [--seconds N] [--out DIR]

Each input is written to a file (on /dev/shm where there is one) and opened, read and checked
by the chosen reader: ``python`` is the pure-Python reference (``PyShardReader`` and its
recovery), ``rust`` is the Rust core through the bindings (``RustShardReader``,
``layertap.recover``). Then the shard is recovered and read again. Any exception other than the
reader's own errors (``FormatError`` and its ``CorruptRecordError``) is a failure, and so is a
Rust panic (``PanicException``). With ``both``, the two readers must also agree on what they
find: the records, the problems, what each record reads as (metadata and tensors' bytes, or a
refusal), and the bytes their recoveries leave.

libFuzzer enforces the rest: a case running past ``-timeout`` is a hang, and the process may
not grow past ``-rss_limit_mb`` (4 GiB past the peak it inherited from the process that started
it). On top, the address space is limited (``RLIMIT_AS``) to what
the process had at start plus what the largest input justifies (its records' decoded size is
bounded by 32768 times their stored size, as zstd's is), so that an allocation beyond that
fails instead of passing unnoticed.

The summary (inputs run, coverage, seconds) is printed at the end; failing inputs are written
to ``--out`` (``crash-*``, ``timeout-*``, ``oom-*``), which tests/test_fuzz_readers.py and
benches/fuzz/README.md read.
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import atheris

# Coverage of layertap's own code guides the mutations: instrumenting every module these imports
# pull in (84 of numpy's, email, json, ...) took 7 of the short run's 30 s of CPU to start, and
# counted numpy's branches as the readers' coverage.
with atheris.instrument_imports(include=["layertap"]):
    from layertap import _native
    from layertap._py.reader import PyShardReader
    from layertap._py.recover import recover as py_recover
    from layertap._rust_reader import RustShardReader
    from layertap._spec.format import FRAME_MAGIC, TRAILER_LEN, TRAILER_MAGIC, align8, crc32c
    from layertap.errors import FormatError
    from layertap.recover import recover as rust_recover

VECTORS = Path(__file__).resolve().parents[1] / "vectors"
MAX_LEN = 8192
#: As the readers bound it: zstd cannot expand data more than this.
ZSTD_MAX_RATIO = 32 << 10


def _probe(cls, path: str) -> dict | None:
    """What a reader finds in the shard at ``path``, reading and checking every record."""
    try:
        r = cls(path, probe_lock=False)
    except FormatError:
        return None
    try:
        found = {
            "complete": r.complete,
            "lost_in_recovery": r.lost_in_recovery,
            "torn_tail_bytes": r.torn_tail_bytes,
            "problems": [(p.kind, p.offset, p.key) for p in r.scan_problems],
            "entries": list(r.entries),
            "reads": [],
        }
        for i in range(len(r.entries)):
            try:
                metadata, tensors = r.read(i)
                assert metadata.get("key") == r.entries[i].key
                # What it read, values included: two readers that read a record must read the same.
                ok = (metadata, [(n, d, tuple(s), bytes(memoryview(b).cast("B"))) for n, d, s, b in tensors])
            except FormatError:
                ok = None
            try:
                r.read(i, verify=False)
            except FormatError:
                pass
            try:
                r.check(i)
                checked = True
            except FormatError:
                checked = False
            found["reads"].append((ok, checked))
        return found
    finally:
        r.close()


def _recovered(recover, path: str) -> bytes | str:
    """The file after recovery, or what the recovery raised (its type)."""
    try:
        report = recover(path)
    except FormatError:
        return "FormatError"
    if report.removed:
        return "removed"
    return Path(path).read_bytes()


def remember_decoding_tables() -> None:
    """The Python reader's exp-huf decoding tables (``_spec.exphuf._table``, 2,048 entries built
    in Python per context and block) kept for the code lengths they were built from, the last
    256 of them: most mutations leave a block's code lengths as they were, and rebuilding the
    same tables six times an input (three reads of each record, before and after recovery) was
    two thirds of the short run's time. A table depends on nothing but its lengths; new lengths
    (a mutation of them) still build theirs, checked and covered as before."""
    from layertap._spec import exphuf

    build = exphuf._table

    @functools.lru_cache(maxsize=256)
    def built(lengths: tuple, shift: int) -> tuple:
        return tuple(build(list(lengths), shift))

    exphuf._table = lambda lengths, shift: built(tuple(lengths), shift)


def make_one_input(reader: str, workdir: str):
    readers = {"python": [(PyShardReader, py_recover)], "rust": [(RustShardReader, rust_recover)]}
    readers["both"] = readers["python"] + readers["rust"]
    chosen = readers[reader]

    def one_input(data: bytes) -> None:
        results = []
        for k, (cls, recover) in enumerate(chosen):
            path = os.path.join(workdir, f"case-{k}.lts")
            with open(path, "wb") as f:
                f.write(data)
            before = _probe(cls, path)
            after = _recovered(recover, path)
            again = _probe(cls, path) if isinstance(after, bytes) else None
            if isinstance(after, bytes):
                assert again is not None and again["complete"], "a recovered shard must open complete"
                assert _recovered(recover, path) == after, "recovering again must change nothing"
            results.append((before, after, again))
        if len(results) == 2:
            (py_before, py_after, py_again), (rs_before, rs_after, rs_again) = results
            assert py_before == rs_before, ("the readers disagree", py_before, rs_before)
            assert py_after == rs_after, "the recoveries disagree"
            assert py_again == rs_again, ("the readers disagree after recovery", py_again, rs_again)

    return one_input


def repair(data: bytes) -> bytes:
    """Every checksum a writer would have written, recomputed over the bytes as they are now
    (file header, frame headers and payloads found by their magic at multiples of 8, trailer),
    so that mutations reach what the checksums protect. rust/core/tests/fuzz_vectors.rs does
    the same."""
    b = bytearray(data)
    if len(b) >= 16:
        crc_at = 32 + int.from_bytes(b[12:16], "little")
        if crc_at + 4 <= len(b):
            b[crc_at : crc_at + 4] = crc32c(b[:crc_at]).to_bytes(4, "little")
    for at in range(0, len(b) - 47, 8):
        if b[at : at + 4] != FRAME_MAGIC:
            continue
        key_len = int.from_bytes(b[at + 6 : at + 8], "little")
        stored = int.from_bytes(b[at + 8 : at + 16], "little")
        payload_at = at + align8(48 + key_len)
        if payload_at + stored <= len(b):
            b[at + 28 : at + 32] = crc32c(b[payload_at : payload_at + stored]).to_bytes(4, "little")
        if at + 48 + key_len <= len(b):
            crc = crc32c(b[at + 48 : at + 48 + key_len], crc32c(b[at : at + 44]))
            b[at + 44 : at + 48] = crc.to_bytes(4, "little")
    if len(b) >= TRAILER_LEN and b[-8:] == TRAILER_MAGIC:
        t = len(b) - TRAILER_LEN
        b[t + 20 : t + 24] = crc32c(b[t : t + 20]).to_bytes(4, "little")
    return bytes(b)


def mutate(data: bytes, max_size: int, seed: int) -> bytes:
    """libFuzzer's mutations, then (every other time) the checksums made right again."""
    out = atheris.Mutate(data, max_size)
    return repair(out) if seed % 2 else out


def _limit_address_space() -> None:
    """Allows what the process has now plus what the largest input can justify (and room for
    libFuzzer's own bookkeeping), so that a larger allocation fails loudly."""
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    allowed = vm + MAX_LEN * ZSTD_MAX_RATIO + (2 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (allowed, allowed))


#: How far the process may grow past the peak it started with (libFuzzer's ``-rss_limit_mb``).
RSS_BUDGET_MB = 4096


def inherited_peak_mb() -> int:
    """The peak resident size this process started with: libFuzzer checks its limit against
    ``getrusage``'s ``ru_maxrss``, which Linux carries across fork and exec, so a harness started
    by a large process (a test worker that ran in-process engines: 4.3 GB in a fresh-clone CI)
    begins at that process's size and was stopped as out of memory before its first input."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reader", choices=["python", "rust", "both"], required=True)
    parser.add_argument("--seconds", type=int, default=15)
    parser.add_argument("--out", default=None, help="where failing inputs go (default: a temporary folder)")
    args, libfuzzer_args = parser.parse_known_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="layertap-fuzz-out-"))
    out.mkdir(parents=True, exist_ok=True)
    root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    workdir = tempfile.mkdtemp(prefix="layertap-fuzz-", dir=root)
    corpus = tempfile.mkdtemp(prefix="layertap-fuzz-corpus-", dir=root)
    for p in sorted(VECTORS.glob("*.lts")):
        shutil.copyfile(p, os.path.join(corpus, p.name))
    print(f"fuzz_readers: reader {args.reader}, {args.seconds} s, native {_native.__file__}", flush=True)
    _limit_address_space()
    started = time.monotonic()
    argv = [
        sys.argv[0],
        corpus,
        f"-max_total_time={args.seconds}",
        f"-max_len={MAX_LEN}",
        "-timeout=120",  # a hang, not a slow case on a loaded machine
        f"-rss_limit_mb={inherited_peak_mb() + RSS_BUDGET_MB}",
        "-print_final_stats=1",
        f"-artifact_prefix={out}/",
        *libfuzzer_args,
    ]
    remember_decoding_tables()
    # libFuzzer ends its process with exit() (no finally, no atexit of Python's), so the fuzzing
    # runs in a child and this process removes the scratch folders (7 MB of /dev/shm a run).
    child = os.fork()
    if child == 0:
        atheris.Setup(argv, make_one_input(args.reader, workdir), custom_mutator=mutate)
        atheris.Fuzz()
        os._exit(0)
    try:
        _, status = os.waitpid(child, 0)
    finally:
        print(f"fuzz_readers: {time.monotonic() - started:.0f} s", flush=True)
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(corpus, ignore_errors=True)
    code = os.waitstatus_to_exitcode(status)
    sys.exit(code if code >= 0 else 128 - code)  # killed by a signal: as a shell says it


if __name__ == "__main__":
    main()
