"""One Mooncake Store client per process and address: ``connect`` checks that a master answers
at the address (``check_master``: within ``CONNECT_TIMEOUT + HANDSHAKE_TIMEOUT`` seconds, where
Mooncake's own set-up retries 20 times, for minutes) and sets the client up, its log going to a
file (``logs``); ``StoreClient`` turns Mooncake's status codes into what layertap reports."""

from __future__ import annotations

import copy
import dataclasses
import logging
import socket
import struct
import threading

from layertap.errors import InvalidInputError, StoreUnavailableError
from layertap.mooncake import logs
from layertap.mooncake.address import StoreAddress
from layertap.mooncake.node_process import node_master, same_master

logger = logging.getLogger("layertap.mooncake")

#: Seconds ``check_master`` waits for the master's port to accept a connection.
CONNECT_TIMEOUT = 3.0
#: Seconds ``check_master`` then waits for the answer to its request: a master answers at once.
HANDSHAKE_TIMEOUT = 3.0
#: Mooncake's status for a call that did not reach the master (``ErrorCode::RPC_FAIL``); also
#: what a call returns here while the master is known gone.
RPC_FAIL = -900
#: Seconds a call waits for the master's port once a call has failed (``StoreClient``).
PROBE_TIMEOUT = 0.5
#: Reads of an object that exists before ``get`` gives up: a read that outlives the lease the
#: master granted for it (the node holding it slow to answer) fails with LEASE_EXPIRED, and the
#: next read, under a new lease, succeeds.
GET_TRIES = 3
#: Names ``exist_many`` asks the master about in one call.
EXIST_BATCH = 1000

_clients: dict[StoreAddress, StoreClient] = {}
"""The client of each master and client options."""
_datasets: dict[StoreAddress, StoreClient] = {}
"""That client for each address (dataset) given: what its errors name."""
_lock = threading.Lock()


#: A request of Mooncake's RPC protocol (yalantinglibs' coro_rpc: magic 21, version 0, struct_pack,
#: a request; sequence number 1, function id 0, no body): ``req_header``, 20 bytes, little-endian.
#: No master function has id 0, so a master answers "function not registered", a response whose
#: first byte is the same magic; a port that is no master (its metrics or HTTP port, another
#: service) answers otherwise, closes, or waits for more.
_RPC_PROBE = struct.pack("<BBBBIIII", 21, 0, 0, 0, 1, 0, 0, 0)
_RPC_MAGIC = 21


def _connect(address: StoreAddress, timeout: float) -> socket.socket:
    try:
        return socket.create_connection((address.host, address.port), timeout)
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise StoreUnavailableError(
            f"{address}: cannot reach the Mooncake master at {address.master} ({reason}): start mooncake_master "
            f"-rpc_port={address.port} there, or fix the address"
        ) from None


def check_master(address: StoreAddress, timeout: float = CONNECT_TIMEOUT) -> None:
    """Raises StoreUnavailableError, one line saying what to do, unless a Mooncake master answers
    an RPC request at the address: Mooncake's client, set up against a port that is no master,
    retries for minutes, logging each try."""
    sock = _connect(address, timeout)
    with sock:
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            sock.sendall(_RPC_PROBE)
            reply = sock.recv(64)
            answer = "closed the connection" if not reply else f"answered {reply[:16]!r}"
        except TimeoutError:
            reply, answer = b"", f"did not answer within {HANDSHAKE_TIMEOUT:g} s"
        except OSError as e:
            reply, answer = b"", e.strerror or type(e).__name__
    if not reply or reply[0] != _RPC_MAGIC:
        raise StoreUnavailableError(
            f"{address}: {address.master} is not a Mooncake master (or one that hangs): it accepts connections but "
            f"{answer} when sent a Mooncake RPC request; give the master's -rpc_port (default 50051), not its "
            "metrics or HTTP port"
        )


class BufferTooSmallError(StoreUnavailableError):
    """An object the store has that this client could not read into its transfer buffer (the
    address's ``buffer``): too small for it, or full of objects still held."""


#: The abstract Unix socket a store node listening on port P takes dummy clients' shared memory
#: at, as ``/proc/net/unix`` lists it: Mooncake's ``real_client_main.cpp`` and the binding's
#: ``setup_dummy`` name it ``@mooncake_client_P.sock``, its ``uds_transport.cpp`` puts a NUL
#: before that name, and procfs shows an abstract name after a ``@``.
_NODE_SOCKET = "@@mooncake_client_{}.sock"


def check_node(address: StoreAddress, timeout: float = CONNECT_TIMEOUT) -> None:
    """Raises StoreUnavailableError, one line naming ``node=`` and the fix, unless a store node
    answers at ``address.node`` on this host: its port accepts a connection within ``timeout``
    seconds and its shared-memory socket is in this host's (network namespace's) list of Unix
    sockets. (Mooncake's ``setup_dummy`` spends about 4 s on a port where nothing listens, and
    a node on another host takes the RPC but not the memory.) InvalidInputError where the node's
    process shows it serves another master than ``address``'s (``node_process.py``)."""
    host, port = address.node_endpoint
    fix = (
        f"start mooncake_client -host={host} -port={port} -master_server_address={address.master} on this host, "
        "or remove node= to read over the network"
    )
    refused = _node_refuses(address, timeout)
    if refused is not None:
        raise StoreUnavailableError(
            f"{address}: no store node answers at node={address.node} ({refused.strerror or type(refused).__name__}): "
            f"{fix}"
        )
    try:
        with open("/proc/net/unix") as f:
            sockets = {line.split()[-1] for line in f.read().splitlines()[1:] if len(line.split()) > 7}
    except OSError:
        sockets = None  # no procfs: Mooncake's set-up says, if the node is elsewhere
    if sockets is not None and _NODE_SOCKET.format(port) not in sockets:
        raise StoreUnavailableError(
            f"{address}: node={address.node} answers but is not a store node on this host (no Unix socket "
            f"{_NODE_SOCKET.format(port)[1:]} here; node= reads through shared memory): {fix}"
        )
    master = node_master(port)
    if master is not None and not same_master(master, address.master):
        raise InvalidInputError(
            f"{address}: node={address.node} is a store node of the master at {master}, not of this address's "
            f"{address.master} (it would read that store's objects under this dataset's names): name a node of "
            f"{address.master} in node= (mooncake_client -master_server_address={address.master} -port=P on this "
            "host), or remove node= to read over the network"
        )


def _node_refuses(address: StoreAddress, timeout: float) -> OSError | None:
    """Why the store node's port refuses a connection; None when it takes one."""
    try:
        socket.create_connection(address.node_endpoint, timeout).close()
    except OSError as e:
        return e
    return None


class _Failing:
    """Whether the last call of a Mooncake client failed (then the next one checks the master's
    port first): shared by its ``StoreClient`` for each dataset (``StoreClient.for_address``)."""

    failing = False


class StoreClient:
    """A set-up ``MooncakeDistributedStore``. Thread-safe (Mooncake's client is).

    While its master is down, Mooncake's client spends about 4 s on every put, upsert and get
    (it reconnects each time): a connector shutting down then outlives vLLM's 5 s grace for its
    workers and is killed before it reports. So once a call has failed, each later call first
    checks that the master's port accepts a connection (refused at once on a host that is up,
    ``PROBE_TIMEOUT`` at most) and fails at once (``RPC_FAIL``, None, or StoreUnavailableError
    from ``get``) while it does not; a call that succeeds ends the checks.

    With ``node=`` (``address.node``) the client is Mooncake's dummy client: it sets up no
    transfer engine of its own, and the store node on this host does each call for it, moving
    the objects through memory the two share. The node's port is then checked as well: a node
    that stopped (killed, or restarted without this client) fails each call at once, where
    Mooncake's dummy client spends about 4 s on each until its own ping notices."""

    def __init__(self, address: StoreAddress):
        if address.node is not None:  # first: a node of another master is a wrong address
            check_node(address)
        check_master(address)
        with logs.into_files() as log_dir:
            try:
                from mooncake.store import MooncakeDistributedStore, ReplicateConfig
            except ImportError as e:
                raise StoreUnavailableError(
                    f"Mooncake is not installed ({e}): pip install mooncake-transfer-engine-non-cuda (CPU) or "
                    "mooncake-transfer-engine (CUDA); it needs Debian's libibverbs1 and librdmacm1"
                ) from None
            quiet = log_dir is not None and logs.quiet_stderr()
            self.address = address
            self.store = MooncakeDistributedStore()
            with logs.setup_output(log_dir, quiet):
                if address.node is not None:
                    # The pool for put_from's memory: unused by what layertap calls.
                    status = self.store.setup_dummy(0, address.buffer, address.node)
                else:
                    status = self.store.setup(
                        address.local_host(),
                        address.metadata,
                        address.segment,
                        address.buffer,
                        address.protocol,
                        address.device,
                        address.master,
                    )
        if status != 0 and address.node is not None:
            raise StoreUnavailableError(
                f"{address}: attaching to the store node at node={address.node} failed (status {status}): check that it "
                f"is a mooncake_client on this host with -port={address.node_endpoint[1]}, or remove node= to "
                f"read over the network ({logs.where()})"
            )
        if status != 0:
            raise StoreUnavailableError(
                f"{address}: Mooncake client set-up failed (status {status}) with master {address.master}, "
                f"metadata {address.metadata!r}, protocol {address.protocol}: check the master and these options "
                f"({logs.where()})"
            )
        self._state = _Failing()
        self._pinned = ReplicateConfig()
        # The small objects that list the records are never evicted: without them a reader
        # cannot find the records that are still there.
        self._pinned.with_hard_pin = True

    def for_address(self, address: StoreAddress) -> StoreClient:
        """This client for another dataset (prefix) of the same master and options: the same
        Mooncake client and failure state, its messages naming ``address``."""
        other = copy.copy(self)
        other.address = address
        return other

    def put(self, name: str, data, pinned: bool = False) -> int:
        """Puts a new object; 0 or Mooncake's negative status. An existing object is left as it
        is (Mooncake ignores the put: see ``exists``)."""
        if self._master_gone():
            return RPC_FAIL
        status = self.store.put(name, data, self._pinned) if pinned else self.store.put(name, data)
        self._state.failing = status != 0
        return status

    def upsert(self, name: str, data) -> int:  # always pinned: only the heads are upserted
        if self._master_gone():
            return RPC_FAIL
        status = self.store.upsert(name, data, self._pinned)
        self._state.failing = status != 0
        return status

    def get(self, name: str) -> bytes | None:
        """The object's bytes; None if the store has no such object. Raises
        StoreUnavailableError when the store cannot say: a read that failed is never taken for
        an object that is not there (a follower would skip records, a reader report them
        missing)."""
        return self._read(name, self.store.get)

    def get_view(self, name: str) -> memoryview | None:
        """``get`` without the copy into ``bytes``: a read-only view of the object where
        Mooncake's ``get`` received it, in this client's transfer buffer (``buffer``), which
        holds the object until the view and every slice of it are gone. For reads that decode
        the object at once into memory of their own (a record through the Rust core's decoder);
        an object held longer takes room that later gets and puts need. Same answers and errors
        as ``get``."""
        return self._read(name, self._view)

    def _view(self, name: str) -> memoryview | None:
        # Mooncake's get is this get_buffer and a copy of the handle's bytes into a new bytes
        # object (store_py.cpp); the handle gives its memory as a buffer of signed chars, and
        # frees it when the last view of it is gone.
        handle = self.store.get_buffer(name)
        return None if handle is None else memoryview(handle).cast("B").toreadonly()

    def _read(self, name: str, read):
        """``read(name)``, with ``get``'s checks and retries."""
        for _ in range(GET_TRIES):
            if self._master_gone():
                break
            data = read(name)
            if data:  # layertap puts no empty object
                self._state.failing = False
                return data
            # Mooncake's get returns empty bytes (get_buffer None) for an object that is not there
            # and for a call that failed alike: whether the object exists tells them apart (a
            # node= that is gone would take Mooncake's dummy client seconds to say so).
            if self._node_gone():
                self._state.failing = True
                break
            there = self.store.is_exist(name)
            self._state.failing = there < 0
            if there == 0:
                return None
            if there < 0:
                break
        else:
            raise self._unread(name)
        raise StoreUnavailableError(
            f"{self.address}: cannot read {name!r}: {self.who()} does not answer; check that they run, then try again"
        )

    def _unread(self, name: str) -> BufferTooSmallError:
        """The error for an object that is there (the master says so each time) but that
        ``GET_TRIES`` reads could not get: Mooncake's get places an object in this client's
        transfer buffer, and gives nothing, as for a failed call, when there is no room."""
        size = self.store.get_size(name)
        room = f"buffer={self.address.buffer >> 20}MiB"
        if size > self.address.buffer:
            return BufferTooSmallError(
                f"{self.address}: cannot read {name!r}: the object is {size} bytes, more than this client's transfer "
                f"buffer holds ({room}): raise buffer= in the address above {-(-size >> 20)}MiB"
            )
        held = f"{size} bytes" if size > 0 else "it"
        return BufferTooSmallError(
            f"{self.address}: cannot read {name!r}: the store has it but {GET_TRIES} reads failed: this client's "
            f"transfer buffer ({room}) had no room for {held} (objects read earlier and still held take room there), "
            "or the store node holding it answered later than the read's lease; raise buffer= in the address, or "
            "hold fewer objects at once"
        )

    def who(self) -> str:
        """What must answer for a call to succeed (for messages)."""
        node = "" if self.address.node is None else f"the store node at node={self.address.node} (this host), "
        return f"{node}the Mooncake master at {self.address.master} or the store node holding it"

    def exists(self, name: str) -> bool | None:
        """Whether the object is there; None when the store cannot say."""
        if self._master_gone():
            return None
        r = self.store.is_exist(name)
        self._state.failing = r < 0
        return None if r < 0 else bool(r)

    def exist_many(self, names: list[str]) -> list[bool] | None:
        """Whether each object is there (asked ``EXIST_BATCH`` names a call); None when the
        store cannot say."""
        out: list[bool] = []
        for i in range(0, len(names), EXIST_BATCH):
            if self._master_gone():
                return None
            got = self.store.batch_is_exist(names[i : i + EXIST_BATCH])
            self._state.failing = any(r < 0 for r in got)
            if self._state.failing:
                return None
            out += [r == 1 for r in got]
        return out

    def _master_gone(self) -> bool:
        """After a failed call: whether the master's port refuses connections, or with
        ``node=`` the node's (see the class)."""
        if not self._state.failing:
            return False
        if self._node_gone():
            return True
        try:
            _connect(self.address, PROBE_TIMEOUT).close()
        except StoreUnavailableError:
            return True
        return False

    def _node_gone(self) -> bool:  # on this host a refusal comes at once
        return self.address.node is not None and _node_refuses(self.address, PROBE_TIMEOUT) is not None

    def close(self) -> None:
        self.store.close()


def connect(address: StoreAddress) -> StoreClient:
    """This process's client for ``address``: one Mooncake client for its master and client
    options (made once), named by each dataset's address in what it reports."""
    k = dataclasses.replace(address, prefix="")  # the master and the client options
    with _lock:
        client = _datasets.get(address)
        if client is None:
            shared = _clients.get(k)
            if shared is None:
                shared = _clients[k] = StoreClient(address)
            client = _datasets[address] = shared.for_address(address)
        return client


__all__ = [
    "BufferTooSmallError",
    "GET_TRIES",
    "HANDSHAKE_TIMEOUT",
    "RPC_FAIL",
    "StoreClient",
    "check_master",
    "check_node",
    "connect",
]
