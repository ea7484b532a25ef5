"""What counting for vLLM's metrics costs on the engine thread (``layertap.vllm.stats``).

    python benches/bench_counters.py [--records 64] [--out benches/results/counters-cpu2.md]

Times each call the connector makes on the engine thread for the metrics, in a loop, with the
real writers' ``stats`` and a real host pool: per step (``step``, ``report``, the scheduler's
``writing``) and per step and its records (``submitted``, ``written``) and per request (``accepted``). No vLLM engine: these are
the calls alone, so that they can be compared with the engine-cost budget (issue 12: <= 5 us per
request in all, <= 1 ms per step at p99).
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from types import SimpleNamespace

from layertap import ShardWriter
from layertap.vllm.pool import HostPool
from layertap.vllm.stats import SchedulerStats, WorkerStats


def per_call(fn, calls: int) -> float:
    """Median over 5 rounds of the seconds per call of ``fn`` (called ``calls`` times a round)."""
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls)
    return sorted(rounds)[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=64, help="records per step (batch)")
    ap.add_argument("--out", help="write the table as Markdown here")
    args = ap.parse_args()
    n = args.records
    stats = WorkerStats("w")
    pool = HostPool(1 << 20, pin=False)
    # A step's saves as the worker has them (``StepSaves``: what counting reads of it).
    saves = SimpleNamespace(num_tokens=[100] * n, finished_at=time.time())

    def submitted_then_written():
        stats.submitted(saves)
        stats.written(n // 2)  # as a step's records come back, in two polls
        stats.written(n - n // 2)

    rows = [("worker: `step` (once per step)", per_call(lambda: stats.step(1e-4), 100_000) * 1e6, "per step")]
    rows.append(
        (
            f"worker: `submitted` + `written`, {n} records",
            per_call(submitted_then_written, 2000) / n * 1e6,
            "per record",
        )
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name, cls in (("Rust", ShardWriter),):
            writer = cls(f"{tmp}/{name}", writer_id=name)

            def report(writer=writer):
                stats._last_report = -1.0  # as if the interval had passed
                stats.records_written += 1  # and there were news
                stats.report(pool, writer)

            rows.append((f"worker: `report` ({name} writer's stats)", per_call(report, 5000) * 1e6, "per report"))
            writer.close()
    scheduler = SchedulerStats()
    rows.append(("scheduler: `accepted`", per_call(scheduler.accepted, 100_000) * 1e6, "per request"))
    rows.append(
        ("scheduler: `writing` (has_pending_push_work)", per_call(scheduler.writing, 100_000) * 1e6, "per call")
    )
    report = {"counters": {"records_written": 3}}
    rows.append(
        ("scheduler: `worker_report`", per_call(lambda: scheduler.worker_report(report), 100_000) * 1e6, "per step")
    )

    lines = [
        f"# Engine-thread cost of the metrics' counting, {time.strftime('%Y-%m-%d')}",
        "",
        f"`python benches/bench_counters.py --records {n}` on {platform.node()} "
        f"({platform.processor() or platform.machine()}, Python {platform.python_version()}); "
        "median of 5 rounds, the calls alone (no engine).",
        "",
        "| call | us | |",
        "|---|---:|---|",
        *(f"| {what} | {us:.3f} | {unit} |" for what, us, unit in rows),
        "",
        f"A report is built at most every {0.25} s (and when the writer catches up).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
