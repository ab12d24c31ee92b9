"""What the one-shot commands run, without typer: their helpers (one clear error line, the
exit codes' names, one runner per command) and `ctl exec`'s body.

Why apart from the typer declarations: `ctl exec`, `ctl status` and `ctl tail` are parsed by
controller/front.py without importing typer (a quarter of their start-up: docs/benchmarks.md),
and call these same bodies; typer's commands
(controller/commands/remote.py, run.py) call them too, so both paths behave alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from typing import Iterator, List, Optional, Union

from controller import config as cfg
from controller.container import Container, ContainerError
from controller.exitcodes import CtlExit
from controller.session import open_runner
from controller.transport import CommandError, TransportError

# When set, `ctl` writes {"ssh_connections": N} here on exit (bench/ctl_exec/roundtrip.py, tests).
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


# click's pattern of the escape sequences it strips from what goes to anything but a terminal.
_ANSI = re.compile(r"\033\[[;?0-9]*[a-zA-Z]")


def echo(message: str = "", err: bool = False) -> None:
    """One line to stdout (or stderr), flushed: what typer.echo does with a string — colour
    codes (a trainer's log line) dropped unless the stream is a terminal."""
    stream = sys.stderr if err else sys.stdout
    if "\033" in message and not stream.isatty():
        message = _ANSI.sub("", message)
    stream.write(f"{message}\n")
    stream.flush()


def fail(message: str, code: int) -> SystemExit:
    """The one error line of a command, and the exit that ends it (``raise fail(…)``).
    SystemExit, not typer.Exit: the same under typer's runner and without it."""
    echo(f"ctl: error: {message}", err=True)
    return SystemExit(code)


def run_id_checked(value: Optional[str]) -> Optional[str]:
    """Every `--run`: the launcher's run-id grammar (agent/protocol.py), checked before any
    connection is opened, so no empty id (an unset $RUN), path or option-like value ever
    reaches the node."""
    if value is None:
        return None
    from agent.protocol import run_id_problem

    problem = run_id_problem(value)
    if problem:
        raise fail(problem, EXIT_CONFIG)
    return value


def container_checked(value: Optional[Union[int, str]]) -> Optional[Union[int, str]]:
    """Every `--container` that takes one id (an int from typer, a launch's text): a Proxmox
    VMID (controller/vmid.py), checked before any connection is opened (pct's own refusal
    came back as exit 1 from the node)."""
    if value is None:
        return None
    from controller import vmid

    problem = vmid.problem(value)
    if problem:
        raise fail(f"--container {value}: {problem}", EXIT_CONFIG)
    return value


def seconds_checked(value: Optional[float]) -> Optional[float]:
    """Options that take seconds: finite and not negative (click's FloatRange lets nan in)."""
    if value is not None and not 0 <= value < float("inf"):
        raise fail(f"{value} is not a number of seconds: give 0 or more, e.g. 30", EXIT_CONFIG)
    return value


@contextlib.contextmanager
def errors_as_exits() -> Iterator[None]:
    """A config, connection or in-container failure as one line and its exit code."""
    try:
        yield
    except cfg.ConfigError as exc:
        raise fail(str(exc), EXIT_CONFIG) from None
    except TransportError as exc:
        raise fail(str(exc), EXIT_TRANSPORT) from None
    except ContainerError as exc:
        raise fail(str(exc), getattr(exc, "exit_code", EXIT_CONTAINER)) from None
    except CommandError as exc:
        raise fail(str(exc), exc.result.returncode or 1) from None


@contextlib.contextmanager
def container_session(container: int, node: Optional[str], config_path: Optional[str],
                      trust_new_host_key: bool, one_shot: bool = False) -> Iterator[Container]:
    """One runner (one SSH connection) for the whole command; errors as one clear line.
    ``one_shot``: the command runs one thing in the container (controller/session.py)."""
    runner = None
    try:
        with errors_as_exits():
            conf = cfg.load(config_path)
            node_name, node_conf = conf.node(node)
            runner = open_runner(node_name, node_conf, trust_new_host_key=trust_new_host_key, one_shot=one_shot)
            handle = Container(runner, node_name, node_conf, container)
            yield handle
            trusted = getattr(runner, "trusted_key", None)
            if trusted:
                echo(f"ctl: recorded the host key of node {node_name} ({trusted})", err=True)
    except KeyboardInterrupt:
        # pct exec does not forward signals (docs/research/proxmox-and-supervision.md §1.1):
        # closing our side is not a kill.
        raise fail(f"interrupted; whatever was started in container {container} may still be running "
                   f"(pct exec does not forward signals): check with `ctl exec -c {container} -- ps -ef`",
                   EXIT_INTERRUPTED) from None
    finally:
        if runner is not None:
            runner.close()
        write_stats()


def write_stats() -> None:
    path = os.environ.get(ENV_STATS)
    if not path:
        return
    from controller.transport import Runner

    with open(path, "w") as fh:
        json.dump({"ssh_connections": Runner.connections_opened}, fh)


def exec_in(argv: List[str], container: int, node: Optional[str], config: Optional[str], stdin: bool,
            trust_new_host_key: bool) -> int:
    """`ctl exec`: the command's exit code (128+N when a signal N killed it)."""
    with container_session(container, node, config, trust_new_host_key, one_shot=True) as ct:
        result = ct.exec(argv, stdin=sys.stdin.buffer if stdin else None, capture=False,
                         stdout_sink=sys.stdout.buffer, stderr_sink=sys.stderr.buffer)
    quiet_if_stdout_closed()
    return result.returncode & 0xFF


def quiet_if_stdout_closed() -> None:
    """`ctl exec … | head`: the reader left early. The command ran to its end anyway (its
    output was drained, not fed back as SIGPIPE); don't let Python's exit flush complain."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
