"""The pure-Python reference implementation of the format: a writer of whole shards for the
test vectors and the tests (``write``), the shard reader with its scan (``reader``, ``scan``) and
recovery (``recover``), built on the shared definitions of ``layertap._spec``. The Rust core is
tested against it.

The production path (``ShardWriter``, the Rust reader backend, ``layertap.follow``, the command
line, the vLLM connector) never imports this package: it is loaded only where a user picks it
(``backend="python"``) or where the extension is not built (``backend="auto"``). The
``ShardFile`` of ``shardfile`` also writes the shards of ``layertap mooncake pull``."""
