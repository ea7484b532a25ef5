"""What docs/FORMAT.md defines, as code, in one place: limits, names and their checks (keys,
writer ids, shard file names), codec wire ids and names, dtypes, the byte layout of shards and
record payloads, and how a shard's lock is probed.

Both the production path (the writers' option checks, the readers, ``layertap.follow``, the
command line, the vLLM connector) and the pure-Python reference implementation (``layertap._py``)
import from here; nothing here imports either of them. The Rust twin is ``rust/core`` (its
``format``, ``names``, ``codec``, ``blob`` and ``dtype`` modules).

- ``format``: byte layout of file headers, frames, indexes and trailers; names and limits;
- ``levels``: the zstd levels writers accept;
- ``codecs``, ``exphuf``: payload decoding (``none``, ``zstd``, ``bp16-zstd``, ``exp-huf``), the
  Python reference's (``_py`` and ``layertap._decoder``'s python backend import it; production
  reads decode in the Rust core);
- ``blob``: the safetensors blob a record payload decodes to;
- ``record``: the hidden-states record's tensor and metadata names (docs/RECORD.md);
- ``dtypes``: element sizes, torch and numpy names of the safetensors dtypes;
- ``lock``: whether a live writer holds a shard.
"""
