"""``layertap generate --out mooncake://...`` (docs/MOONCAKE.md): the run writes its shards into a
spool directory, as any run (resumable, read back for the summary), with the connector's
``mooncake`` option, so that each record is also put into Mooncake Store as soon as it is
written. The spool is ``--also-dir`` when given (kept: the dataset on disk too), else a
temporary directory removed after the run."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator

from layertap.errors import InvalidInputError, StoreUnavailableError
from layertap.generate.errors import GenerateError
from layertap.mooncake.address import is_store_address, parse_address
from layertap.mooncake.client import check_master


def _connector_args(given, address: str) -> dict:
    if isinstance(given, str):
        try:
            given = json.loads(given)
        except ValueError as e:
            raise GenerateError(f"--connector-args is not JSON: {e}") from None
    given = dict(given or {})
    if "mooncake" in given:
        raise GenerateError("--connector-args: mooncake is set by --out mooncake://...; leave it out")
    # The run reads its shards back for the summary (and resumes from them): they stay.
    return {**given, "mooncake": address, "mooncake_keep_shards": True}


@contextlib.contextmanager
def store_output(out: str, also_dir: str | os.PathLike | None, connector_args) -> Iterator[tuple[str, dict]]:
    """``(spool directory, connector arguments)`` for a run into the store ``out``; checks the
    address and that the master answers first (one line, before anything starts)."""
    try:
        address = parse_address(out)
        check_master(address)
    except (InvalidInputError, StoreUnavailableError) as e:
        raise GenerateError(str(e)) from None
    args = _connector_args(connector_args, out)
    if also_dir is not None:
        yield os.path.abspath(os.fspath(also_dir)), args
        return
    spool = tempfile.mkdtemp(prefix="layertap-spool-")
    try:
        yield spool, args
    finally:
        shutil.rmtree(spool, ignore_errors=True)


__all__ = ["is_store_address", "store_output"]
