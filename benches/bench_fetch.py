"""``fetch`` of one record against ``layertap.open`` reading the same record (issue 33, goal 4).

For each codec, records of real activations (benches/activations.py: all-MiniLM-L6-v2, 2,048
tokens x 7 layers x 384, bf16, 11 MB a record) are written by the Rust writer, and one record at
a time is read through:

- ``fetch live``: ``layertap.vllm.online.fetch`` of a record while its shard is still being
  written (the writer open: the shard locked, no index), as a client of ``vllm serve`` fetches
  its response's record: it finds the shard, reads the frame headers and decodes the record;
- ``follow live``: ``layertap.follow`` over the same live shard, per record;
- ``fetch store``: ``fetch`` from Mooncake Store (``mooncake://``; a real ``mooncake_master`` and
  store node on loopback, tests/store_support.py's ``LoopbackStore``), the records forwarded by
  the connector's forwarder;
- ``fetch node``: the same through the store node (the address option ``node=``: Mooncake's
  dummy client, the object in memory shared with the node), in turns with ``fetch store``;
- ``open``: ``layertap.open`` of the dataset once the writer closed it, then ``ds[key]``, per
  call (opening included, as fetch finds its shard on every call).

With ``--reference``, ``follow live`` once more with ``backend="python"`` (the Python reference's
decoder, which follow used before issue 33), one pass.

Every read touches one byte of every page of each tensor (a mapped record would otherwise not be
read at all). Times are medians over ``--repeats`` reads of each of the records, page cache warm.

    python benches/bench_fetch.py --reference --out benches/results/fetch-DATE-MACHINE

writes NAME.json and NAME.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from bench_writer import load_activations  # noqa: E402

CODECS = ("none", "zstd", "bp16-zstd", "exp-huf")
TOKENS = 2048
WRITER = "w"


def touch(record) -> None:
    """Reads one byte of every page of each tensor."""
    import torch

    for t in record.tensors.values():
        t.reshape(-1).view(torch.uint8)[::4096].sum()


def thread_cpu(pid: int) -> float:
    """CPU seconds the threads of process ``pid`` alive now have run (their schedstat: ns)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def timed(fn, repeats: int, keys: list[str], node_pid: int | None = None) -> tuple[float, ...]:
    """Median wall seconds and median CPU seconds of ``fn(key)`` over ``repeats`` calls for each
    key. CPU: this process's, all its threads (Mooncake's transfer threads and its waiting
    caller among them; the store node's and the master's not), less disturbed than wall time
    on a shared machine. With ``node_pid`` (the store node's process) a third value: the
    node's CPU seconds over all the calls (its threads' schedstat), per call: a mean, since the
    node does the work of a call partly after it returns (releasing the buffer)."""
    wall, cpu = [], []
    n0 = thread_cpu(node_pid) if node_pid else 0.0
    for _ in range(repeats):
        for key in keys:
            c0, t0 = time.process_time(), time.perf_counter()
            touch(fn(key))
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    if node_pid:
        return statistics.median(wall), statistics.median(cpu), (thread_cpu(node_pid) - n0) / len(wall)
    return statistics.median(wall), statistics.median(cpu)


def measure(codec: str, records: list, scratch: Path, store, repeats: int, reference: bool) -> dict:
    import layertap
    from layertap.mooncake.address import parse_address
    from layertap.vllm.mooncake_forwarder import Forwarder
    from layertap.vllm.online import RecordLocation, fetch

    directory = scratch / codec
    shutil.rmtree(directory, ignore_errors=True)
    keys = [key for key, _ in records]
    w = layertap.ShardWriter(str(directory), writer_id=WRITER, codec=codec, durability="none")
    for key, tensors in records:
        w.submit(key, tensors, {"model": "all-MiniLM-L6-v2"})
    w.flush()

    def fetch_live(key):
        return fetch(RecordLocation(str(directory), WRITER, key), timeout=30, durable=False)

    def follow_live(backend: str = "auto"):
        t0 = time.perf_counter()
        n = 0
        for r in layertap.follow(str(directory), timeout=0, backend=backend):
            touch(r)
            n += 1
        assert n == len(records), n
        return (time.perf_counter() - t0) / n

    fetch_live(keys[0])  # imports, first look
    row = {"codec": codec}
    row["fetch_live_s"], row["fetch_live_cpu_s"] = timed(fetch_live, repeats, keys)
    row["follow_live_s"] = statistics.median(follow_live() for _ in range(repeats))
    if reference:  # the Python reference's decoder, what follow used before issue 33: one pass
        row["follow_live_python_s"] = follow_live("python")
    w.close()

    def open_read(key):
        with layertap.open(str(directory)) as ds:
            return ds[key]

    open_read(keys[0])
    row["open_s"], row["open_cpu_s"] = timed(open_read, repeats, keys)
    from layertap._rust_reader import RustShardReader

    (path,) = directory.glob("*.lts")
    with RustShardReader(path) as shard:
        row["raw_bytes"] = sum(e.raw_len for e in shard.entries) // len(keys)
        row["stored_bytes"] = sum(e.stored_len for e in shard.entries) // len(keys)

    if store is not None:
        address = store.address(f"bench/{codec}")
        f = Forwarder(parse_address(address), str(directory), WRITER, {}, keep_shards=True)
        f.close(timeout=120)
        assert f.error is None and f.stats["records_put"] == len(records), (f.error, f.stats)

        def fetch_store(key):
            return fetch(RecordLocation(str(directory), WRITER, key, store=address), timeout=30, durable=False)

        def fetch_node(key):  # through the store node on this host (node=: shared memory)
            return fetch(
                RecordLocation(str(directory), WRITER, key, store=address),
                timeout=30,
                durable=False,
                store=store.node_address(f"bench/{codec}"),
            )

        fetch_store(keys[0])
        fetch_node(keys[0])
        pid = store.node.pid
        # in turns, so that both see the same load
        for _ in range(2):
            tcp = timed(fetch_store, max(1, repeats // 2), keys, pid)
            node = timed(fetch_node, max(1, repeats // 2), keys, pid)
            for name, got in (("fetch_store", tcp), ("fetch_node", node)):
                for unit, value in zip(("s", "cpu_s", "node_cpu_s"), got):
                    row.setdefault(f"{name}_{unit}_turns", []).append(value)
        for name in ("fetch_store", "fetch_node"):
            for unit in ("s", "cpu_s", "node_cpu_s"):
                row[f"{name}_{unit}"] = statistics.mean(row[f"{name}_{unit}_turns"])
    for name in ("fetch_live", "follow_live", "fetch_store", "fetch_node", "follow_live_python"):
        if f"{name}_s" in row:
            row[f"{name}_ratio"] = row[f"{name}_s"] / row["open_s"]
        if f"{name}_cpu_s" in row:
            row[f"{name}_cpu_ratio"] = row[f"{name}_cpu_s"] / row["open_cpu_s"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="results path without suffix")
    p.add_argument("--records", type=int, default=3, help="records of each codec")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-store", action="store_true", help="skip Mooncake Store")
    p.add_argument("--codecs", default=",".join(CODECS), help="codecs to measure, comma-separated (default: all)")
    p.add_argument(
        "--reference", action="store_true", help="also follow once with backend='python' (the reference decoder)"
    )
    p.add_argument("--scratch", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args(argv)

    import torch

    load_start = round(os.getloadavg()[0], 2)
    acts = load_activations("bf16")
    records = []
    for i in range(args.records):
        start = (i * TOKENS) % max(1, acts.shape[0] - TOKENS)
        hs = acts[start : start + TOKENS].contiguous()
        ids = torch.arange(start, start + hs.shape[0], dtype=torch.int64)
        records.append((f"r{i}", {"hidden_states": hs, "token_ids": ids}))

    rows = []
    with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
        scratch = Path(tmp)
        store = None
        if not args.no_store:
            from store_support import LoopbackStore

            store = LoopbackStore(str(scratch), segment="512MB")
        try:
            for codec in args.codecs.split(","):
                rows.append(measure(codec, records, scratch / "data", store, args.repeats, args.reference))
                print(json.dumps(rows[-1]), flush=True)
        finally:
            if store is not None:
                store.stop()

    shape = list(records[0][1]["hidden_states"].shape)
    machine = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "record": f"hidden_states bf16 {shape} + token_ids, all-MiniLM-L6-v2 activations",
        "records": args.records,
        "repeats": args.repeats,
        "note": "machine shared with other processes; one run",
        "load_average_1min": {"start": load_start, "end": round(os.getloadavg()[0], 2)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))

    def ms(r, name):
        return f"{r[name] * 1e3:.1f}" if name in r else "-"

    def ratio(r, name):
        return f"{r[name]:.2f}x" if name in r else "-"

    lines = [
        "| codec | raw MB | stored MB | open ms | fetch live ms (ratio) | follow live ms (ratio) "
        "| fetch store ms (ratio) | fetch node ms (ratio) | follow live, backend python, ms (ratio) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['codec']} | {r['raw_bytes'] / 1e6:.1f} | {r['stored_bytes'] / 1e6:.1f} | {ms(r, 'open_s')} "
            f"| {ms(r, 'fetch_live_s')} ({ratio(r, 'fetch_live_ratio')}) "
            f"| {ms(r, 'follow_live_s')} ({ratio(r, 'follow_live_ratio')}) "
            f"| {ms(r, 'fetch_store_s')} ({ratio(r, 'fetch_store_ratio')}) "
            f"| {ms(r, 'fetch_node_s')} ({ratio(r, 'fetch_node_ratio')}) "
            f"| {ms(r, 'follow_live_python_s')} ({ratio(r, 'follow_live_python_ratio')}) |"
        )
    cpu = [
        "| codec | open CPU ms | fetch live CPU ms (ratio) | fetch store CPU ms (ratio) | fetch node CPU ms (ratio) "
        "| store node's CPU ms a fetch: store, node |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cpu.append(
            f"| {r['codec']} | {ms(r, 'open_cpu_s')} | {ms(r, 'fetch_live_cpu_s')} ({ratio(r, 'fetch_live_cpu_ratio')}) "
            f"| {ms(r, 'fetch_store_cpu_s')} ({ratio(r, 'fetch_store_cpu_ratio')}) "
            f"| {ms(r, 'fetch_node_cpu_s')} ({ratio(r, 'fetch_node_cpu_ratio')}) "
            f"| {ms(r, 'fetch_store_node_cpu_s')}, {ms(r, 'fetch_node_node_cpu_s')} |"
        )
    note = (
        "Per record, median; ratio: against `open` (layertap.open of the closed shard, then ds[key]) "
        "of the same record. Target (issue 33): within 2x for every codec. `fetch store` (the reader's own "
        "Mooncake client, loopback TCP) and `fetch node` (`node=`: through the store node on this host, shared "
        "memory) ran in turns, two of each: the mean of the two turns' medians.\n\n"
    )
    cpu_note = (
        "\nCPU time of this process (all its threads: Mooncake's transfer threads and its waiting caller "
        "among them; the store node's and the master's not), median per record; the store node's: its "
        "threads' CPU over the calls, per call (the mean):\n\n"
    )
    md = (
        f"# fetch against layertap.open, {machine['date']}\n\n{json.dumps(machine)}\n\n{note}"
        + "\n".join(lines)
        + "\n"
        + cpu_note
        + "\n".join(cpu)
        + "\n"
    )
    args.out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
