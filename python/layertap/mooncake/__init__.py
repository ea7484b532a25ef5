"""Records through Mooncake Store (docs/MOONCAKE.md): a dataset's records as objects of the
store, each its frame exactly as a shard holds it, under a dataset prefix, with the small index
objects readers list them by.

- ``address``: ``mooncake://MASTER_HOST:PORT/PREFIX?...``, parsed once;
- ``layout``: the objects' names and the JSON of the index objects;
- ``client``: this process's Mooncake client, and the start-up check of the master;
- ``logs``: Mooncake's own log into files rather than onto stderr;
- ``publisher``: putting records (the connector's forwarder, ``layertap.vllm.mooncake_forwarder``);
- ``backend``: reading, as a shard backend of ``layertap.open``'s ``Dataset``;
- ``pull``: draining a dataset into shards on disk.

Mooncake (``mooncake-transfer-engine-non-cuda`` on CPUs) is imported only when a store is used.
"""
