"""Where a timed window's time went (issue 20): the engine loop's steps from the clock plugin
(``clock/layertap_bench_clock.py``), summed per phase, and the sampling profile's busiest frames.

    summary = engine_steps(clock_json, t_start, t_end)
    top = profile_top(speedscope_json)
"""

from __future__ import annotations

import json
from pathlib import Path

#: The phases of an engine-loop iteration as the report names them (clock phase -> row).
PHASE_GROUPS = (
    ("input wait", ("process_input_queue",)),
    ("schedule", ("schedule",)),
    ("connector, scheduler side", ("conn_sched.",)),
    ("model: execute_model (prepare, launch; forward when synchronous)", ("execute_model",)),
    ("model: sample_tokens", ("sample_tokens",)),
    ("model: wait for the GPU's output", ("wait_gpu_output",)),
    ("connector, worker side", ("conn_worker.",)),
    ("update_from_output", ("update_from_output",)),
    ("garbage collection", ("gc0", "gc1", "gc2")),
    ("step, rest", ("step",)),
    ("loop, rest (output queue, post-step, sleeps)", ("other",)),
)
META = ("t", "wall", "tokens", "reqs", "draft", "finished", "running", "waiting", "probe_us", "cpu")


def _group(phase: str) -> str:
    for label, prefixes in PHASE_GROUPS:
        for p in prefixes:
            if phase == p or (p.endswith(".") and phase.startswith(p)):
                return label
    return phase


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * len(values)) - 1))]


def load_clock(path: Path) -> dict:
    """A clock file (``<mode>.clock.<pid>.json``, or gzipped as committed)."""
    if path.suffix == ".gz":
        import gzip

        return json.loads(gzip.decompress(path.read_bytes()))
    return json.loads(path.read_text())


def _in_window(s: dict, t_start: float, t_end: float) -> dict[str, float]:
    """The seconds of one iteration's phases that fall inside ``[t_start, t_end)``.

    An iteration runs its input wait first (``process_input_queue``), then the step; it starts
    at ``t`` and lasts ``wall``. The iteration that spans the window's start (the engine idle
    until the first request, then the first step) and the one that spans its end (the last
    step, then idle until the next batch) count only their part inside: the input wait by its
    overlap, the step's phases scaled by the step part's overlap."""
    t0 = s["t"]
    wait = s.get("process_input_queue", 0.0) / 1e6
    wall = s["wall"] / 1e6

    def overlap(a: float, b: float) -> float:
        return max(0.0, min(b, t_end) - max(a, t_start))

    wait_in = overlap(t0, t0 + wait)
    rest = wall - wait
    frac = overlap(t0 + wait, t0 + wall) / rest if rest > 0 else 0.0
    out = {}
    for k, v in s.items():
        if k in META:
            continue
        out[k] = wait_in if k == "process_input_queue" else v / 1e6 * frac
    out["_inside"] = wait_in + rest * frac
    out["_step_frac"] = frac
    return out


def engine_steps(clock: dict, t_start: float, t_end: float) -> dict:
    """The iterations inside ``[t_start, t_end)`` (``time.time()``, clipped at both ends):
    seconds per phase group and per connector hook, and what was scheduled."""
    clipped = []
    for s in clock["steps"]:
        if s["t"] + s["wall"] / 1e6 <= t_start or s["t"] >= t_end:
            continue
        clipped.append((s, _in_window(s, t_start, t_end)))
    out: dict = {"iterations": len(clipped)}
    if not clipped:
        return out
    steps = [s for s, c in clipped if c["_step_frac"] > 0.5]  # whose step ran inside the window
    forward = [s for s in steps if s.get("tokens", 0) > 0]
    groups: dict[str, float] = {}
    hooks: dict[str, float] = {}
    for _, c in clipped:
        for k, v in c.items():
            if k.startswith("_"):
                continue
            g = _group(k)
            groups[g] = groups.get(g, 0.0) + v
            if k.startswith("conn_"):
                hooks[k] = hooks.get(k, 0.0) + v
    inside = sum(c["_inside"] for _, c in clipped)
    out.update(
        wall_s=round(inside, 4),
        steps_with_tokens=len(forward),
        iterations_without_tokens=len(steps) - len(forward),
        seconds_without_tokens=round(sum(s["wall"] for s in steps if s.get("tokens", 0) == 0) / 1e6, 4),
        phases_s={label: round(groups.get(label, 0.0), 4) for label, _ in PHASE_GROUPS},
        connector_hooks_s=dict(sorted(((k, round(v, 5)) for k, v in hooks.items()), key=lambda kv: -kv[1])),
        step_wall_us={
            "p10": _pct([s["wall"] for s in forward], 10),
            "p50": _pct([s["wall"] for s in forward], 50),
            "p90": _pct([s["wall"] for s in forward], 90),
            "p99": _pct([s["wall"] for s in forward], 99),
        },
        tokens_per_step={
            "mean": round(sum(s["tokens"] for s in forward) / max(1, len(forward)), 1),
            "p50": _pct([s["tokens"] for s in forward], 50),
        },
        reqs_per_step_mean=round(sum(s.get("reqs", 0) for s in forward) / max(1, len(forward)), 1),
        draft_tokens=sum(s.get("draft", 0) for s in steps),
        scheduled_tokens=sum(s.get("tokens", 0) for s in steps),
    )
    conn = [sum(v for k, v in s.items() if k.startswith(("conn_worker.", "conn_sched."))) for s in forward]
    out["connector_us_per_step"] = {"p50": round(_pct(conn, 50), 1), "p99": round(_pct(conn, 99), 1)}
    for key in ("probe_us", "cpu"):  # the clock's speed probe and the engine thread's CPU, where recorded
        vals = [s[key] for s in forward if key in s]
        if vals and key == "probe_us":
            out["probe_us"] = {"p10": _pct(vals, 10), "p50": _pct(vals, 50), "p90": _pct(vals, 90)}
        elif vals:
            out["engine_cpus"] = dict(sorted(((str(c), vals.count(c)) for c in set(vals)), key=lambda kv: -kv[1]))
    return out


#: Frames of the harness and the interpreter's plumbing, left out of the function totals.
_PLUMBING = ("layertap_bench_clock.py", "threading.py", "process.py", "spawn.py", "<string>")


def profile_top(path: Path, n: int = 15, inside: tuple[str, ...] = ("WorkerSide.get_finished",)) -> dict:
    """Per sampled thread of a py-spy speedscope file (the busiest first): seconds sampled,
    the functions most often on top of the stack (self) and on it at all (total), by function
    (all its lines together), and for each function named in ``inside``, what the samples
    under it were in (its callees' totals)."""
    data = json.loads(path.read_text())
    frames = data["shared"]["frames"]

    def fn(i: int) -> str:
        f = frames[i]
        return f"{f['name']} ({Path(f.get('file') or '?').name})"

    keep = [not any(p in (frames[i].get("file") or "") for p in _PLUMBING) for i in range(len(frames))]
    out = {}
    for prof in data.get("profiles", []):
        samples = prof.get("samples", [])
        weights = prof.get("weights") or [1] * len(samples)
        total = sum(weights)
        if not total:
            continue
        top: dict[str, float] = {}
        incl: dict[str, float] = {}
        under: dict[str, dict[str, float]] = {name: {} for name in inside}
        for stack, w in zip(samples, weights):
            if not stack:
                continue
            top[fn(stack[-1])] = top.get(fn(stack[-1]), 0) + w
            for name in {fn(i) for i in stack if keep[i]}:
                incl[name] = incl.get(name, 0) + w
            names = [frames[i]["name"] for i in stack]
            for target in inside:
                if target in names:
                    below = {fn(i) for i in stack[names.index(target) + 1 :] if keep[i]} or {"(itself)"}
                    for name in below:
                        under[target][name] = under[target].get(name, 0) + w

        def ranked(d: dict[str, float]) -> list:
            return [(k, round(v, 3)) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]]

        out[prof.get("name", "?")] = {
            "seconds": round(total, 3),
            "self": ranked(top),
            "total": ranked(incl),
            "inside": {k: ranked(v) for k, v in under.items() if v},
        }
    return dict(sorted(out.items(), key=lambda kv: (0 if "MainThread" in kv[0] else 1, -kv[1]["seconds"])))


def main(argv: list[str] | None = None) -> int:
    """Recomputes the attribution of committed results (after a change to this module): the
    ``engine`` and ``profile_top`` members of every ``<case>-<mode>.json`` under RESULTS, from
    the clock and speedscope files beside them."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("results", type=Path)
    args = ap.parse_args(argv)
    for f in sorted(args.results.glob("*.json")):
        if f.name.endswith(".speedscope.json") or ".clock." in f.name or f.name == "disk.json":
            continue
        r = json.loads(f.read_text())
        if "window" not in r:
            continue
        label = r["mode"] + (f"-{r['tag']}" if r.get("tag") else "")
        clocks = [load_clock(p) for p in sorted(args.results.glob(f"{label}.clock.*.json*"))]
        clock = next((c for c in clocks if c["steps"]), None)
        if clock is not None:
            r["engine"] = engine_steps(clock, *r["window"])
        prof = args.results / f"{r['case']}-{label}.speedscope.json"
        if prof.exists():
            r["profile_top"] = profile_top(prof)
        f.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
