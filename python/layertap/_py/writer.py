"""Placeholder: the pure-Python writer is being written."""


class PyShardWriter:  # replaced by the real implementation
    pass
