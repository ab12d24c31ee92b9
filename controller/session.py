"""Sessions: the runner (one SSH connection) per node that a `ctl` command uses, and the
container handles on top. Above both transports: nothing below imports this module."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator, Optional

from controller import config as cfg
from controller.container import Container
from controller.transport import LocalRunner, Runner

if TYPE_CHECKING:
    from controller.job import Member


def open_runner(node_name: str, node: cfg.NodeConfig, *, trust_new_host_key: bool = False,
                one_shot: bool = False) -> Runner:
    """The runner for a configured node — the one place the transport is chosen: local when
    ctl runs on the node itself; over SSH, for a command that runs one thing (``one_shot``),
    the operator's own ``ssh`` binary, which costs no paramiko import (controller/openssh.py);
    otherwise paramiko's one connection for all the commands (controller/ssh.py), and for
    --trust-new-host-key, which records the key and shows its fingerprint."""
    if node.transport == "local":
        return LocalRunner()
    if one_shot and not trust_new_host_key:
        from controller.openssh import OpenSSHRunner

        return OpenSSHRunner(node_name, node)
    from controller.ssh import SSHRunner  # paramiko only when a node is remote

    return SSHRunner.for_node(node_name, node, trust_new_host_key=trust_new_host_key)


@contextlib.contextmanager
def open_containers(members: "list[Member]", ctl_config: Optional[str], trust_new_host_key: bool = False,
                    per_member: bool = False) -> Iterator[list[Container]]:
    """One SSH connection per node (``per_member``: one per container, for concurrent use
    from threads), and a Container handle per member."""
    conf = cfg.load(ctl_config)
    runners: dict[str, Runner] = {}
    try:
        cts = []
        for m in members:
            name, node = conf.node(m.node)
            key = m.label if per_member else name
            if key not in runners:
                runners[key] = open_runner(name, node, trust_new_host_key=trust_new_host_key)
            cts.append(Container(runners[key], name, node, m.ctid))
        yield cts
    finally:
        for r in runners.values():
            with contextlib.suppress(Exception):
                r.close()
