"""The node's OpenSSH server on 127.0.0.1, with its own keys and a deliberately polluted login.

sshd runs in a private mount namespace where a home of ours is bound over /root
(docs/research/sim-node.md). That keeps the test machine's own ~/.bashrc out, and lets us
reproduce the incident host's environment on purpose: Homebrew and perl5 first on PATH,
stray PERL5LIB / PERL_MB_OPT / JAVA_HOME, and a .bashrc that prints to stdout. The product
must survive all of it; tests prove that it scrubs it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

from agent.protocol import atomic_write
from sim.layout import NodePaths
from sim.proc import SimError, run, tail, wait_until, which

# What the incident host's login put in front of everything (docs/design.md, the story).
POLLUTED_PATH_PREFIX = "/opt/homebrew/opt/openjdk/bin:/root/perl5/bin"
NOISE_PREFIX = "sim-node"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# sshd's privilege-separation directory. Debian's ssh.service makes it (RuntimeDirectory=sshd)
# on every boot, since /run is a tmpfs; a machine that installed openssh-server without
# systemd running never has it, and sshd refuses to start without it.
PRIVSEP_DIR = Path("/run/sshd")

BASHRC = """\
# ~/.bashrc of the simulated Proxmox node {name}. Polluted ON PURPOSE, like the real host's:
# Homebrew's JDK and perl local::lib first on PATH, stray exports, and a line of noise on
# stdout for every command run over SSH. dflash-ctl must scrub all of this.
export PATH="{prefix}${{PATH:+:$PATH}}"
export PERL5LIB="/root/perl5/lib/perl5${{PERL5LIB:+:$PERL5LIB}}"
export PERL_LOCAL_LIB_ROOT="/root/perl5"
export PERL_MB_OPT="--install_base \\"/root/perl5\\""
export PERL_MM_OPT="INSTALL_BASE=/root/perl5"
export JAVA_HOME="/opt/homebrew/opt/openjdk"
echo "{noise} {name}: perl5 local::lib and openjdk are active"
# Not the real host's: one line per SSH session run on the node, so tests can count the
# sessions a ctl command opens (bash builtins only: no process of its own on every login).
printf '%s\\n' "${{BASH_EXECUTION_STRING//$'\\n'/ }}" 2>/dev/null >> {log}/ssh-sessions.log
"""

# Debian's root .profile: a login shell reads .bashrc through it.
PROFILE = """\
if [ "$BASH" ] && [ -f ~/.bashrc ]; then
  . ~/.bashrc
fi
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def accepting(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.settimeout(1.0)
            return sock.recv(4).startswith(b"SSH-")
    except OSError:
        return False


class Sshd:
    """One node's sshd: files under ``<state>/ssh`` and ``<state>/home``. With
    ``role="bastion"``, the node's bastion (sim/bastion.py): files under ``<state>/bastion``."""

    def __init__(self, paths: NodePaths, role: str = "node"):
        self.paths = paths
        self.role = role
        # (source, target) files bound over the host's in sshd's namespace (sim/users.py, /etc/hosts)
        self.binds: tuple[tuple[str, str], ...] = ()
        d = paths.ssh if role == "node" else paths.root / "bastion"
        self.dir = d
        self.host_key = d / "ssh_host_ed25519_key"
        self.client_key = d / "id_ed25519"
        self.authorized_keys = d / "authorized_keys"
        self.known_hosts = d / "known_hosts"
        self.config = d / "sshd_config"
        self.pidfile = d / "sshd.pid"
        self.runfile = d / "sshd.run.json"  # pid + start time: guards against PID reuse
        self.logfile = d / "sshd.log"

    # --- files -------------------------------------------------------------------------
    def ensure_keys(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        keys = [(self.host_key, f"dflash-sim-{self.paths.name}-{self.role}-host")]
        if self.role == "node":
            keys.append((self.client_key, f"dflash-sim-{self.paths.name}-client"))
        for key, comment in keys:
            if not key.exists():
                run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", key],
                    what=f"ssh-keygen for {key.name}")

    def prepare(self, port: int, binds: tuple[tuple[str, str], ...] = ()) -> None:
        self.binds = tuple(binds)
        self.ensure_keys()
        if self.role == "node":
            client_pub = Path(f"{self.client_key}.pub").read_text()
            atomic_write(str(self.authorized_keys), client_pub, mode=0o600)
            atomic_write(str(self.known_hosts), self.known_hosts_line("127.0.0.1", port), mode=0o644)
            self._write_home()
        atomic_write(str(self.config), self._config_text(port), mode=0o600)
        ensure_privsep_dir()
        proc = run([which("sshd") or "/usr/sbin/sshd", "-t", "-f", self.config],
                   what=f"sshd -t (config check of {self.config})", check=False)
        if proc.returncode != 0:
            raise SimError(f"sim node {self.paths.name}: sshd rejects {self.config}: {tail(proc.stderr)}")

    def known_hosts_line(self, host: str, port: int) -> str:
        """This server's known_hosts line under the name ``host`` (and port)."""
        pub = Path(f"{self.host_key}.pub").read_text().split()
        name = host if port == 22 else f"[{host}]:{port}"
        return f"{name} {pub[0]} {pub[1]}\n"

    def bashrc(self) -> str:
        return BASHRC.format(name=self.paths.name, prefix=POLLUTED_PATH_PREFIX, noise=NOISE_PREFIX,
                             log=self.paths.log)

    def _write_home(self) -> None:
        home = self.paths.home
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(str(home / ".bashrc"), self.bashrc())
        atomic_write(str(home / ".profile"), PROFILE)

    def _config_text(self, port: int) -> str:
        from sim.users import USERS

        d = self.dir
        common = [
            f"Port {port}",
            "ListenAddress 127.0.0.1",
            f"HostKey {self.host_key}",
            f"PidFile {self.pidfile}",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "PrintMotd no",
            # Tests open many sessions at once.
            "MaxStartups 64:30:128",
            "MaxSessions 64",
        ]
        users = ",".join(USERS)
        # The sim's other users log in with their own authorized_keys (sim/users.py).
        match = ["", f"Match User {users}", f"    AuthorizedKeysFile {self.paths.root}/users/%u/.ssh/authorized_keys", ""]
        if self.role == "bastion":
            return "\n".join([
                f"# bastion of the simulated Proxmox node {self.paths.name} (sim/bastion.py)",
                *common,
                "PermitRootLogin no",
                "AuthorizedKeysFile none",
                # A jump host forwards TCP (ssh -J, ProxyJump) and is nothing else here.
                "AllowTcpForwarding yes",
                "PermitTTY no",
                "Subsystem sftp internal-sftp",
                *match,
            ])
        return "\n".join([
            f"# sshd of the simulated Proxmox node {self.paths.name} (sim/sshd.py)",
            *common,
            f"AuthorizedKeysFile {self.authorized_keys}",
            "PermitRootLogin prohibit-password",
            # Like Debian's default: the client's locale travels in, as on the incident host.
            "AcceptEnv LANG LC_*",
            # In-process sftp, so .bashrc noise cannot corrupt the SFTP stream.
            "Subsystem sftp internal-sftp",
            # pct on the login PATH; .bashrc then prepends the polluted entries before it.
            f"SetEnv PATH={self.paths.bin}:{SYSTEM_PATH}",
            f"# host key fingerprint source: {d}",
            *match,
        ])

    # --- process -----------------------------------------------------------------------
    def pid(self) -> Optional[int]:
        """PID of our running sshd, or None (checks the recorded start time, not just the PID)."""
        try:
            rec = json.loads(self.runfile.read_text())
        except (OSError, ValueError):
            return None
        pid = rec.get("pid")
        if not isinstance(pid, int) or _start_time(pid) != rec.get("start_time"):
            return None
        return pid

    def _recorded(self) -> dict:
        try:
            return json.loads(self.runfile.read_text())
        except (OSError, ValueError):
            return {}

    def mount_ns(self) -> Optional[str]:
        """The private mount namespace sshd (and every session under it) lives in."""
        try:
            return json.loads(self.runfile.read_text()).get("mnt_ns")
        except (OSError, ValueError):
            return None

    def start(self, port: int) -> int:
        pid = self.pid()
        if pid and accepting(port) and self._recorded().get("binds") == [list(b) for b in self.binds]:
            return pid
        if pid:
            self.stop()
        if not port_free(port):
            raise SimError(f"sim node {self.paths.name}: port {port} is taken by another process")
        sshd = which("sshd") or "/usr/sbin/sshd"
        log = open(self.logfile, "ab")
        # unshare without --fork execs in place: the Popen PID *is* sshd's PID.
        # In its own mount namespace: the sim's account and name files over /etc (sim/users.py),
        # then the node's home over /root; the host's stay as they are. The binds come first
        # and the home goes over recursively, so a bind into the home (a host path under /root
        # that `pct start` must see, Node.kept_under_root) is still there under /root.
        script = ('set -e; home=$1 sshd=$2 conf=$3; shift 3; '
                  'while [ $# -gt 1 ]; do mount --bind "$1" "$2"; shift 2; done; '
                  '[ "$home" = - ] || mount --rbind "$home" /root; exec "$sshd" -D -e -f "$conf"')
        home = str(self.paths.home) if self.role == "node" else "-"
        proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh",
             home, sshd, str(self.config), *[p for pair in self.binds for p in pair]],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True)
        log.close()
        if not wait_until(lambda: accepting(port) or proc.poll() is not None, 10):
            proc.kill()
        if proc.poll() is not None or not accepting(port):
            raise SimError(f"sim node {self.paths.name}: sshd did not come up on 127.0.0.1:{port}: "
                           f"{tail(self.logfile.read_bytes())}")
        record = {"pid": proc.pid, "start_time": _start_time(proc.pid), "port": port,
                  "mnt_ns": os.readlink(f"/proc/{proc.pid}/ns/mnt"), "binds": [list(b) for b in self.binds]}
        atomic_write(str(self.runfile), json.dumps(record) + "\n")
        return proc.pid

    def stop(self) -> None:
        """Stop sshd and every process left in its mount namespace (sessions, nohup'd
        commands): any of them would keep the btrfs storage mounted in that namespace."""
        pid = self.pid()
        ns = self.mount_ns()
        if pid:
            _signal(pid, signal.SIGTERM)
            if not wait_until(lambda: _start_time(pid) is None, 5):
                _signal(pid, signal.SIGKILL)
                wait_until(lambda: _start_time(pid) is None, 5)
        if ns:
            for other in processes_in_mount_ns(ns):
                _signal(other, signal.SIGKILL)
            wait_until(lambda: not processes_in_mount_ns(ns), 5)
        self.runfile.unlink(missing_ok=True)
        self.pidfile.unlink(missing_ok=True)


def ensure_privsep_dir(path: Path = PRIVSEP_DIR) -> None:
    """What the service unit would have made: root-owned, not group/world writable (sshd
    checks both)."""
    try:
        path.mkdir(mode=0o755, exist_ok=True)
        os.chown(path, 0, 0)
        os.chmod(path, 0o755)
    except OSError as exc:
        raise SimError(f"cannot create sshd's privilege separation directory {path}: {exc.strerror} "
                       f"(the sshd service unit makes it at boot; make it by hand: mkdir -m 0755 {path})") from None


def processes_in_mount_ns(ns: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/mnt") == ns:
                pids.append(int(entry))
        except OSError:
            continue
    return pids


def _start_time(pid: int) -> Optional[str]:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":  # a zombie is gone for our purposes
        return None
    return fields[19]  # starttime, field 22 of /proc/PID/stat


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
    # Reap it if it is our child (ctl sim up and down in one process, as tests do).
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
