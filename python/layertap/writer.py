"""Placeholder: the Rust writer wrapper is being written."""


class ShardWriter:
    pass
