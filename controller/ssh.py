"""The SSH runner: one paramiko connection per ``ctl`` command, host keys verified.

Lessons this module encodes (docs/research/proxmox-and-supervision.md §3):
- Host keys are checked against the configured known_hosts and an unknown or changed key
  is refused with the exact fix. fabric's Connection and proxmoxer force AutoAddPolicy;
  we never do. A new key is recorded only with an explicit ``trust_new_host_key``.
- stdout and stderr are drained concurrently by two threads: reading one stream while the
  other fills its window deadlocks (paramiko#448, #563, #1778); ``recv_exit_status`` is
  called only after both reached EOF.
- Keepalives are on (paramiko's default is off).
- Connection set-up is retried with backoff (tenacity); authentication and host-key
  failures are not (retrying cannot fix them). Commands are never retried: they may have
  side effects.
- Environment variables are never sent over SSH (servers drop them silently; fabric's
  inline export does no escaping). The command string is ``shlex.join(argv)`` only.
- A polluted login shell on the node (a .bashrc that prints) must not reach our output:
  the remote side prints a random marker line on stdout and stderr before running the
  command, and everything before it is dropped (transport._MarkerGate).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shlex
import socket
import sys
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional


def _import_paramiko():
    """Import paramiko with its ``import invoke`` deferred.

    paramiko.config imports invoke at import time, only to run ``Match exec`` lines of an
    ssh_config; that is a third to a half of paramiko's import time, paid by every `ctl`
    command (bench/ctl_exec/roundtrip.py). A stand-in module imports the real invoke the first
    time paramiko touches it, so ``Match exec`` still works.
    """
    if "paramiko" in sys.modules or "invoke" in sys.modules or importlib.util.find_spec("invoke") is None:
        return importlib.import_module("paramiko")

    class _DeferredInvoke(types.ModuleType):
        def __getattr__(self, name):
            if sys.modules.get("invoke") is self:
                del sys.modules["invoke"]
            return getattr(importlib.import_module("invoke"), name)

    stand_in = _DeferredInvoke("invoke")
    sys.modules["invoke"] = stand_in
    try:
        return importlib.import_module("paramiko")
    finally:
        if sys.modules.get("invoke") is stand_in:
            del sys.modules["invoke"]


paramiko = _import_paramiko()

from controller.config import NodeConfig  # noqa: E402
from controller.sshconfig import (CONNECT_ATTEMPTS, CONNECT_TIMEOUT_S, DEFAULT_KNOWN_HOSTS,  # noqa: E402
                                  KEEPALIVE_S, missing_config_message, ssh_config_path)
from controller.transport import (HostKeyError, MarkerGate, Process, Runner, TransportError,  # noqa: E402
                                  marked_command)


@dataclass
class SSHTarget:
    """Where and how to connect, after merging the node config over ~/.ssh/config."""

    node: str
    hostname: str
    port: int
    user: str
    key_filenames: list[str] = field(default_factory=list)
    known_hosts: str = ""
    jump: Optional["SSHTarget"] = None  # the bastion this host is reached through (its own jump: the hop before)
    proxy_command: Optional[str] = None  # ~/.ssh/config ProxyCommand, when no jump is set
    bastion_for: Optional[str] = None  # set on a bastion: the node it leads to

    @property
    def label(self) -> str:
        """How messages name this host: the node, or the bastion on the way to it."""
        if self.bastion_for:
            return f"bastion {self.hostname}:{self.port} (on the way to node {self.bastion_for})"
        return f"node {self.node}"

    @property
    def hops(self) -> list["SSHTarget"]:
        """Every host to connect to, first hop first, this one last."""
        return [*(self.jump.hops if self.jump else []), self]

    @property
    def known_hosts_name(self) -> str:
        """The name known_hosts uses for this host ([host]:port when the port is not 22)."""
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"


def _ssh_config() -> "Optional[paramiko.SSHConfig]":
    path = ssh_config_path()
    if path is None:
        return None
    if not path.exists():
        raise TransportError(missing_config_message(path))
    return paramiko.SSHConfig.from_path(str(path))


def _keys(looked: dict) -> list[str]:
    # like OpenSSH, IdentityFile lines naming absent files are skipped
    return [str(Path(k).expanduser()) for k in looked.get("identityfile", []) if Path(k).expanduser().is_file()]


def _parse_hop(spec: str) -> tuple[Optional[str], str, Optional[int]]:
    """'[user@]host[:port]' (or ssh://…) → (user, host, port)."""
    spec = spec.strip().removeprefix("ssh://")
    user, _, hostport = spec.rpartition("@")
    host, port = hostport, None
    if hostport.startswith("["):  # [v6]:port
        host, _, rest = hostport[1:].partition("]")
        port = rest[1:] or None
    elif hostport.count(":") == 1:
        host, port = hostport.split(":")
    if not host or (port is not None and not port.isdigit()):
        raise TransportError(f"proxy_jump {spec!r}: expected [user@]host[:port]")
    return user or None, host, int(port) if port else None


def resolve_target(node_name: str, node: NodeConfig) -> SSHTarget:
    """Node config fields win; ~/.ssh/config (an alias in ``host``) fills the rest, the
    bastions included: ``proxy_jump`` (or the config's ProxyJump) names hops that are looked
    up in ~/.ssh/config in turn, and use the node's key and known_hosts unless it says otherwise."""
    config = _ssh_config()
    looked = config.lookup(node.host) if config else {}
    hostname = looked.get("hostname", node.host)
    port = node.port or int(looked.get("port", 22))
    user = node.user or looked.get("user") or "root"
    keys = [str(Path(node.identity_file).expanduser())] if node.identity_file else _keys(looked)
    known = str(Path(node.known_hosts or (looked.get("userknownhostsfile", "").split() or [DEFAULT_KNOWN_HOSTS])[0])
                .expanduser())
    target = SSHTarget(node_name, hostname, port, user, keys, known)
    jump_spec = node.proxy_jump or looked.get("proxyjump")
    if jump_spec and jump_spec.strip().lower() != "none":
        previous = None
        for spec in jump_spec.split(","):  # OpenSSH order: the first hop is connected to first
            hop_user, hop_host, hop_port = _parse_hop(spec)
            hop_looked = config.lookup(hop_host) if config else {}
            previous = SSHTarget(
                node_name, hop_looked.get("hostname", hop_host), hop_port or int(hop_looked.get("port", 22)),
                hop_user or hop_looked.get("user") or user, _keys(hop_looked) or keys,
                str(Path((hop_looked.get("userknownhostsfile", "").split() or [known])[0]).expanduser()),
                jump=previous, bastion_for=node_name)
        target.jump = previous
    elif looked.get("proxycommand") and looked["proxycommand"].strip().lower() != "none":
        target.proxy_command = looked["proxycommand"]
    return target


def _fingerprint(key: paramiko.PKey) -> str:
    return f"{key.get_name()} {key.fingerprint}"


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Unknown key: refuse, or record it when the operator passed --trust-new-host-key."""

    def __init__(self, target: SSHTarget, trust_new: bool):
        self.target = target
        self.trust_new = trust_new
        self.trusted: Optional[str] = None

    def missing_host_key(self, client, hostname, key):
        t = self.target
        if not self.trust_new:
            raise HostKeyError(
                f"the host key of {t.label} ({t.known_hosts_name}) is not in {t.known_hosts}; "
                f"the node offered {_fingerprint(key)}. Compare it with the node's own "
                f"(on that host: `ssh-keygen -lf /etc/ssh/ssh_host_{_keyfile(key)}_key.pub`) and, if "
                f"they match, rerun with --trust-new-host-key to record it"
            )
        path = Path(t.known_hosts)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as fh:
            fh.write(line)
        self.trusted = _fingerprint(key)


def _keyfile(key: paramiko.PKey) -> str:
    name = key.get_name()
    return {"ssh-ed25519": "ed25519", "ssh-rsa": "rsa"}.get(name, "ecdsa" if "ecdsa" in name else name)


class _HopError(Exception):
    """Connecting to one hop failed in a way a retry may fix (refused, timed out, reset)."""

    def __init__(self, hop: SSHTarget, detail: str, retryable: bool):
        super().__init__(detail)
        self.hop, self.detail, self.retryable = hop, detail, retryable


class SSHRunner(Runner):
    """Runs argv lists on a node over one SSH connection, opened lazily and reused."""

    def __init__(self, target: SSHTarget, *, trust_new_host_key: bool = False,
                 keepalive_s: int = KEEPALIVE_S, attempts: int = CONNECT_ATTEMPTS):
        self.target = target
        self.trust_new_host_key = trust_new_host_key
        self.keepalive_s = keepalive_s
        self.attempts = attempts
        self.where = f"node {target.node}"
        self._client: Optional[paramiko.SSHClient] = None
        self._jumps: list[paramiko.SSHClient] = []  # bastions' clients, first hop first
        self.connections = 0  # opened by this runner
        self.trusted_key: Optional[str] = None  # fingerprint recorded with trust_new_host_key
        self._connect_lock = threading.Lock()  # threads share one connection, never open two

    @classmethod
    def for_node(cls, node_name: str, node: NodeConfig, **kw) -> "SSHRunner":
        return cls(resolve_target(node_name, node), **kw)

    # -- connection ------------------------------------------------------------------------
    def _connect_once(self) -> paramiko.SSHClient:
        """Every hop in turn, each host key checked; the clients of the bastions are kept (the
        node's connection runs through their channels) and closed with the runner."""
        clients: list[paramiko.SSHClient] = []
        try:
            hops = self.target.hops
            sock = paramiko.ProxyCommand(hops[0].proxy_command) if hops[0].proxy_command else None
            for i, hop in enumerate(hops):
                clients.append(self._open_hop(hop, sock))
                if i + 1 < len(hops):
                    sock = self._tunnel(clients[-1], hops[i + 1])
        except BaseException:
            for c in reversed(clients):
                c.close()
            raise
        self._jumps = clients[:-1]
        return clients[-1]

    def _tunnel(self, bastion: paramiko.SSHClient, to: SSHTarget):
        try:
            return bastion.get_transport().open_channel("direct-tcpip", (to.hostname, to.port), ("127.0.0.1", 0),
                                                        timeout=CONNECT_TIMEOUT_S)
        except paramiko.ChannelException as exc:
            raise _HopError(to, f"the bastion could not reach {to.hostname}:{to.port} ({exc.text or exc}). "
                                "Check the node's host/port as the bastion sees them, and that the bastion allows "
                                "TCP forwarding (AllowTcpForwarding)", retryable=True) from None

    def _open_hop(self, t: SSHTarget, sock) -> paramiko.SSHClient:
        client = paramiko.SSHClient()
        if Path(t.known_hosts).exists():
            client.load_host_keys(t.known_hosts)
        policy = _HostKeyPolicy(t, self.trust_new_host_key)
        client.set_missing_host_key_policy(policy)
        try:
            client.connect(
                t.hostname, port=t.port, username=t.user, sock=sock,
                key_filename=t.key_filenames or None,
                look_for_keys=not t.key_filenames, allow_agent=not t.key_filenames,
                timeout=CONNECT_TIMEOUT_S, banner_timeout=CONNECT_TIMEOUT_S, auth_timeout=CONNECT_TIMEOUT_S,
            )
        except HostKeyError:
            client.close()
            raise
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise HostKeyError(
                f"the host key of {t.label} ({t.known_hosts_name}) has CHANGED: {t.known_hosts} has "
                f"{_fingerprint(exc.expected_key)} but it offered {_fingerprint(exc.key)}. Either the "
                f"host was reinstalled or someone is intercepting the connection. Verify the new key on the "
                f"host; if it is legitimate, remove the old entry with "
                f"`ssh-keygen -R {shlex.quote(t.known_hosts_name)} -f {shlex.quote(t.known_hosts)}` "
                f"and rerun with --trust-new-host-key"
            ) from None
        except paramiko.AuthenticationException as exc:
            client.close()
            keys = ", ".join(t.key_filenames) or "the default keys and agent"
            raise TransportError(
                f"SSH authentication as {t.user} to {t.label} ({t.hostname}:{t.port}) failed with "
                f"{keys}: {exc}. Put the public key in its authorized_keys or set identity_file"
            ) from None
        except (OSError, EOFError, paramiko.SSHException) as exc:
            client.close()
            raise _HopError(t, str(exc) or type(exc).__name__, retryable=True) from None
        if policy.trusted:
            self.trusted_key = policy.trusted
        return client

    def connect(self) -> paramiko.SSHClient:
        with self._connect_lock:
            return self._connect_locked()

    def _connect_locked(self) -> paramiko.SSHClient:
        if self._client is not None and self._client.get_transport() and self._client.get_transport().is_active():
            return self._client
        t = self.target
        for key in t.key_filenames:  # retrying cannot create a missing key file
            if not Path(key).is_file():
                raise TransportError(f"the SSH key {key} for node {t.node} does not exist: fix identity_file "
                                     f"in the config")
        try:
            try:
                client = self._connect_once()
            except _HopError as first:
                if not first.retryable or self.attempts <= 1:
                    raise
                # Only a failed first attempt pays for importing the retry policy (~90 ms of
                # every command's start-up otherwise: bench/ctl_exec/roundtrip.py).
                import tenacity

                for attempt in tenacity.Retrying(
                    stop=tenacity.stop_after_attempt(self.attempts - 1),
                    wait=tenacity.wait_exponential(multiplier=0.25, max=4),
                    retry=tenacity.retry_if_exception(lambda e: isinstance(e, _HopError) and e.retryable),
                    reraise=True,
                ):
                    with attempt:
                        client = self._connect_once()
        except _HopError as exc:
            hint = ("Check the node is up and its host/port in the config" if exc.hop is t else
                    "Check the bastion is up and proxy_jump (or ProxyJump in ~/.ssh/config)")
            raise TransportError(
                f"cannot connect to {exc.hop.label} at {exc.hop.hostname}:{exc.hop.port} after {self.attempts} "
                f"attempts: {exc.detail}. {hint}"
            ) from None
        for c in [*self._jumps, client]:
            c.get_transport().set_keepalive(self.keepalive_s)
        _tcp_keepalive((self._jumps[0] if self._jumps else client).get_transport().sock)
        self._client = client
        self.connections += 1
        self._count_connection()
        return client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        for jump in reversed(self._jumps):
            jump.close()
        self._jumps = []

    # -- commands --------------------------------------------------------------------------
    def _start(self, argv: list[str], with_stdin: bool) -> Process:
        client = self.connect()
        marker, remote = marked_command(argv)
        try:
            chan = client.get_transport().open_session(timeout=CONNECT_TIMEOUT_S)
            chan.exec_command(remote)
        except (OSError, EOFError, paramiko.SSHException) as exc:
            self.close()
            raise TransportError(f"cannot start a command on node {self.target.node}: {exc}") from None
        return _SSHProcess(self, chan, marker, argv)


class _SSHProcess(Process):
    """One exec channel. Output before the marker line is the login shell's noise."""

    timeout_note = "it may still be running there (closing the channel does not stop it)"

    def __init__(self, runner: SSHRunner, chan, marker: bytes, argv: list[str]):
        self.runner = runner
        self.chan = chan
        self.marker = marker
        self.argv = argv
        self.gates: list[MarkerGate] = []

    def gate(self, stream, sink):
        gate = MarkerGate(self.marker, sink)
        self.gates.append(gate)
        return gate

    def recv_out(self, n: int) -> bytes:
        return self.chan.recv(n)

    def recv_err(self, n: int) -> bytes:
        return self.chan.recv_stderr(n)

    def send_in(self, data: bytes) -> bool:
        try:
            self.chan.sendall(data)
            return True
        except OSError:
            if not self.chan.closed and not self.chan.exit_status_ready():
                raise
            return False  # the command ended without reading all its input

    def close_in(self) -> None:
        if not self.chan.closed:
            self.chan.shutdown_write()

    def wait(self, timeout):
        # Both streams are at their end here, so the status is there or the channel died.
        status = self.chan.recv_exit_status()
        self.chan.close()
        for gate in self.gates:
            if not gate.open:  # the marker never came: the login shell failed; its words are the diagnostic
                gate.sink.feed(bytes(gate.noise))
        if status == -1:
            transport = self.runner._client.get_transport() if self.runner._client else None
            if transport is None or not transport.is_active():
                self.runner.close()
                raise TransportError(
                    f"the connection to node {self.runner.target.node} was lost while running "
                    f"{shlex.join(self.argv)}; it may or may not have completed: check before running it again")
            status = 255  # the remote side ended without an exit status (killed by a signal)
        return status, (status - 128 if 128 < status < 128 + 65 else None)

    def abort(self) -> None:
        # Closing the channel gives the remote side EOF; it is not a kill
        # (docs/research/proxmox-and-supervision.md §1.1).
        self.chan.close()


def _tcp_keepalive(sock, idle: int = 30, interval: int = 10, count: int = 3) -> None:
    """paramiko's keepalive is sent with wait=False: it keeps NAT state alive but never notices
    a dead peer (docs/research/proxmox-and-supervision.md §3), so a command on a vanished node
    would wait forever. TCP keepalive does notice: after idle + interval × count seconds the
    socket errors, the command ends, and the caller is told the connection was lost."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except (OSError, AttributeError):
        pass  # not a TCP socket (a ProxyCommand): paramiko's keepalive still runs


