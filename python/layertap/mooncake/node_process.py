"""Which master a store node on this host serves, read from its process's command line.

A reader with ``node=`` gets every object through that node, from the node's master: a node of
another master would hand it another store's objects under the same names. Mooncake's dummy
client cannot ask the node which master it serves, so ``node_master`` finds the
``mooncake_client`` process listening on the node's port in ``/proc`` and reads its
``-master_server_address`` (gflags' spellings: ``-flag=v``, ``--flag=v``, ``-flag v``, and lines of a
``--flagfile``), or Mooncake's default where the flag is not given. The look reads every process's
command line (about 50 us a process on the CPU machine), once a client: each process makes one
client per address.
"""

from __future__ import annotations

import os
import socket

#: ``mooncake_client``'s defaults (its ``--help``).
DEFAULT_MASTER = "127.0.0.1:50051"
DEFAULT_PORT = 50052
_CLIENT = "mooncake_client"


def _flags(argv: list[str]) -> dict[str, str] | None:
    """gflags' ``-name=value``, ``--name=value`` and ``-name value`` (last one wins), with the
    lines of each ``--flagfile`` read where they stand; None where a flag file cannot be read
    (the flags are then not known)."""
    flags: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("-"):
            continue
        name, eq, value = arg.lstrip("-").partition("=")
        if not eq:
            if i < len(argv) and not argv[i].startswith("-"):
                value = argv[i]
                i += 1
            else:
                continue  # a boolean flag
        if name == "flagfile":
            try:
                with open(value) as f:
                    lines = [line.strip() for line in f if line.strip() and not line.startswith("#")]
            except OSError:
                return None
            inner = _flags(lines)
            if inner is None:
                return None
            flags.update(inner)
            continue
        flags[name] = value
    return flags


def _clients() -> list[dict[str, str]]:
    """The flags of every ``mooncake_client`` process this host's ``/proc`` shows (those whose
    flags can be read)."""
    found = []
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return found
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue  # gone, or hidden from this user
        if argv and os.path.basename(argv[0]) == _CLIENT and (flags := _flags(argv[1:])) is not None:
            found.append(flags)
    return found


def node_master(port: int) -> str | None:
    """``HOST:PORT`` of the master that the store node listening on ``port`` on this host serves;
    None where no ``mooncake_client`` process with that port can be read here (another user's
    processes hidden, a node started some other way, a flag file that cannot be read), several
    claim the port, or its master is not one ``HOST:PORT`` (found through etcd)."""
    masters = set()
    for flags in _clients():
        try:
            if int(flags.get("port", DEFAULT_PORT)) != port:
                continue
        except ValueError:
            continue
        masters.add(flags.get("master_server_address", DEFAULT_MASTER))
    if len(masters) != 1:
        return None
    master = masters.pop()
    # A master found through etcd (high availability), or a list: not one HOST:PORT to compare.
    return None if "://" in master or "," in master else master


def _endpoints(address: str) -> tuple[int, set[str]] | None:
    host, _, port = address.rpartition(":")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        return None
    return int(port), {info[4][0] for info in infos}


def same_master(a: str, b: str) -> bool:
    """Whether two ``HOST:PORT`` name one master: the same port and a host address in common
    (``localhost`` and ``127.0.0.1`` are one); a host that does not resolve is compared as
    written."""
    if a == b:
        return True
    ea, eb = _endpoints(a), _endpoints(b)
    if ea is None or eb is None:
        return False
    return ea[0] == eb[0] and bool(ea[1] & eb[1])
