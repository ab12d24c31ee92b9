"""`ctl exec` and `ctl env`: run a command in a container, see the environment it gets.

Both go through the same path every other command uses (Runner → pct exec with a scrubbed
environment → container), so what `ctl env` prints is exactly what the trainer gets.
"""

from __future__ import annotations

import sys
from typing import List, Optional

import typer

from controller.commands.plain import (ENV_STATS, EXIT_CONFIG, EXIT_CONTAINER, EXIT_FAILED,  # noqa: F401 - the
                                       EXIT_INTERRUPTED, EXIT_NOT_DONE, EXIT_REFUSED, EXIT_RESTARTED,  # names the
                                       EXIT_TRANSPORT, container_checked, container_session,  # command
                                       exec_in, fail, run_id_checked, seconds_checked)  # modules import from here

def guard_refused(call):
    """``call()``; an in-container refusal (envgen, compilecache: nothing was changed) becomes
    the command's one error line and its refused exit code."""
    from controller.envgen_client import EnvGenRefused

    try:
        return call()
    except EnvGenRefused as exc:
        raise fail(f"refused: {exc}", EXIT_REFUSED) from None


def container_option(default, help: str) -> typer.models.OptionInfo:  # noqa: A002 - typer's own word
    """A `--container`/`-c` option with the VMID check (plain.container_checked)."""
    return typer.Option(default, "--container", "-c", help=help, callback=container_checked)


ContainerOpt = container_option(..., "container id (Proxmox VMID), e.g. 200")
NodeOpt = typer.Option(None, "--node", "-n", help="node name from the config (default: the only one / default_node)")
ConfigOpt = typer.Option(None, "--config", help="controller config file (default: $DFLASH_CTL_CONFIG, "
                                                 "else ~/.config/dflash-ctl/config.toml)")
TrustOpt = typer.Option(False, "--trust-new-host-key",
                        help="record the node's SSH host key in known_hosts if none is there yet "
                             "(a changed key is still refused)")


def check_run_option(value: Optional[str]) -> Optional[str]:
    """The callback of every `--run` option (controller/commands/plain.py run_id_checked)."""
    return run_id_checked(value)


def run_option(help: str, default=None) -> typer.models.OptionInfo:  # noqa: A002 - typer's own word
    """A `--run`/`-r` option with the run-id check: every command's `--run` is made here
    (tests/test_ctl_input_guard.py finds them all in the app and feeds each bad ids)."""
    return typer.Option(default, "--run", "-r", help=help, callback=check_run_option)


def exec_command(
    argv: List[str] = typer.Argument(..., metavar="-- COMMAND [ARG...]",
                                     help="the command and its arguments, after --"),
    container: int = ContainerOpt,
    node: Optional[str] = NodeOpt,
    config: Optional[str] = ConfigOpt,
    stdin: bool = typer.Option(False, "--stdin", "-i", help="forward this process's stdin to the command"),
    trust_new_host_key: bool = TrustOpt,
) -> None:
    """Run a command in a container with a clean, explicit environment.

    Output streams as it comes; ctl exits with the command's exit code (128+N when a
    signal N killed it)."""
    raise typer.Exit(exec_in(argv, container, node, config, stdin, trust_new_host_key))


def env_command(
    container: int = ContainerOpt,
    node: Optional[str] = NodeOpt,
    config: Optional[str] = ConfigOpt,
    trust_new_host_key: bool = TrustOpt,
) -> None:
    """Print the environment a process started in the container actually gets."""
    with container_session(container, node, config, trust_new_host_key, one_shot=True) as ct:
        result = ct.exec(["env"], check=True)
    sys.stdout.write(result.stdout)


def register(app: typer.Typer) -> None:
    # Options stop at the first argument, so `ctl exec -c 200 ls -l` passes -l to ls.
    app.command("exec", context_settings={"allow_interspersed_args": False})(exec_command)
    # `ctl env` is a group (controller/commands/envs.py) whose no-subcommand form calls
    # env_command, so `ctl env --container 200` keeps this behaviour next to `ctl env list`.
