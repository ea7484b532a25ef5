"""The README's Python examples run as written: each block defines or imports every name it uses
(a reader copies one block, not the page). Checked with ruff's undefined-name rule (F821)."""

from __future__ import annotations

import re
import subprocess
import sys

from helpers import REPO


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, code) of each ```python block."""
    return [
        (text[: m.start()].count("\n") + 2, m.group(1))
        for m in re.finditer(r"^```python\n(.*?)^```$", text, re.S | re.M)
    ]


def test_readme_examples_define_every_name(tmp_path):
    blocks = python_blocks((REPO / "README.md").read_text())
    assert len(blocks) >= 4
    problems = []
    for line, code in blocks:
        path = tmp_path / f"readme_line_{line}.py"
        path.write_text(code)
        proc = subprocess.run(
            [sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated", "--select", "F821", str(path)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            problems += [f"README.md block at line {line}: {m}" for m in re.findall(r"F821 (.*)", proc.stdout)]
    assert not problems, "\n".join(problems)
