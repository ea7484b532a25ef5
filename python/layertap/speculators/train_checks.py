"""The layertap backend's arguments, checked as soon as speculators' ``train`` has resolved its
configuration and before it does anything with it.

speculators asks the backend for its transfer (``from_train_args``) only after it has built the
draft model (about 50 s for an 8B verifier), and an error there is a traceback. The launcher
(``python -m layertap.speculators``) wraps ``speculators.train.cli.main``, which speculators'
``train`` command imports when it runs, so that a ``--hidden-states-path`` that cannot serve (one
that does not exist, or holds the ``file`` backend's ``hs_*.safetensors``) ends the command with
one line and exit status 2 first. The configuration is read as speculators resolved it, so a
path given in a ``--config`` YAML file is checked too.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

from layertap.speculators import BACKEND_NAME
from layertap.speculators.backend import check_dataset

#: The attribute that marks speculators' ``main`` as wrapped (the launcher may run twice in a
#: process: tests, or a script that calls it).
_WRAPPED = "_layertap_checked"


def check_train_args(args: dict[str, Any]) -> None:
    """``args``: speculators' flattened training configuration. With the layertap backend, the
    dataset of cached rows must be readable (``check_dataset``); else one line on stderr and
    ``SystemExit(2)``."""
    if args.get("hidden_states_backend") != BACKEND_NAME:
        return
    explicit = args.get("hidden_states_path")
    path = explicit or os.path.join(args.get("data_path") or ".", "hidden_states")
    try:
        check_dataset(path, explicit=bool(explicit))
    except (FileNotFoundError, ValueError) as e:
        print(f"layertap backend: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def checked(main: Callable) -> Callable:
    """speculators' ``train`` entry point (``main(cfg)``), checking the backend's arguments first."""

    @functools.wraps(main)
    def run(cfg: Any, *args: Any, **kwargs: Any) -> Any:
        check_train_args(cfg.flatten())
        return main(cfg, *args, **kwargs)

    setattr(run, _WRAPPED, True)
    return run


def install() -> None:
    """Wraps ``speculators.train.cli.main`` (once). Call it after ``register()``: importing
    speculators' training code reads the backend registry."""
    import speculators.train.cli as train_cli

    if not getattr(train_cli.main, _WRAPPED, False):
        train_cli.main = checked(train_cli.main)


__all__ = ["check_train_args", "checked", "install"]
