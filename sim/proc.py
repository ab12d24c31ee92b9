"""Running host commands for the simulated node: argv lists only, errors that say what failed.

Standard library only (the sim runs where the controller's dependencies may not be)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from typing import Callable, Optional, Sequence

# Progress sink: ``ctl sim up`` prints these lines; tests leave it silent.
Progress = Callable[[str], None]


def quiet(_line: str) -> None:
    pass


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class SimError(Exception):
    """A problem bringing the simulated node up or down. The message names the node or
    container and what to do; callers print it, never a traceback."""


# Which Debian package provides each host tool the sim needs, for the error message.
PACKAGES = {
    "lxc-start": "lxc",
    "lxc-attach": "lxc",
    "lxc-stop": "lxc",
    "lxc-wait": "lxc",
    "lxc-info": "lxc",
    "lxc-freeze": "lxc",
    "debootstrap": "debootstrap",
    "mkfs.btrfs": "btrfs-progs",
    "btrfs": "btrfs-progs",
    "sshd": "openssh-server",
    "ssh-keygen": "openssh-client",
    "unshare": "util-linux",
    "losetup": "mount",
    "mount": "mount",
    "umount": "mount",
}


def require_tools(tools: Sequence[str]) -> None:
    """Fail early, naming the apt packages to install, when a host tool is missing."""
    missing = [t for t in tools if not which(t)]
    if missing:
        pkgs = sorted({PACKAGES.get(t, t) for t in missing})
        raise SimError(f"missing host tools: {', '.join(missing)}. "
                       f"Install them with: apt-get install -y --no-install-recommends {' '.join(pkgs)}")


def which(tool: str) -> Optional[str]:
    # sshd and friends live in /usr/sbin, which a non-login PATH may lack.
    return shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin:/usr/bin:/bin")


def run(argv: Sequence[str], *, what: str, check: bool = True, input: Optional[bytes] = None,
        timeout: Optional[float] = None, env: Optional[dict] = None,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE) -> subprocess.CompletedProcess:
    """Run ``argv``; on failure raise SimError("<what> failed (exit N): <stderr tail>")."""
    argv = [str(a) for a in argv]
    exe = which(argv[0])
    if exe is None:
        require_tools([argv[0]])
    try:
        proc = subprocess.run([exe, *argv[1:]], input=input, stdout=stdout, stderr=stderr,
                              timeout=timeout, env=env, stdin=None if input is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise SimError(f"{what} did not finish within {timeout:.0f} s ({' '.join(argv[:4])} …)") from exc
    if check and proc.returncode != 0:
        raise SimError(f"{what} failed (exit {proc.returncode}): {tail(proc.stderr) or tail(proc.stdout)}")
    return proc


def tail(data, lines: int = 8) -> str:
    if not data:
        return ""
    text = data.decode(errors="replace") if isinstance(data, bytes) else str(data)
    return " | ".join(line for line in text.strip().splitlines()[-lines:] if line.strip())


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def is_root() -> bool:
    return os.geteuid() == 0
