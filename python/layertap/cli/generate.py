"""``layertap generate`` on the command line (docs/GENERATE.md): the subcommand's arguments and
what it prints. Exit status: 0 every usable row has its record (bad rows are listed, not
failures); 1 the run failed or left rows without their record (run it again); 2 bad input,
found before the engine started, or data whose every row is bad (nothing to write)."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import traceback

# layertap.generate (its options included) is imported only when ``generate`` is the command:
# importing it costs a quarter of a second, which every other subcommand's process paid before.


def add_parser(sub: argparse._SubParsersAction, *, deferred: bool = False) -> None:
    """Adds ``generate`` to the ``layertap`` command's subcommands. ``deferred``: its arguments
    are added when the subcommand parses its arguments or shows its help, not before (``layertap
    inspect`` then imports nothing of layertap.generate); ``layertap --help`` shows the same."""
    p = sub.add_parser(
        "generate",
        help="write the hidden states of a prompt dataset (resumable)",
        description="Run MODEL in vLLM over every row of DATA and write the hidden states of the chosen "
        "layers into DIR, one record per row keyed by its index. Rerun with the same --out to "
        "resume. See docs/GENERATE.md.",
    )
    p.set_defaults(func=run)
    if not deferred:
        _add_arguments(p)
        return

    def added_first(name: str):
        def call(*args, **kwargs):
            for each in _DEFERRING:
                delattr(p, each)  # argparse's own methods again
            _add_arguments(p)
            return getattr(p, name)(*args, **kwargs)

        return call

    for name in _DEFERRING:
        setattr(p, name, added_first(name))


#: The parser's methods that need its arguments: parsing, and the usage and help it prints (for
#: ``layertap generate --help`` and for its errors, both of which parse first).
_DEFERRING = ("parse_known_args", "format_usage", "format_help")


def _add_arguments(p: argparse.ArgumentParser) -> None:
    from layertap.generate.options import add_arguments

    add_arguments(p)  # every option of a run: GenerateOptions' fields
    # argparse takes a value that begins with '-' and is not a number (-64:) for an option, so
    # `--window -64:` failed with "expected one argument": such a value is joined to its option.
    p.parse_known_args = _windows_joined(p.parse_known_args)  # type: ignore[method-assign]
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show vLLM's log on stderr (by default it goes to vllm.log in --out, and only its errors to stderr)",
    )


def run(args: argparse.Namespace) -> int:
    from layertap.generate import GenerateError, generate, vllm_log
    from layertap.generate.errors import EngineStartError
    from layertap.generate.options import from_namespace
    from layertap.generate.progress import WriterFailedError
    from layertap.generate.summary import summary_text

    vllm_log.configure(args.verbose)  # before vLLM is imported (a run imports it)
    log = vllm_log.log_file  # where to look, named in the lines of a failed run (when it exists)

    terminated = []

    def stop_as_on_ctrl_c(signum, frame):
        # SIGTERM (kill PID, timeout, a job scheduler) ended the process at once: vLLM 0.32's
        # engine processes, which watch nothing of it, went on holding the shard (as after kill
        # -9). Ctrl-C's path stops the engine and prints the summary; here it does the same.
        terminated.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop_as_on_ctrl_c)
    # A command started with SIGINT ignored (`layertap generate ... &` in a script: the shell
    # ignores it in background jobs, and Python then installs no KeyboardInterrupt) still had
    # its engine stopped by SIGINT to its process group, since vLLM's engine processes set
    # handlers of their own: the run failed with EngineDeadError and a traceback. It is Ctrl-C.
    sigint_ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if sigint_ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        summary = generate(from_namespace(args))
    except GenerateError as e:
        print(f"layertap generate: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print("layertap generate: interrupted; run the same command again to resume", file=sys.stderr)
        summary = getattr(e, "summary", None)  # GenerateInterrupted: the engine stopped, its records read back
        if summary is not None:
            print(json.dumps(summary, indent=2) if args.json else summary_text(summary))
        return 128 + terminated[0] if terminated else 130
    except EngineStartError as e:
        if not vllm_log.write_traceback():  # into vLLM's log, beside vLLM's own, when there is one
            traceback.print_exc()
        print(
            f"layertap generate: vLLM's engine did not start: {e}; this run wrote nothing: fix the cause "
            f"({f'vLLM log: {e.log}' if e.log else 'the traceback above'}), then run the command again",
            file=sys.stderr,
        )
        return 1
    except WriterFailedError as e:  # a full disk: one line naming the directory and the space left
        print(f"layertap generate: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # the engine failed while running: the traceback, then one line saying what to do
        traceback.print_exc()
        first = str(e).strip().splitlines()
        print(
            f"layertap generate: the run failed: {type(e).__name__}: {first[0] if first else ''}"
            f"{_see(log(os.path.abspath(args.out)))}; run the same command again to resume",
            file=sys.stderr,
        )
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        if sigint_ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(summary_text(summary))
    return _exit_status(summary)


#: What ``--window`` takes: ``START:END``, either side empty or an integer (negative from the end).
_WINDOW_VALUE = re.compile(r"^-?\d*:-?\d*$")


def _windows_joined(parse_known_args):
    """``parse_known_args`` taking ``--window -64:`` as ``--window=-64:`` (and so any prefix of
    ``--window`` that argparse takes for it), before ``--`` only."""

    def parse(args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        end = args.index("--") if "--" in args else len(args)
        for i in reversed(range(end - 1)):  # from the end, so that joining keeps the earlier indices
            if len(args[i]) > 3 and "--window".startswith(args[i]) and _WINDOW_VALUE.match(args[i + 1]):
                args[i : i + 2] = [f"{args[i]}={args[i + 1]}"]
        return parse_known_args(args, namespace)

    return parse


def _see(path: str | None) -> str:
    return f" (vLLM's log: {path})" if path else ""


def _exit_status(summary: dict) -> int:
    """0 for a complete dataset; 2, with one line saying why, for data without a usable row (a
    rerun of the same command cannot succeed); 1 otherwise (rerun to resume)."""
    from layertap.generate.summary import every_row_bad, most_common_reason

    if summary["complete"]:
        return 0
    if every_row_bad(summary):
        reason, count = most_common_reason(summary["bad_rows"])
        print(
            f"layertap generate: no record written: all {summary['rows']:,} rows are bad, {count:,} of them: "
            f"{reason}; fix the data (the summary lists every bad row)",
            file=sys.stderr,
        )
        return 2
    return 1


__all__ = ["add_parser", "run"]
