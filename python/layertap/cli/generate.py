"""``layertap generate`` on the command line (docs/GENERATE.md): the subcommand's arguments and
what it prints. Exit status: 0 every usable row has its record (bad rows are listed, not
failures); 1 the run failed or left rows without their record (run it again); 2 bad input,
found before the engine started, or data whose every row is bad (nothing to write)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import traceback

from layertap._choices import CAPTURE_MODES, DEFAULT_CAPTURE
from layertap.generate import GenerateError, generate, vllm_log
from layertap.generate.errors import EngineStartError
from layertap.generate.progress import PROGRESS_MODES, WriterFailedError
from layertap.generate.render import LOSS_MASK_MODES
from layertap.generate.summary import every_row_bad, most_common_reason, summary_text


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Adds ``generate`` to the ``layertap`` command's subcommands."""
    p = sub.add_parser(
        "generate",
        help="write the hidden states of a prompt dataset (resumable)",
        description="Run MODEL in vLLM over every row of DATA and write the hidden states of the chosen "
        "layers into DIR, one record per row keyed by its index. Rerun with the same --out to "
        "resume. See docs/GENERATE.md.",
    )
    p.add_argument("model", metavar="MODEL", help="model name or path, as vLLM takes it")
    p.add_argument(
        "--data",
        required=True,
        metavar="DATA",
        help="JSONL file, Parquet file, or Hugging Face datasets directory (save_to_disk) with "
        "input_ids, messages or prompt, and optionally loss_mask",
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="dataset directory (created; resumed when it holds an earlier run's dataset; a directory holding "
        "other files is refused unless --allow-other-files), or a dataset in Mooncake Store: "
        "mooncake://MASTER_HOST:PORT/PREFIX (docs/MOONCAKE.md)",
    )
    p.add_argument(
        "--allow-other-files",
        action="store_true",
        help="write into --out (or --also-dir) although it holds files that are not a layertap dataset's "
        "(they are left as they are; readers ignore them)",
    )
    p.add_argument(
        "--also-dir",
        metavar="DIR",
        help="with --out mooncake://...: keep the run's shards in DIR too (resumable; else a temporary spool)",
    )
    p.add_argument(
        "--layers",
        metavar="IDS",
        help="comma-separated layer ids in vLLM numbering (N = the last layer's output before "
        "the final norm); default EAGLE-3's 2,N//2,N-3,N",
    )
    p.add_argument(
        "--capture",
        choices=CAPTURE_MODES,
        default=DEFAULT_CAPTURE,
        help="how vLLM caches the hidden states: method (vLLM's extract_hidden_states, the default) or "
        "in-model (layertap's model class, no speculative decoding: faster decode; docs/CONNECTOR.md)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=1,
        metavar="N",
        help="tokens to generate per row (default: %(default)s: prefill only)",
    )
    p.add_argument(
        "--include-output-tokens", action="store_true", help="record the generated tokens too (all but the last)"
    )
    p.add_argument(
        "--window",
        metavar="START:END",
        help="record only positions [START, END) of each row's recorded tokens (either may be empty; "
        "negative counts from the end), e.g. 100: or -64: or -64:-1 (docs/CONNECTOR.md, 'Windows and reductions')",
    )
    # argparse takes a value that begins with '-' and is not a number (-64:) for an option, so
    # `--window -64:` failed with "expected one argument": such a value is joined to its option.
    p.parse_known_args = _windows_joined(p.parse_known_args)  # type: ignore[method-assign]
    p.add_argument(
        "--reduction",
        choices=("last", "mean"),
        help="store one vector per layer per row ([1, layers, hidden]): the window's last position, or the mean of its positions",
    )
    p.add_argument(
        "--max-len",
        type=int,
        metavar="N",
        help="longest prompt in tokens; longer rows are skipped and listed "
        "(default: the model's context minus --max-tokens)",
    )
    p.add_argument(
        "--loss-mask",
        choices=LOSS_MASK_MODES,
        default="auto",
        help="the loss mask stored with each record: auto (the data's loss_mask column, else for chats the "
        "assistant's turns when the chat template marks them with {%% generation %%}), assistant (those turns; "
        "refused without the markers), none (default: %(default)s; docs/GENERATE.md, 'Loss masks')",
    )
    p.add_argument("--limit", type=int, metavar="N", help="use only the first N rows")
    p.add_argument(
        "--engine-args", metavar="JSON", help="other vLLM LLM() arguments, e.g. '{\"tensor_parallel_size\": 2}'"
    )
    p.add_argument("--sampling-args", metavar="JSON", help="SamplingParams arguments, e.g. '{\"temperature\": 0}'")
    p.add_argument(
        "--connector-args",
        metavar="JSON",
        help='connector options (docs/CONNECTOR.md), e.g. \'{"codec": "zstd"}\'; default Rust writer, bp16-zstd',
    )
    p.add_argument(
        "--data-parallel-size",
        type=int,
        metavar="N",
        help="run N engines (each on its own tensor_parallel_size GPUs), each writing a part of --out; "
        "rows are dealt out among them (docs/SCALE.md)",
    )
    p.add_argument(
        "--ray",
        metavar="ADDRESS",
        dest="ray_address",
        help="run the engines on the Ray cluster at ADDRESS ('auto': the one this machine belongs to); "
        "--out must be on a file system every node sees",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show vLLM's log on stderr (by default it goes to vllm.log in --out, and only its errors to stderr)",
    )
    p.add_argument(
        "--progress",
        choices=PROGRESS_MODES,
        default="auto",
        help="bar (a terminal), lines (periodic lines), none; default: bar on a terminal, else lines",
    )
    p.add_argument(
        "--progress-interval",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds between progress lines (default: %(default)s)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    vllm_log.configure(args.verbose)  # before vLLM is imported (a run imports it)
    log = vllm_log.log_file  # where to look, named in the lines of a failed run (when it exists)

    try:
        summary = generate(
            args.model,
            args.data,
            args.out,
            layers=args.layers,
            max_tokens=args.max_tokens,
            include_output_tokens=args.include_output_tokens,
            window=args.window,
            reduction=args.reduction,
            max_len=args.max_len,
            limit=args.limit,
            engine_args=args.engine_args,
            sampling_args=args.sampling_args,
            connector_args=args.connector_args,
            progress=args.progress,
            progress_interval=args.progress_interval,
            data_parallel_size=args.data_parallel_size,
            ray_address=args.ray_address,
            capture=args.capture,
            also_dir=args.also_dir,
            allow_other_files=args.allow_other_files,
            loss_mask=args.loss_mask,
        )
    except GenerateError as e:
        print(f"layertap generate: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print("layertap generate: interrupted; run the same command again to resume", file=sys.stderr)
        summary = getattr(e, "summary", None)  # GenerateInterrupted: the engine stopped, its records read back
        if summary is not None:
            print(json.dumps(summary, indent=2) if args.json else summary_text(summary))
        return 130
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
        joined: list[str] = []
        i = 0
        while i < len(args):
            arg = args[i]
            if arg == "--":
                joined += args[i:]
                break
            if len(arg) > 3 and "--window".startswith(arg) and i + 1 < len(args) and _WINDOW_VALUE.match(args[i + 1]):
                joined.append(f"{arg}={args[i + 1]}")
                i += 2
                continue
            joined.append(arg)
            i += 1
        return parse_known_args(joined, namespace)

    return parse


def _see(path: str | None) -> str:
    return f" (vLLM's log: {path})" if path else ""


def _exit_status(summary: dict) -> int:
    """0 for a complete dataset; 2, with one line saying why, for data without a usable row (a
    rerun of the same command cannot succeed); 1 otherwise (rerun to resume)."""
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
