"""SSH as operators have it: the node behind a bastion (ProxyJump), reached as a non-root
user whose pct runs through `sudo -n` (sim/bastion.py, sim/users.py).

The node's management name (`sim.pve.internal`) resolves only on the bastion, so nothing
here can reach the node except through it; both host keys come from one known_hosts file
and are checked, never learned.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from controller import config as cfg

pytestmark = [pytest.mark.sim]

REPO = Path(__file__).resolve().parent.parent
CTL = [sys.executable, "-c", "from controller.cli import main; main()"]
CT = "200"


def write_config(path: Path, entry: dict) -> Path:
    entry = dict(entry)
    containers = {k: cfg.ContainerConfig(**v) for k, v in entry.pop("containers").items()}
    cfg.save(cfg.Config(default_node="sim", nodes={"sim": cfg.NodeConfig(**entry, containers=containers)}), path)
    return path


def ctl(config: Path, *args: str, ssh_config: str = "none", timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, DFLASH_CTL_CONFIG=str(config), DFLASH_CTL_SSH_CONFIG=ssh_config)
    return subprocess.run([*CTL, *args], capture_output=True, text=True, env=env, cwd=str(REPO), timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def via_bastion(sim_node, tmp_path_factory) -> Path:
    return write_config(tmp_path_factory.mktemp("bastion") / "config.toml", sim_node.node_config("bastion"))


def test_launch_through_a_bastion_as_a_sudo_user(sim_node, via_bastion, tmp_path):
    env = ctl(via_bastion, "env", "--container", CT)
    assert env.returncode == 0, env.stderr
    assert env.stdout.splitlines() == ["PATH=/root/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                                       "HOME=/root", "LANG=C.UTF-8"]
    run = tmp_path / "tiny.toml"
    run.write_text((REPO / "examples/tiny.toml").read_text().replace("max-steps = 24", "max-steps = 4"))
    launched = ctl(via_bastion, "launch", "--container", CT, "--config", str(run), "--from-scratch", "--follow")
    assert launched.returncode == 0, launched.stdout + launched.stderr
    assert "completed" in launched.stdout
    log = (sim_node.paths.root / "bastion" / "sshd.log").read_text()
    assert f"Accepted publickey for dflash-jump" in log


def test_the_node_cannot_be_reached_without_its_bastion(sim_node, tmp_path):
    entry = sim_node.node_config("bastion")
    entry.pop("proxy_jump")
    proc = ctl(write_config(tmp_path / "direct.toml", entry), "exec", "--container", CT, "--", "true", timeout=120)
    assert proc.returncode == 255
    assert "cannot connect to node sim at sim.pve.internal:" in proc.stderr, proc.stderr


def test_proxyjump_from_the_operators_ssh_config(sim_node, tmp_path):
    entry = sim_node.node_config("bastion")
    jump = entry.pop("proxy_jump")
    user, _, hostport = jump.partition("@")
    host, port = hostport.split(":")
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(f"Host bastion\n  HostName {host}\n  Port {port}\n  User {user}\n\n"
                          f"Host sim.pve.internal\n  ProxyJump bastion\n")
    proc = ctl(write_config(tmp_path / "c.toml", entry), "exec", "--container", CT, "--", "echo", "through",
               ssh_config=str(ssh_config))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "through\n"


def test_an_unknown_bastion_key_is_refused_naming_the_bastion(sim_node, tmp_path):
    entry = sim_node.node_config("bastion")
    lines = Path(entry["known_hosts"]).read_text().splitlines(keepends=True)
    only_node = tmp_path / "known_hosts"
    only_node.write_text("".join(line for line in lines if "pve.internal" in line))
    entry["known_hosts"] = str(only_node)
    proc = ctl(write_config(tmp_path / "c.toml", entry), "exec", "--container", CT, "--", "true")
    assert proc.returncode == 255
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "the host key of bastion 127.0.0.1:" in err[0] and "is not in" in err[0], err
    assert only_node.read_text().count("\n") == 1, "the key was learned"


def _with_forged_key(entry: dict, tmp_path: Path, bastion: bool) -> dict:
    """``entry`` with a known_hosts whose bastion (or node) line holds another key."""
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    new_pub = other.with_suffix(".pub").read_text().split()
    lines = Path(entry["known_hosts"]).read_text().splitlines()
    forged = [f"{line.split()[0]} {new_pub[0]} {new_pub[1]}" if ("pve.internal" not in line) == bastion else line
              for line in lines]
    known = tmp_path / "known_hosts"
    known.write_text("\n".join(forged) + "\n")
    return dict(entry, known_hosts=str(known))


def test_a_changed_bastion_key_is_refused_even_with_trust_new_host_key(sim_node, tmp_path):
    entry = _with_forged_key(sim_node.node_config("bastion"), tmp_path, bastion=True)
    proc = ctl(write_config(tmp_path / "c.toml", entry), "exec", "--container", CT, "--trust-new-host-key",
               "--", "true")
    assert proc.returncode == 255
    assert "the host key of bastion 127.0.0.1:" in proc.stderr and "has CHANGED" in proc.stderr, proc.stderr
    assert "ssh-keygen -R" in proc.stderr


def test_a_changed_node_key_behind_the_bastion_is_refused(sim_node, tmp_path):
    entry = _with_forged_key(sim_node.node_config("bastion"), tmp_path, bastion=False)
    proc = ctl(write_config(tmp_path / "c.toml", entry), "exec", "--container", CT, "--", "true")
    assert proc.returncode == 255
    assert "the host key of node sim ([sim.pve.internal]:" in proc.stderr and "has CHANGED" in proc.stderr, proc.stderr


def test_a_sudo_that_would_ask_for_a_password_is_one_line_not_a_hang(sim_node, tmp_path):
    proc = ctl(write_config(tmp_path / "c.toml", sim_node.node_config("bastion-password")),
               "status", "--container", CT, timeout=60)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 255, proc.stdout + proc.stderr
    assert len(err) == 1 and "dflash-pw cannot run" in err[0] and "sudo: a password is required" in err[0], err
    assert "NOPASSWD" in err[0]
