"""A throwaway OpenSSH server on 127.0.0.1 with a polluted root login, for transport tests.

Independent of the simulated node (no LXC): it exercises only the SSH layer. root's home
is a private bind mount (docs/research/sim-node.md) whose .bashrc prints to stdout and stderr
and exports foreign PATH entries, like the node in the story.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

NOISY_BASHRC = """\
echo "Welcome to the polluted node (.bashrc noise on stdout)"
echo "perl5 local::lib warning on stderr" >&2
export PATH="/opt/homebrew/opt/openjdk/bin:/root/perl5/bin:$PATH"
export PERL5LIB=/root/perl5/lib/perl5
export STRAY_EXPORT=yes
"""


@dataclass
class Sshd:
    root: Path
    port: int
    host_key: Path
    client_key: Path
    known_hosts: Path
    proc: subprocess.Popen

    def keyscan_line(self) -> str:
        pub = (self.host_key.with_suffix(".pub")).read_text().split()
        return f"[127.0.0.1]:{self.port} {pub[0]} {pub[1]}\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


def start(root: Path, bashrc: str = NOISY_BASHRC) -> Sshd:
    root.mkdir(parents=True, exist_ok=True)
    home = root / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".bashrc").write_text(bashrc)
    host_key, client_key = root / "host_ed25519", root / "client_ed25519"
    _keygen(host_key)
    _keygen(client_key)
    authorized = root / "authorized_keys"
    authorized.write_text(client_key.with_suffix(".pub").read_text())
    port = _free_port()
    conf = root / "sshd_config"
    conf.write_text("\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {host_key}", f"PidFile {root}/sshd.pid",
        f"AuthorizedKeysFile {authorized}", "PermitRootLogin prohibit-password", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no", "MaxSessions 64",
        "MaxStartups 64:30:128", "",
    ]))
    os.makedirs("/run/sshd", exist_ok=True)
    subprocess.run(["/usr/sbin/sshd", "-t", "-f", str(conf)], check=True)
    log = open(root / "sshd.log", "wb")
    proc = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount --bind "$1" /root && exec /usr/sbin/sshd -D -e -f "$2"', "sh", str(home), str(conf)],
        stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        raise RuntimeError(f"sshd did not start; log: {(root / 'sshd.log').read_text()}")
    known = root / "known_hosts"
    server = Sshd(root, port, host_key, client_key, known, proc)
    known.write_text(server.keyscan_line())
    return server


def stop(server: Sshd) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(10)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
    shutil.rmtree(server.root, ignore_errors=True)
