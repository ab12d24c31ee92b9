"""The shared connection's rules that need no node (controller/sshmux.py): where the socket
goes, when there is none, and the one-line refusals; and the `ssh` runner on a throwaway
sshd (tests/_sshd.py) riding one connection for two commands, or none when sharing is off."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

import _sshd
from controller import config as cfg
from controller import sshmux
from controller.config import NodeConfig
from controller.openssh import OpenSSHRunner, wrapper_text


@pytest.fixture
def sockets(monkeypatch):
    d = Path(tempfile.mkdtemp(prefix="cm", dir="/tmp"))
    monkeypatch.setenv(sshmux.ENV_SOCKET_DIR, str(d))
    monkeypatch.setenv("DFLASH_CTL_SSH_CONFIG", "none")
    yield d
    for sock in d.iterdir():
        sshmux.close_master(sock)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    server = _sshd.start(tmp_path_factory.mktemp("sshd"))
    yield server
    _sshd.stop(server)


def node(server, **kw) -> NodeConfig:
    return NodeConfig(**{**dict(host="127.0.0.1", port=server.port, user="root",
                                identity_file=str(server.client_key), known_hosts=str(server.known_hosts)), **kw})


def test_a_missing_socket_directory_is_made_0700_whatever_the_umask(sockets):
    sockets.rmdir()
    old = os.umask(0o000)
    try:
        assert sshmux.control_path(NodeConfig(host="pve"), None).parent == sockets
    finally:
        os.umask(old)
    assert oct(sockets.stat().st_mode & 0o777) == "0o700"


def test_a_symlink_in_place_of_the_socket_directory_is_refused(sockets, tmp_path):
    sockets.rmdir()
    sockets.symlink_to(tmp_path)
    with pytest.raises(sshmux.SocketDirError, match=rf"{sockets} is not a directory .* Fix: remove it"):
        sshmux.control_path(NodeConfig(host="pve"), None)
    sockets.unlink()
    sockets.mkdir(mode=0o700)


def test_every_input_that_decides_the_connection_names_its_own_socket(sockets, tmp_path):
    base = NodeConfig(host="pve", port=22, user="ops", identity_file="/k1", known_hosts="/kh1", proxy_jump="b1")
    variants = [base, NodeConfig(host="pve2", port=22, user="ops", identity_file="/k1", known_hosts="/kh1",
                                 proxy_jump="b1"),
                *(NodeConfig(**{**base.__dict__, field: value}) for field, value in
                  [("port", 2222), ("user", "root"), ("identity_file", "/k2"), ("known_hosts", "/kh2"),
                   ("proxy_jump", "b2")])]
    paths = {sshmux.control_path(n, None) for n in variants}
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text("Host pve\n  HostName 10.0.0.1\n")
    paths.add(sshmux.control_path(base, ssh_config))
    ssh_config.write_text("Host pve\n  HostName 10.0.0.2\n")  # the same file, another host behind the name
    paths.add(sshmux.control_path(base, ssh_config))
    assert len(paths) == len(variants) + 2
    # what does not decide the connection does not change it
    assert sshmux.control_path(NodeConfig(**{**base.__dict__, "control_persist": 60}), None) == \
        sshmux.control_path(base, None)


@pytest.mark.parametrize("kw", [dict(control_persist=0), dict(host="pve*"), dict(proxy_jump="ops@pve:2222")],
                         ids=["turned off", "a host pattern", "a bastion of the node's own name"])
def test_no_sharing_where_it_cannot_be_kept_apart(kw, sockets):
    n = NodeConfig(**{"host": "pve", **kw})
    assert sshmux.control_path(n, None) is None
    assert "ControlMaster" not in wrapper_text(n, None, None)


def test_control_persist_must_be_a_whole_number_of_seconds(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('[nodes.a]\nhost = "pve"\ncontrol_persist = -1\n')
    with pytest.raises(cfg.ConfigError, match=r"nodes.a.control_persist: must be 0 .* \(got -1\)"):
        cfg.load(path)


def test_two_commands_ride_one_connection_and_none_without_sharing(sshd, sockets):
    with OpenSSHRunner("testnode", node(sshd)) as r:
        assert r.run(["echo", "one"]).stdout == "one\n"
        assert r.run(["echo", "two"]).stdout == "two\n"
        assert r.connections == 1 and r._fallback is None
    with OpenSSHRunner("testnode", node(sshd)) as r:  # a later ctl command
        assert r.run(["true"]).ok and r.connections == 0
    assert len(sshmux.masters()) == 1
    with OpenSSHRunner("testnode", node(sshd, control_persist=0)) as r:
        assert r.run(["true"]).ok and r.run(["true"]).ok
        assert r.connections == 2
    assert len(sshmux.masters()) == 1


def test_a_remote_exit_255_on_a_live_master_is_the_commands_own(sshd, sockets):
    with OpenSSHRunner("testnode", node(sshd)) as r:
        assert r.run(["true"]).ok
        assert r.run(["sh", "-c", "exit 255"]).returncode == 255  # not "connection lost"


def test_on_the_operators_own_master_a_remote_exit_255_is_the_commands_own(sshd, sockets, tmp_path, monkeypatch):
    theirs = Path(tempfile.mkdtemp(prefix="op", dir="/tmp"))
    conf = tmp_path / "ssh_config"
    conf.write_text(f"Host 127.0.0.1\n  ControlMaster auto\n  ControlPath {theirs}/%C\n  ControlPersist 30\n")
    monkeypatch.setenv("DFLASH_CTL_SSH_CONFIG", str(conf))
    try:
        with OpenSSHRunner("testnode", node(sshd)) as r:
            assert r.run(["sh", "-c", "exit 255"]).returncode == 255  # ours was never made: not "lost"
            assert r.run(["sh", "-c", "exit 255"]).returncode == 255
        assert len(list(theirs.iterdir())) == 1 and sshmux.masters() == []
    finally:
        for sock in theirs.iterdir():
            sshmux.close_master(sock)
        shutil.rmtree(theirs, ignore_errors=True)


def test_stdin_reaches_the_command_through_a_new_and_a_shared_connection(sshd, sockets):
    for _ in range(2):
        with OpenSSHRunner("testnode", node(sshd)) as r:
            assert r.run(["cat"], stdin=b"x" * 300_000).stdout_bytes == b"x" * 300_000
    assert len(sshmux.masters()) == 1


def test_a_runtime_dir_that_is_not_ours_is_passed_over(monkeypatch, tmp_path):
    monkeypatch.delenv(sshmux.ENV_SOCKET_DIR, raising=False)
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    mine.mkdir()
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(mine))
    assert sshmux.socket_dir() == mine / "dflash-ctl-ssh"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(theirs))
    assert sshmux.socket_dir() == Path(f"/tmp/dflash-ctl-ssh-{os.geteuid()}")
