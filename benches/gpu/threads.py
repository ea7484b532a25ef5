"""What every thread of the benchmark's processes did in a window (issue 20): CPU seconds,
run-queue wait, context switches, from Linux's per-thread accounting.

    before = snapshot(pids)   ...   after = snapshot(pids)
    rows = diff(before, after)          # one row per thread alive at the end
    summary = by_group(rows)            # summed per named group (engine loop, compression, ...)

Per thread (``/proc/PID/task/TID``):
- ``stat`` fields 14 and 15 (utime, stime, clock ticks): CPU seconds;
- ``schedstat``: nanoseconds on a CPU, nanoseconds **runnable but waiting for a CPU** (what
  contention for cores costs the thread), timeslices;
- ``status``: voluntary and involuntary context switches (a high involuntary count is a thread
  preempted by another that wanted its core);
- ``stat`` fields 10 and 12: minor and major page faults (memory the thread touched for the
  first time: fresh allocations, pages the kernel took back);
- ``comm``: the thread's name, which the groups are made of.
And for the machine (``cpu_times``, ``interrupts``): each CPU's busy and steal time, and the
interrupts that one thread's memory management sends to the others' cores (TLB shootdowns,
function-call IPIs), which slow a thread without making it wait for a core.
"""

from __future__ import annotations

import os
import re

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

#: Thread name patterns -> group (first match wins); the engine core's main thread is found by
#: its tid (== pid), the front end's likewise.
GROUPS = (
    (re.compile(r"^layertap-zstd"), "compression"),
    (re.compile(r"^layertap-io"), "writer I/O"),
    (re.compile(r"^layertap-sync"), "writer fsync"),
    (re.compile(r"^layertap-gpu"), "GPU compression"),
    (re.compile(r"^layertap"), "layertap other"),
    (re.compile(r"^py-spy"), "profiler"),
)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (engine core, its helpers), from /proc's parent links."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = _read(f"/proc/{name}/stat")
        if stat is None:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        parent[int(name)] = int(fields[1])
    out: list[int] = []
    frontier = [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out.extend(kids)
        frontier.extend(kids)
    return out


def process_name(pid: int) -> str:
    return (_read(f"/proc/{pid}/comm") or "?").strip()


def snapshot(pids: list[int]) -> dict[tuple[int, int], dict]:
    """``{(pid, tid): counters}`` for every thread of ``pids`` now."""
    out: dict[tuple[int, int], dict] = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        pname = process_name(pid)
        for t in tids:
            base = f"/proc/{pid}/task/{t}"
            stat = _read(f"{base}/stat")
            sched = _read(f"{base}/schedstat")
            status = _read(f"{base}/status")
            if stat is None:
                continue
            fields = stat[stat.rfind(")") + 2 :].split()
            row = {
                "name": (_read(f"{base}/comm") or "?").strip(),
                "process": pname,
                "cpu_s": (int(fields[11]) + int(fields[12])) / TICK,
                "minflt": int(fields[7]),
                "majflt": int(fields[9]),
                "processor": int(fields[36]),
                "nice": int(fields[16]),
            }
            if sched:
                run_ns, wait_ns, slices = (int(x) for x in sched.split()[:3])
                row.update(run_s=run_ns / 1e9, wait_s=wait_ns / 1e9, slices=slices)
            for line in (status or "").splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    row["vcsw"] = int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches:"):
                    row["ivcsw"] = int(line.split()[1])
                elif line.startswith("Cpus_allowed_list:"):
                    row["cpus"] = line.split()[1]
            out[(pid, int(t))] = row
    return out


COUNTERS = ("cpu_s", "run_s", "wait_s", "slices", "vcsw", "ivcsw", "minflt", "majflt")


def diff(before: dict, after: dict) -> list[dict]:
    """One row per thread alive at the end: counters over the window (a thread born inside
    it counts from zero)."""
    rows = []
    for key, a in after.items():
        b = before.get(key, {})
        row = {"pid": key[0], "tid": key[1], "name": a["name"], "process": a["process"], "nice": a["nice"]}
        for c in COUNTERS:
            if c in a:
                row[c] = round(a[c] - b.get(c, 0), 6)
        row["cpus"] = a.get("cpus")
        rows.append(row)
    return rows


def group_of(row: dict, engine_pid: int | None, front_pid: int) -> str:
    name = row["name"]
    for pattern, group in GROUPS:
        if pattern.search(name):
            return group
    if row["pid"] == row["tid"]:
        if row["pid"] == engine_pid:
            return "engine loop"
        if row["pid"] == front_pid:
            return "front end main"
        return f"{row['process']} main"
    where = "engine" if row["pid"] == engine_pid else "front end" if row["pid"] == front_pid else row["process"]
    # vLLM's and torch's helpers, by name without their numbers (pt_autograd_0 -> pt_autograd_).
    return f"{where}: {re.sub(r'[0-9]+$', '', name)}"


def by_group(rows: list[dict], engine_pid: int | None, front_pid: int) -> dict[str, dict]:
    """Counters summed per group, with the number of threads; the busiest groups first."""
    groups: dict[str, dict] = {}
    for row in rows:
        g = groups.setdefault(group_of(row, engine_pid, front_pid), {"threads": 0})
        g["threads"] += 1
        for c in COUNTERS:
            if c in row:
                g[c] = round(g.get(c, 0) + row[c], 6)
    return dict(sorted(groups.items(), key=lambda kv: -kv[1].get("run_s", kv[1].get("cpu_s", 0))))


def cpu_times() -> list[list[int]]:
    """Per CPU: [busy, idle+iowait, steal] jiffies from /proc/stat (steal: time the hypervisor
    gave this virtual CPU's physical CPU to something else; counted in busy too)."""
    out = []
    for line in (_read("/proc/stat") or "").splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            v = [int(x) for x in line.split()[1:]]
            idle = v[3] + (v[4] if len(v) > 4 else 0)
            out.append([sum(v[:8]) - idle, idle, v[7] if len(v) > 7 else 0])
    return out


def cpu_busy(before: list[list[int]], after: list[list[int]]) -> dict:
    """How busy the machine's CPUs were over a window: each CPU's busy share, and their sum
    (the number of cores kept busy on average)."""
    shares, steal = [], 0.0
    for b, a in zip(before, after):
        busy, idle = a[0] - b[0], a[1] - b[1]
        shares.append(round(busy / (busy + idle), 3) if busy + idle else 0.0)
        if len(a) > 2 and busy + idle:
            steal += (a[2] - b[2]) / (busy + idle)
    return {"cpus": len(shares), "busy_cores": round(sum(shares), 2), "steal_cores": round(steal, 3), "per_cpu": shares}


def topology() -> dict:
    """This machine's CPUs as physical cores (hyper-thread siblings together)."""
    cores: dict[str, list[int]] = {}
    for cpu in range(os.cpu_count() or 1):  # all of them, whatever this thread is pinned to
        sib = (_read(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") or str(cpu)).strip()
        cores.setdefault(sib, []).append(cpu)
    return {"cpus": sum(len(c) for c in cores.values()), "cores": list(cores.values())}


def pin_writer(pids: list[int], writer_cpus: int) -> dict:
    """A bench-only experiment (run.sh's ``+aff``): the compression, I/O and fsync threads of
    ``pids`` onto whole cores taken from the top of the CPU list, at least ``writer_cpus``
    CPUs and at most half; every other thread of ``pids`` onto the rest. Returns the split."""
    cores = topology()["cores"]
    mine: list[int] = []
    while cores and len(mine) < writer_cpus and len(mine) + len(cores[-1]) <= max(1, topology()["cpus"] // 2):
        mine = cores.pop() + mine
    rest = [c for core in cores for c in core]
    moved = {"writer": 0, "other": 0}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for t in tids:
            name = (_read(f"/proc/{pid}/task/{t}/comm") or "").strip()
            ours = name.startswith("layertap-")
            try:
                os.sched_setaffinity(int(t), mine if ours else rest)
                moved["writer" if ours else "other"] += 1
            except OSError:
                continue
    return {"writer_cpus": mine, "engine_cpus": rest, "threads_moved": moved}


#: /proc/interrupts rows that count one core disturbing the others: TLB shootdowns (a thread
#: unmapped or changed memory that other threads of the process may have cached) and
#: function-call interrupts.
IPI_ROWS = ("TLB", "CAL", "RES")


def interrupts() -> dict[str, list[int]]:
    """Per row of ``IPI_ROWS``: the count on each CPU so far."""
    out: dict[str, list[int]] = {}
    for line in (_read("/proc/interrupts") or "").splitlines():
        name, _, rest = line.partition(":")
        name = name.strip()
        if name in IPI_ROWS:
            counts = []
            for x in rest.split():
                if not x.isdigit():
                    break
                counts.append(int(x))
            out[name] = counts
    return out


def interrupts_diff(before: dict[str, list[int]], after: dict[str, list[int]]) -> dict[str, int]:
    """Each row's total over the window."""
    return {k: sum(after[k]) - sum(before.get(k, [0] * len(after[k]))) for k in after}
