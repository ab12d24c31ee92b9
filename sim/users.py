"""The node's other users, as many clusters have them: an operator who is not root and runs
`pct` through sudo, and the bastion's jump user.

They exist only inside the sim's sshd mount namespaces: /etc/passwd, /etc/group,
/etc/shadow and /etc/sudoers there are files of the node's state directory, bound over the
host's (the host's own lines first), so the test machine's accounts never change.

- ``dflash-op``: may run the node's pct as root with no password — the
  rule operators write (``dflash-op ALL=(root) NOPASSWD: /usr/sbin/pct``), and the node's kernel log
  readers (``/usr/bin/journalctl``, ``/usr/bin/dmesg``) beside it;
- ``dflash-pw``: the same rule without NOPASSWD, so `sudo -n` refuses ("a password is
  required"): what ctl must turn into one line, never a hang at a prompt;
- ``dflash-jump``: the bastion's login (sim/bastion.py), no sudo.

Each logs in with the node's client key (its own authorized_keys under ``users/<name>/``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from agent.protocol import atomic_write
from sim.layout import NodePaths

OPERATOR = "dflash-op"
PASSWORD_OPERATOR = "dflash-pw"
JUMP = "dflash-jump"
USERS = {OPERATOR: 64200, PASSWORD_OPERATOR: 64201, JUMP: 64202}
SECURE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class UserFiles:
    """The files bound over /etc in the sim's sshd namespaces, as (source, target) pairs."""

    binds: tuple[tuple[str, str], ...]


def home(paths: NodePaths, user: str) -> Path:
    return paths.root / "users" / user


def write(paths: NodePaths, client_pub: str, bashrc: str) -> UserFiles:
    """(Re)write the users' account files, homes and keys; returns what to bind over /etc."""
    etc = paths.root / "etc"
    etc.mkdir(parents=True, exist_ok=True, mode=0o755)
    passwd = Path("/etc/passwd").read_text()
    group = Path("/etc/group").read_text()
    try:
        shadow = Path("/etc/shadow").read_text()
    except OSError:
        shadow = ""
    for user, uid in USERS.items():
        h = home(paths, user)
        h.mkdir(parents=True, exist_ok=True)
        os.chmod(h.parent, 0o755)
        (h / ".ssh").mkdir(exist_ok=True)
        atomic_write(str(h / ".ssh" / "authorized_keys"), client_pub, mode=0o600)
        atomic_write(str(h / ".bashrc"), bashrc)
        for p in (h, h / ".ssh", h / ".ssh" / "authorized_keys", h / ".bashrc"):
            os.chown(p, uid, uid)
        os.chmod(h, 0o755)
        passwd = _without(passwd, user) + f"{user}:x:{uid}:{uid}:dflash sim:{h}:/bin/bash\n"
        group = _without(group, user) + f"{user}:x:{uid}:\n"
        # '*': no password can log in, yet the account is not locked ('!'), which sshd
        # without PAM would refuse even for key logins.
        shadow = _without(shadow, user) + f"{user}:*:19000:0:99999:7:::\n"
    pct = paths.pct
    sudoers = "\n".join([
        "# sudoers of the simulated node (sim/users.py); only in the sim's sshd namespaces",
        "Defaults env_reset",
        f'Defaults secure_path="{SECURE_PATH}"',
        "root ALL=(ALL:ALL) ALL",
        f"{OPERATOR} ALL=(root) NOPASSWD: {pct}, {paths.bin / 'journalctl'}, {paths.bin / 'dmesg'}",
        f"{PASSWORD_OPERATOR} ALL=(root) {pct}",
        "",
    ])
    files = {"passwd": (passwd, 0o644), "group": (group, 0o644), "shadow": (shadow, 0o640),
             "sudoers": (sudoers, 0o440)}
    binds = []
    for name, (text, mode) in files.items():
        target = etc / name
        # In place, not by rename: sshd's namespace binds this inode, and a renamed new file
        # would not be what it sees.
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(target, mode)
        os.chown(target, 0, 0)
        binds.append((str(target), f"/etc/{name}"))
    return UserFiles(tuple(binds))


def _without(table: str, user: str) -> str:
    kept = [line for line in table.splitlines() if line and line.split(":", 1)[0] != user]
    return "\n".join(kept) + "\n"
