"""The pure-Python reference implementation of the format, which the Rust core is tested
against: a writer of whole shards for the test vectors (``write``), the reader with its scan and
recovery. The production path never imports it: it is loaded only for ``backend="python"`` or
where the extension is not built, and for ``shardfile``, which writes ``layertap pull``'s shards."""
