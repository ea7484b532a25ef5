"""Turns the results of benches/gpu/run.sh (one JSON per case and mode, and disk.json) into the
markdown tables of benches/RESULTS.md: per case, the throughput table, and (for results with
the engine clock and thread counters, issue 20) where the time went: the engine loop's phases,
the threads' CPU and run-queue wait, and each phase's difference to no extraction.

    python benches/gpu/report.py RESULTS_DIR [--title TEXT] > table.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attribution import PHASE_GROUPS
from bench_extract import CASES as CASE_SPECS
from bench_extract import MODES

CASES = {name: c.about for name, c in CASE_SPECS.items()}
#: Short names of the engine-loop phases (attribution.PHASE_GROUPS), in its order.
PHASE_SHORT = (
    "input",
    "sched",
    "conn-S",
    "execute",
    "sample",
    "wait GPU",
    "conn-W",
    "update",
    "gc",
    "step rest",
    "loop rest",
)


def step_times(r: dict) -> tuple[float | None, float | None]:
    """The connector's time on the engine thread per step: from the engine clock over the
    window where there is one (both sides' hooks), else the connector's own (its lifetime)."""
    per_step = r.get("engine", {}).get("connector_us_per_step")
    if per_step and r.get("mode") not in ("none",):
        return per_step["p50"], per_step["p99"]
    if "connector_stats" in r:
        hook = r["connector_stats"]["hook"]
        return hook["p50_us"], hook["p99_us"]
    return r.get("p50_us"), r.get("p99_us")


def where_time_goes(r: dict) -> str:
    """The engine's waits for pool space (and the steps that left requests in the KV cache for
    lack of it instead), and the writer's compression time (for the whole engine lifetime,
    warm-up included)."""
    cs = r.get("connector_stats")
    if not cs:
        return "- | -"
    w = cs.get("writer", {})
    enc = f"{w['encode_seconds']:.2f} / {w['threads']}" if "encode_seconds" in w else "-"
    deferrals = f" ({cs['pool_deferrals']} deferred)" if cs.get("pool_deferrals") else ""
    return f"{cs.get('pool_stall_seconds', 0):.2f}{deferrals} | {enc}"


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def baseline(rows: dict[str, dict], mode: str = "none") -> dict | None:
    """The row the others are divided by: the untagged run of ``mode``, else its first round."""
    if mode in rows:
        return rows[mode]
    return next((r for _, r in sorted(rows.items()) if r["mode"] == mode), None)


def case_table(case: str, rows: dict[str, dict]) -> str:
    base = baseline(rows)
    noop = baseline(rows, "noop")
    noop_inmodel = baseline(rows, "noop-inmodel")
    up = rows.get("upstream")
    out = [
        f"### {CASES.get(case, case)}",
        "",
        "| mode | tok/s generate | tok/s readable | tok/s durable | vs none (gen / read / durable) | vs noop (gen) | "
        "vs noop-inmodel (gen) | GB on disk | vs upstream bytes | engine-thread us/step p50 / p99 | pool stalls s | "
        "compression thread-s / threads |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---|---:|---|",
    ]
    for label, r in sorted(rows.items(), key=lambda kv: (MODES.index(kv[1]["mode"]), kv[0])):
        mode = r["mode"]
        ratios = "-"
        if base:
            b = base["tok_s_generate"]
            ratios = " / ".join(f"{r[k] / b:.2f}" for k in ("tok_s_generate", "tok_s_readable", "tok_s_durable"))
        vs_noop = f"{r['tok_s_generate'] / noop['tok_s_generate']:.2f}" if noop else "-"
        vs_noop_inmodel = f"{r['tok_s_generate'] / noop_inmodel['tok_s_generate']:.2f}" if noop_inmodel else "-"
        vs_up = (
            f"{r['bytes_on_disk'] / up['bytes_on_disk']:.2f}" if up and up["bytes_on_disk"] and mode != "none" else "-"
        )
        p50, p99 = step_times(r)
        out.append(
            f"| {label} | {r['tok_s_generate']:,.0f} | {r['tok_s_readable']:,.0f} | {r['tok_s_durable']:,.0f} | {ratios} | {vs_noop} | {vs_noop_inmodel} | "
            f"{r['bytes_on_disk'] / 1e9:.2f} | {vs_up} | {fmt(p50, '.0f')} / {fmt(p99, '.0f')} | {where_time_goes(r)} |"
        )
    return "\n".join(out) + "\n"


def _group(r: dict, name: str) -> dict:
    return r.get("thread_groups", {}).get(name, {})


def attribution_tables(case: str, rows: dict[str, dict]) -> str:
    """Where each mode's time went in the generate window: engine-loop phases (ms), what was
    scheduled, the threads' CPU and run-queue wait; then each mode's gap to ``none`` split
    into the phases' differences."""
    rows = {k: r for k, r in rows.items() if r.get("engine", {}).get("iterations")}
    if not rows:
        return ""
    order = sorted(rows.items(), key=lambda kv: (MODES.index(kv[1]["mode"]), kv[0]))
    base = baseline(rows)
    head = " | ".join(PHASE_SHORT)
    out = [
        f"#### Where the time went: {case} (generate window; ms on the engine thread)",
        "",
        f"| mode | t gen ms | steps | tokens/step | draft tok | {head} | engine loop CPU s / run-queue wait s | "
        "compression CPU s / wait s (threads) | I/O + fsync CPU s | front end CPU s | busy cores | "
        "page faults: engine loop / compression | TLB shootdowns | speed probe us p50 |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(PHASE_SHORT) + "---|---|---:|---:|---:|---|---:|---:|",
    ]
    for label, r in order:
        e = r["engine"]
        ph = [e["phases_s"].get(g, 0.0) * 1e3 for g, _ in PHASE_GROUPS]
        loop, comp = _group(r, "engine loop"), _group(r, "compression")
        io = _group(r, "writer I/O").get("cpu_s", 0) + _group(r, "writer fsync").get("cpu_s", 0)
        front = sum(g.get("cpu_s", 0) for n, g in r.get("thread_groups", {}).items() if n.startswith("front end"))
        comp_s = f"{comp.get('cpu_s', 0):.1f} / {comp.get('wait_s', 0):.2f} ({comp.get('threads', 0)})" if comp else "-"
        out.append(
            f"| {label} | {r['t_generate'] * 1e3:,.0f} | {e['steps_with_tokens']} | {e['tokens_per_step']['mean']:,.0f} | "
            f"{e['draft_tokens']:,} | " + " | ".join(f"{x:,.0f}" for x in ph) + " | "
            f"{loop.get('cpu_s', 0):.2f} / {loop.get('wait_s', 0):.3f} | {comp_s} | {io:.2f} | {front:.2f} | "
            f"{r.get('machine', {}).get('busy_cores', 0):.1f} | "
            f"{fmt(loop.get('minflt'), ',')} / {fmt(comp.get('minflt'), ',')} | "
            f"{fmt(r.get('machine', {}).get('interrupts', {}).get('TLB'), ',')} | "
            f"{fmt(e.get('probe_us', {}).get('p50'), '.1f')} |"
        )
    if base:
        b = [base["engine"]["phases_s"].get(g, 0.0) * 1e3 for g, _ in PHASE_GROUPS]
        out += [
            "",
            "Gap to `none` (ms of the generate window), and the phases' differences:",
            "",
            f"| mode | gap ms | {head} |",
            "|---|---:|" + "---:|" * len(PHASE_SHORT),
        ]
        for label, r in order:
            if r is base:
                continue
            ph = [r["engine"]["phases_s"].get(g, 0.0) * 1e3 for g, _ in PHASE_GROUPS]
            gap = (r["t_generate"] - base["t_generate"]) * 1e3
            out.append(f"| {label} | {gap:+,.0f} | " + " | ".join(f"{x - y:+,.0f}" for x, y in zip(ph, b)) + " |")
    hooks = [(label, r["engine"].get("connector_hooks_s", {})) for label, r in order]
    hooks = [(label, h) for label, h in hooks if any(v > 0.0005 for v in h.values())]
    if hooks:
        out += ["", "Connector hooks over the window (ms; the largest):", ""]
        for label, h in hooks:
            top = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in list(h.items())[:6])
            out.append(f"- {label}: {top}")
    parts = [(label, r.get("connector_stats", {}).get("hook_parts_s")) for label, r in order]
    parts = [(label, p) for label, p in parts if p]
    if parts:
        out += ["", "The worker hook's parts over the engine's life (every case of the run; s):", ""]
        for label, p in parts:
            out.append(f"- {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in p.items()))
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path)
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    by_case: dict[str, dict[str, dict]] = {}
    for f in sorted(args.results.glob("*.json")):
        if f.name == "disk.json" or f.name.endswith(".speedscope.json") or ".clock." in f.name:
            continue
        r = json.loads(f.read_text())
        if "mode" not in r or "tok_s_generate" not in r:
            continue  # not a bench_extract result (a connector's stats file)
        case = r.get("case")
        if not case:  # results from before the cases had names
            case = {"llama-3.2-1b-arch": "1b", "llama-3.1-8b-arch": "8b"}.get(r["model"], r["model"])
            if r["prompts"] < 100:
                case = "smoke"
        label = r["mode"] + (f" ({r['tag']})" if r.get("tag") else "")
        by_case.setdefault(case, {})[label] = r
    print(f"## {args.title}\n" if args.title else "", end="")
    disk = args.results / "disk.json"
    if disk.exists():
        d = json.loads(disk.read_text())
        print(
            f"Disk (dd, {d['gib']} GiB): buffered + fsync {d['dd_buffered_fsync_gbps']} GB/s, "
            f"O_DIRECT {d['dd_odirect_gbps']} GB/s.\n"
        )
    for case, rows in by_case.items():
        print(case_table(case, rows))
        tables = attribution_tables(case, rows)
        if tables:
            print(tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
