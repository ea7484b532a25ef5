"""What docs/FORMAT.md defines, as code, in one place (each module says which part): both the
production path and the pure-Python reference (``layertap._py``) import from here, and nothing
here imports either of them. The Rust twin is ``rust/core`` (its ``format``, ``names``,
``codec``, ``blob`` and ``dtype`` modules). Only ``codecs`` and ``exphuf``, the reference's
payload decoding, stay out of the production path (it decodes in the Rust core).
"""
