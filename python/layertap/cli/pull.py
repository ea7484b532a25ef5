"""``layertap pull mooncake://HOST:PORT/PREFIX DIR``: a dataset in Mooncake Store drained into
shards on disk (docs/MOONCAKE.md, "Durability"); exit status 1 if records were missing."""

from __future__ import annotations

import argparse
import os
import sys

from layertap._text import plural, problem_line
from layertap.cli.common import UsageError
from layertap.errors import LayertapError
from layertap.mooncake.address import parse_address
from layertap.mooncake.backend import open_address
from layertap.reader import open as layertap_open
from layertap.reader import shard_paths


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pull", help="copy a dataset out of Mooncake Store into shards on disk")
    p.add_argument("address", metavar="ADDRESS", help="the dataset: mooncake://MASTER_HOST:PORT/PREFIX[?options]")
    p.add_argument(
        "out", metavar="DIR", help="the dataset directory to write shards into (records already there are skipped)"
    )
    p.add_argument(
        "--shard-size", type=int, default=None, help="bytes per shard (default: the writers' shard_size, 1 GiB)"
    )
    p.set_defaults(func=cmd_pull)


def _keys_there(directory: str) -> set[str]:
    if not shard_paths(directory):
        return set()
    with layertap_open(directory) as ds:
        return set(ds.keys())


def cmd_pull(args) -> int:
    # The pull writes shards with the reference writer's shard files, which the production path
    # (every other command) never loads.
    from layertap.mooncake.pull import pull

    try:
        # The address and the store first: a malformed address or a master that does not answer
        # leaves no directory behind.
        parse_address(args.address)
        address, shards, problems = open_address(args.address)
        os.makedirs(args.out, exist_ok=True)
        have = _keys_there(args.out)
        report = pull(shards, args.out, have, address.dataset, args.shard_size)
    except (LayertapError, OSError) as e:
        raise UsageError(str(e)) from None
    for p in problems + report.missing + report.corrupt:
        print(problem_line(p), file=sys.stderr)
    verdict = "OK" if report.ok and not problems else "INCOMPLETE"
    print(
        f"{verdict}: {address}: {plural(report.records, 'record')} ({report.bytes:,} bytes) into "
        f"{plural(len(report.shards), 'shard')} in {args.out}; {report.skipped:,} already there, "
        f"{len(report.missing):,} missing, {len(report.corrupt):,} corrupt"
    )
    return 0 if report.ok and not problems else 1


__all__ = ["add_parser", "cmd_pull"]
