"""Checks a wheel that ``make wheel`` built (run by it, not collected by pytest): its file name
carries the platform tag asked for, ``auditwheel`` finds the extension consistent with that tag
(no glibc symbol newer than it allows), and installing it pulls neither torch nor vLLM unless
their extras are asked for.

    python tests/check_wheel.py --platform manylinux_2_28 dist/layertap-*.whl
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import zipfile


def check(wheel: str, want_platform: str) -> list[str]:
    """What is wrong with ``wheel`` (empty: nothing)."""
    problems = []
    tag = f"{want_platform}_{platform.machine()}"
    platforms = os.path.basename(wheel).removesuffix(".whl").split("-")[-1].split(".")
    if tag not in platforms:
        problems.append(f"the file name's platform tags are {platforms}, not {tag}")
    auditwheel = os.path.join(os.path.dirname(sys.executable), "auditwheel")
    shown = subprocess.run([auditwheel, "show", wheel], capture_output=True, text=True)
    text = " ".join(shown.stdout.split())
    if shown.returncode != 0 or f'consistent with the following platform tag: "{tag}"' not in text:
        problems.append(f"auditwheel does not find it consistent with {tag}: {text or shown.stderr.strip()}")
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        requires = [line for line in z.read(name).decode().splitlines() if line.startswith("Requires-Dist:")]
    for line in requires:
        if re.match(r"Requires-Dist: (torch|vllm)\b", line) and "extra ==" not in line:
            problems.append(f"{line!r}: only an extra may require it")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--platform", required=True, help="e.g. manylinux_2_28")
    parser.add_argument("wheels", nargs="+")
    args = parser.parse_args()
    status = 0
    for wheel in args.wheels:
        problems = check(wheel, args.platform)
        for p in problems:
            print(f"{wheel}: {p}", file=sys.stderr)
        if not problems:
            print(f"{wheel}: {args.platform} wheel, checked")
        status |= bool(problems)
    return status


if __name__ == "__main__":
    sys.exit(main())
