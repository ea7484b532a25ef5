"""What the subcommands of ``layertap`` share: the usage error, opening the paths a command is
given, the ``PATH`` and ``--backend`` arguments."""

from __future__ import annotations

import argparse

from layertap._choices import READER_BACKENDS
from layertap.errors import LayertapError
from layertap.reader import open as layertap_open

PATHS_HELP = (
    "dataset directory (with or without a layertap-dataset.json manifest), manifest or shard file; "
    "several paths are parts of one dataset, in that order"
)


class UsageError(Exception):
    """The command cannot run; the message is printed and the exit status is 2."""


def add_backend_argument(p: argparse.ArgumentParser) -> None:
    """``--backend``: which reader (or recovery) implementation a command uses."""
    p.add_argument(
        "--backend",
        choices=READER_BACKENDS,
        default="auto",
        help="reader implementation (default: Rust when built)",
    )


def _listed_in(e: FileNotFoundError) -> str:
    """ " (a part listed in MANIFEST)" when the missing path was a manifest's part."""
    text = e.strerror or ""
    return text[text.index(" (") :] if " (a part listed in" in text else ""


def open_dataset(paths: list[str], backend: str, tensors: str = "auto"):
    """The dataset that one path, or several (parts of one dataset), name; its records hold
    ``tensors`` (``layertap.open``'s)."""
    try:
        return layertap_open(paths[0] if len(paths) == 1 else paths, backend=backend, tensors=tensors)
    except FileNotFoundError as e:
        raise UsageError(f"{e.filename}: no such file or directory{_listed_in(e)}") from None
    except (LayertapError, OSError, ImportError) as e:
        raise UsageError(str(e)) from None


__all__ = ["PATHS_HELP", "UsageError", "add_backend_argument", "open_dataset"]
