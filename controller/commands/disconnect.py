"""`ctl disconnect`: close the shared SSH connections the one-shot commands keep
(controller/sshmux.py) now, instead of after their keep time."""

from __future__ import annotations

from typing import Optional

import typer

from controller import config as cfg
from controller.commands.remote import EXIT_CONFIG, EXIT_TRANSPORT, ConfigOpt, fail
from controller.transport import TransportError


def disconnect_command(
    node: Optional[str] = typer.Option(None, "--node", "-n",
                                       help="close only this node's connection (default: every one ctl keeps)"),
    config: Optional[str] = ConfigOpt,
) -> None:
    """Close the SSH connections ctl keeps open between commands (all, or one node's)."""
    from controller import sshmux
    from controller.openssh import node_socket

    try:
        if node is None:
            socks = sshmux.masters()
            closed = sum(sshmux.close_master(s) for s in socks)
            typer.echo(f"closed {closed} shared SSH connection{'s' * (closed != 1)} "
                       f"({sshmux.socket_dir()})")
            return
        name, node_conf = cfg.load(config).node(node)
        sock = node_socket(node_conf)
    except cfg.ConfigError as exc:
        raise fail(str(exc), EXIT_CONFIG) from None
    except TransportError as exc:
        raise fail(str(exc), EXIT_TRANSPORT) from None
    if sock is None:
        typer.echo(f"node {name} shares no SSH connection (control_persist = 0, or your ssh config's own)")
    elif sock.exists() and sshmux.close_master(sock):
        typer.echo(f"closed the shared SSH connection to node {name}")
    else:
        typer.echo(f"no shared SSH connection to node {name} was open")


def register(app: typer.Typer) -> None:
    app.command("disconnect")(disconnect_command)
