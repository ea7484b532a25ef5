"""Mooncake Store addresses: ``mooncake://MASTER_HOST:PORT/PREFIX?option=value&...``
(docs/MOONCAKE.md, "Addresses"), parsed and checked once into a ``StoreAddress``."""

from __future__ import annotations

import re
import socket
import urllib.parse
from dataclasses import dataclass

from layertap.errors import InvalidInputError

SCHEME = "mooncake://"
_SCHEME_NAME = "mooncake:"
#: A dataset prefix: path segments of ``[A-Za-z0-9._-]``, joined by ``/``.
_PREFIX = re.compile(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*")
MAX_PREFIX_LEN = 200

#: What this process lends the store when the address does not say (``segment``): nothing. Engines
#: and trainers come and go; the memory that holds records belongs on store nodes that stay
#: (``mooncake_client``, docs/MOONCAKE.md, "Where records live").
DEFAULT_SEGMENT_BYTES = 0
#: The client's transfer buffer (``buffer``): a get or put of an object goes through it.
DEFAULT_BUFFER_BYTES = 256 << 20
DEFAULT_METADATA = "P2PHANDSHAKE"
PROTOCOLS = ("tcp", "rdma")
_SIZE = re.compile(r"(\d+)([KMG]i?B?)?", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
OPTIONS = ("metadata", "protocol", "device", "local", "segment", "buffer", "node")
#: ``node=HOST:PORT``: a store node's ``mooncake_client -host`` and ``-port``.
_NODE = re.compile(r"([A-Za-z0-9.-]+):(\d{1,5})")


def _size(option: str, text: str) -> int:
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise InvalidInputError(f"mooncake address: {option}={text!r} is not a size (bytes, or e.g. 512MiB, 4GiB)")
    return int(m.group(1)) * _UNITS[(m.group(2) or "")[:1].lower()]


@dataclass(frozen=True)
class StoreAddress:
    """Where a dataset lives in Mooncake Store: the master, the prefix its objects' names start
    with, and how this process joins the store."""

    host: str
    port: int
    prefix: str
    metadata: str = DEFAULT_METADATA
    """The metadata service: ``P2PHANDSHAKE`` (none), or ``http://HOST:PORT/metadata``."""
    protocol: str = "tcp"
    device: str = ""
    """RDMA devices (``protocol=rdma``), e.g. ``mlx5_0,mlx5_1``."""
    local: str | None = None
    """This process's address as the other clients reach it; None: the address of the interface
    that routes to the master."""
    segment: int = DEFAULT_SEGMENT_BYTES
    buffer: int = DEFAULT_BUFFER_BYTES
    node: str | None = None
    """``HOST:PORT`` of a store node on this host (its ``mooncake_client -host`` and ``-port``)
    that reads go through, over shared memory (Mooncake's dummy client); None: this process's
    own client, over the network."""

    @property
    def master(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def node_endpoint(self) -> tuple[str, int]:
        """``node``'s host and port (an address with ``node``: ``parse_address`` checked its form)."""
        host, _, port = self.node.rpartition(":")
        return host, int(port)

    @property
    def dataset(self) -> str:
        """The address without the client options: what names the dataset."""
        return f"{SCHEME}{self.master}/{self.prefix}"

    def __str__(self) -> str:
        return self.dataset

    def local_host(self) -> str:
        if self.local:
            return self.local
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((self.host, self.port))  # no packet is sent: this only picks the route
                return s.getsockname()[0]
            except OSError:
                return "127.0.0.1"


def refuse_node(address: StoreAddress, text: str) -> None:
    """Raises InvalidInputError when a writer's address has ``node=``: it is for readers (what a
    writer puts goes through its own client, which ``node`` would replace; docs/MOONCAKE.md)."""
    if address.node is not None:
        raise InvalidInputError(
            f"{text}: node= is for readers (fetch, layertap.open, pull, follow); a writer puts through its own "
            "client: remove node= from the address it writes to"
        )


def is_store_address(path: object) -> bool:
    """Whether ``path`` is meant as a store address: anything that starts with ``mooncake:``
    (a ``mooncake:/host...`` typo is then refused by ``parse_address`` rather than taken for a
    directory to write into)."""
    return isinstance(path, str) and path[: len(_SCHEME_NAME)].lower() == _SCHEME_NAME


def parse_address(text: str) -> StoreAddress:
    """Parses ``mooncake://HOST:PORT/PREFIX[?option=value&...]``; raises InvalidInputError with
    one line naming what is wrong. Nothing is normalised: an address that does not read exactly
    so (a trailing or doubled ``/``, an option without a value) is refused, since taking it for
    another would put a dataset under a prefix the user did not name."""
    if not isinstance(text, str) or not text.startswith(SCHEME):
        raise InvalidInputError(f"{text!r} is not a Mooncake address: mooncake://MASTER_HOST:PORT/PREFIX")
    url = urllib.parse.urlsplit(text)
    if url.username or url.password or url.fragment or "#" in text:
        raise InvalidInputError(f"{text}: a Mooncake address has no user, password or #fragment")
    try:
        host, port = url.hostname, url.port
    except ValueError as e:
        raise InvalidInputError(f"{text}: bad master port ({e})") from None
    if not host or port is None or port == 0:
        raise InvalidInputError(
            f"{text}: name the master as HOST:PORT (its -rpc_port), e.g. mooncake://10.0.0.5:50051/hs"
        )
    prefix = url.path[1:]  # the path starts with the one "/" after HOST:PORT
    if not prefix or len(prefix) > MAX_PREFIX_LEN or not _PREFIX.fullmatch(prefix):
        raise InvalidInputError(
            f"{text}: the dataset prefix {prefix!r} must be 1 to {MAX_PREFIX_LEN} characters of "
            "[A-Za-z0-9._-] segments joined by single '/', with no leading or trailing '/', "
            "e.g. mooncake://HOST:PORT/runs/llama-hs"
        )
    values: dict = {}
    for field in url.query.split("&") if url.query else ():
        name, eq, value = field.partition("=")
        if name not in OPTIONS:
            raise InvalidInputError(f"{text}: unknown option {name!r}; the options are {', '.join(OPTIONS)}")
        if not eq or not value:
            raise InvalidInputError(f"{text}: option {name!r} has no value (write {name}=VALUE, or leave it out)")
        if name in values:
            raise InvalidInputError(f"{text}: option {name!r} is given twice")
        values[name] = urllib.parse.unquote(value)
    if "protocol" in values and values["protocol"] not in PROTOCOLS:
        raise InvalidInputError(f"{text}: protocol must be one of {', '.join(PROTOCOLS)}, not {values['protocol']!r}")
    for name in ("segment", "buffer"):
        if name in values:
            values[name] = _size(name, values[name])
    if values.get("buffer", DEFAULT_BUFFER_BYTES) < 16 << 20:
        raise InvalidInputError(f"{text}: buffer must be at least 16MiB (Mooncake's smallest transfer buffer)")
    if "node" in values:
        m = _NODE.fullmatch(values["node"])
        if m is None or not 0 < int(m.group(2)) < 65536:
            raise InvalidInputError(
                f"{text}: node must be HOST:PORT, a store node on this host as its mooncake_client -host and -port "
                f"give it (e.g. node=127.0.0.1:50052), not {values['node']!r}"
            )
        if "segment" in values or "local" in values or "protocol" in values or "device" in values:
            raise InvalidInputError(
                f"{text}: with node= this process reads through the store node and sets up no client of its own: "
                "leave out segment, local, protocol and device"
            )
    if 0 < values.get("segment", 0) < 16 << 20:
        raise InvalidInputError(f"{text}: segment must be 0 (lend no memory) or at least 16MiB")
    return StoreAddress(host, port, prefix, **values)


__all__ = ["SCHEME", "StoreAddress", "is_store_address", "parse_address", "refuse_node"]
