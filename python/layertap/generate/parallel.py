"""``layertap generate`` on many engines: ``--data-parallel-size N`` (N engine processes on this
machine) and ``--ray ADDRESS`` (N engines on a Ray cluster), writing one dataset of parts
(docs/GENERATE.md, "Many engines"; docs/SCALE.md).

``--out`` becomes a dataset of parts: engine ``i`` writes into ``--out/engine-{i}`` as a single
run writes into its directory, and ``--out/layertap-dataset.json`` lists the parts. The run that
starts the engines locks ``--out``, writes the manifest (the earlier parts, ``.`` when ``--out``
holds a single run's shards, and one per engine) before any engine starts, completes every part
as a single run would and reads which rows have a record in any part, deals the rows not done to
the engines in turn (row ``todo[k]`` to engine ``k mod N``: no row to two engines, none that
another part holds), then sums their reports into one progress and merges their summaries.

Why N processes rather than vLLM's ``data_parallel_size``: vLLM's ``LLM`` refuses it in one
process (its offline data parallelism is one process per rank, started by the caller), and its
ranks step in lockstep, which only MoE models with expert parallelism need; independent engines
lose nothing for a dense model and one engine's failure does not stop the others.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Generator
from dataclasses import dataclass, field

import numpy as np

from layertap.generate import vllm_log
from layertap.generate.errors import GenerateError
from layertap.generate.local import device_slices, local_events
from layertap.generate.options import GenerateOptions
from layertap.generate.progress import EngineTotals, Progress
from layertap.generate.ray_engines import connect, default_engines, disconnect, ray_events
from layertap.generate.repair import damaged_entries
from layertap.generate.resume import SOURCE, OutputState, lock_directory, make_output_directory, prepare_output
from layertap.generate.run import Checked, assigned_mask, check_options, run_one
from layertap.generate.same_data import check_same_data
from layertap.generate.summary import EngineEntry, Summary, is_complete
from layertap.parts import MANIFEST_NAME, read_manifest, write_manifest

#: Engine ``i`` writes into ``--out/engine-{i}``.
PART_PREFIX = "engine-"

#: An engine's message to the run: ``("report", i, totals)``, ``("summary", i, summary)`` or
#: ``("error", i, (kind, text))`` (``run.run_engine``).
Event = tuple[str, int, object]


def wants_parallel(options: GenerateOptions) -> bool:
    """Several engines, Ray, or an ``out`` that is already a dataset of parts (resumed as a whole)."""
    o = options
    return (
        (o.data_parallel_size or 1) > 1
        or o.ray_address is not None
        or os.path.isfile(os.path.join(o.out, MANIFEST_NAME))
    )


@dataclass
class PartsState(OutputState):
    """``--out`` as a dataset of parts, locked for this run: ``done`` is a bool per row (a record of
    it is in some part), ``run`` the first run number no part has used (engine ``i`` writes as
    ``gen-{run + i}``: Mooncake Store lists records by writer id, whatever part they are in)."""

    parts: list[str] = field(default_factory=list)


def prepare_parts(c: Checked, engines: int) -> PartsState:
    """Locks ``--out``, writes its manifest, completes every part and reads which rows are done."""
    out = c.out_dir
    make_output_directory(out)
    state = PartsState(out, 0, np.zeros(c.rows.num_rows, dtype=bool), _lock_fd=lock_directory(out))
    try:
        manifest = os.path.join(out, MANIFEST_NAME)
        if os.path.exists(manifest):
            try:
                parts = read_manifest(manifest)
            except Exception as e:  # FormatError, FileNotFoundError
                raise GenerateError(f"{manifest}: {e}") from None
            for p in parts:
                if not os.path.isdir(p):
                    raise GenerateError(
                        f"{p}, a part listed in {manifest}, is missing: its rows would be written again; "
                        "bring it back, or remove it from the manifest to write them again"
                    )
        else:
            # A single run's dataset becomes part ".".
            parts = [out] if any(n.endswith((".lts", ".lts.torn")) for n in os.listdir(out)) else []
        for i in range(engines):
            p = os.path.join(out, f"{PART_PREFIX}{i}")
            if p not in parts:
                parts.append(p)
            # Before the manifest lists it: a part "." (a single run's shards) is read through
            # the manifest, which names every part, and a missing one stopped the run.
            make_output_directory(p)
        write_manifest(out, parts, source=SOURCE)
        state.parts = parts
        n = c.rows.num_rows
        for p in parts:
            part = prepare_output(p, c.options.model, c.layer_ids, lock=p != out)
            part.release()
            check_same_data(p, part.done, c.rows, c.renderer, os.path.abspath(c.options.data))
            rows = part.done[part.done < n]
            state.duplicates += part.duplicates + int(state.done[rows].sum())
            state.done[rows] = True
            state.recovered += part.recovered
            state.set_aside += part.set_aside
            state.damaged += part.damaged
            state.run = max(state.run, part.run)
    except BaseException:
        state.release()
        raise
    return state


def _in_this_process(c: Checked, part: str, rows: np.ndarray, run: int) -> dict[int, tuple[str, object]]:
    """A run of one engine over a dataset of parts: in this process, as a single run."""
    checked = dataclasses.replace(c, out_dir=part, options=c.options.replace(out=part))
    return {0: ("summary", run_one(checked, assigned_mask(rows, c.rows.num_rows), first_run=run))}


def generate_parallel(options: GenerateOptions) -> Summary:
    """A run of ``data_parallel_size`` engines (here or on Ray) writing parts of ``out``."""
    t0 = time.monotonic()
    engines, ray_address = options.data_parallel_size, options.ray_address
    # The engines started here share this machine's memory (a CPU engine's KV cache by default).
    c = check_options(options, engines_here=1 if ray_address is not None else engines or 1)
    if ray_address is not None:
        connect(ray_address)
        try:
            return _generate(c, engines or default_engines(c.engine_args), ray_address, t0)
        finally:
            disconnect()
    return _generate(c, engines or 1, None, t0)


def _generate(c: Checked, engines: int, ray_address: str | None, t0: float) -> Summary:
    local = None
    if ray_address is None and engines > 1:
        local = device_slices(engines, c.engine_args)  # checked before anything is written
    state = prepare_parts(c, engines)
    try:
        vllm_log.start(c.out_dir)  # this process's; each engine logs into its part
        todo = np.flatnonzero(~state.done)
        jobs = [
            (i, os.path.join(c.out_dir, f"{PART_PREFIX}{i}"), todo[i::engines]) for i in range(min(engines, len(todo)))
        ]
        t_load = time.monotonic()
        # Each engine writes into its part as run state.run + i, drawing nothing.
        specs = [(i, c.options.replace(out=p, progress="none"), state.run + i, a) for i, p, a in jobs]
        if not jobs:
            results = {}
        elif ray_address is not None:
            results = _follow(ray_events(specs, c.engine_args), len(todo), c)
        elif local is not None:
            results = _follow(local_events(specs, local), len(todo), c)
        else:
            results = _in_this_process(c, jobs[0][1], jobs[0][2], state.run)
    finally:
        state.release()
    return _merge(c, state, jobs, results, engines, ray_address, t0, t_load)


def _follow(events: Generator[Event, None, None], todo: int, c: Checked) -> dict[int, tuple[str, object]]:
    """Draws the engines' reports as one progress; returns each engine's summary or error."""
    totals = EngineTotals()
    bar = None
    results: dict[int, tuple[str, object]] = {}
    try:
        for kind, engine, value in events:
            if kind == "report":
                step = totals.take(engine, value)  # type: ignore[arg-type]
                elapsed = value.get("elapsed", 0.0) if "rows" in value else None  # type: ignore[union-attr,operator]
            elif kind == "summary":
                results[engine] = (kind, value)
                # Its final figures: the last report may come late or not at all (a Ray actor's).
                step = totals.settle(engine, value)  # type: ignore[arg-type]
                elapsed = value["seconds"]["generate"]  # type: ignore[index]
            else:
                results[engine] = (kind, value)
                continue
            if bar is None and elapsed is not None:
                # From the first engine ready, as a single run's progress (rates without start-up).
                bar = Progress(todo, totals, c.progress, c.options.progress_interval)  # type: ignore[arg-type]
                bar.start -= elapsed
            if bar is not None:
                bar.update(**step)
    finally:
        if bar is not None:
            bar.close()
        # Now, not when the traceback lets go of it: an interrupted run stops its engines here.
        events.close()
    return results


def _merge(
    c: Checked,
    state: PartsState,
    jobs: list,
    results: dict[int, tuple[str, object]],
    engines: int,
    ray_address: str | None,
    t0: float,
    t_load: float,
) -> Summary:
    """One summary of the run, in a single run's fields, plus each engine's."""
    ok = [v for k, v in results.values() if k == "summary"]
    per_engine, errors, bad, missing = [], [], [], []
    for i, part, rows in jobs:
        kind, value = results.get(i, ("error", ("failed", "the engine ended without a result")))
        entry: EngineEntry = {"engine": i, "part": part, "rows_assigned": len(rows)}
        if kind == "summary":
            s = value
            keys = ("writer_id", "rows_written", "rows_bad", "rows_missing", "tokens", "stored_bytes", "seconds")
            entry.update({k: s[k] for k in keys})
            bad += s["bad_rows"]
            missing += s["missing_rows"]
        else:
            what, text = value  # type: ignore[misc]
            entry.update(error=text, error_kind=what)
            errors.append(f"engine {i} ({os.path.basename(part)}): {text}")
        per_engine.append(entry)

    def total(key: str) -> int:
        return sum(s[key] for s in ok)

    phases = ("engine_start", "generate", "drain", "shutdown")
    seconds = {k: max((s["seconds"][k] for s in ok), default=0.0) for k in phases}
    t_end = time.monotonic()
    gen = seconds["generate"]
    raw, stored = total("raw_bytes"), total("stored_bytes")
    bad.sort(key=lambda b: b["row"])
    summary: Summary = {
        **c.asked(),
        "dtype": next((s["dtype"] for s in ok if s["dtype"]), None),
        "run": None,
        "writer_id": None,
        "data_parallel_size": engines,
        "ray_address": ray_address,
        "parts": state.parts,
        "engines": per_engine,
        "engine_errors": errors,
        "rows": c.rows.num_rows,
        "rows_done_before": int(state.done.sum()),
        "rows_written": total("rows_written"),
        "rows_bad": len(bad),
        "rows_missing": len(missing),
        "bad_rows": bad,
        "missing_rows": sorted(missing)[:1000],
        "duplicate_records": state.duplicates + total("duplicate_records"),
        "tokens": total("tokens"),
        "raw_bytes": raw,
        "stored_bytes": stored,
        "ratio": round(raw / stored, 4) if stored else None,
        "shards": total("shards"),
        "shards_recovered": state.recovered + [p for s in ok for p in s["shards_recovered"]],
        "files_set_aside": state.set_aside + [p for s in ok for p in s["files_set_aside"]],
        "damaged_records": damaged_entries(state.damaged) + [d for s in ok for d in s["damaged_records"]],
        "tokens_per_second": round(total("tokens") / gen, 1) if gen > 0 else 0.0,
        "seconds": {
            "load": round(t_load - t0, 3),
            **{k: round(v, 3) for k, v in seconds.items()},
            "total": round(t_end - t0, 3),
        },
    }
    summary["complete"] = is_complete(
        summary, summary["rows_done_before"] + summary["rows_written"] + summary["rows_bad"]
    )
    return summary


__all__ = ["PART_PREFIX", "generate_parallel", "prepare_parts", "wants_parallel"]
