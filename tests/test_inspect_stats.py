"""``layertap inspect --stats``: what a drafter's trainer checks first (issue 34, item 11), on
shards written by the Rust writer with known lengths, loss masks and broken layers, through the
real command (``python -m layertap``)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from helpers import flip_bit, payload_offset, run_cli, run_python, shard_files, writer_class

LAYER_IDS = "[2, 16, 29]"
LENGTHS = [4, 5, 6, 7, 8, 10]
#: loss masks of the first four records: 2 of 4, 2 of 5, 6 of 6, 0 of 7 tokens learned from.
MASKS = {0: [0, 0, 1, 1], 1: [0, 0, 0, 1, 1], 2: [1] * 6, 3: [0] * 7}
HIDDEN = 8


def _record(i: int, tokens: int) -> dict:
    """Layer 2: +-1 (RMS 1), two NaN in record k2; layer 16: +-2, all zero in k1 and k3, one
    token's row zero in k5; layer 29: 0.25 everywhere (constant in every record)."""
    g = torch.Generator().manual_seed(i)
    signs = torch.randint(0, 2, (tokens, 3, HIDDEN), generator=g).float() * 2 - 1
    hs = signs * torch.tensor([1.0, 2.0, 0.0]).reshape(1, 3, 1)
    hs[:, 2, :] = 0.25
    if i in (1, 3):
        hs[:, 1, :] = 0
    if i == 2:
        hs[0, 0, 0] = hs[3, 0, 5] = float("nan")
    if i == 5:
        hs[4, 1, :] = 0
    tensors = {"hidden_states": hs.to(torch.bfloat16), "token_ids": torch.arange(tokens, dtype=torch.int64)}
    if i in MASKS:
        tensors["loss_mask"] = torch.tensor(MASKS[i], dtype=torch.uint8)
    return tensors


@pytest.fixture
def flagged(tmp_path):
    d = tmp_path / "flagged"
    with writer_class()(d, writer_id="w", codec="bp16-zstd", durability="none") as w:
        for i, n in enumerate(LENGTHS):
            w.submit(f"k{i}", _record(i, n), {"layer_ids": LAYER_IDS})
        w.flush()
    return d


@pytest.fixture
def clean(tmp_path):
    d = tmp_path / "clean"
    with writer_class()(d, writer_id="w", durability="none") as w:
        for i in range(3):
            g = torch.Generator().manual_seed(i)
            hs = torch.randn(5, 2, HIDDEN, generator=g).to(torch.bfloat16)
            w.submit(f"c{i}", {"hidden_states": hs, "token_ids": torch.arange(5)}, {"layer_ids": "[1, 3]"})
        w.flush()
    return d


def _stats(path, *args: str) -> dict:
    proc = run_cli("inspect", "--stats", "--json", path, *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["stats"]


WARNINGS = [
    "loss_mask all 0 (nothing to learn from) in 1 record (key k3)",
    "layer 2: NaN in 1 record (2 values; key k2)",
    "layer 16: all zero in 2 of 6 records (keys k1, k3)",
    "layer 16: 1 token whose row is all zero in 1 record (key k5)",
    "layer 29: constant (every value equal, not zero) in 6 of 6 records (keys k0, k1, k2, k3, k4 and 1 more)",
]


@pytest.mark.parametrize("backend", ["rust", "python"])
def test_stats_json_numbers_and_flags(flagged, backend):
    s = _stats(flagged, "--backend", backend)
    assert s["records"] == 6 and s["tokens"] == sum(LENGTHS) == 40
    assert s["lengths"] == {"min": 4, "median": 7, "mean": 6.67, "p90": 10, "p99": 10, "max": 10}
    # Bars of one token each from 4 to 10: [4, 5), ..., [10, 11).
    assert s["length_histogram"] == {"edges": list(range(4, 12)), "counts": [1, 1, 1, 1, 1, 0, 1]}
    mask = s["loss_mask"]
    assert (mask["records"], mask["records_without"], mask["tokens"], mask["ones"]) == (4, 2, 22, 10)
    assert mask["coverage"] == pytest.approx(10 / 22)
    # Coverage 0.5, 0.4, 1.0, 0.0 in bars of a tenth.
    assert mask["coverage_histogram"]["counts"] == [1, 0, 0, 0, 1, 1, 0, 0, 0, 1]
    assert mask["all_zero"] == {"count": 1, "keys": ["k3"]}
    layers = {layer["layer"]: layer for layer in s["layers"]}
    assert list(layers) == [2, 16, 29]
    two, sixteen, last = layers[2], layers[16], layers[29]
    assert (two["nan"], two["inf"], two["with_nan"]) == (2, 0, {"count": 1, "keys": ["k2"]})
    assert two["rms"] == 1.0 and (two["min"], two["max"]) == (-1.0, 1.0)  # over the finite values
    assert two["all_zero"]["count"] == two["constant"]["count"] == 0
    assert sixteen["all_zero"] == {"count": 2, "keys": ["k1", "k3"]}
    assert sixteen["zero_rows"] == 1 and sixteen["with_zero_rows"]["keys"] == ["k5"]
    nonzero = (40 - 5 - 7 - 1) * HIDDEN  # values of layer 16 that are +-2
    assert sixteen["rms"] == pytest.approx(math.sqrt(4 * nonzero / (40 * HIDDEN)))
    assert last["constant"]["count"] == 6 and last["rms"] == 0.25 and last["min"] == last["max"] == 0.25
    # Each record's RMS: layer 29's are all 0.25, in one bar.
    assert last["rms_histogram"] == {"edges": [0.25, 0.25], "counts": [6]}
    assert s["warnings"] == WARNINGS
    assert s["dtypes"] == {"bfloat16": 6} and s["lossy_records"] == 0 and s["corrupt_records"] == []


def test_stats_in_the_terminal(flagged):
    proc = run_cli("inspect", "--stats", flagged)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    lines = out.splitlines()
    assert lines[0].startswith(f"{flagged}: 1 shard (1 complete), 6 records, 40 tokens")  # the summary first
    assert "stats: 6 records read, 40 tokens; bfloat16 (6)" in lines
    assert "tokens per record: min 4, median 7, mean 6.67, p90 10, p99 10, max 10" in lines
    assert "  10  " + "█" * 40 + " 1" in lines  # the length histogram's last bar
    assert "loss mask: 4 of 6 records carry one; 10 of 22 tokens learned from (45.5%)" in lines
    assert "      0%-10%  " + "█" * 40 + " 1" in lines
    rows = {line.split()[0]: line.split() for line in lines if re.match(r"\s*(2|16|29)\s", line)}
    # layer, rms, min, max, NaN, Inf, all zero, constant, zero rows, then the RMS spread
    assert rows["2"][:9] == ["2", "1", "-1", "1", "2", "0", "0", "0", "0"]
    assert rows["16"][6:9] == ["2", "0", "1"]
    assert rows["29"][:9] == ["29", "0.25", "0.25", "0.25", "0", "0", "0", "6", "0"]
    at = lines.index("WARNING: 5 findings to look at before training:")
    assert lines[at + 1 :] == [f"  {w}" for w in WARNINGS]


def test_strict_exits_1_on_a_warning_and_0_on_a_clean_dataset(flagged, clean):
    bad = run_cli("inspect", "--strict", flagged)
    assert bad.returncode == 1 and "WARNING: 5 findings" in bad.stdout
    good = run_cli("inspect", "--strict", clean)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "no warnings: no layer all zero, constant, NaN or Inf; every record has tokens" in good.stdout
    assert "loss mask: none of the records carries one" in good.stdout
    # Without --stats, inspect reads no record: the same table as before, nothing more.
    plain = run_cli("inspect", flagged)
    assert plain.returncode == 0 and "stats:" not in plain.stdout and "WARNING" not in plain.stdout


def test_html_page_has_the_histograms_and_warnings(flagged, tmp_path):
    page = tmp_path / "stats.html"
    proc = run_cli("inspect", flagged, "--html", page)
    assert proc.returncode == 0, proc.stderr
    assert f"histograms: {page}" in proc.stdout and "WARNING: 5 findings" in proc.stdout
    text = page.read_text(encoding="utf-8")
    assert (
        text.startswith("<!DOCTYPE html>")
        and "<script" not in text
        and "http" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")
    )
    # lengths, loss-mask coverage, and one chart of RMS per record for each of the 3 layers
    assert text.count("<svg ") == 5
    assert 'class="warn"' in text and "WARNING: 5 findings to look at before training" in text
    assert "<th>layer</th>" in text and text.count('<tr class="flag">') == 3  # each layer has a finding
    for w in WARNINGS:
        assert f"<li>{w}</li>" in text
    # The length chart's bars, with their counts: seven bars, six records.
    lengths = text[text.index("tokens per record") : text.index("</figure>")]
    assert lengths.count('<rect class="bar"') == 7 and "<title>10 to 10: 1</title>" in lengths
    assert not list(tmp_path.glob("stats.html.tmp*"))


def test_html_at_a_directory_is_refused(flagged, tmp_path):
    proc = run_cli("inspect", flagged, "--html", tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith(f"--html must name a file to write, not the directory {tmp_path}")
    nowhere = run_cli("inspect", flagged, "--html", tmp_path / "no" / "stats.html")
    assert nowhere.returncode == 2
    assert (
        nowhere.stderr.strip()
        == f"layertap inspect: --html {tmp_path / 'no' / 'stats.html'}: its directory does not exist"
    )


def test_lossy_windowed_and_corrupt_records(tmp_path):
    """fp8 records are counted dequantized; windows and reductions are counted; a corrupt record
    is left out and named, the others still counted."""
    d = tmp_path / "d"
    ones = torch.ones(4, 2, HIDDEN)
    ones[:, 1] *= 3
    with writer_class()(d, writer_id="l", codec="zstd", lossy="fp8-e4m3", durability="none") as w:
        w.submit(
            "q0", {"hidden_states": ones.to(torch.bfloat16), "token_ids": torch.arange(4)}, {"layer_ids": "[0, 1]"}
        )
        w.flush()
    with writer_class()(d, writer_id="m", durability="none") as w:
        meta = {"layer_ids": "[0, 1]", "window_start": "0", "window_end": "8"}
        for i in range(3):
            hs = torch.full((1 if i else 2, 2, HIDDEN), float(i + 1), dtype=torch.bfloat16)
            hs[..., 0] = -hs[..., 0]
            w.submit(
                f"m{i}",
                {"hidden_states": hs, "token_ids": torch.arange(hs.shape[0])},
                meta | ({"reduction": "mean"} if i else {}),
            )
        w.flush()
    m_shard = next(p for p in shard_files(d) if "/m-" in p)
    offset, _, key = payload_offset(m_shard, 2)
    flip_bit(m_shard, offset + 5)
    s = _stats(d)
    assert s["records"] == 3 and s["corrupt_records"] == [key] == ["m2"]
    assert s["lossy_records"] == 1 and s["dtypes"] == {"float8_e4m3fn": 1, "bfloat16": 2}
    assert (s["windows"], s["reductions"]) == (2, {"mean": 1})
    layers = {layer["layer"]: layer for layer in s["layers"]}
    # Layer 1 of q0 is 3 everywhere: dequantized, not the stored fp8 448; m1's values are +-2.
    assert (layers[1]["min"], layers[1]["max"], layers[0]["min"], layers[0]["max"]) == (-2, 3, -2, 2)
    assert s["warnings"][0].startswith("1 corrupt record left out (keys m2; `layertap verify` lists them)")


def test_stats_without_torch(flagged):
    """The stats are numpy's: they run where torch is not installed."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from layertap.cli import main\n"
        "rc = main(['inspect', '--strict', sys.argv[1]])\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "sys.exit(rc)\n"
    )
    proc = run_python(code, str(flagged))
    assert proc.returncode == 1, proc.stderr
    assert "layer 2: NaN in 1 record (2 values; key k2)" in proc.stdout


def test_verify_warns_of_broken_layers_and_still_passes(flagged, clean):
    """verify: the values' findings are warnings (issue 36), the exit status stays 0."""
    proc = run_cli("verify", flagged)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"OK: {flagged}: 6 records ok, 0 bad, 0 problems")
    assert lines[1] == (
        "WARNING: 5 findings in the records' values (not a failure; `layertap inspect --stats` shows the numbers):"
    )
    assert lines[2:] == [f"  {w}" for w in WARNINGS]
    doc = json.loads(run_cli("verify", "--json", flagged).stdout)
    assert doc["ok"] is True and doc["warnings"] == WARNINGS
    skipped = run_cli("verify", "--no-values", flagged)
    assert skipped.returncode == 0 and skipped.stdout.splitlines() == lines[:1]
    good = run_cli("verify", clean)
    assert good.returncode == 0 and len(good.stdout.splitlines()) == 1 and "WARNING" not in good.stdout
    assert json.loads(run_cli("verify", "--json", clean).stdout)["warnings"] == []


def test_verify_does_not_warn_of_records_that_are_not_hidden_states(tmp_path):
    """The format holds any tensors: verify warns of hidden states' values only, inspect --stats
    says that a record has none."""
    with writer_class()(tmp_path / "d", writer_id="w", durability="none") as w:
        w.submit("x", {"embedding": torch.zeros(4, 8)})
        w.flush()
    proc = run_cli("verify", tmp_path / "d")
    assert proc.returncode == 0 and proc.stdout.count("\n") == 1, proc.stdout
    s = _stats(tmp_path / "d")
    assert s["warnings"] == ["1 record without hidden_states [tokens, layers, hidden] (key x)"]
