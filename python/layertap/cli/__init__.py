"""The ``layertap`` command: ``generate`` a dataset with vLLM, ``inspect``, ``verify`` and ``recover``
datasets and shards, ``export`` them to a drafter trainer's files, ``pull`` one out of Mooncake Store,
and ``doctor``: what this environment holds and what is wrong between its parts.

Here: the top-level parser and ``main``; each subcommand's module adds its arguments and the
function that runs it with ``add_parser(subparsers)``, and ``common`` holds what they share.

Exit status: 0 all good; 1 problems found (corrupt records, torn tails, a shard that could not
be recovered, a problem ``doctor`` found); 2 the command could not run (missing path, not a
shard, bad arguments); 141 the reader of its output went away (``layertap inspect --json DIR |
head``), quietly, as for any Unix tool ended by SIGPIPE.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys

from layertap.cli import doctor, export, generate, inspect, pull, recover, verify
from layertap.cli.common import UsageError

#: The subcommands, in the order ``layertap --help`` lists them: first the one that makes a dataset.
SUBCOMMANDS = (generate, inspect, verify, recover, export, pull, doctor)


def build_parser(*, deferred: bool = False) -> argparse.ArgumentParser:
    """The ``layertap`` command's parser. ``deferred``: ``generate``'s arguments are added only when
    that subcommand parses or shows its help (they import layertap.generate), as ``main`` does."""
    parser = argparse.ArgumentParser(
        prog="layertap",
        description="Generate hidden-states datasets with vLLM, inspect, verify and recover them, and export them "
        "for the drafter trainers speculators and SpecForge.",
    )
    parser.add_argument(
        "--version",
        action=doctor.VersionAction,
        help="show layertap's version and those of its extension, Python, torch, vLLM and transformers, and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in SUBCOMMANDS:
        if command is generate:
            generate.add_parser(sub, deferred=deferred)
        else:
            command.add_parser(sub)
    return parser


#: The exit status of a command whose reader closed its pipe: a shell's for a process ended by
#: SIGPIPE (128 + 13), as ``inspect | head`` reports for any Unix tool.
CLOSED_PIPE_STATUS = 141


def _closed_pipe() -> int:
    """stdout's reader has gone: point stdout at /dev/null, so that the interpreter's last flush
    at exit does not fail again (and print "Exception ignored"), and end quietly."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return CLOSED_PIPE_STATUS


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    parser = build_parser(deferred=True)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        print(_unrecognized(parser, args.command, unknown), file=sys.stderr)
        return 2
    try:
        status = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe can still be caught
        return status
    except BrokenPipeError:
        # Python ignores SIGPIPE (so a closed socket in vLLM cannot kill a run); a closed stdout
        # then raises here instead of ending the process as it ends other tools.
        return _closed_pipe()
    except UsageError as e:
        print(f"layertap {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _unrecognized(parser: argparse.ArgumentParser, command: str, unknown: list[str]) -> str:
    """The line for arguments ``command`` does not take. argparse's own error printed the usage
    of the top-level ``layertap`` (the subcommand leaves unknown arguments to its parent) and
    named none of the subcommand's options; this names the unknown options (without the values
    that followed them), the closest option of the subcommand for a misspelling, and --help."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    known = [s for action in sub._actions for s in action.option_strings if s.startswith("--")]
    options = [u.split("=", 1)[0] for u in unknown if u.startswith("-") and not u.lstrip("-")[:1].isdigit()]
    named = options or unknown
    close = difflib.get_close_matches(options[0], known, n=1, cutoff=0.8) if options else []
    hint = f" (did you mean {close[0]}?)" if close else ""
    plural = "s" if len(named) > 1 else ""
    return f"layertap {command}: unrecognized argument{plural}: {' '.join(named)}{hint}; see layertap {command} --help"


__all__ = ["CLOSED_PIPE_STATUS", "SUBCOMMANDS", "build_parser", "main"]
