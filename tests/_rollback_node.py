"""Fixtures for the kill-and-rollback tests: a simulated node of their own.

Why not the shared ``sim_node`` (tests/conftest.py): these tests break the venv on purpose
(a generation with a deliberately broken package the trainer imports), roll the root
filesystem back and hard-stop the container. On the shared node that would break other
sessions' tests running at the same moment. So they get ``SimNode("rb", ctids=(260, 261))``
— 260 on btrfs (snapshots), 261 on dir storage (snapshots refused) — left up between
sessions like the shared one (``DFLASH_SIM_TEARDOWN=1`` takes it down).

Container 260 is reset to a snapshot ``pristine`` (taken once, with the tiny target and
data provisioned) at the start of each test module, through pct itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _simnode import session_node

REPO = Path(__file__).resolve().parent.parent
NODE_NAME = "rb"
SNAP_CT, DIR_CT = 260, 261
PRISTINE = "pristine"
CTL = [sys.executable, "-c", "from controller.cli import main; main()"]


@pytest.fixture(scope="session")
def rb_node(tmp_path_factory):
    with session_node(NODE_NAME, (SNAP_CT, DIR_CT),
                      prepare=lambda node: _ensure_pristine(node, tmp_path_factory.mktemp("rb-setup"))) as node:
        yield node


def write_config(node, path: Path) -> Path:
    from controller import config as cfg

    entry = node.node_config()
    conf = cfg.NodeConfig(host=entry["host"], port=entry["port"], user=entry["user"],
                          identity_file=entry["identity_file"], known_hosts=entry["known_hosts"],
                          containers={k: cfg.ContainerConfig(**v) for k, v in entry["containers"].items()})
    cfg.save(cfg.Config(default_node=NODE_NAME, nodes={NODE_NAME: conf}), path)
    return path


def _ensure_pristine(node, tmp: Path) -> None:
    """Take snapshot `pristine` of 260 once, on a fresh container with the tiny data."""
    os.environ.setdefault("DFLASH_CTL_SSH_CONFIG", "none")
    config = write_config(node, tmp / "config.toml")
    h = Handle(config, SNAP_CT)
    try:
        if PRISTINE in h.pct("listsnapshot", str(SNAP_CT)).stdout:
            return
        if h.sh("test", "-L", "/root/venv").ok:
            # Changed by an earlier session before a pristine snapshot existed: rebuild.
            h.close()
            node.down(purge=True)
            node.up()
            config = write_config(node, tmp / "config.toml")
            h = Handle(config, SNAP_CT)
        from controller.provision import provision_tiny

        provision_tiny(h.ct)
        result = h.pct("snapshot", str(SNAP_CT), PRISTINE, "--description", "rollback tests: fresh container")
        assert result.ok, result.stderr
    finally:
        h.close()


@pytest.fixture(scope="session")
def rb_config(rb_node, tmp_path_factory) -> Path:
    return write_config(rb_node, tmp_path_factory.mktemp("rb-config") / "config.toml")


def ctl(config: Path, *args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    full = dict(os.environ, DFLASH_CTL_SSH_CONFIG="none", DFLASH_CTL_CONFIG=str(config), **(env or {}))
    return subprocess.run([*CTL, *args], capture_output=True, text=True, env=full, cwd=str(REPO),
                          timeout=timeout, stdin=subprocess.DEVNULL)


def ctl_popen(config: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    full = dict(os.environ, DFLASH_CTL_SSH_CONFIG="none", DFLASH_CTL_CONFIG=str(config), **(env or {}))
    return subprocess.Popen([*CTL, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full,
                            cwd=str(REPO), stdin=subprocess.DEVNULL)


class Handle:
    """An SSH runner + Container for direct checks (what is really in the container)."""

    def __init__(self, config: Path, ctid: int):
        from controller import config as cfg
        from controller.container import Container
        from controller.ssh import SSHRunner

        name, node = cfg.load(config).node(NODE_NAME)
        self.runner = SSHRunner.for_node(name, node)
        self.node = node
        self.ct = Container(self.runner, name, node, ctid)

    def pct(self, *args: str):
        return self.runner.run([self.node.pct, *args])

    def sh(self, *argv: str):
        return self.ct.exec(list(argv))

    def close(self) -> None:
        self.runner.close()


def reset_to_pristine(config: Path) -> None:
    """Container 260 back to snapshot `pristine` (as the sim built it + the tiny data)."""
    os.environ.setdefault("DFLASH_CTL_SSH_CONFIG", "none")
    h = Handle(config, SNAP_CT)
    try:
        result = h.pct("rollback", str(SNAP_CT), PRISTINE)
        assert result.ok, result.stderr
        h.pct("start", str(SNAP_CT))
        deadline = time.monotonic() + 60
        while not h.pct("exec", str(SNAP_CT), "--", "true").ok:
            assert time.monotonic() < deadline, "container 260 does not answer after the reset"
            time.sleep(0.5)
    finally:
        h.close()


def started_run(launch_output: str) -> str:
    """The run id from `ctl launch`'s "run <id> started in …" line (other lines may name
    other runs, e.g. the known-good one in the drift report)."""
    import re

    m = re.search(r"^run (\S+) started in ", launch_output, re.M)
    assert m, launch_output
    return m.group(1)


def tiny_config(tmp: Path, max_steps: int = 8, save_interval: int = 4) -> Path:
    """examples/tiny.toml, shorter, with a baseline any 2 steps satisfy (|r - median| <= median
    always holds for two positive rates), so a completed run is known-good deterministically."""
    text = (REPO / "examples" / "tiny.toml").read_text()
    out = []
    for line in text.splitlines():
        key = line.split("=", 1)[0].strip()
        if key == "max-steps":
            line = f"max-steps = {max_steps}"
        elif key == "save-interval":
            line = f"save-interval = {save_interval}"
        elif key == "epochs" and max_steps > 100:
            line = "epochs = 1000"
        elif key == "steady-steps":
            line = "steady-steps = 2"
        elif key == "throughput-tolerance":
            line = "throughput-tolerance = 1.0"
        out.append(line)
    path = tmp / f"tiny-rb-{max_steps}.toml"
    path.write_text("\n".join(out) + "\n")
    return path
