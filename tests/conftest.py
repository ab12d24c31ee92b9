"""Shared pytest fixtures.

Simulated Proxmox node (sim/, docs/sim.md) — session scope, for tests marked ``@pytest.mark.sim``:

``sim_node``
    A ``sim.node.SimNode("sim")`` that is up: sshd on 127.0.0.1 (polluted root login, `pct`
    on PATH) and running LXC containers 200 (btrfs storage: snapshots work) and 201 (dir
    storage: snapshots refused), each with ``/root/venv`` (torch CPU, transformers,
    safetensors, numpy) and ``/workspace``. ``up()`` once per session: a no-op when it is
    already up (the first time on a machine builds the rootfs cache: a few minutes); left up so
    the next session starts in seconds, unless ``DFLASH_SIM_TEARDOWN=1``. Skips the test
    when the machine cannot host it (not root, LXC missing). ``sim_node.node_config()``
    gives host/port/user/identity_file/known_hosts/containers as plain data.

    The node is shared by every test session on the machine: a test that changes a
    container (files, snapshots, stopped state) must restore it, and must not call
    ``down()`` on it (make your own ``SimNode("name", ctids=(a, b))`` for that).

``ctl_config``
    Path of a temporary controller config (TOML) holding only the sim node, as node
    ``"sim"`` and ``default_node``; ``DFLASH_CTL_CONFIG`` points at it for the whole
    session, so no test (and no ``ctl`` subprocess) reads the developer's ~/.config.
"""

from __future__ import annotations

import os
import signal

import pytest

from _simnode import session_node

# scripts/test.sh runs one pytest as a background job of a non-interactive shell, which starts
# it with SIGINT ignored; Python then installs no KeyboardInterrupt handler, and every child
# inherits the ignore: the Ctrl-C tests saw their signal vanish (prepare ran to the end, exit 0).
# A caught signal is reset to the default at exec, so the children start as from a terminal.
signal.signal(signal.SIGINT, signal.default_int_handler)



@pytest.fixture(scope="session", autouse=True)
def ssh_sockets(tmp_path_factory):
    """The one-shot commands' shared SSH connections (controller/sshmux.py) of this test session
    go to a directory of its own, never the developer's, and are closed at its end: no ssh
    master outlives the tests."""
    from controller import sshmux

    path = tmp_path_factory.mktemp("ssh-sockets")
    path.chmod(0o700)
    old = os.environ.get(sshmux.ENV_SOCKET_DIR)
    os.environ[sshmux.ENV_SOCKET_DIR] = str(path)
    yield path
    for sock in sshmux.masters():
        sshmux.close_master(sock)
    if old is None:
        os.environ.pop(sshmux.ENV_SOCKET_DIR, None)
    else:
        os.environ[sshmux.ENV_SOCKET_DIR] = old


@pytest.fixture(scope="session")
def sim_node():
    with session_node("sim") as node:
        yield node


@pytest.fixture(scope="session")
def ctl_config(sim_node, tmp_path_factory):
    from controller import config as cfg

    path = tmp_path_factory.mktemp("ctl-config") / "config.toml"
    entry = sim_node.node_config()
    node = cfg.NodeConfig(
        host=entry["host"], port=entry["port"], user=entry["user"], identity_file=entry["identity_file"],
        known_hosts=entry["known_hosts"],
        containers={k: cfg.ContainerConfig(**v) for k, v in entry["containers"].items()},
    )
    cfg.save(cfg.Config(default_node="sim", nodes={"sim": node}), path)
    old = os.environ.get(cfg.ENV_CONFIG)
    os.environ[cfg.ENV_CONFIG] = str(path)
    yield path
    if old is None:
        os.environ.pop(cfg.ENV_CONFIG, None)
    else:
        os.environ[cfg.ENV_CONFIG] = old
