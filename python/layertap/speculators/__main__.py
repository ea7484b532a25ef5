"""``python -m layertap.speculators ARGS...``: speculators' command line with the ``layertap``
hidden-states backend registered.

- ``python -m layertap.speculators train --hidden-states-backend layertap ...`` is
  ``speculators train ...`` (any speculators command works: ``prepare-data``, ``convert``...);
- ``python -m layertap.speculators path/to/script.py ARGS...`` runs a speculators script (its
  ``scripts/launch_vllm.py``, ``scripts/train.py``) as ``__main__`` with the backend registered;
- ``torchrun ... -m layertap.speculators train ...`` for several GPUs.

speculators reads its backend registry once, at import, and has no plugin entry points, so the
registration has to come first. The launcher also checks the backend's training arguments once
speculators has resolved them, before it builds the draft model (``train_checks``).
"""

from __future__ import annotations

import os
import runpy
import sys

from layertap._install import pip_install_keeping_torch

USAGE = """usage: python -m layertap.speculators COMMAND [ARGS...]   (speculators' command line)
       python -m layertap.speculators SCRIPT.py [ARGS...]  (a speculators script)

Registers layertap's hidden-states backend, then runs speculators; select it with
--hidden-states-backend layertap (docs/TRAINING.md)."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    try:
        from layertap.speculators import register

        register()
    except ImportError as e:
        print(
            f"layertap.speculators: speculators' hs_connectors is not installed ({e}); "
            f"{pip_install_keeping_torch('speculators')}",
            file=sys.stderr,
        )
        return 2
    if argv[0].endswith(".py"):
        script = argv[0]
        if not os.path.isfile(script):
            print(f"layertap.speculators: {script}: no such script", file=sys.stderr)
            return 2
        sys.argv = argv
        runpy.run_path(script, run_name="__main__")
        return 0
    from speculators.cli import app

    from layertap.speculators.train_checks import install

    install()  # train's backend arguments checked before speculators builds anything
    sys.argv = ["speculators", *argv]
    app(prog_name="speculators")  # typer exits with the command's status
    return 0


if __name__ == "__main__":
    sys.exit(main())
