"""Proxmox's ``pct`` as the node runs it: every command that touches a container is
built here.

A container command is always::

    [sudo -n --] pct exec <ctid> [--keep-env 0] -- env -i -- PATH=<venv/bin + system dirs> \
        HOME=<home> LANG=C.UTF-8 [explicit vars…] <argv…>

Why both layers (docs/research/proxmox-and-supervision.md §1.1): ``pct exec`` keeps the caller's
environment by default (keep-env=1, even at pve-container HEAD), so the SSH session's PATH
(Homebrew, perl5 …), SSH_* and whatever the node's .bashrc exported would reach the
trainer. ``env -i`` inside the container leaves exactly the variables we name, on every
Proxmox version. ``--keep-env 0`` (pve-container 5.0.9, commit 069553d: Proxmox VE 8.2 and
later) also keeps the node's variables from ever entering the container, not even the
environment of the ``env`` process; older ``pct`` has no such option and refuses it
(``Unknown option: keep-env``, exit 255, before anything runs). Which one the node has is
decided on the node, in the command's own session: a fixed script asks dpkg for the
installed pve-container (what ``pveversion -v`` lists, a few milliseconds) and leaves the
option out where that release predates it. Nothing is asked in a round trip of its own and
nothing is remembered, so a node upgraded or downgraded between two commands gets the right
``pct exec`` on the very next one (the answer used to be asked once per connection, one
more round trip for every `ctl exec`: docs/benchmarks.md).

Non-root operators run pct through ``sudo -n`` (node config ``sudo = true``): never a
password prompt, and a sudo that would ask for one is one line saying what to configure.

No heredocs, no ``bash -c`` with interpolated text: the argv after ``--`` reaches the
container process as separate arguments (pct uses list-form exec), and the SSH runner
quotes it with ``shlex.join``.
"""

from __future__ import annotations

import re
from typing import Mapping, Optional, Sequence

from controller.config import ContainerConfig, NodeConfig
from controller.transport import Result, TransportError

# Every process we start in a container gets these and nothing else (plus explicit extras).
BASE_LOCALE = "C.UTF-8"
VAR_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SUDO = ["sudo", "-n", "--"]

# What sudo -n says when it will not run pct for this user without asking.
_SUDO_REFUSALS = re.compile(r"^sudo: (a password is required|a terminal is required|.*is not allowed to execute"
                            r"|.*is not in the sudoers file|.*may not run sudo)", re.M)
_NO_SUDO = re.compile(r"sudo: (command )?not found|sudo: No such file", re.I)


class PctUsageError(ValueError):
    """A container command that cannot be built safely (bad variable name, bad argv)."""


class PctAccessError(TransportError):
    """The node's pct cannot be run as configured (sudo refuses, pct missing)."""


# pve-container's first release with `pct exec --keep-env` (commit 069553d).
KEEP_ENV_SINCE = "5.0.9"

# Runs on the node in front of the pct command. "$1" is the position of "--keep-env" in that
# command ("$2"…), which it runs as is where dpkg has a pve-container of KEEP_ENV_SINCE or
# later; otherwise without that word and the next (its value). A pct that dpkg does not know
# is not a Proxmox node's own: it too runs without the option, which every pct accepts, and
# env -i still sets the whole environment.
_PICK_KEEP_ENV = (
    'at=$1; shift; '
    'v=$(dpkg-query -W -f=\'${Version}\' pve-container 2>/dev/null) '
    f'&& dpkg --compare-versions "$v" ge {KEEP_ENV_SINCE} 2>/dev/null && exec "$@"; '
    'i=0; for a; do shift; i=$((i + 1)); [ "$i" -eq "$at" ] || [ "$i" -eq "$((at + 1))" ] || set -- "$@" "$a"; done; '
    'exec "$@"'
)


def container_env(container: ContainerConfig, extra: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The complete environment a container process gets, in order: the one builder of it
    (the start script's environment extends it: controller/render.py)."""
    env = {"PATH": container.path, "HOME": container.home, "LANG": BASE_LOCALE}
    for key, value in (extra or {}).items():
        if not VAR_NAME.match(key):
            raise PctUsageError(f"environment variable name {key!r} is not a valid shell name")
        if "\0" in str(value):
            raise PctUsageError(f"environment variable {key} contains a NUL byte")
        env[key] = str(value)
    return env


def argv(node: NodeConfig, *args: str) -> list[str]:
    """``pct <args…>`` as this node runs it (through ``sudo -n`` when configured)."""
    return [*(SUDO if node.sudo else []), node.pct, *[str(a) for a in args]]


def command_text(node: NodeConfig, *args: str) -> str:
    """The same, as an operator would type it on the node (for messages)."""
    return " ".join(argv(node, *args))


def pct_exec_argv(node: NodeConfig, ctid: int | str, command: Sequence[str], *, keep_env: bool = True,
                  container: Optional[ContainerConfig] = None,
                  env: Optional[Mapping[str, str]] = None) -> list[str]:
    """``pct exec`` of ``command`` in container ``ctid`` with a scrubbed, explicit environment,
    as an operator would type it for a pct that has (``keep_env``) or lacks ``--keep-env``."""
    command = [str(a) for a in command]
    if not command or command[0] == "":
        raise PctUsageError("no command given to run in the container")
    if "=" in command[0]:
        # env(1) would take it for another assignment instead of the program to run.
        raise PctUsageError(f"the program name {command[0]!r} contains '=': env would read it as a variable")
    for arg in command:
        if "\0" in arg:
            raise PctUsageError("an argument contains a NUL byte, which no process can receive")
    container = container or node.container(ctid)
    assignments = [f"{k}={v}" for k, v in container_env(container, env).items()]
    keep = ["--keep-env", "0"] if keep_env else []
    # "--" after -i: an assignment or program that starts with "-" is never read as an option.
    return [*argv(node, "exec", str(ctid), *keep, "--"), "env", "-i", "--", *assignments, *command]


def on_node_choice(pct_command: Sequence[str]) -> list[str]:
    """A :func:`pct_exec_argv` with ``--keep-env 0`` run behind the script that lets the node
    drop the option where its pve-container predates it (see above)."""
    return ["sh", "-c", _PICK_KEEP_ENV, "sh", str(list(pct_command).index("--keep-env") + 1), *pct_command]


def exec_argv(node: NodeConfig, ctid: int | str, command: Sequence[str], **kw) -> list[str]:
    """What runs on the node for ``command`` in the container: :func:`pct_exec_argv` with the
    node's own choice of ``--keep-env``."""
    return on_node_choice(pct_exec_argv(node, ctid, command, **kw))


def raw_exec_argv(node: NodeConfig, ctid: int | str, command: Sequence[str]) -> list[str]:
    """``pct exec`` without scrubbing: what an operator would type. Tests use it to show the
    pollution the product removes; the product itself never does."""
    return argv(node, "exec", str(ctid), "--", *command)


def start_hint(node: NodeConfig, ctid: int | str) -> str:
    return f"`{command_text(node, 'start', str(ctid))}`"


def access_problem(node_name: str, node: NodeConfig, result: Result) -> Optional[str]:
    """One line when ``result`` failed because pct could not be run at all, else None."""
    if result.ok:
        return None
    text = result.stderr
    user = node.user or "the SSH user"
    if node.sudo and _SUDO_REFUSALS.search(text):
        why = _SUDO_REFUSALS.search(text).group(0)
        return (f"node {node_name}: {user} cannot run {node.pct} through `sudo -n` ({why.strip()}); a password "
                f"prompt is never answered. On the node, allow it without one, e.g. in /etc/sudoers.d/dflash-ctl: "
                f"`{user} ALL=(root) NOPASSWD: {node.pct}` (pct must be named by its full path, as sudo's "
                f"secure_path decides what `pct` means)")
    if node.sudo and _NO_SUDO.search(text):
        return f"node {node_name}: sudo is not installed there (`apt install sudo`), or set sudo = false for the node"
    if result.returncode == 127 and ("not found" in text or "No such file" in text) and node.pct in text:
        return (f"node {node_name}: `{node.pct}` is not there: is it a Proxmox VE node? "
                f"Set `pct` in the node config to its full path (usually /usr/sbin/pct)")
    return None
