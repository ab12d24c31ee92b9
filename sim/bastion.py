"""The node's bastion: a second OpenSSH server, the only way to the node for an operator
whose SSH config says ProxyJump (the jump host many clusters put in front of their nodes).

It listens on 127.0.0.1 like the node's sshd, with its own host key and a non-root login
(``dflash-jump``, sim/users.py) that may forward TCP and nothing more. What makes it a real
bastion rather than a detour: the node's management name, ``<node>.pve.internal``, resolves
only on the bastion (its mount namespace binds an /etc/hosts that has it), so a controller
that skipped the bastion cannot even find the node; through the bastion it reaches the
node's sshd there, and checks both host keys.
"""

from __future__ import annotations

from pathlib import Path

from agent.protocol import atomic_write
from sim.layout import NodePaths
from sim.sshd import Sshd


def internal_name(node: str) -> str:
    return f"{node}.pve.internal"


def hosts_file(paths: NodePaths) -> tuple[str, str]:
    """/etc/hosts as the bastion sees it: the host's, plus the node's internal name."""
    text = Path("/etc/hosts").read_text()
    line = f"127.0.0.1\t{internal_name(paths.name)}\n"
    target = paths.root / "etc" / "hosts-bastion"
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(str(target), text.rstrip("\n") + "\n" + line, mode=0o644)
    return str(target), "/etc/hosts"


def bastion(paths: NodePaths) -> Sshd:
    return Sshd(paths, role="bastion")
