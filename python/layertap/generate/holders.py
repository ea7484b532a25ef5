"""Which processes hold a file's flock, for the line that says a shard is still held: a run
killed with SIGKILL alone leaves vLLM's engine processes running (vLLM 0.32 does not watch the
process that started them), and their writer keeps its shard locked; the user needs their pids
to stop them. Linux's /proc only; elsewhere nothing is named."""

from __future__ import annotations

import os

#: vLLM names its processes so (setproctitle): ``VLLM::EngineCore``, ``VLLM::Worker``...
VLLM_PROCESS_PREFIX = "VLLM::"


def flock_holders(path: str) -> list[int]:
    """The pids /proc/locks gives for the flocks held on ``path`` (waiters left out), in order."""
    try:
        st = os.stat(path)
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    file_id = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in lines:
        # "4: FLOCK  ADVISORY  WRITE 13610 fe:00:10387509 0 EOF"; a waiter's has "->" after "4:".
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == file_id and fields[4].isdigit():
            pids.append(int(fields[4]))
    return pids


def process_name(pid: int) -> str | None:
    """The process's title (vLLM sets ``VLLM::Worker``), None when it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = [w for w in f.read().split(b"\0") if w]
    except OSError:
        return None
    return os.path.basename(words[0].decode(errors="replace")) if words else ""


def parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2 :].split()[1])  # after "pid (comm) state"


def describe_holders(path: str) -> tuple[str, list[int]]:
    """("process 13610 VLLM::Worker, under 13509 VLLM::EngineCore", [13610, 13509]) for the
    processes holding ``path``'s flock, with their vLLM parents (which stop only when killed
    too); ("", []) when none can be named."""
    named, pids = [], []
    for pid in flock_holders(path):
        name = process_name(pid)
        if name is None:
            continue
        text, chain = f"process {pid} {name}".rstrip(), [pid]
        parent = parent_pid(pid)
        while name.startswith(VLLM_PROCESS_PREFIX) and parent not in (None, 0, 1):
            name = process_name(parent) or ""
            if not name.startswith(VLLM_PROCESS_PREFIX):
                break
            text += f", under {parent} {name}"
            chain.append(parent)
            parent = parent_pid(parent)
        named.append(text)
        pids += [p for p in chain if p not in pids]
    return "; ".join(named), pids
