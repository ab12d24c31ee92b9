"""`ctl`: the operator's command line. Each command group lives in its own module under
controller/commands/; this file only assembles them."""

from __future__ import annotations

import gc
import sys
from typing import Optional

# Start-up (typer, click, the command's modules) makes a few hundred thousand objects and no
# garbage; the collector's passes over them were ≈ 10 % of a one-shot command's time
# (docs/benchmarks.md). Off until the command runs; then they are frozen out of every
# later pass (the one at exit too) and collection is on again for the command itself.
gc.disable()

import typer  # noqa: E402

app = typer.Typer(
    name="ctl",
    help="Launch, watch and recover DFlash drafter training in Proxmox LXC containers.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """Launch, watch and recover DFlash drafter training in Proxmox LXC containers."""


def _register(command: Optional[str] = None) -> None:
    # Imported here so a command pays only for its own module, and a broken group names itself.
    from controller.commands import register

    register(app, command)


def _command(argv: list[str]) -> Optional[str]:
    """The top-level command `ctl` was asked for (the first word that is not an option)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main() -> None:
    _register(_command(sys.argv[1:]))
    gc.freeze()
    gc.enable()
    app()


@app.command("version")
def version() -> None:
    """Print ctl's version and the agent protocol version it speaks."""
    from importlib.metadata import version as dist_version

    from agent.protocol import PROTOCOL_VERSION

    typer.echo(f"dflash-ctl {dist_version('dflash-ctl')} (agent protocol {PROTOCOL_VERSION})")
