"""One Mooncake Store client per process and address: ``connect`` checks that the master answers
(in about a second, where Mooncake's own set-up retries for 90 s) and sets the client up;
``StoreClient`` turns Mooncake's status codes into what layertap reports."""

from __future__ import annotations

import logging
import os
import socket
import threading

from layertap.errors import StoreUnavailableError
from layertap.mooncake.address import StoreAddress

logger = logging.getLogger("layertap.mooncake")

#: Seconds ``connect`` waits for the master's port to accept a connection.
CONNECT_TIMEOUT = 3.0
#: Mooncake's status for a key that is not in the store (``ErrorCode::OBJECT_NOT_FOUND``).
OBJECT_NOT_FOUND = -704
#: Mooncake's status for a call that did not reach the master (``ErrorCode::RPC_FAIL``); also
#: what a call returns here while the master is known gone.
RPC_FAIL = -900
#: Seconds a call waits for the master's port once a call has failed (``StoreClient``).
PROBE_TIMEOUT = 0.5
#: Reads of an object that exists before ``get`` gives up: a read that outlives the lease the
#: master granted for it (the node holding it slow to answer) fails with LEASE_EXPIRED, and the
#: next read, under a new lease, succeeds.
GET_TRIES = 3

_clients: dict[tuple, StoreClient] = {}
_lock = threading.Lock()


def _quiet_mooncake_logs() -> None:
    # Mooncake logs through glog to stderr, every transfer error at ERROR: layertap reports
    # failures itself (counted, one line per cause), so only fatal lines are left. A user who
    # wants them sets GLOG_minloglevel.
    os.environ.setdefault("GLOG_minloglevel", "3")


def check_master(address: StoreAddress, timeout: float = CONNECT_TIMEOUT) -> None:
    """Raises StoreUnavailableError, one line saying what to do, unless the master's RPC port
    accepts a TCP connection within ``timeout`` seconds."""
    try:
        socket.create_connection((address.host, address.port), timeout).close()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise StoreUnavailableError(
            f"{address}: cannot reach the Mooncake master at {address.master} ({reason}): start mooncake_master "
            f"-rpc_port={address.port} there, or fix the address"
        ) from None


class StoreClient:
    """A set-up ``MooncakeDistributedStore``. Thread-safe (Mooncake's client is).

    While its master is down, Mooncake's client spends about 4 s on every put, upsert and get
    (it reconnects each time): a connector shutting down then outlives vLLM's 5 s grace for its
    workers and is killed before it reports. So once a call has failed, each later call first
    checks that the master's port accepts a connection (refused at once on a host that is up,
    ``PROBE_TIMEOUT`` at most) and fails at once (``RPC_FAIL``, None, or StoreUnavailableError
    from ``get``) while it does not; a call that succeeds ends the checks."""

    def __init__(self, address: StoreAddress):
        _quiet_mooncake_logs()
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as e:
            raise StoreUnavailableError(
                f"Mooncake is not installed ({e}): pip install mooncake-transfer-engine-non-cuda (CPU) or "
                "mooncake-transfer-engine (CUDA); it needs Debian's libibverbs1 and librdmacm1"
            ) from None
        check_master(address)
        self.address = address
        self.store = MooncakeDistributedStore()
        status = self.store.setup(
            address.local_host(),
            address.metadata,
            address.segment,
            address.buffer,
            address.protocol,
            address.device,
            address.master,
        )
        if status != 0:
            raise StoreUnavailableError(
                f"{address}: Mooncake client set-up failed (status {status}) with master {address.master}, "
                f"metadata {address.metadata!r}, protocol {address.protocol}: check the master and these options"
            )
        self._failing = False
        """Whether the last call failed (then the next one checks the master's port first)."""
        self._pinned = ReplicateConfig()
        # The small objects that list the records are never evicted: without them a reader
        # cannot find the records that are still there.
        self._pinned.with_hard_pin = True

    def put(self, name: str, data, pinned: bool = False) -> int:
        """Puts a new object; 0 or Mooncake's negative status. An existing object is left as it
        is (Mooncake ignores the put: see ``exists``)."""
        if self._master_gone():
            return RPC_FAIL
        status = self.store.put(name, data, self._pinned) if pinned else self.store.put(name, data)
        self._failing = status != 0
        return status

    def upsert(self, name: str, data) -> int:
        if self._master_gone():
            return RPC_FAIL
        status = self.store.upsert(name, data, self._pinned)
        self._failing = status != 0
        return status

    def get(self, name: str) -> bytes | None:
        """The object's bytes; None if the store has no such object. Raises
        StoreUnavailableError when the store cannot say: a read that failed is never taken for
        an object that is not there (a follower would skip records, a reader report them
        missing)."""
        for _ in range(GET_TRIES):
            if self._master_gone():
                break
            data = self.store.get(name)
            if data:  # layertap puts no empty object
                self._failing = False
                return data
            # Mooncake's get returns empty bytes for an object that is not there and for a call
            # that failed alike: whether the object exists tells them apart.
            there = self.store.is_exist(name)
            self._failing = there < 0
            if there == 0:
                return None
            if there < 0:
                break
        raise StoreUnavailableError(
            f"{self.address}: cannot read {name!r}: the Mooncake master at {self.address.master} or the store node "
            "holding it does not answer; check that they run, then try again"
        )

    def exists(self, name: str) -> bool | None:
        """Whether the object is there; None when the store cannot say."""
        if self._master_gone():
            return None
        r = self.store.is_exist(name)
        self._failing = r < 0
        return None if r < 0 else bool(r)

    def _master_gone(self) -> bool:
        """After a failed call: whether the master's port refuses connections (see the class)."""
        if not self._failing:
            return False
        try:
            check_master(self.address, PROBE_TIMEOUT)
        except StoreUnavailableError:
            return True
        return False

    def healthy(self) -> bool:
        return self.store.health_check() == 0

    def close(self) -> None:
        self.store.close()


def connect(address: StoreAddress) -> StoreClient:
    """This process's client for ``address``'s master and client options (made once)."""
    k = (
        address.master,
        address.metadata,
        address.protocol,
        address.device,
        address.local,
        address.segment,
        address.buffer,
    )
    with _lock:
        client = _clients.get(k)
        if client is None:
            client = _clients[k] = StoreClient(address)
        return client


__all__ = ["GET_TRIES", "OBJECT_NOT_FOUND", "RPC_FAIL", "StoreClient", "check_master", "connect"]
