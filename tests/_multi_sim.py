"""Shared pieces of the multi-container tests (tests/test_multi_*.py): the second simulated
node ``sim2`` (containers 300/301) and plain in-container commands for test set-up.

``sim2_node`` is session-scoped like ``sim_node`` and, like it, left up for the next session
(unless DFLASH_SIM_TEARDOWN=1). Both nodes' containers sit on the sim network (sim/net.py)."""

from __future__ import annotations

import subprocess

import pytest

from _simnode import session_node


@pytest.fixture(scope="session")
def sim2_node(sim_node):
    with session_node("sim2") as node:
        yield node


def attach(node, ctid: int, *argv: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    """A command in a sim container, straight through lxc-attach (test set-up and probes; the
    product's own path is `pct exec` over SSH)."""
    proc = subprocess.run(["lxc-attach", "-P", str(node.paths.lxcpath), "-n", str(ctid), "--clear-env", "--",
                           *argv], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{argv} in {node.name}:{ctid} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc


def over_ssh(node, *argvs: list[str]) -> None:
    """Each argv on the node through the product's SSH session, as an operator's `pct stop` or
    `pct start` there: run in sshd's namespace, not the test's."""
    from controller import config as cfg
    from controller.session import open_runner

    entry = node.node_config()
    conf = cfg.NodeConfig(host=entry["host"], port=entry["port"], user=entry["user"],
                          identity_file=entry["identity_file"], known_hosts=entry["known_hosts"])
    with open_runner(node.name, conf) as runner:
        for argv in argvs:
            res = runner.run(argv)
            assert res.ok, res.tail("stderr")


def address(node, ctid: int) -> str:
    from sim import net

    return net.address_of(node.name, ctid)
