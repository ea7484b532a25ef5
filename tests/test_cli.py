"""The ``layertap`` command, run as ``python -m layertap`` on real shards."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from helpers import (
    HOLD_LOCK,
    VECTORS,
    Holder,
    cut_footer,
    flip_bit,
    payload_offset,
    run_cli,
    run_python,
    shard_files,
    subprocess_env,
    write_records,
)


@pytest.fixture
def dataset(tmp_path):
    d = tmp_path / "ds"
    write_records(d, 6, writer_id="a", prefix="a", codec="bp16-zstd", shard_size=1200)
    write_records(d, 2, writer_id="b", prefix="b", codec="none")
    return d


def test_inspect_table(dataset):
    proc = run_cli("inspect", dataset)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    lines = out.splitlines()
    n = len(shard_files(dataset))
    assert lines[0].startswith(f"{dataset}: {n} shards ({n} complete), 8 records, 24 tokens, ")
    # What every shard shares is said once; what differs (the codecs here) has a column.
    assert lines[1] == "layers 2, hidden 8, dtype bfloat16, codecs bp16-zstd (6), none (2), layer ids [1, 3]"
    header = next(line for line in lines if line.startswith("shard "))
    assert header.split() == ["shard", "state", "records", "tokens", "codecs", "raw", "stored", "ratio"]
    rows = {line.split()[0]: line for line in lines if ".lts " in line}
    assert "a-000000.lts" in rows and "b-000000.lts" in rows
    assert "complete" in rows["b-000000.lts"] and " none " in rows["b-000000.lts"]
    total = next(line for line in lines if line.startswith("total"))
    assert " 8 " in total and " 24 " in total and " mixed " in total
    assert "KiB" in total and total.split()[-1].endswith("x")
    assert max(len(line) for line in lines[lines.index("") :]) <= 100


def test_inspect_fits_100_columns_with_long_names_and_says_one_record(tmp_path):
    """vLLM's writer ids are 41 characters long (more on data-parallel ranks): shard names are
    shortened in the middle, keeping the shard number; a torn tail brings its column."""
    wid = "vllm-1b7c1f0e-3a0b-4b6f-9d7c-0123456789ab"
    write_records(tmp_path, 1, writer_id=wid, codec="bp16-zstd")
    one = run_cli("inspect", tmp_path).stdout.splitlines()
    assert one[0].startswith(f"{tmp_path}: 1 shard (1 complete), 1 record, 3 tokens, ")
    write_records(tmp_path, 3, writer_id=wid + "_dp1", prefix="dp1-", codec="none", shard_size=800)
    cut_footer(shard_files(tmp_path)[-1], b"x" * 11)
    lines = run_cli("inspect", tmp_path).stdout.splitlines()
    assert lines[0].startswith(f"{tmp_path}: 4 shards (3 complete, 1 open), 4 records, 12 tokens, ")
    table = lines[lines.index("") + 1 :]
    assert max(len(line) for line in table) <= 100, "\n".join(table)
    assert table[0].split() == [
        "shard",
        "state",
        "records",
        "tokens",
        "codecs",
        "raw",
        "stored",
        "ratio",
        "torn",
        "tail",
    ]
    assert "11 B" in table[-2] and "11 B" in table[-1]
    names = [line.split()[0] for line in table[1:-1]]
    assert names[0].endswith("89ab-000000.lts") and names[1].endswith("_dp1-000000.lts")
    assert all("…" in n for n in names) and len(set(names)) == len(names)
    doc = json.loads(run_cli("inspect", "--json", tmp_path).stdout)
    assert doc["shards"][0]["name"] == f"{wid}-000000.lts"  # whole in --json


def test_version():
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("layertap ") and proc.stdout.split()[1][0].isdigit()


def test_help_names_every_command():
    """The description, the first thing ``--help`` says, names what the tool does: generate and
    export too, not only inspect, verify and recover (issue 24, item 7)."""
    proc = run_cli("--help")
    assert proc.returncode == 0
    description = proc.stdout.split("\n\n")[1].lower()
    for command in ("generate", "inspect", "verify", "recover", "export"):
        assert command in description, (command, description)


def test_inspect_json(dataset):
    proc = run_cli("inspect", dataset, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert (doc["records"], doc["tokens"], doc["layers"], doc["hidden_size"], doc["dtype"]) == (8, 24, 2, 8, "bfloat16")
    assert doc["layer_ids"] == [1, 3] and doc["codecs"] == {"bp16-zstd": 6, "none": 2}
    assert doc["raw_bytes"] == sum(s["raw_bytes"] for s in doc["shards"]) and doc["ratio"] > 0
    names = [s["name"] for s in doc["shards"]]
    assert names == sorted(names) and names[-1] == "b-000000.lts"
    b = doc["shards"][-1]
    assert b["state"] == "complete" and b["records"] == 2 and b["ratio"] == 1.0 and b["torn_tail_bytes"] == 0
    assert b["writer"].startswith("layertap-rust ") and b["writer_id"] == "b" and b["problems"] == []


def test_inspect_open_shard(dataset):
    path = shard_files(dataset)[-1]
    cut_footer(path, b"x" * 11)
    doc = json.loads(run_cli("inspect", dataset, "--json").stdout)
    b = doc["shards"][-1]
    assert b["state"] == "open" and b["torn_tail_bytes"] == 11 and b["problems"][0]["kind"] == "torn_tail"
    table = run_cli("inspect", path).stdout
    assert "open" in table and "11 B" in table


def test_verify_good(dataset):
    proc = run_cli("verify", dataset)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"OK: {dataset}: 8 records ok, 0 bad, 0 problems in ")
    assert proc.stderr == ""
    quiet = run_cli("verify", "--quiet", dataset)
    assert quiet.returncode == 0 and quiet.stdout == "" and quiet.stderr == ""


def test_verify_corrupt_payload(dataset):
    path = shard_files(dataset)[-1]
    at, n, _key = payload_offset(path, 1)
    with open(path, "rb") as f:
        offset_of_frame = at - 56  # key "b1": header 48 + 2 bytes of key, padded to 56
        f.seek(offset_of_frame)
        assert f.read(4) == b"LTRF"
    flip_bit(path, at + n - 2)
    proc = run_cli("verify", dataset)
    assert proc.returncode == 1
    assert proc.stdout.startswith("FAILED:") and "1 bad" in proc.stdout
    line, hint = proc.stderr.splitlines()
    assert line.startswith(f"corrupt_record: {path} offset {offset_of_frame} key 'b1': ")
    assert "checksum" in line
    assert hint == (
        "hint: 1 shard with damaged records came from another writer: reading a damaged record raises "
        "CorruptRecordError; write those records again from their source (`layertap recover` leaves "
        "complete shards as they are)"
    )
    assert run_cli("verify", "--quiet", dataset).stderr == line + "\n"
    doc = json.loads(run_cli("verify", "--json", dataset).stdout)
    assert not doc["ok"] and doc["records_bad"] == 1 and doc["records_ok"] == 7
    assert doc["problems"][0]["kind"] == "corrupt_record" and doc["problems"][0]["key"] == "b1"
    assert doc["problems"][0]["offset"] == offset_of_frame


def test_a_damaged_record_of_generate_says_a_rerun_writes_it_again(tmp_path):
    """A new user's walk: verify failed on a flipped byte of a `layertap generate` output and
    recover said "already complete"; neither said that rerunning generate rewrites the row."""
    out = tmp_path / "out"
    write_records(out, 3, writer_id="gen-0", prefix="", metadata={"source": "layertap.generate"})
    write_records(out, 2, writer_id="other", prefix="x")
    (path, other) = shard_files(out)
    at, n, _key = payload_offset(path, 1)
    flip_bit(path, at + n - 2)
    proc = run_cli("verify", out)
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[1:] == [
        "hint: 1 shard with damaged records came from `layertap generate`: run the same command again (same "
        "--out) and it writes those rows again"
    ]
    assert json.loads(run_cli("verify", "--json", out).stdout)["hints"] == [proc.stderr.splitlines()[1][6:]]
    recovered = run_cli("recover", path, other)
    assert recovered.returncode == 0, recovered.stderr
    assert recovered.stdout.splitlines()[0] == (
        f"{path}: already complete (3 records); left as it is (recover completes shards whose writer died; "
        "`layertap verify` checks every record)"
    )


def test_verify_truncated_file(dataset):
    path = shard_files(dataset)[0]
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)  # index and trailer cut, part of a record too
    proc = run_cli("verify", dataset)
    assert proc.returncode == 1
    assert "torn_tail: " + path in proc.stderr


def test_recover_then_verify(tmp_path):
    shard = tmp_path / "w-000000.lts"
    shutil.copyfile(VECTORS / "open-torn.lts", shard)
    assert run_cli("verify", shard).returncode == 1
    proc = run_cli("recover", shard)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{shard}: recovered: 3 records indexed, 100 B of torn tail cut"
    ok = run_cli("verify", shard)
    assert ok.returncode == 0, ok.stderr
    again = run_cli("recover", "--json", shard)
    assert again.returncode == 0
    (r,) = json.loads(again.stdout)["shards"]
    assert r["was_complete"] and r["records"] == 3 and r["truncated_bytes"] == 0 and r["ok"]


@pytest.mark.parametrize("backend", ["python", "rust"])
def test_recover_keeps_damage_and_exits_1(tmp_path, backend):
    shard = tmp_path / "w-000000.lts"
    shutil.copyfile(VECTORS / "open-damaged.lts", shard)
    proc = run_cli("recover", "--backend", backend, "--json", shard)
    assert proc.returncode == 1, proc.stderr
    (r,) = json.loads(proc.stdout)["shards"]
    assert r["records"] == 2 and r["truncated_bytes"] == 20 and not r["ok"]
    assert [p["kind"] for p in r["problems"]] == ["corrupt_record", "damaged_region"]
    assert "corrupt_record: " in proc.stderr and "damaged_region: " in proc.stderr


def test_recover_locked_shard(tmp_path):
    shard = tmp_path / "w-000000.lts"
    shutil.copyfile(VECTORS / "open-torn.lts", shard)
    with Holder(HOLD_LOCK, str(shard)) as child:
        assert child.ready == "locked"
        proc = run_cli("recover", shard)
        assert proc.returncode == 1 and "locked" in proc.stderr and "Traceback" not in proc.stderr
        child.release()
    assert os.path.getsize(shard) == os.path.getsize(VECTORS / "open-torn.lts")


@pytest.mark.parametrize("command", ["inspect", "verify", "recover"])
def test_missing_path_exits_2(tmp_path, command):
    missing = tmp_path / "nope.lts"
    proc = run_cli(command, missing)
    assert proc.returncode == 2
    assert str(missing) in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["inspect", "verify", "recover"])
def test_not_a_shard_exits_2(tmp_path, command):
    bogus = tmp_path / "bogus.lts"
    bogus.write_text("this is a text file, not a shard\n")
    proc = run_cli(command, bogus)
    assert proc.returncode == 2
    assert str(bogus) in proc.stderr and "not a layertap shard" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_directory_without_shards_exits_2(tmp_path):
    proc = run_cli("verify", tmp_path)
    assert proc.returncode == 2 and str(tmp_path) in proc.stderr and "no shards" in proc.stderr


def test_usage_error_exits_2():
    proc = run_cli("frobnicate")
    assert proc.returncode == 2 and "usage:" in proc.stderr


@pytest.mark.parametrize(
    ("args", "want"),
    [
        (
            ["generate", "MODEL", "--data", "d.jsonl", "--out", "hs/", "--layres", "1,2"],
            "layertap generate: unrecognized argument: --layres (did you mean --layers?); see layertap generate --help",
        ),
        (
            ["generate", "MODEL", "--data", "d.jsonl", "--out", "hs/", "--max-rows", "3"],
            "layertap generate: unrecognized argument: --max-rows; see layertap generate --help",
        ),
        (
            ["verify", "hs/", "--quite"],
            "layertap verify: unrecognized argument: --quite (did you mean --quiet?); see layertap verify --help",
        ),
    ],
)
def test_a_misspelled_option_is_one_line_naming_the_subcommand(args, want):
    """A new user's typo got argparse's usage of the top-level ``layertap`` (not of the subcommand)
    and 'layertap: error: unrecognized arguments: --layres 1,2', three lines without the option
    meant. Now one line: the subcommand, the unknown option (its value left out), the closest
    option of that subcommand when one is close, and where the options are listed."""
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert proc.stderr.strip() == want


def test_verify_progress_bar(dataset):
    proc = run_cli("verify", "--progress", dataset)
    assert proc.returncode == 0
    assert "8/8" in proc.stderr  # tqdm's counter


def test_inspect_shows_shards_being_written(tmp_path):
    shard = tmp_path / "w-000000.lts"
    shutil.copyfile(VECTORS / "open-torn.lts", shard)
    with Holder(HOLD_LOCK, str(shard)) as child:
        assert child.ready == "locked"
        doc = json.loads(run_cli("inspect", "--json", tmp_path).stdout)
        assert doc["shards"][0]["state"] == "being_written" and doc["shards"][0]["being_written"]
        table = run_cli("inspect", tmp_path).stdout
        assert "being written" in table and "1 being written" in table
        assert run_cli("verify", tmp_path).returncode == 0  # a live writer's torn tail is fine
        child.release()


def test_human_bytes_and_plural():
    from layertap._text import human_bytes, plural

    assert human_bytes(0) == "0 B" and human_bytes(1023) == "1023 B"
    assert human_bytes(1024) == "1.0 KiB" and human_bytes(1536) == "1.5 KiB"
    assert human_bytes(5 << 20) == "5.0 MiB" and human_bytes(3 << 30) == "3.0 GiB"
    assert human_bytes(None) == "-"
    assert plural(1, "shard") == "1 shard" and plural(0, "shard") == "0 shards"
    assert plural(1200, "record") == "1,200 records"


def test_import_layertap_loads_no_command_line():
    """The library (``import layertap``, ``layertap.generate``) loads none of the command line's
    modules: the text helpers that generate's progress and summary share with it are a module
    below both (issue 22). (argparse itself may be loaded: crc32c imports it.)"""
    proc = run_python(
        "import json, sys, layertap\n"
        "print(json.dumps(sorted(m for m in sys.modules if m == 'layertap.cli' or m.startswith('layertap.cli.'))))"
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def test_only_generate_imports_layertap_generate(dataset):
    """Issue 35, item 5: ``layertap inspect`` (and ``--help``, and ``import layertap``) imports
    nothing of layertap.generate, whose import cost each such process a quarter of a second;
    ``dir(layertap)`` lists it, ``layertap generate --help`` and ``layertap.generate(...)`` find it."""
    proc = run_python(
        "import contextlib, io, json, sys\n"
        "import layertap\n"
        "from layertap.cli import main\n"
        "seen = ['layertap.generate' in sys.modules, 'generate' in dir(layertap)]\n"
        "for argv in (['inspect', sys.argv[1]], ['verify', sys.argv[1]], ['--help'], ['generate', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main(argv)\n"
        "    seen.append('layertap.generate' in sys.modules)\n"
        "seen.append(callable(layertap.generate) and layertap.generate is sys.modules['layertap.generate'])\n"
        "print(json.dumps(seen))",
        str(dataset),
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [False, True, False, False, False, True, True]


@pytest.mark.parametrize("args", [["inspect", "--json"], ["inspect"], ["verify", "--json"]])
def test_closed_pipe_ends_quietly(dataset, args):
    """``layertap inspect --json DIR | head``: the reader has gone before the output is written.
    The command ends as Unix tools do on a closed pipe, without a traceback or "Exception
    ignored" message, with the status of a process ended by SIGPIPE (141, as a shell reports
    it)."""
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to stdout now fails with EPIPE
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "layertap", *args, str(dataset)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            env=subprocess_env(),
        )
    finally:
        os.close(write_end)
    assert proc.stderr == ""
    assert proc.returncode == 141


def _window_examples() -> list[str]:
    """Every ``--window`` value docs/GENERATE.md and ``layertap generate --help`` show (``P``, the
    prompts' length, as 100), and the forms of a Python slice."""
    import re
    from pathlib import Path

    from layertap.cli import build_parser

    docs = (Path(__file__).parent.parent / "docs" / "GENERATE.md").read_text()
    row = next(line for line in docs.splitlines() if line.startswith("| `--window START:END`"))
    sub = build_parser()._subparsers._group_actions[0].choices["generate"]
    help_text = " ".join(sub.format_help().split())
    shown = re.findall(r"--window (\S+?)`", docs) + re.findall(r"`(-?\d*:-?\d*)`", row)
    shown += re.findall(r"(?:e\.g\.|or) (-?\d*:-?\d*)", help_text)
    assert "-64:" in shown and "-255:" in shown and "P:" in shown and "-64:-1" in shown, shown
    return sorted({w.replace("P", "100") for w in shown} | {"-64:-1", ":-1", "-1:", "10:-5", "-5:10"})


@pytest.mark.parametrize("window", _window_examples())
@pytest.mark.parametrize("form", ["separate", "joined"])
def test_generate_parses_every_documented_window(window, form):
    """Issue 34, item 7: ``--window -64:`` failed with 'expected one argument' (argparse took the
    value for an option); only ``--window=-64:`` worked."""
    from layertap.cli import build_parser

    given = ["--window", window] if form == "separate" else [f"--window={window}"]
    args = build_parser().parse_args(["generate", "MODEL", "--data", "d.jsonl", *given, "--out", "hs/", "--json"])
    assert (args.window, args.out, args.json) == (window, "hs/", True)
    args = build_parser().parse_args(["generate", "MODEL", "--data", "d.jsonl", "--out", "hs/", "--win", window])
    assert args.window == window
