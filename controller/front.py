"""The one-shot commands without typer: `ctl exec`, `ctl status` and `ctl tail` (no --follow),
as an operator types them, parsed here and run by the same bodies typer's commands call
(controller/commands/plain.py, watch.py).

Why: a one-shot command on the node's kept connection takes ≈ 170 ms, half of it ctl's own
start-up, and importing typer and click was a quarter of that start-up (77 of 305 M
instructions under callgrind; docs/benchmarks.md, "Shared SSH connection"). Only the plain
forms are read here: long options as ``--opt value`` or ``--opt=value``, short ones as
``-c value``, flags, ``--``. Anything else — ``--help``, an unknown or repeated-in-one-word
option, a missing or option-like value, a value that does not convert, a missing required
option — returns None, and typer's app parses the whole command line instead, so every
help text and error message is typer's own, unchanged.

The option tables below name the same flags as the typer declarations
(controller/commands/remote.py, run.py); tests/test_front.py checks every table against the
click command typer builds, and that both read the same values from the same command lines.
"""

from __future__ import annotations

import errno
import sys
from typing import Callable, NamedTuple, Optional


class Opt(NamedTuple):
    flags: tuple[str, ...]
    name: str  # the command function's parameter
    convert: Optional[Callable[[str], object]]  # None: a flag (no value)
    required: bool = False
    default: object = None  # a flag's is False


class Spec(NamedTuple):
    options: tuple[Opt, ...]
    # the parameter that takes every argument from the first positional one on (options stop
    # there: typer's allow_interspersed_args=False), or None for a command without arguments
    rest: Optional[str] = None


def _seconds(value: str) -> float:
    """A finite, non-negative number of seconds; anything else is typer's to refuse."""
    seconds = float(value)
    if not 0 <= seconds < float("inf"):
        raise ValueError(value)
    return seconds


def _count(value: str) -> int:
    """A whole number, 0 or more; anything else is typer's to refuse."""
    count = int(value)
    if count < 0:
        raise ValueError(value)
    return count


NODE = Opt(("--node", "-n"), "node", str)
TRUST = Opt(("--trust-new-host-key",), "trust_new_host_key", None)
# controller/commands/remote.py
EXEC = Spec((Opt(("--container", "-c"), "container", int, required=True), NODE, Opt(("--config",), "config", str),
             Opt(("--stdin", "-i"), "stdin", None), TRUST), rest="argv")
# controller/commands/run.py: the container defaults to the last launch's
CONTAINER = Opt(("--container", "-c"), "container", int)
RUN = Opt(("--run", "-r"), "run", str)
CTL_CONFIG = Opt(("--ctl-config",), "ctl_config", str)
STATUS = Spec((CONTAINER, RUN, Opt(("--json",), "json_out", None), Opt(("--all",), "all_runs", None), NODE, CTL_CONFIG,
               TRUST))
TAIL = Spec((CONTAINER, RUN, Opt(("--follow", "-f"), "follow", None), Opt(("--since",), "since", _count, default=0),
             Opt(("--json",), "raw", None), Opt(("--wait-stopped",), "stopped_wait", _seconds, default=300.0), NODE,
             CTL_CONFIG, TRUST))


def parse(spec: Spec, argv: list[str]) -> Optional[dict]:
    """The parameters ``argv`` gives (defaults: None, False for flags), or None where it is not
    one of the plain forms."""
    by_flag = {flag: opt for opt in spec.options for flag in opt.flags}
    params: dict = {opt.name: (False if opt.convert is None else opt.default) for opt in spec.options}
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--" or not word.startswith("-"):
            if spec.rest is None:
                return None
            rest = argv[i + 1:] if word == "--" else argv[i:]
            if not rest:
                return None
            params[spec.rest] = rest
            break
        flag, eq, value = word.partition("=") if word.startswith("--") else (word, "", "")
        opt = by_flag.get(flag)
        if opt is None:
            return None
        if opt.convert is None:
            if eq:
                return None
            params[opt.name] = True
            i += 1
            continue
        if not eq:
            if i + 1 >= len(argv):
                return None
            value = argv[i + 1]
            i += 1
        if value.startswith("-"):
            return None  # click's reading of an option-like value is click's to give
        try:
            params[opt.name] = opt.convert(value)
        except ValueError:
            return None
        i += 1
    if spec.rest is not None and spec.rest not in params:
        return None
    if any(opt.required and params[opt.name] is None for opt in spec.options):
        return None
    return params


def _exec(params: dict) -> int:
    from controller.commands.plain import container_checked, exec_in

    container_checked(params["container"])  # typer's --container callback
    return exec_in(**params)


def _status(params: dict) -> int:
    from controller.commands.plain import container_checked, run_id_checked
    from controller.commands.watch import status_in

    container_checked(params["container"])
    run_id_checked(params["run"])  # typer's --run callback
    return status_in(**{k: v for k, v in params.items() if k != "all_runs"})


def _tail(params: dict) -> int:
    from controller.commands.plain import container_checked, run_id_checked
    from controller.commands.watch import tail_in

    container_checked(params["container"])
    run_id_checked(params["run"])
    return tail_in(**params)


# command → its table, its body (the parameters by name → the exit code), and which of its
# command lines it takes (`ctl tail --follow` is a long session: typer's import is nothing there)
COMMANDS: dict[str, tuple[Spec, Callable[[dict], int], Callable[[dict], bool]]] = {
    "exec": (EXEC, _exec, lambda params: True),
    "status": (STATUS, _status, lambda params: not params["all_runs"]),  # --all: every node (typer's)
    "tail": (TAIL, _tail, lambda params: not params["follow"]),
}


def plain_call(argv: list[str]) -> Optional[Callable[[], int]]:
    """The command ``argv`` (sys.argv[1:]) asks for, ready to run, or None for typer's app."""
    if not argv or argv[0] not in COMMANDS:
        return None
    spec, body, takes = COMMANDS[argv[0]]
    params = parse(spec, argv[1:])
    if params is None or not takes(params):
        return None
    return lambda: body(params)


def run(call: Callable[[], int]) -> None:
    """Run ``call`` and exit with its code, ending as click's standalone mode ends a command:
    Ctrl-C outside a command's own handling is "Aborted!" and 1; a reader that went away
    (`ctl status | head -1`) is 1, quietly."""
    try:
        code = call()
    except KeyboardInterrupt:
        sys.stderr.write("\nAborted!\n")
        code = 1
    except OSError as exc:
        if exc.errno != errno.EPIPE:
            raise
        from controller.commands.plain import quiet_if_stdout_closed

        quiet_if_stdout_closed()  # what is still buffered must not fail again at exit
        code = 1
    sys.exit(code)
