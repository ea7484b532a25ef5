"""Turns the results of benches/gpu/run.sh (one JSON per case and mode, and disk.json) into the
markdown tables of benches/RESULTS.md.

    python benches/gpu/report.py RESULTS_DIR [--title TEXT] > table.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_extract import MODES

CASES = {
    "1b": "Llama-3.2-1B arch, layers 2,8,13, 3000 x 256",
    "short": "Llama-3.2-1B arch, layers 2,8,13, 20000 short prompts (16 to 128 tokens)",
    "decode": "Llama-3.2-1B arch, layers 2,8,13, decode: 2000 x (128 prompt + 128 generated), output tokens recorded",
    "8b": "Llama-3.1-8B arch, layers 2,16,29,32, 1500 x 1024",
    "qwen7b": "Qwen2.5-7B arch, layers 2,14,25,28, 400 x 2048",
    "smoke": "smoke test: 64 prompts",
}


def step_times(r: dict) -> tuple[float | None, float | None]:
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


def case_table(case: str, rows: dict[str, dict]) -> str:
    base = rows.get("none")
    noop = rows.get("noop")
    noop_inmodel = rows.get("noop-inmodel")
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path)
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    by_case: dict[str, dict[str, dict]] = {}
    for f in sorted(args.results.glob("*.json")):
        if f.name == "disk.json":
            continue
        r = json.loads(f.read_text())
        if "mode" not in r or "tok_s_generate" not in r:
            continue  # not a bench_extract result (a connector's stats file)
        case = r.get("case") or {"llama-3.2-1b-arch": "1b", "llama-3.1-8b-arch": "8b"}.get(r["model"], r["model"])
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
