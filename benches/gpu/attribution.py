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
    ("step, rest", ("step",)),
    ("loop, rest (output queue, post-step, sleeps)", ("other",)),
)
META = ("t", "wall", "tokens", "reqs", "draft", "finished", "running", "waiting")


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
    return json.loads(path.read_text())


def engine_steps(clock: dict, t_start: float, t_end: float) -> dict:
    """The iterations that began inside ``[t_start, t_end)`` (``time.time()``): seconds per
    phase group and per connector hook, and what was scheduled."""
    steps = [s for s in clock["steps"] if t_start <= s["t"] < t_end]
    out: dict = {"iterations": len(steps)}
    if not steps:
        return out
    forward = [s for s in steps if s.get("tokens", 0) > 0]
    groups: dict[str, float] = {}
    hooks: dict[str, float] = {}
    for s in steps:
        for k, v in s.items():
            if k in META:
                continue
            g = _group(k)
            groups[g] = groups.get(g, 0.0) + v / 1e6
            if k.startswith("conn_"):
                hooks[k] = hooks.get(k, 0.0) + v / 1e6
    wall = sum(s["wall"] for s in steps) / 1e6
    out.update(
        wall_s=round(wall, 4),
        steps_with_tokens=len(forward),
        iterations_without_tokens=len(steps) - len(forward),
        seconds_without_tokens=round(sum(s["wall"] for s in steps if s.get("tokens", 0) == 0) / 1e6, 4),
        phases_s={label: round(groups.get(label, 0.0), 4) for label, _ in PHASE_GROUPS},
        connector_hooks_s=dict(sorted(((k, round(v, 5)) for k, v in hooks.items()), key=lambda kv: -kv[1])),
        step_wall_us={"p50": _pct([s["wall"] for s in forward], 50), "p99": _pct([s["wall"] for s in forward], 99)},
        tokens_per_step={
            "mean": round(sum(s["tokens"] for s in forward) / max(1, len(forward)), 1),
            "p50": _pct([s["tokens"] for s in forward], 50),
        },
        reqs_per_step_mean=round(sum(s.get("reqs", 0) for s in forward) / max(1, len(forward)), 1),
        draft_tokens=sum(s.get("draft", 0) for s in steps),
        scheduled_tokens=sum(s.get("tokens", 0) for s in steps),
    )
    conn = [
        sum(v for k, v in s.items() if k.startswith("conn_worker."))
        + sum(v for k, v in s.items() if k.startswith("conn_sched."))
        for s in forward
    ]
    out["connector_us_per_step"] = {"p50": round(_pct(conn, 50), 1), "p99": round(_pct(conn, 99), 1)}
    return out


def profile_top(path: Path, n: int = 12) -> dict:
    """Per sampled thread of a py-spy speedscope file: samples, and the frames that were on
    top of the stack most often (self share) and on the stack at all (total share)."""
    data = json.loads(path.read_text())
    frames = data["shared"]["frames"]

    def label(i: int) -> str:
        f = frames[i]
        where = Path(f.get("file") or "?").name
        return f"{f['name']} ({where}:{f.get('line', '?')})"

    out = {}
    for prof in data.get("profiles", []):
        samples = prof.get("samples", [])
        weights = prof.get("weights") or [1] * len(samples)
        total = sum(weights)
        if not total:
            continue
        top: dict[int, float] = {}
        incl: dict[int, float] = {}
        for stack, w in zip(samples, weights):
            if stack:
                top[stack[-1]] = top.get(stack[-1], 0) + w
            for i in set(stack):
                incl[i] = incl.get(i, 0) + w
        out[prof.get("name", "?")] = {
            "samples": total,
            "self": [(label(i), round(w / total, 3)) for i, w in sorted(top.items(), key=lambda kv: -kv[1])[:n]],
            "total": [(label(i), round(w / total, 3)) for i, w in sorted(incl.items(), key=lambda kv: -kv[1])[:n]],
        }
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["samples"]))
