"""docs/CONNECTOR.md's support table is what the value tests reported, for exactly the families
they cover (tests/vllm/support_table.py). Fast: no engine, no vLLM import."""

from __future__ import annotations

import importlib
import json

import pytest
import support_table

from vllm_support import VLLM_WARNINGS

pytestmark = VLLM_WARNINGS


def declared() -> set[tuple[str, str]]:
    pairs = set()
    for name in support_table.MODULES:
        module = importlib.import_module(name)
        pairs |= {(arch, capture) for arch, capture in module.SUPPORT_TABLE}
    return pairs


def test_the_table_has_a_row_for_each_family_and_mode_the_tests_cover():
    stored = {(r["architecture"], r["capture"]) for r in support_table.read_rows(support_table.STORED)}
    want = declared()
    assert not want - stored, (
        f"covered by tests but not in the table (run the tests, then --write): {sorted(want - stored)}"
    )
    assert not stored - want, f"in the table but no test covers them: {sorted(stored - want)}"


def test_the_document_shows_the_stored_rows():
    assert support_table.main(["--check"]) == 0


def test_rows_are_written_only_when_asked(tmp_path, monkeypatch):
    out = tmp_path / "rows.jsonl"
    row = dict(vllm_class="llama.LlamaForCausalLM", compared="ids 0..N", worst_abs_error=2e-6, records=3)
    monkeypatch.delenv(support_table.ENV_VAR, raising=False)
    support_table.report("LlamaForCausalLM", "method", **row)
    assert not out.exists()
    monkeypatch.setenv(support_table.ENV_VAR, str(out))
    support_table.report("LlamaForCausalLM", "method", **row)
    support_table.report("LlamaForCausalLM", "method", **{**row, "worst_abs_error": 5e-6})
    rows = support_table.read_rows(out)
    assert [r["worst_abs_error"] for r in rows] == [2e-6, 5e-6]
    with pytest.raises(ValueError, match="capture must be one of"):
        support_table.report("LlamaForCausalLM", "eagle", **row)


def test_a_new_run_replaces_its_families_rows_and_keeps_the_others():
    def row(arch, capture, err, records=1, compared="c"):
        return dict(
            architecture=arch,
            vllm_class="m.C",
            capture=capture,
            compared=compared,
            worst_abs_error=err,
            records=records,
        )

    stored = [row("LlamaForCausalLM", "method", 1e-6), row("Gemma2ForCausalLM", "method+plugin", 9e-6)]
    new = [row("LlamaForCausalLM", "method", 3e-6, 2), row("LlamaForCausalLM", "method", 2e-6, 5)]
    merged = support_table.merge(stored, new)
    assert [(r["architecture"], r["worst_abs_error"], r["records"]) for r in merged] == [
        ("Gemma2ForCausalLM", 9e-6, 1),
        ("LlamaForCausalLM", 3e-6, 7),
    ]
    with pytest.raises(ValueError, match="disagree"):
        support_table.merge(
            [], [row("LlamaForCausalLM", "method", 1e-6), row("LlamaForCausalLM", "method", 1e-6, compared="d")]
        )
    table = support_table.render(merged)
    assert "| Gemma 2 | `Gemma2ForCausalLM` | `m.C` | method+plugin | c | 9.0e-06 | - | 1 |" in table.splitlines()
    json.dumps(merged)  # what --write stores
