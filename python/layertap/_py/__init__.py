"""Pure-Python reference implementation of the format (writer, reader)."""
