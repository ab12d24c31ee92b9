"""The OpenSSH runner: a command that runs one thing on a node, carried by the operator's own
``ssh`` binary (as Ansible's ssh connection plugin does).

Why: `ctl exec`, `ctl env`, `ctl status`, `ctl runs` and `ctl tail` without --follow run one
command in a container, and most of their time was ctl starting up; importing paramiko was
≈140 ms of it (docs/benchmarks.md, "ctl start-up: where the time goes"). The ``ssh`` binary
costs no import, and it reads the operator's ssh config the way OpenSSH itself does (Match,
certificates, agents, FIDO keys, their own ControlMaster). Commands that run many things
(launch, rollback, jobs, --follow) keep the paramiko runner (controller/ssh.py): one
connection for all of them, where each ``ssh`` here is a connection of its own.
controller/session.py picks between them.

What it shares with the paramiko runner, so that both behave alike:
- the ssh config ($DFLASH_CTL_SSH_CONFIG, else ~/.ssh/config: controller/sshconfig.py), read
  through a small config of ctl's own (:func:`wrapper_config`): first what no Host block there
  may turn off (host keys checked strictly and never learned, never a prompt), then the
  operator's config, then what the node config gives where theirs says nothing — user root,
  the node's key and known_hosts, for the bastions of a ProxyJump too. The node config's own
  fields go on the command line, which wins over any config file;
- the marker line that drops login-shell noise (transport.marked_command);
- the errors. When ssh cannot connect — unknown or changed host key, refused key, node or
  bastion down — the paramiko runner connects instead: it names the problem as every other
  command does (which hop, which key, the fingerprint, the fix), after its retries, or, if it
  gets through, runs the command. Nothing had started on the node: ssh never printed the
  marker that comes before the command. --trust-new-host-key goes through the paramiko runner
  from the start (it records the key and shows its fingerprint).
"""

from __future__ import annotations

import hashlib
import os
import re
import select
import selectors
import shlex
import subprocess
import threading
from pathlib import Path
from typing import Optional

from controller.config import NodeConfig
from controller.configcache import KEEP_UNUSED_S, cache_dir, write_cached  # noqa: F401 - tests
from controller import sshmux
from controller.sshconfig import (CONNECT_TIMEOUT_S, SERVER_ALIVE_COUNT, SERVER_ALIVE_S, missing_config_message,
                                  ssh_config_path)
from controller.transport import CHUNK, MarkerGate, Process, Runner, TransportError, _LocalProcess, marked_command

SSH = "ssh"

# What ssh says when a connection it had dies under a command: the command may or may not
# have completed, and running it again is the operator's decision.
_LOST = re.compile(rb"^(Connection to \S+ closed by remote host\.|Timeout, server \S+ not responding\."
                   rb"|client_loop: send disconnect: .*|packet_write_wait: .*)\s*$", re.M)


def _arg(value: str) -> str:
    """A path as one ssh_config argument: %-tokens and ~ are expanded there, so a literal % is
    doubled and the path made absolute; quoted for spaces."""
    if '"' in value or "\n" in value:
        raise TransportError(f"{value!r}: ssh cannot be given a path with a double quote or a newline")
    return '"' + str(Path(value).expanduser()).replace("%", "%%") + '"'


def wrapper_text(node: NodeConfig, user_config: Optional[Path], sock: Optional[Path] = None) -> str:
    lines = ["# Written by dflash-ctl for its ssh commands (controller/openssh.py); rewritten when it changes.",
             "# First, for every host on the way: what no Host block below may turn off.",
             "BatchMode yes", "StrictHostKeyChecking yes", "UpdateHostKeys no"]
    if user_config is not None:
        lines.append(f"Include {_arg(str(user_config))}")
    if sock is not None:
        lines += ["# The node's shared connection (controller/sshmux.py), where the config above sets none.",
                  *sshmux.config_lines(node, sock, _arg)]
    lines += ["# Last: the node config's defaults, where the config above says nothing (its bastions too).",
              "Host *", f"  User {node.user or 'root'}", f"  ConnectTimeout {CONNECT_TIMEOUT_S}",
              f"  ServerAliveInterval {SERVER_ALIVE_S}", f"  ServerAliveCountMax {SERVER_ALIVE_COUNT}"]
    if node.identity_file:
        lines += [f"  IdentityFile {_arg(node.identity_file)}", "  IdentitiesOnly yes"]
    if node.known_hosts:
        lines.append(f"  UserKnownHostsFile {_arg(node.known_hosts)}")
    return "\n".join(lines) + "\n"


def wrapper_config(node: NodeConfig, user_config: Optional[Path] = None, sock: Optional[Path] = None) -> Path:
    """The ``ssh -F`` file for ``node`` (sharing the connection through ``sock``): written once
    per content (its name is its hash), so concurrent commands with different configs never
    see each other's."""
    text = wrapper_text(node, user_config, sock)
    path = cache_dir() / "ssh" / f"{hashlib.sha256(text.encode()).hexdigest()[:20]}.conf"
    if not path.exists():
        write_cached(path, text)
    return path


def ssh_options(node: NodeConfig, sock: Optional[Path]) -> list[str]:
    """``ssh`` and its options for ``node``, up to the host: the wrapper config, then the node
    config's own fields, which win over any file."""
    user_config = ssh_config_path()
    if user_config is not None and not user_config.exists():
        raise TransportError(missing_config_message(user_config))
    argv = [SSH, "-F", str(wrapper_config(node, user_config, sock)), "-T"]
    if node.port:
        argv += ["-p", str(node.port)]
    if node.user:
        argv += ["-l", node.user]
    if node.identity_file:
        argv += ["-o", f"IdentityFile={_arg(node.identity_file)}", "-o", "IdentitiesOnly=yes"]
    if node.known_hosts:
        argv += ["-o", f"UserKnownHostsFile={_arg(node.known_hosts)}"]
    if node.proxy_jump:  # "none" too: then no ProxyJump of the ssh config applies, as with paramiko
        argv += ["-J", node.proxy_jump]
    return argv


def node_socket(node: NodeConfig) -> Optional[Path]:
    """Where ``node``'s shared connection listens (controller/sshmux.py), or None for none."""
    return sshmux.control_path(node, ssh_config_path())


def _socket_id(sock: Optional[Path]) -> Optional[tuple[int, int, int]]:
    """Which socket is at ``sock`` now (None for none): a master that replaced another's
    left-over socket made a new one (its inode number may well be the old one's)."""
    if sock is None:
        return None
    try:
        st = sock.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


class OpenSSHRunner(Runner):
    """Runs each argv on ``node`` through one ``ssh`` process: a channel of the node's shared
    connection when there is one (controller/sshmux.py), else a connection of its own that
    stays behind as the shared one."""

    def __init__(self, node_name: str, node: NodeConfig):
        self.node_name = node_name
        self.node = node
        self.where = f"node {node_name}"
        self.connections = 0
        self._fallback: Optional[Runner] = None  # the paramiko runner, once ssh could not connect
        self.sock: Optional[Path] = None

    def ssh_argv(self, remote: str) -> list[str]:
        self.sock = node_socket(self.node)
        # "--": the host is never read as an option, and nothing after it either.
        return [*ssh_options(self.node, self.sock), "--", self.node.host, remote]

    def paramiko(self) -> Runner:
        if self._fallback is None:
            from controller.ssh import SSHRunner

            self._fallback = SSHRunner.for_node(self.node_name, self.node)
        return self._fallback

    def _start(self, argv: list[str], with_stdin: bool) -> Process:
        if self._fallback is not None:
            return self._fallback._start(argv, with_stdin)
        marker, remote = marked_command(argv)
        try:
            command = self.ssh_argv(remote)
        except OSError:  # no writable cache for the config file
            return self.paramiko()._start(argv, with_stdin)
        for attempt in (1, 2):
            before = _socket_id(self.sock)
            try:
                popen = subprocess.Popen(command, stdin=subprocess.PIPE if with_stdin else subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            except OSError:  # no ssh binary here
                return self.paramiko()._start(argv, with_stdin)
            proc = _OpenSSHProcess(self, popen, marker, argv)
            try:
                started = proc.wait_for_marker()
            except BaseException:
                proc.abort()
                raise
            if started:
                # Our master carries this command (it was there, or this ssh just became it);
                # with the operator's own ControlPath ours is never made.
                after = _socket_id(self.sock)
                proc.on_master = after is not None
                # A connection of its own, or a new master's socket (one that replaced the stale
                # socket of a killed master too).
                if after is None or after != before:
                    self.connections += 1
                    self._count_connection()
                return proc
            if popen.wait() != 255:
                return proc  # the login shell ended before our command; its words are the diagnostic
            said = bytes(proc.early["stderr"])
            proc.close_wake()
            if _LOST.search(said):
                raise TransportError(f"the connection to node {self.node_name} was lost as {shlex.join(argv)} was "
                                     f"starting; it may or may not have run: check before running it again "
                                     f"({said.decode(errors='replace').strip().splitlines()[-1]})")
            if not (before is not None and attempt == 1):
                break
            # The shared connection failed before the command began (its peer gone: rebooted,
            # restarted, cut off, found out by ServerAlive): once more, through a new one.
            self._drop_master()
        # ssh did not get as far as the command: the paramiko runner says why, or gets through.
        return self.paramiko()._start(argv, with_stdin)

    def _drop_master(self) -> None:
        """A master that can no longer open a session: asked to exit, its socket removed, so the
        next ``ssh`` starts a new one."""
        if self.sock is not None:
            sshmux.close_master(self.sock)

    def close(self) -> None:
        if self._fallback is not None:
            self._fallback.close()
            self._fallback = None


class _OpenSSHProcess(_LocalProcess):
    """One ``ssh`` process. Its stdout and stderr before the marker lines are the login
    shell's noise and ssh's own messages.

    Its streams end when ``ssh`` exits, even while another process holds them open: the
    proxy command of a new master (``ssh -W`` to the bastion) inherited ``ssh``'s stderr and
    lives as long as the master, minutes after this command ended."""

    timeout_note = "it may still be running there (stopping ssh does not stop it)"

    def __init__(self, runner: OpenSSHRunner, popen: subprocess.Popen, marker: bytes, argv: list[str]):
        super().__init__(popen)
        self.runner = runner
        self.marker = marker
        self.argv = argv
        self.early = {"stdout": bytearray(), "stderr": bytearray()}  # read while waiting for the marker
        self.gates: list[MarkerGate] = []
        self.err_tail = b""
        self.on_master = False
        self.fds = {"stdout": popen.stdout.fileno(), "stderr": popen.stderr.fileno()}
        self._ended, ended_w = os.pipe()  # readable once ssh has exited
        threading.Thread(target=self._note_exit, args=(ended_w,), daemon=True).start()

    def _note_exit(self, fd: int) -> None:
        try:
            self.popen.wait()
        finally:
            os.close(fd)  # EOF on self._ended

    def master_gone(self) -> bool:
        """The command rode a shared connection that has ended (a mux client says nothing of
        it). Its socket may outlive it for a moment, or for good when it was killed: one that
        is still there is asked."""
        if not self.on_master:
            return False
        return not self.runner.sock.exists() or not sshmux.master_answers(self.runner.sock)

    def close_wake(self) -> None:
        if self._ended >= 0:
            os.close(self._ended)
            self._ended = -1

    def _read(self, name: str, n: int) -> bytes:
        """Up to ``n`` bytes of one stream; b"" at its end or, once ssh exited, when nothing
        more is waiting in it."""
        fd = self.fds[name]
        ready, _, _ = select.select([fd, self._ended] if self._ended >= 0 else [fd], [], [])
        if fd in ready or select.select([fd], [], [], 0)[0]:
            return os.read(fd, n)
        return b""

    def wait_for_marker(self) -> bool:
        """Read both streams until the marker line comes on stdout (the command is starting:
        True) or ssh's output ends without it (False). Both are drained meanwhile: a login
        shell's noise must not fill a pipe while we wait on the other."""
        line = b"\n" + self.marker + b"\n"
        streams = {self.fds["stdout"]: "stdout", self.fds["stderr"]: "stderr"}
        with selectors.DefaultSelector() as sel:
            for fd in streams:
                sel.register(fd, selectors.EVENT_READ)
            sel.register(self._ended, selectors.EVENT_READ)
            while streams:
                events = sel.select()
                fds = {key.fd for key, _ in events}
                for fd in [f for f in fds if f in streams]:
                    data = os.read(fd, CHUNK)
                    if not data:
                        sel.unregister(fd)
                        del streams[fd]
                        continue
                    name = streams[fd]
                    self.early[name] += data
                    if name == "stdout" and line in b"\n" + self.early["stdout"]:
                        return True
                if self._ended in fds and not fds & set(streams):
                    return False  # ssh exited and nothing more is waiting in its streams
        return False

    def gate(self, stream, sink):
        gate = MarkerGate(self.marker, sink)
        self.gates.append(gate)
        return gate

    def recv_out(self, n: int) -> bytes:
        if self.early["stdout"]:
            data, self.early["stdout"] = bytes(self.early["stdout"]), bytearray()
            return data
        return self._read("stdout", n)

    def recv_err(self, n: int) -> bytes:
        if self.early["stderr"]:
            data, self.early["stderr"] = bytes(self.early["stderr"]), bytearray()
        else:
            data = self._read("stderr", n)
        self.err_tail = (self.err_tail + data)[-4096:]
        return data

    def wait(self, timeout):
        status, _ = super().wait(timeout)
        self.close_wake()
        for gate in self.gates:
            if not gate.open:  # the marker never came: what the login shell said is the diagnostic
                gate.sink.feed(bytes(gate.noise))
        if status == 255 and (_LOST.search(self.err_tail) or self.master_gone()):
            raise TransportError(
                f"the connection to node {self.runner.node_name} was lost while running {shlex.join(self.argv)}; "
                f"it may or may not have completed: check before running it again")
        return status, (status - 128 if 128 < status < 128 + 65 else None)
