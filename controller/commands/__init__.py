"""Command groups of `ctl`. Each module exposes ``register(app)``; COMMANDS says which module
holds each top-level command, so `ctl exec` imports the exec module and not the launch
machinery (start-up time is most of a short command: bench/ctl_exec/roundtrip.py)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # not imported at run time: controller/front.py's commands never load typer
    import typer

# top-level command → the module under controller/commands/ that registers it
COMMANDS: dict[str, str] = {
    "exec": "remote",
    "env": "envs",
    "launch": "launch", "tail": "run", "status": "run", "runs": "run", "stop": "run", "watch": "run",
    "kill-and-rollback": "rollback", "history": "rollback",
    "sim": "sim",
    "export": "export",
    "served-check": "servedcheck",
    "disconnect": "disconnect",
}


def register(app: typer.Typer, command: Optional[str] = None) -> None:
    """Register the module of ``command``, or every module when it is None or unknown
    (`ctl --help`, a typo: then typer lists them all)."""
    names = [COMMANDS[command]] if command in COMMANDS else sorted(set(COMMANDS.values()))
    for name in names:
        importlib.import_module(f"controller.commands.{name}").register(app)
