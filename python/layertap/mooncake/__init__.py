"""Records through Mooncake Store (docs/MOONCAKE.md): a dataset's records as objects of the
store, each its frame exactly as a shard holds it, under a dataset prefix, with the small index
objects readers list them by. Mooncake (``mooncake-transfer-engine-non-cuda`` on CPUs) is
imported only when a store is used.
"""
