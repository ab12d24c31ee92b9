"""The SSH runners against a real OpenSSH server on loopback (tests/_sshd.py): host keys,
login noise, concurrent streams, exit codes, connection reuse, ~/.ssh/config aliases.

Tests through the ``runner`` fixture run for both: paramiko's (controller/ssh.py) and the
one that runs the operator's ``ssh`` binary (controller/openssh.py); the OpenSSH runner's
own promises (the same errors, a config that cannot turn host-key checking off, no paramiko
import) are at the end."""

from __future__ import annotations

import hashlib
import socket

import paramiko
import pytest

import _sshd
from controller.config import NodeConfig
from controller.openssh import OpenSSHRunner
from controller.ssh import SSHRunner, resolve_target
from controller.transport import CommandError, HostKeyError, TransportError


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    server = _sshd.start(tmp_path_factory.mktemp("sshd"))
    yield server
    _sshd.stop(server)


@pytest.fixture(autouse=True)
def no_user_ssh_config(monkeypatch):
    # Never read the developer's own ~/.ssh/config (fabric's tests do the same).
    monkeypatch.setenv("DFLASH_CTL_SSH_CONFIG", "none")


def node(server, **kw) -> NodeConfig:
    fields = dict(host="127.0.0.1", port=server.port, user="root", identity_file=str(server.client_key),
                  known_hosts=str(server.known_hosts))
    fields.update(kw)
    return NodeConfig(**fields)


@pytest.fixture(params=["paramiko", "openssh"])
def runner(sshd, request):
    runner_class = SSHRunner.for_node if request.param == "paramiko" else OpenSSHRunner
    with runner_class("testnode", node(sshd)) as r:
        yield r
        if request.param == "openssh":
            assert r._fallback is None, "the ssh binary could not connect: paramiko ran the commands"


def test_login_noise_does_not_reach_stdout_or_stderr(runner):
    result = runner.run(["sh", "-c", "echo out; echo err >&2"])
    assert result.stdout == "out\n"
    assert result.stderr == "err\n"


def test_raw_ssh_command_shows_the_login_noise(sshd):
    # The pollution the marker removes is real: a plain exec_command sees the .bashrc output.
    client = paramiko.SSHClient()
    client.load_host_keys(str(sshd.known_hosts))
    client.connect("127.0.0.1", sshd.port, "root", key_filename=str(sshd.client_key),
                   look_for_keys=False, allow_agent=False)
    try:
        _, out, _ = client.exec_command("echo out")
        assert "polluted node" in out.read().decode()
    finally:
        client.close()


def test_one_connection_is_reused_for_many_commands(sshd):
    before = SSHRunner.connections_opened
    with SSHRunner.for_node("testnode", node(sshd)) as r:
        for i in range(5):
            assert r.run(["echo", str(i)]).stdout == f"{i}\n"
        assert r.connections == 1
        sock = r.connect().get_transport().sock  # a dead peer is noticed (TCP keepalive)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    assert SSHRunner.connections_opened == before + 1


def test_exit_code_propagates_and_check_raises_with_command_and_stderr_tail(runner):
    result = runner.run(["sh", "-c", "echo boom >&2; exit 7"])
    assert (result.returncode, result.ok, result.failed) == (7, False, True)
    with pytest.raises(CommandError) as info:
        runner.run(["sh", "-c", "echo first >&2; echo last words >&2; exit 3"], check=True)
    text = str(info.value)
    assert "exit code 3" in text and "last words" in text and "echo last words" in text


def test_signal_killed_command_reports_128_plus_signal(runner):
    result = runner.run(["sh", "-c", "kill -KILL $$"])
    assert result.returncode == 137 and result.signal == 9


def test_50mb_on_stdout_and_stderr_at_once_without_deadlock(runner):
    # Both streams far beyond the SSH window (paramiko#1778 deadlocks at ~2 MiB each when one
    # stream is read at a time). Output is produced interleaved, from one process.
    script = ("import sys\nblock = b'x' * 65535 + b'\\n'\n"
              "for i in range(800):\n    sys.stdout.buffer.write(block)\n    sys.stderr.buffer.write(block)\n")
    result = runner.run(["python3", "-c", script], capture=False)
    assert result.ok
    lines = {"out": 0, "err": 0}
    result = runner.run(["python3", "-c", script],
                        on_stdout=lambda line: lines.__setitem__("out", lines["out"] + 1),
                        on_stderr=lambda line: lines.__setitem__("err", lines["err"] + 1))
    assert result.ok
    assert len(result.stdout_bytes) == len(result.stderr_bytes) == 800 * 65536
    assert lines == {"out": 800, "err": 800}


def test_stdin_reaches_the_command_byte_for_byte(runner):
    data = bytes(range(256)) * 4096
    result = runner.run(["sha256sum"], stdin=data)
    assert result.stdout.split()[0] == hashlib.sha256(data).hexdigest()


def test_command_that_ignores_its_stdin_is_not_an_error(runner):
    result = runner.run(["sh", "-c", "exit 3"], stdin=b"x" * (8 << 20))
    assert result.returncode == 3
    assert runner.run(["true"]).ok  # the connection is still usable


def test_unknown_host_key_is_refused_with_the_fix(sshd, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with SSHRunner.for_node("testnode", node(sshd, known_hosts=str(empty))) as r:
        with pytest.raises(HostKeyError) as info:
            r.run(["true"])
    text = str(info.value)
    assert "not in" in text and str(empty) in text and "--trust-new-host-key" in text and "SHA256:" in text
    assert empty.read_text() == ""


def test_trust_new_host_key_records_it_then_it_is_verified(sshd, tmp_path):
    known = tmp_path / "sub" / "known_hosts"
    with SSHRunner.for_node("testnode", node(sshd, known_hosts=str(known)), trust_new_host_key=True) as r:
        assert r.run(["true"]).ok
        assert r.trusted_key and "SHA256:" in r.trusted_key
    assert f"[127.0.0.1]:{sshd.port} ssh-ed25519 " in known.read_text()
    with SSHRunner.for_node("testnode", node(sshd, known_hosts=str(known))) as r:
        assert r.run(["true"]).ok


def _forged_known_hosts(sshd, tmp_path):
    """A known_hosts that holds another key for the server: what a reinstalled host, or a
    man in the middle, looks like."""
    other = tmp_path / "other"
    _sshd._keygen(other)
    pub = other.with_suffix(".pub").read_text().split()
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{sshd.port} {pub[0]} {pub[1]}\n")
    return known


def test_changed_host_key_is_refused_even_with_trust_flag(sshd, tmp_path):
    known = _forged_known_hosts(sshd, tmp_path)
    for trust in (False, True):
        with SSHRunner.for_node("testnode", node(sshd, known_hosts=str(known)), trust_new_host_key=trust) as r:
            with pytest.raises(HostKeyError) as info:
                r.run(["true"])
            text = str(info.value)
            assert "CHANGED" in text and "ssh-keygen -R" in text and "testnode" in text
            assert r.connections == 0
    assert known.read_text().count("\n") == 1


def test_ssh_config_alias_is_honoured(sshd, tmp_path, monkeypatch):
    conf = tmp_path / "ssh_config"
    conf.write_text(f"Host simalias\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User root\n"
                    f"  IdentityFile {sshd.client_key}\n  UserKnownHostsFile {sshd.known_hosts}\n")
    monkeypatch.setenv("DFLASH_CTL_SSH_CONFIG", str(conf))
    target = resolve_target("aliased", NodeConfig(host="simalias"))
    assert (target.hostname, target.port, target.user) == ("127.0.0.1", sshd.port, "root")
    with SSHRunner(target) as r:
        assert r.run(["echo", "via alias"]).stdout == "via alias\n"


def test_authentication_failure_is_clear_and_not_retried(sshd, tmp_path):
    stranger = tmp_path / "stranger"
    _sshd._keygen(stranger)
    with _Counting(resolve_target("testnode", node(sshd, identity_file=str(stranger)))) as r:
        with pytest.raises(TransportError) as info:
            r.run(["true"])
    assert "authentication" in str(info.value) and "authorized_keys" in str(info.value)
    assert r.hop_attempts == 1  # retrying cannot fix a refused key


def test_a_refused_connection_is_retried_then_named(sshd, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with _Counting(resolve_target("testnode", node(sshd, port=closed)), attempts=3) as r:
        with pytest.raises(TransportError, match=rf"cannot connect to node testnode at 127.0.0.1:{closed} after 3 "):
            r.run(["true"])
    assert r.hop_attempts == 3


class _Counting(SSHRunner):
    hop_attempts = 0

    def _open_hop(self, t, sock):
        self.hop_attempts += 1
        return super()._open_hop(t, sock)


def test_missing_key_file_is_named_not_retried(sshd, tmp_path):
    with SSHRunner.for_node("testnode", node(sshd, identity_file=str(tmp_path / "nope"))) as r:
        with pytest.raises(TransportError, match=r"the SSH key .*nope for node testnode does not exist"):
            r.run(["true"])


def test_unreachable_node_is_retried_then_reported(tmp_path):
    port = _sshd._free_port()
    known = tmp_path / "kh"
    known.write_text("")
    with SSHRunner.for_node("gone", NodeConfig(host="127.0.0.1", port=port, known_hosts=str(known)),
                            attempts=2) as r:
        with pytest.raises(TransportError) as info:
            r.run(["true"])
    assert "cannot connect to node gone" in str(info.value) and "after 2 attempts" in str(info.value)


def _descendants_of(pid: int) -> dict[int, bytes]:
    """Every live process under ``pid``, with its command line."""
    import os

    parent, cmdline = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
                cmdline[int(entry)] = open(f"/proc/{entry}/cmdline", "rb").read()
            except OSError:
                continue
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])

    def under(p: int) -> bool:
        while p in parent and p > 1:
            p = parent[p]
            if p == pid:
                return True
        return False

    return {p: c for p, c in cmdline.items() if p in parent and under(p)}


def _kill_the_servers_connections(sshd) -> None:
    """SIGKILL the server's per-connection processes (what a rebooting node or a dropped link does)."""
    import os
    import signal

    for pid, cmdline in _descendants_of(sshd.proc.pid).items():
        if cmdline.startswith(b"sshd"):  # the per-connection sshd processes, not the command
            os.kill(pid, signal.SIGKILL)


def _lose_the_connection_under_a_sleep(r, sshd, cut=_kill_the_servers_connections) -> dict:
    """Run `sleep 8` through ``r``; once it runs on the server, ``cut(sshd)``."""
    import threading
    import time

    outcome: dict = {}

    def run():
        try:
            outcome["result"] = r.run(["sleep", "8"])
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome["error"] = exc

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 20
    # `sleep 8` itself: an earlier test's `sleep 3` may still be running there.
    while not any(c.startswith(b"sleep\x008\0") for c in _descendants_of(sshd.proc.pid).values()):
        assert time.monotonic() < deadline, "the command never started on the server"
        time.sleep(0.05)
    cut(sshd)
    worker.join(30)
    assert not worker.is_alive()
    return outcome


def test_connection_lost_mid_command_is_reported_not_retried(sshd):
    with SSHRunner.for_node("testnode", node(sshd)) as r:
        r.connect()
        outcome = _lose_the_connection_under_a_sleep(r, sshd)
    assert isinstance(outcome.get("error"), TransportError), outcome
    assert "may or may not have completed" in str(outcome["error"])
    assert r.connections == 1


def test_timeout_raises_and_the_connection_stays_usable(runner):
    with pytest.raises(TimeoutError, match="did not finish within 0.5 s"):
        runner.run(["sleep", "3"], timeout=0.5)
    assert runner.run(["echo", "still here"]).stdout == "still here\n"


# --- the OpenSSH runner's own promises --------------------------------------------------------

def test_openssh_refuses_an_unknown_host_key_with_the_same_fix_and_learns_nothing(sshd, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with OpenSSHRunner("testnode", node(sshd, known_hosts=str(empty))) as r:
        with pytest.raises(HostKeyError) as info:
            r.run(["true"])
        assert r.connections == 0
    text = str(info.value)
    assert "not in" in text and str(empty) in text and "--trust-new-host-key" in text and "SHA256:" in text
    assert empty.read_text() == ""


def test_openssh_refuses_a_changed_host_key(sshd, tmp_path):
    known = _forged_known_hosts(sshd, tmp_path)
    with OpenSSHRunner("testnode", node(sshd, known_hosts=str(known))) as r:
        with pytest.raises(HostKeyError) as info:
            r.run(["true"])
    text = str(info.value)
    assert "CHANGED" in text and "ssh-keygen -R" in text and "testnode" in text
    assert known.read_text().count("\n") == 1


def test_no_host_block_of_the_operators_config_turns_host_key_checking_off(sshd, tmp_path, monkeypatch):
    """ctl's own settings come before the operator's config, where OpenSSH's first value wins."""
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    conf = tmp_path / "ssh_config"
    conf.write_text("Host *\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  BatchMode no\n")
    monkeypatch.setenv("DFLASH_CTL_SSH_CONFIG", str(conf))
    with OpenSSHRunner("testnode", node(sshd, known_hosts=str(empty))) as r:
        with pytest.raises(HostKeyError):
            r.run(["true"])
    assert empty.read_text() == ""


def test_openssh_names_a_refused_key_and_a_closed_port_as_paramiko_does(sshd, tmp_path):
    stranger = tmp_path / "stranger"
    _sshd._keygen(stranger)
    with OpenSSHRunner("testnode", node(sshd, identity_file=str(stranger))) as r:
        with pytest.raises(TransportError) as info:
            r.run(["true"])
    assert "authentication" in str(info.value) and "authorized_keys" in str(info.value)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with OpenSSHRunner("testnode", node(sshd, port=closed)) as r:
        with pytest.raises(TransportError, match=rf"cannot connect to node testnode at 127.0.0.1:{closed} after "):
            r.run(["true"])


def test_openssh_honours_an_ssh_config_alias(sshd, tmp_path, monkeypatch):
    conf = tmp_path / "ssh_config"
    conf.write_text(f"Host simalias\n  HostName 127.0.0.1\n  Port {sshd.port}\n"
                    f"  IdentityFile {sshd.client_key}\n  UserKnownHostsFile {sshd.known_hosts}\n")
    monkeypatch.setenv("DFLASH_CTL_SSH_CONFIG", str(conf))
    with OpenSSHRunner("aliased", NodeConfig(host="simalias")) as r:
        assert r.run(["sh", "-c", 'echo "via alias as $(id -un)"']).stdout == "via alias as root\n"
        assert r.connections == 1


def test_openssh_reports_a_connection_lost_mid_command(sshd):
    with OpenSSHRunner("testnode", node(sshd)) as r:
        outcome = _lose_the_connection_under_a_sleep(r, sshd)
        assert r._fallback is None  # lost under way, not a failure to connect: nothing is run again
    assert isinstance(outcome.get("error"), TransportError), outcome
    assert "may or may not have completed" in str(outcome["error"])


def test_openssh_reports_a_command_lost_with_a_killed_master_whose_socket_stayed(sshd):
    """A mux client whose master died says nothing and exits 255; the socket a killed master
    leaves behind (as one that is still closing its channels does for a moment) must not make
    that 255 the command's own."""
    import os
    import re
    import signal
    import subprocess

    from controller import sshmux

    def check():
        return subprocess.run(["ssh", "-F", "/dev/null", "-S", str(r.sock), "-O", "check", "--", "x"],
                              capture_output=True, text=True)

    with OpenSSHRunner("testnode", node(sshd)) as r:
        r.run(["true"])  # the master is up
        master = int(re.search(r"pid=(\d+)", check().stderr).group(1))
        outcome = _lose_the_connection_under_a_sleep(r, sshd, cut=lambda _: os.kill(master, signal.SIGKILL))
        assert r.sock.exists() and check().returncode != 0  # stale: what the runner must see through
        assert r.run(["echo", "again"]).stdout == "again\n"  # ssh replaces the stale socket
        assert r.connections == 2 and check().returncode == 0
        sshmux.close_master(r.sock)
    assert isinstance(outcome.get("error"), TransportError), outcome
    assert "may or may not have completed" in str(outcome["error"])


def test_an_exit_status_of_255_through_a_live_master_is_the_commands_own(sshd):
    from controller import sshmux

    with OpenSSHRunner("testnode", node(sshd)) as r:
        try:
            assert r.run(["sh", "-c", "exit 255"], check=False).returncode == 255
            assert r.run(["echo", "after"]).stdout == "after\n"
            assert r.connections == 1
        finally:
            sshmux.close_master(r.sock)  # the next tests count their own connections


def test_a_command_through_openssh_imports_no_paramiko_and_is_one_connection(sshd):
    import json
    import os
    import subprocess
    import sys

    code = ("import json, sys\n"
            "from controller.config import NodeConfig\n"
            "from controller.openssh import OpenSSHRunner\n"
            "from controller.transport import Runner\n"
            "with OpenSSHRunner('testnode', NodeConfig(**json.loads(sys.argv[1]))) as r:\n"
            "    out = r.run(['echo', 'hi']).stdout\n"
            "print(json.dumps([out, Runner.connections_opened, sorted(m for m in sys.modules if 'paramiko' in m)]))\n")
    fields = dict(host="127.0.0.1", port=sshd.port, user="root", identity_file=str(sshd.client_key),
                  known_hosts=str(sshd.known_hosts))
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(fields)], capture_output=True, text=True,
                          env=dict(os.environ, DFLASH_CTL_SSH_CONFIG="none"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ["hi\n", 1, []]



def test_ssh_config_files_unused_for_a_month_are_removed_when_another_is_written(tmp_path, monkeypatch):
    import os
    import time

    from controller.openssh import KEEP_UNUSED_S, wrapper_config

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = wrapper_config(NodeConfig(host="pve", user="one"))
    old = time.time() - KEEP_UNUSED_S - 60
    os.utime(first, (old, old))
    assert wrapper_config(NodeConfig(host="pve", user="one")) == first and first.exists()  # in use: kept
    second = wrapper_config(NodeConfig(host="pve", user="two"))
    assert second.exists() and not first.exists()
    assert wrapper_config(NodeConfig(host="pve", user="one")) == first and first.exists()  # written again
    assert sorted(p.name for p in second.parent.iterdir()) == sorted([first.name, second.name])


@pytest.mark.parametrize("kind", ["paramiko", "openssh"])
def test_proxy_jump_none_in_the_node_config_turns_the_ssh_configs_off(kind, sshd, tmp_path, monkeypatch):
    conf = tmp_path / "ssh_config"
    conf.write_text("Host 127.0.0.1\n  ProxyJump nobody@bastion.invalid\n")
    monkeypatch.setenv("DFLASH_CTL_SSH_CONFIG", str(conf))
    runner_class = SSHRunner.for_node if kind == "paramiko" else OpenSSHRunner
    with runner_class("testnode", node(sshd, proxy_jump="none")) as r:
        assert r.run(["echo", "direct"]).stdout == "direct\n"
        if kind == "openssh":
            assert r._fallback is None
