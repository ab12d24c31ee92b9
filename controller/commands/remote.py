"""`ctl exec` and `ctl env`: run a command in a container, see the environment it gets.

Both go through the same path every other command uses (Runner → pct exec with a scrubbed
environment → container), so what `ctl env` prints is exactly what the trainer gets.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Iterator, List, Optional

import typer

from controller import config as cfg
from controller.container import Container, ContainerError
from controller.exitcodes import CtlExit
from controller.session import open_runner
from controller.transport import CommandError, TransportError

# When set, `ctl` writes {"ssh_connections": N} here on exit (bench/exec_roundtrip.py, tests).
ENV_STATS = "DFLASH_CTL_STATS"

# Exit codes of ctl itself (a remote command's own code passes through unchanged); their
# one home is controller/exitcodes.py, these are the names the command modules import.
EXIT_CONFIG = CtlExit.USAGE
EXIT_CONTAINER = CtlExit.FAILED  # a command in the container failed
EXIT_FAILED = CtlExit.FAILED  # a followed run failed
EXIT_REFUSED = CtlExit.REFUSED  # a launch or rollback refused: nothing was started or changed
EXIT_NOT_DONE = CtlExit.NOT_DONE  # the run stopped, or its agent is gone, before it completed
EXIT_RESTARTED = CtlExit.CONTAINER_RESTARTED
EXIT_INTERRUPTED = CtlExit.INTERRUPTED
EXIT_TRANSPORT = CtlExit.TRANSPORT  # like ssh(1): could not reach the node

ContainerOpt = typer.Option(..., "--container", "-c", help="container id (Proxmox VMID), e.g. 200")
NodeOpt = typer.Option(None, "--node", "-n", help="node name from the config (default: the only one / default_node)")
ConfigOpt = typer.Option(None, "--config", help="controller config file (default: $DFLASH_CTL_CONFIG, "
                                                 "else ~/.config/dflash-ctl/config.toml)")
TrustOpt = typer.Option(False, "--trust-new-host-key",
                        help="record the node's SSH host key in known_hosts if none is there yet "
                             "(a changed key is still refused)")


def check_run_option(value: Optional[str]) -> Optional[str]:
    """The callback of every `--run` option: the launcher's run-id grammar
    (agent/protocol.py), checked before any connection is opened, so no empty id (an unset
    $RUN), path or option-like value ever reaches the node."""
    if value is None:
        return None
    from agent.protocol import run_id_problem

    problem = run_id_problem(value)
    if problem:
        raise fail(problem, EXIT_CONFIG)
    return value


def run_option(help: str) -> typer.models.OptionInfo:  # noqa: A002 - typer's own word
    """A `--run`/`-r` option with the run-id check."""
    return typer.Option(None, "--run", "-r", help=help, callback=check_run_option)


def fail(message: str, code: int) -> "typer.Exit":
    typer.echo(f"ctl: error: {message}", err=True)
    return typer.Exit(code)


@contextlib.contextmanager
def container_session(container: int, node: Optional[str], config_path: Optional[str],
                      trust_new_host_key: bool, one_shot: bool = False) -> Iterator[Container]:
    """One runner (one SSH connection) for the whole command; errors as one clear line.
    ``one_shot``: the command runs one thing in the container (controller/session.py)."""
    runner = None
    try:
        conf = cfg.load(config_path)
        node_name, node_conf = conf.node(node)
        runner = open_runner(node_name, node_conf, trust_new_host_key=trust_new_host_key, one_shot=one_shot)
        handle = Container(runner, node_name, node_conf, container)
        yield handle
        trusted = getattr(runner, "trusted_key", None)
        if trusted:
            typer.echo(f"ctl: recorded the host key of node {node_name} ({trusted})", err=True)
    except cfg.ConfigError as exc:
        raise fail(str(exc), EXIT_CONFIG) from None
    except TransportError as exc:
        raise fail(str(exc), EXIT_TRANSPORT) from None
    except ContainerError as exc:
        raise fail(str(exc), getattr(exc, "exit_code", EXIT_CONTAINER)) from None
    except CommandError as exc:
        raise fail(str(exc), exc.result.returncode or 1) from None
    except KeyboardInterrupt:
        # pct exec does not forward signals (research §1.1): closing our side is not a kill.
        raise fail(f"interrupted; whatever was started in container {container} may still be running "
                   f"(pct exec does not forward signals): check with `ctl exec -c {container} -- ps -ef`",
                   EXIT_INTERRUPTED) from None
    finally:
        if runner is not None:
            runner.close()
        _write_stats()


def _write_stats() -> None:
    path = os.environ.get(ENV_STATS)
    if not path:
        return
    from controller.transport import Runner

    with open(path, "w") as fh:
        json.dump({"ssh_connections": Runner.connections_opened}, fh)


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
    with container_session(container, node, config, trust_new_host_key, one_shot=True) as ct:
        result = ct.exec(argv, stdin=sys.stdin.buffer if stdin else None, capture=False,
                         stdout_sink=sys.stdout.buffer, stderr_sink=sys.stderr.buffer)
    _quiet_if_stdout_closed()
    raise typer.Exit(result.returncode & 0xFF)


def _quiet_if_stdout_closed() -> None:
    """`ctl exec … | head`: the reader left early. The command ran to its end anyway (its
    output was drained, not fed back as SIGPIPE); don't let Python's exit flush complain."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


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
