"""The SSH runner: one paramiko connection per ``ctl`` command, host keys verified.

Lessons this module encodes (research/proxmox-and-supervision.md §3):
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
import os
import shlex
import socket
import sys
import threading
import types
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional


def _import_paramiko():
    """Import paramiko with its ``import invoke`` deferred.

    paramiko.config imports invoke at import time, only to run ``Match exec`` lines of an
    ssh_config; that is a third to a half of paramiko's import time, paid by every `ctl`
    command (bench/exec_roundtrip.py). A stand-in module imports the real invoke the first
    time paramiko touches it, so ``Match exec`` still works.
    """
    if "paramiko" in sys.modules or "invoke" in sys.modules:
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
import tenacity  # noqa: E402

from controller.config import NodeConfig  # noqa: E402
from controller.transport import (  # noqa: E402
    CHUNK,
    HostKeyError,
    Result,
    Runner,
    TransportError,
    _finish,
    _MarkerGate,
    _Sink,
    _stdin_chunks,
)

# Which ssh_config file to honour. Tests point this at their own file (or "none") so a
# developer's ~/.ssh/config never changes what a test does (fabric's tests do the same).
ENV_SSH_CONFIG = "DFLASH_CTL_SSH_CONFIG"
DEFAULT_SSH_CONFIG = "~/.ssh/config"
DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"

KEEPALIVE_S = 15
CONNECT_TIMEOUT_S = 10
CONNECT_ATTEMPTS = 4

# Printed first by the remote side; everything a login shell printed before it is noise.
# "$0" is the marker (passed as an argument, never interpolated); the command's status is
# that of "$@", so a signal-killed command reports 128+N through sh, like lxc-attach.
_PRELUDE = 'printf "%s\\n" "$0"; printf "%s\\n" "$0" >&2; "$@"'


@dataclass
class SSHTarget:
    """Where and how to connect, after merging the node config over ~/.ssh/config."""

    node: str
    hostname: str
    port: int
    user: str
    key_filenames: list[str] = field(default_factory=list)
    known_hosts: str = ""

    @property
    def known_hosts_name(self) -> str:
        """The name known_hosts uses for this host ([host]:port when the port is not 22)."""
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"


def ssh_config_path() -> Optional[Path]:
    raw = os.environ.get(ENV_SSH_CONFIG)
    if raw is not None:
        if raw.strip().lower() in ("", "none", "/dev/null"):
            return None
        return Path(raw).expanduser()
    path = Path(DEFAULT_SSH_CONFIG).expanduser()
    return path if path.exists() else None


def resolve_target(node_name: str, node: NodeConfig) -> SSHTarget:
    """Node config fields win; ~/.ssh/config (an alias in ``host``) fills the rest."""
    looked: dict = {}
    path = ssh_config_path()
    if path is not None:
        if not path.exists():
            raise TransportError(f"ssh config {path} (from ${ENV_SSH_CONFIG}) does not exist")
        looked = paramiko.SSHConfig.from_path(str(path)).lookup(node.host)
    hostname = looked.get("hostname", node.host)
    port = node.port or int(looked.get("port", 22))
    user = node.user or looked.get("user") or "root"
    if node.identity_file:
        keys = [str(Path(node.identity_file).expanduser())]
    else:  # like OpenSSH, IdentityFile lines naming absent files are skipped
        keys = [str(Path(k).expanduser()) for k in looked.get("identityfile", []) if Path(k).expanduser().is_file()]
    known = node.known_hosts or (looked.get("userknownhostsfile", "").split() or [DEFAULT_KNOWN_HOSTS])[0]
    return SSHTarget(node_name, hostname, port, user, keys, str(Path(known).expanduser()))


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
                f"the host key of node {t.node} ({t.known_hosts_name}) is not in {t.known_hosts}; "
                f"the node offered {_fingerprint(key)}. Compare it with the node's own "
                f"(on the node: `ssh-keygen -lf /etc/ssh/ssh_host_{_keyfile(key)}_key.pub`) and, if "
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


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, (HostKeyError, paramiko.AuthenticationException, paramiko.BadHostKeyException)):
        return False
    return isinstance(exc, (OSError, EOFError, paramiko.SSHException))


class SSHRunner(Runner):
    """Runs argv lists on a node over one SSH connection, opened lazily and reused."""

    # Connections opened by every SSHRunner in this process (benchmarks and tests read it).
    connections_opened = 0
    _count_lock = threading.Lock()

    def __init__(self, target: SSHTarget, *, trust_new_host_key: bool = False,
                 keepalive_s: int = KEEPALIVE_S, attempts: int = CONNECT_ATTEMPTS):
        self.target = target
        self.trust_new_host_key = trust_new_host_key
        self.keepalive_s = keepalive_s
        self.attempts = attempts
        self.where = f"node {target.node}"
        self._client: Optional[paramiko.SSHClient] = None
        self.connections = 0  # opened by this runner
        self.trusted_key: Optional[str] = None  # fingerprint recorded with trust_new_host_key
        self._connect_lock = threading.Lock()  # threads share one connection, never open two

    @classmethod
    def for_node(cls, node_name: str, node: NodeConfig, **kw) -> "SSHRunner":
        return cls(resolve_target(node_name, node), **kw)

    # -- connection ------------------------------------------------------------------------
    def _connect_once(self) -> paramiko.SSHClient:
        t = self.target
        client = paramiko.SSHClient()
        if Path(t.known_hosts).exists():
            client.load_host_keys(t.known_hosts)
        policy = _HostKeyPolicy(t, self.trust_new_host_key)
        client.set_missing_host_key_policy(policy)
        try:
            client.connect(
                t.hostname, port=t.port, username=t.user,
                key_filename=t.key_filenames or None,
                look_for_keys=not t.key_filenames, allow_agent=not t.key_filenames,
                timeout=CONNECT_TIMEOUT_S, banner_timeout=CONNECT_TIMEOUT_S, auth_timeout=CONNECT_TIMEOUT_S,
            )
        except BaseException:
            client.close()
            raise
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
            for attempt in tenacity.Retrying(
                stop=tenacity.stop_after_attempt(self.attempts),
                wait=tenacity.wait_exponential(multiplier=0.25, max=4),
                retry=tenacity.retry_if_exception(_retryable),
                reraise=True,
            ):
                with attempt:
                    client = self._connect_once()
        except HostKeyError:
            raise
        except paramiko.BadHostKeyException as exc:
            raise HostKeyError(
                f"the host key of node {t.node} ({t.known_hosts_name}) has CHANGED: {t.known_hosts} has "
                f"{_fingerprint(exc.expected_key)} but the node offered {_fingerprint(exc.key)}. Either the "
                f"node was reinstalled or someone is intercepting the connection. Verify the new key on the "
                f"node; if it is legitimate, remove the old entry with "
                f"`ssh-keygen -R {shlex.quote(t.known_hosts_name)} -f {shlex.quote(t.known_hosts)}` "
                f"and rerun with --trust-new-host-key"
            ) from None
        except paramiko.AuthenticationException as exc:
            keys = ", ".join(t.key_filenames) or "the default keys and agent"
            raise TransportError(
                f"SSH authentication as {t.user} to node {t.node} ({t.hostname}:{t.port}) failed with "
                f"{keys}: {exc}. Put the public key in the node's authorized_keys or set identity_file"
            ) from None
        except (OSError, EOFError, paramiko.SSHException) as exc:
            raise TransportError(
                f"cannot connect to node {t.node} at {t.hostname}:{t.port} after {self.attempts} attempts: "
                f"{exc or type(exc).__name__}. Check the node is up and its host/port in the config"
            ) from None
        transport = client.get_transport()
        transport.set_keepalive(self.keepalive_s)
        _tcp_keepalive(transport.sock)
        self._client = client
        self.connections += 1
        with SSHRunner._count_lock:
            SSHRunner.connections_opened += 1
        return client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # -- commands --------------------------------------------------------------------------
    def run(self, argv, *, stdin=None, check=False, capture=True, on_stdout=None, on_stderr=None,
            stdout_sink=None, stderr_sink=None, timeout=None) -> Result:
        argv = [str(a) for a in argv]
        client = self.connect()
        marker = f"--dflash-ctl-begin-{uuid.uuid4().hex}--"
        remote = shlex.join(["sh", "-c", _PRELUDE, marker, *argv])
        try:
            chan = client.get_transport().open_session(timeout=CONNECT_TIMEOUT_S)
            chan.exec_command(remote)
        except (OSError, EOFError, paramiko.SSHException) as exc:
            self.close()
            raise TransportError(f"cannot start a command on node {self.target.node}: {exc}") from None
        out = _Sink(capture, on_stdout, stdout_sink)
        err = _Sink(capture, on_stderr, stderr_sink)
        gates = (_MarkerGate(marker.encode(), out), _MarkerGate(marker.encode(), err))
        readers = [threading.Thread(target=_drain, args=(chan.recv, gates[0]), daemon=True),
                   threading.Thread(target=_drain, args=(chan.recv_stderr, gates[1]), daemon=True)]
        for t in readers:
            t.start()
        try:
            if stdin is not None:
                try:
                    for chunk in _stdin_chunks(stdin):
                        chan.sendall(chunk)
                except OSError:
                    if not chan.closed and not chan.exit_status_ready():
                        raise
                    # The command ended without reading all its input; its exit code says why.
            if not chan.closed:
                chan.shutdown_write()
            for t in readers:
                t.join(timeout)
                if t.is_alive():
                    raise TimeoutError(f"{shlex.join(argv)} did not finish within {timeout} s on {self.where}; "
                                       "it may still be running there (closing the channel does not stop it)")
        except BaseException:
            # Interrupted, timed out or stdin failed: the input is incomplete. Closing the
            # channel gives the remote side EOF; it is not a kill (research §1.1: pct does not
            # forward signals), so writers must verify what they received (container.write_file).
            chan.close()
            for t in readers:
                t.join(5)
            raise
        status = chan.recv_exit_status()
        chan.close()
        for gate in gates:
            if not gate.open:  # the marker never came: the login shell failed; its words are the diagnostic
                gate.sink.feed(bytes(gate.noise))
        if status == -1:
            if not client.get_transport().is_active():
                self.close()
                raise TransportError(
                    f"the connection to node {self.target.node} was lost while running {shlex.join(argv)}; "
                    f"it may or may not have completed: check before running it again"
                )
            status = 255  # the remote side ended without an exit status (killed by a signal)
        sig = status - 128 if 128 < status < 128 + 65 else None
        return _finish(argv, status, out, err, sig, self.where, check)


def _tcp_keepalive(sock, idle: int = 30, interval: int = 10, count: int = 3) -> None:
    """paramiko's keepalive is sent with wait=False: it keeps NAT state alive but never notices
    a dead peer (research §3), so a command on a vanished node would wait forever. TCP
    keepalive does notice: after idle + interval × count seconds the socket errors, the
    command ends, and the caller is told the connection was lost."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except (OSError, AttributeError):
        pass  # not a TCP socket (a ProxyCommand): paramiko's keepalive still runs


def _drain(recv, gate: _MarkerGate) -> None:
    while True:
        try:
            data = recv(CHUNK)
        except (OSError, EOFError, socket.timeout):
            return
        if not data:
            return
        gate.feed(data)
