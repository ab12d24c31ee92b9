"""`ctl`'s typer app: every command, its --help and its option errors. Each command group
lives in its own module under controller/commands/; this file only assembles them. The
entry point is controller/cli.py, which runs the plainest forms of the one-shot commands
without importing this (controller/front.py)."""

from __future__ import annotations

from typing import Optional

import typer

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


def run(argv: list[str]) -> None:
    """`ctl` through typer, for ``argv`` (sys.argv[1:]): registers only the command asked for."""
    import gc

    _register(_command(argv))
    gc.freeze()
    gc.enable()
    app()


@app.command("version")
def version() -> None:
    """Print ctl's version and the agent protocol version it speaks."""
    from importlib.metadata import version as dist_version

    from agent.protocol import PROTOCOL_VERSION

    typer.echo(f"dflash-ctl {dist_version('dflash-ctl')} (agent protocol {PROTOCOL_VERSION})")
