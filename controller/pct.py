"""argv builders for Proxmox's ``pct``: every command that enters a container is built here.

A container command is always::

    pct exec <ctid> --keep-env 0 -- env -i -- PATH=<venv/bin + system dirs> HOME=<home> \
        LANG=C.UTF-8 [explicit vars…] <argv…>

Why both layers (research/proxmox-and-supervision.md §1.1): ``pct exec`` keeps the caller's
environment by default (keep-env=1, even at pve-container HEAD), so the SSH session's PATH
(Homebrew, perl5 …), SSH_* and whatever the node's .bashrc exported would reach the
trainer; ``--keep-env 0`` makes lxc-attach clear it, but LXC then adds its own defaults
(``container=lxc``, ``TERM=linux``, lxc.environment entries) and older pve-container has no
such option. ``env -i`` inside the container leaves exactly the variables we name.

No heredocs, no ``bash -c`` with interpolated text: the argv after ``--`` reaches the
container process as separate arguments (pct uses list-form exec), and the SSH runner
quotes it with ``shlex.join``.
"""

from __future__ import annotations

import re
from typing import Mapping, Optional, Sequence

from controller.config import ContainerConfig, NodeConfig

# Every process we start in a container gets these and nothing else (plus explicit extras).
BASE_LOCALE = "C.UTF-8"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class PctUsageError(ValueError):
    """A container command that cannot be built safely (bad variable name, bad argv)."""


def container_env(container: ContainerConfig, extra: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The complete environment a container process gets, in order."""
    env = {"PATH": container.path, "HOME": container.home, "LANG": BASE_LOCALE}
    for key, value in (extra or {}).items():
        if not _NAME.match(key):
            raise PctUsageError(f"environment variable name {key!r} is not a valid shell name")
        if "\0" in str(value):
            raise PctUsageError(f"environment variable {key} contains a NUL byte")
        env[key] = str(value)
    return env


def exec_argv(node: NodeConfig, ctid: int | str, argv: Sequence[str], *,
              container: Optional[ContainerConfig] = None,
              env: Optional[Mapping[str, str]] = None) -> list[str]:
    """``pct exec`` of ``argv`` in container ``ctid`` with a scrubbed, explicit environment."""
    argv = [str(a) for a in argv]
    if not argv or argv[0] == "":
        raise PctUsageError("no command given to run in the container")
    if "=" in argv[0]:
        # env(1) would take it for another assignment instead of the program to run.
        raise PctUsageError(f"the program name {argv[0]!r} contains '=': env would read it as a variable")
    for arg in argv:
        if "\0" in arg:
            raise PctUsageError("an argument contains a NUL byte, which no process can receive")
    container = container or node.container(ctid)
    assignments = [f"{k}={v}" for k, v in container_env(container, env).items()]
    # "--" after -i: an assignment or program that starts with "-" is never read as an option.
    return [node.pct, "exec", str(ctid), "--keep-env", "0", "--", "env", "-i", "--", *assignments, *argv]


def raw_exec_argv(node: NodeConfig, ctid: int | str, argv: Sequence[str]) -> list[str]:
    """``pct exec`` without scrubbing: what an operator would type. Tests use it to show the
    pollution the product removes; the product itself never does."""
    return [node.pct, "exec", str(ctid), "--", *[str(a) for a in argv]]


def status_argv(node: NodeConfig, ctid: int | str) -> list[str]:
    return [node.pct, "status", str(ctid)]


def start_hint(node: NodeConfig, ctid: int | str) -> str:
    return f"`{node.pct} start {ctid}`"
