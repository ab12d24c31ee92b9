"""The one-shot commands' shared SSH connection (controller/sshmux.py), as an
operator lives it: `ctl` processes one after the other against the simulated node.

A new SSH connection is counted where the node sees it: its sshd logs one "Accepted
publickey" line per authentication (sim/sshd.py runs it with -e into sshd.log). The login
shell's ssh-sessions.log counts channels: every command still is one session of its own,
riding the shared connection.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from _ctl_subprocess import ctl, no_torch_env
from controller import config as cfg
from controller import sshmux

pytestmark = pytest.mark.sim

CT = "200"


def accepted(sim_node) -> int:
    """Authentications the node's sshd has logged: one per new SSH connection."""
    return sim_node.sshd.logfile.read_text(errors="replace").count("Accepted publickey for ")


def write_config(path: Path, entry: dict, **changes) -> Path:
    entry = {**entry, **changes}
    containers = {k: cfg.ContainerConfig(**v) for k, v in entry.pop("containers").items()}
    cfg.save(cfg.Config(default_node="sim", nodes={"sim": cfg.NodeConfig(**entry, containers=containers)}), path)
    return path


def _ssh_processes() -> dict[int, bytes]:
    procs = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if cmdline.startswith(b"ssh") and state != "Z":
                procs[int(entry)] = cmdline
    return procs


def _master_and_its_children(sock: Path, host: str = "") -> set[int]:
    """The master on ``sock`` (its title names the socket) and, behind a ProxyJump, the
    ``ssh -W`` to ``host`` it connects through (started before the master went to the
    background, so no longer its child)."""
    procs = _ssh_processes()
    masters = {pid for pid, cmd in procs.items() if str(sock).encode() in cmd and b"[mux]" in cmd}
    hops = {pid for pid, cmd in procs.items() if host and b"\0-W\0" in cmd and host.encode() in cmd}
    return masters | hops


@pytest.fixture
def sockets():
    """A socket directory for this test alone (short: a socket's path has little room)."""
    d = Path(tempfile.mkdtemp(prefix="cm", dir="/tmp"))
    yield d
    for sock in d.iterdir():
        sshmux.close_master(sock)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def env(sim_node, ctl_config, sockets, tmp_path):
    return {**no_torch_env(ctl_config, tmp_path), sshmux.ENV_SOCKET_DIR: str(sockets)}


def test_the_second_command_opens_no_new_ssh_connection(sim_node, env, sockets):
    before = accepted(sim_node)
    first = ctl(env, "exec", "-c", CT, "--", "echo", "first")
    assert first.returncode == 0 and first.stdout == "first\n", first.stderr
    assert accepted(sim_node) == before + 1
    assert len(list(sockets.iterdir())) == 1
    for args in (("exec", "-c", CT, "--", "echo", "second"), ("env", "-c", CT)):
        again = ctl(env, *args)
        assert again.returncode == 0, again.stderr
    assert accepted(sim_node) == before + 1  # the same connection, a channel each


def test_a_changed_host_key_is_refused_when_a_master_opens(sim_node, ctl_config, env, sockets, tmp_path):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    entry = sim_node.node_config()
    other = (tmp_path / "other.pub").read_text().split()
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{entry['port']} {other[0]} {other[1]}\n")
    config = write_config(tmp_path / "config.toml", entry, known_hosts=str(known))
    before = accepted(sim_node)
    proc = ctl({**env, "DFLASH_CTL_CONFIG": str(config)}, "exec", "-c", CT, "--", "true")
    assert proc.returncode == 255
    assert "has CHANGED" in proc.stderr and "ssh-keygen -R" in proc.stderr, proc.stderr
    assert accepted(sim_node) == before  # never authenticated: no master, no command
    assert list(sockets.iterdir()) == []


@pytest.mark.parametrize("problem", ["mode 0755", "another owner"])
def test_an_unsafe_socket_directory_is_refused_with_the_fix(problem, sim_node, env, sockets):
    if problem == "mode 0755":
        sockets.chmod(0o755)
        fix = f"chmod 700 {sockets}"
    else:
        os.chown(sockets, 65534, 65534)
        fix = f"rm -r {sockets}"
    before = accepted(sim_node)
    proc = ctl(env, "exec", "-c", CT, "--", "true")
    assert proc.returncode == 255
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ctl: error: the ssh socket directory "), proc.stderr
    assert str(sockets) in lines[0] and fix in lines[0]
    assert accepted(sim_node) == before
    os.chown(sockets, os.geteuid(), os.getegid())
    sockets.chmod(0o700)


def test_another_identity_or_known_hosts_file_gets_its_own_master(sim_node, env, sockets, tmp_path):
    entry = sim_node.node_config()
    key, known = tmp_path / "id_copy", tmp_path / "known_copy"
    shutil.copy(entry["identity_file"], key)
    key.chmod(0o600)
    shutil.copy(entry["known_hosts"], known)
    configs = [write_config(tmp_path / "plain.toml", entry),
               write_config(tmp_path / "key.toml", entry, identity_file=str(key)),
               write_config(tmp_path / "known.toml", entry, known_hosts=str(known))]
    before = accepted(sim_node)
    for n, config in enumerate(configs, 1):
        for _ in range(2):
            proc = ctl({**env, "DFLASH_CTL_CONFIG": str(config)}, "exec", "-c", CT, "--", "true")
            assert proc.returncode == 0, proc.stderr
        assert accepted(sim_node) == before + n  # its own master, then a ride on it
        assert len(list(sockets.iterdir())) == n


def test_sshd_restarted_under_a_warm_master_the_next_command_gets_a_new_one(sim_node, env, sockets):
    assert ctl(env, "exec", "-c", CT, "--", "true").returncode == 0
    [sock] = sockets.iterdir()
    old_master = _master_and_its_children(sock)
    assert old_master
    try:
        sim_node.sshd.stop()  # every session and connection on the node ends, as in a reboot
    finally:
        sim_node.up()  # the same port and keys: it comes back for everyone
    before = accepted(sim_node)
    proc = ctl(env, "exec", "-c", CT, "--", "echo", "after")
    assert proc.returncode == 0 and proc.stdout == "after\n", proc.stderr
    # One new connection, through ssh (no paramiko fallback with its retries), a new master.
    assert accepted(sim_node) == before + 1
    assert not old_master & set(_ssh_processes())
    assert _master_and_its_children(sock)


def _sshd_descendants(sim_node) -> set[int]:
    listener = sim_node.sshd.pid()
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [listener]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def test_a_master_whose_peer_went_silent_is_replaced_within_one_command(sim_node, env, sockets):
    """A network cut: the node's end of the master's connection stops answering (SIGSTOP of
    its sshd processes), nothing closes. The next command neither hangs nor fails: the
    master's keepalive gives up on the peer (5 s × 3), and the command, which had not
    started, goes through a new connection."""
    before_first = _sshd_descendants(sim_node)
    assert ctl(env, "exec", "-c", CT, "--", "true").returncode == 0
    [sock] = sockets.iterdir()
    connection = _sshd_descendants(sim_node) - before_first  # what serves the master, and only that
    assert connection
    old_master = _master_and_its_children(sock)
    for pid in connection:
        os.kill(pid, signal.SIGSTOP)
    try:
        before = accepted(sim_node)
        proc = ctl(env, "exec", "-c", CT, "--", "echo", "through a new one", timeout=120)
    finally:
        for pid in connection:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0 and proc.stdout == "through a new one\n", proc.stderr
    assert accepted(sim_node) == before + 1
    assert not old_master & set(_ssh_processes()) and _master_and_its_children(sock)


def test_a_master_killed_without_cleaning_up_is_replaced(sim_node, env, sockets):
    assert ctl(env, "exec", "-c", CT, "--", "true").returncode == 0
    [sock] = sockets.iterdir()
    for pid in _master_and_its_children(sock):
        os.kill(pid, 9)  # ours (this test started it); its socket stays behind
    assert sock.exists()
    before = accepted(sim_node)
    proc = ctl(env, "exec", "-c", CT, "--", "true")
    assert proc.returncode == 0, proc.stderr
    assert accepted(sim_node) == before + 1 and _master_and_its_children(sock)


def test_disconnect_leaves_no_ssh_process_behind_even_behind_a_bastion(sim_node, env, sockets, tmp_path):
    via_bastion = write_config(tmp_path / "bastion.toml", sim_node.node_config("bastion"))
    bastion_env = {**env, "DFLASH_CTL_CONFIG": str(via_bastion)}
    proc = ctl(bastion_env, "exec", "-c", CT, "--", "true")
    assert proc.returncode == 0, proc.stderr
    [sock] = sockets.iterdir()
    host = sim_node.node_config("bastion")["host"]
    chain = _master_and_its_children(sock, host)
    assert len(chain) == 2, chain  # the master holds the whole chain: its `ssh -W` through the bastion
    again = ctl(bastion_env, "exec", "-c", CT, "--", "true")
    assert again.returncode == 0 and _master_and_its_children(sock, host) == chain
    assert ctl(env, "exec", "-c", CT, "--", "true").returncode == 0  # the direct one: a second master
    direct = {pid for s in sockets.iterdir() if s != sock for pid in _master_and_its_children(s)}
    assert direct

    out = ctl(bastion_env, "disconnect", "--node", "sim")
    assert out.returncode == 0 and "closed the shared SSH connection to node sim" in out.stdout, out.stderr
    assert not sock.exists() and not chain & set(_ssh_processes())
    assert direct <= set(_ssh_processes())  # only that node's
    out = ctl(env, "disconnect")
    assert out.returncode == 0 and "closed 1 shared SSH connection" in out.stdout, out.stdout + out.stderr
    assert list(sockets.iterdir()) == [] and not direct & set(_ssh_processes())


def test_the_operators_own_control_master_is_used_as_theirs(sim_node, env, sockets, tmp_path):
    theirs = Path(tempfile.mkdtemp(prefix="op", dir="/tmp"))
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(f"Host 127.0.0.1\n  ControlMaster auto\n  ControlPath {theirs}/%C\n  ControlPersist 60\n")
    op_env = {**env, "DFLASH_CTL_SSH_CONFIG": str(ssh_config)}
    try:
        before = accepted(sim_node)
        for _ in range(2):
            proc = ctl(op_env, "exec", "-c", CT, "--", "true")
            assert proc.returncode == 0, proc.stderr
        assert accepted(sim_node) == before + 1
        assert len(list(theirs.iterdir())) == 1  # their socket, where their config puts it
        assert list(sockets.iterdir()) == []  # none of ours
        out = ctl(op_env, "disconnect", "--node", "sim")
        assert out.returncode == 0 and "no shared SSH connection to node sim was open" in out.stdout
        assert len(list(theirs.iterdir())) == 1  # theirs to close
    finally:
        for sock in theirs.iterdir():
            sshmux.close_master(sock)
        shutil.rmtree(theirs, ignore_errors=True)
