"""Connection sharing for the ``ssh`` binary (controller/openssh.py): OpenSSH's ControlMaster.

Why: a fresh ``ssh`` pays a TCP connect, a key exchange and an authentication on every
`ctl exec` (≈ 280 of raw ssh's ≈ 370 ms on the sim node, docs/benchmarks.md). The first
one-shot command to a node starts a master that stays ``control_persist`` seconds after its
last use (default 300, as SkyPilot's sky/utils/command_runner.py; 0 turns sharing off); every
later one rides it: one new channel, no handshake.

What keeps this as safe as a fresh connection:
- The sockets live in one directory of this user's (:func:`socket_dir`), made 0700. One that
  exists with another owner or mode, or is not a plain directory, is refused with the fix:
  whoever can reach a master's socket runs commands on the node as us.
- A socket's name is a hash of everything that decides what the connection is: host, port,
  user, identity file, known_hosts file, proxy chain, and the operator's ssh config (its path
  and content). A command with another key or known_hosts never rides a master opened with
  different ones; it gets its own.
- A master is opened by the same ``ssh`` with the same wrapper config as a fresh connection:
  host keys checked strictly, a changed key refused.
- The operator's own ``ControlMaster``/``ControlPath``/``ControlPersist`` win: ours are the
  last lines of ctl's wrapper config, and OpenSSH keeps the first value it reads.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Optional

from controller.config import NodeConfig
from controller.transport import TransportError

# Where the sockets go instead of the default (tests: a directory of their own).
ENV_SOCKET_DIR = "DFLASH_CTL_SSH_SOCKETS"
DEFAULT_PERSIST_S = 300
# A Unix socket's path has room for 107 bytes, and ssh adds ".XXXXXXXXXXXXXXXX" to it while it
# binds: a longer path turns sharing off rather than failing the command.
_MAX_PATH = 90
# Characters that make a host name a pattern (or a list) in a ``Host`` line.
_PATTERN = set("*?!, \t\"")


class SocketDirError(TransportError):
    """The socket directory exists but is not safe to use."""


def socket_dir() -> Path:
    """$DFLASH_CTL_SSH_SOCKETS, else a directory of this user's in $XDG_RUNTIME_DIR (a tmpfs
    only they can enter), else in /tmp named by their uid (as SkyPilot's /tmp/skypilot_ssh_USER)."""
    raw = os.environ.get(ENV_SOCKET_DIR)
    if raw:
        return Path(raw).expanduser()
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime) and _owned(runtime):  # not another user's, kept across su
        return Path(runtime) / "dflash-ctl-ssh"
    return Path(f"/tmp/dflash-ctl-ssh-{os.geteuid()}")


def _owned(path: str) -> bool:
    try:
        return os.stat(path).st_uid == os.geteuid()
    except OSError:
        return False


def checked_socket_dir(path: Path) -> Optional[Path]:
    """``path``, made 0700 if it did not exist; SocketDirError if it exists with another owner
    or mode; None where it cannot be made (a read-only file system: no sharing)."""
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # whatever the umask took away
    except FileExistsError:
        pass
    except OSError:
        return None
    st = os.lstat(path)
    me = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        raise SocketDirError(f"the ssh socket directory {path} is not a directory (a symlink or a file): ctl keeps "
                             f"its SSH connections only in a directory of its own. Fix: remove it (rm {path}); "
                             f"ctl makes it again, mode 0700")
    if st.st_uid != me:
        raise SocketDirError(f"the ssh socket directory {path} belongs to uid {st.st_uid}, not to you (uid {me}): "
                             f"ctl will not keep SSH connections where another user controls them. Fix: have it "
                             f"removed (as its owner or root: rm -r {path}), or set ${ENV_SOCKET_DIR} to a "
                             f"directory of your own")
    mode = stat.S_IMODE(st.st_mode)
    if mode != 0o700:
        raise SocketDirError(f"the ssh socket directory {path} has mode {mode:04o}, not 0700: other users could "
                             f"run commands on your nodes through the SSH connections kept there. "
                             f"Fix: chmod 700 {path}")
    return path


def persist_s(node: NodeConfig) -> int:
    return DEFAULT_PERSIST_S if node.control_persist is None else node.control_persist


def connection_key(node: NodeConfig, user_config: Optional[Path]) -> str:
    """The hash that names a master: every input that decides what the connection is."""
    def path(p: Optional[str]) -> Optional[str]:
        return str(Path(p).expanduser().absolute()) if p else None

    config_text = None
    if user_config is not None:
        try:
            config_text = hashlib.sha256(user_config.read_bytes()).hexdigest()
        except OSError:
            config_text = "unreadable"
    fields = [node.host, node.port, node.user, path(node.identity_file), path(node.known_hosts), node.proxy_jump,
              path(str(user_config)) if user_config else None, config_text]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:24]


def control_path(node: NodeConfig, user_config: Optional[Path]) -> Optional[Path]:
    """Where ``node``'s master listens, or None for no sharing (turned off, a host name that is a
    pattern, a bastion under the node's own name, no place for sockets). SocketDirError if the
    socket directory is unsafe."""
    if persist_s(node) == 0 or not node.host or _PATTERN & set(node.host):
        return None
    # Our lines apply to `Host <node.host>`; a hop of that name would share the node's socket.
    hops = [spec.rpartition("@")[2].rsplit(":", 1)[0].strip("[]") for spec in (node.proxy_jump or "").split(",")]
    if node.host in hops:
        return None
    d = checked_socket_dir(socket_dir())
    if d is None:
        return None
    sock = d / connection_key(node, user_config)
    return sock if len(str(sock)) <= _MAX_PATH else None


def config_lines(node: NodeConfig, sock: Path, quote) -> list[str]:
    """The wrapper config's lines that share the node's connection (only for the node's own
    host, so a ProxyJump's bastions are hops inside the master, not masters of their own)."""
    return [f"Host {node.host}", "  ControlMaster auto", f"  ControlPath {quote(str(sock))}",
            f"  ControlPersist {persist_s(node)}"]


def masters(key_prefix: str = "") -> list[Path]:
    """The sockets in the socket directory (of one connection key, or all)."""
    d = socket_dir()
    try:
        return sorted(p for p in d.iterdir() if p.name.startswith(key_prefix) and stat.S_ISSOCK(p.lstat().st_mode))
    except OSError:
        return []


def master_answers(sock: Path, timeout: float = 10) -> bool:
    """Whether a master listens on ``sock`` and answers (``ssh -O check``). A master whose
    connection died frees the channels it carried before it removes its socket, and a master
    that was killed never removes it: the socket alone says nothing in either case."""
    import subprocess

    try:
        proc = subprocess.run(["ssh", "-F", "/dev/null", "-S", str(sock), "-O", "check", "--", "ctl-check"],
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):  # no ssh here, or a master that never answers
        return False
    return proc.returncode == 0


def close_master(sock: Path, timeout: float = 10) -> bool:
    """Ask the master on ``sock`` to exit (``ssh -O exit``: it ends its connection, and with it
    the proxy commands of a ProxyJump) and wait until it has; True if one was there."""
    import subprocess
    import time

    proc = subprocess.run(["ssh", "-F", "/dev/null", "-S", str(sock), "-O", "exit", "--", "ctl-disconnect"],
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
    if proc.returncode != 0:  # nothing listens: a stale socket (its master was killed)
        sock.unlink(missing_ok=True)
        return False
    deadline = time.monotonic() + timeout
    while sock.exists() and time.monotonic() < deadline:  # the master removes it as it exits
        time.sleep(0.02)
    return True
