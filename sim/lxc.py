"""Real LXC containers under a private LXC path (``lxc-* -P <lxcpath>``).

Privileged containers with no network: ``lxc.net.0.type = empty`` because the default veth
wants a bridge that does not exist here (sim/net.py adds its own link), and an
``lxc.init.cmd`` of ours because minbase has no init system (docs/research/sim-node.md;
sim/ctsetup.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Optional, Sequence

from agent.protocol import atomic_write
from sim.proc import SimError, run, wait_until

STOP_TIMEOUT_S = 10


def write_config(lxcpath: Path, name: str, *, rootfs: Path, hostname: str,
                 mounts: Sequence[tuple[Path, str, str]] = (), extra: Sequence[str] = (),
                 init: str = "/bin/sleep infinity") -> Path:
    """Write ``<lxcpath>/<name>/config``. ``mounts``: (host dir, path in rootfs, "ro"|"rw");
    ``extra``: more raw config lines (sim/net.py's start-host hook, sim/ctsetup.py's pre-start
    hook and init mount); ``init``: PID 1 (a node's containers get sim/ctsetup.py's, which
    reaps orphans; a throwaway build container keeps ``sleep``)."""
    if rootfs.resolve() != rootfs:
        raise SimError(f"container {name}: rootfs path {rootfs} contains a symlink; LXC refuses it")
    lines = [
        "# written by dflash-ctl's simulated node (sim/lxc.py)",
        "lxc.include = /usr/share/lxc/config/common.conf",
        f"lxc.uts.name = {hostname}",
        f"lxc.rootfs.path = dir:{rootfs}",
        "lxc.net.0.type = empty",
        f"lxc.init.cmd = {init}",
        "lxc.apparmor.profile = unconfined",
        "lxc.tty.max = 0",
        # Proxmox always sets this (src/PVE/LXC.pm); it shows in a --clear-env exec.
        "lxc.environment = TERM=linux",
    ]
    for host, target, mode in mounts:
        opts = "bind,create=dir" + (",ro" if mode == "ro" else "")
        lines.append(f"lxc.mount.entry = {host} {target} none {opts} 0 0")
    lines += list(extra)
    conf_dir = lxcpath / name
    conf_dir.mkdir(parents=True, exist_ok=True)
    path = conf_dir / "config"
    atomic_write(str(path), "\n".join(lines) + "\n")
    return path


def state(lxcpath: Path, name: str) -> str:
    """RUNNING, STOPPED, FROZEN, … or MISSING when LXC does not know the container."""
    if not (lxcpath / name / "config").exists():
        return "MISSING"
    proc = run(["lxc-info", "-P", lxcpath, "-n", name, "-s", "-H"], what="lxc-info", check=False)
    out = proc.stdout.decode().strip()
    return out or "STOPPED"


def running(lxcpath: Path, name: str) -> bool:
    return state(lxcpath, name) in ("RUNNING", "FROZEN")


def init_pid(lxcpath: Path, name: str) -> Optional[int]:
    proc = run(["lxc-info", "-P", lxcpath, "-n", name, "-p", "-H"], what="lxc-info", check=False)
    out = proc.stdout.decode().strip()
    return int(out) if out.isdigit() else None


def start(lxcpath: Path, name: str, logfile: Optional[Path] = None) -> None:
    if running(lxcpath, name):
        return
    argv = ["lxc-start", "-P", lxcpath, "-n", name]
    if logfile:
        logfile.parent.mkdir(parents=True, exist_ok=True)
        argv += ["-o", logfile, "-l", "ERROR"]
    # lxc-start daemonizes; its fds must not hold a caller's pipe (or an SSH channel) open.
    run(argv, what=f"lxc-start of container {name}", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        timeout=60)
    run(["lxc-wait", "-P", lxcpath, "-n", name, "-s", "RUNNING", "-t", "10"],
        what=f"waiting for container {name} to run")


def stop(lxcpath: Path, name: str) -> None:
    """Hard stop (lxc-stop --kill) and wait: `lxc-stop -k` can return before the container
    is really STOPPED (docs/research/sim-node.md)."""
    if not (lxcpath / name / "config").exists() or not running(lxcpath, name):
        return
    if state(lxcpath, name) == "FROZEN":
        run(["lxc-unfreeze", "-P", lxcpath, "-n", name], what=f"lxc-unfreeze of {name}", check=False)
    run(["lxc-stop", "-P", lxcpath, "-n", name, "--kill"], what=f"lxc-stop of container {name}",
        check=False, timeout=60)
    run(["lxc-wait", "-P", lxcpath, "-n", name, "-s", "STOPPED", "-t", str(STOP_TIMEOUT_S)],
        what=f"waiting for container {name} to stop", check=False)
    if not wait_until(lambda: not running(lxcpath, name), STOP_TIMEOUT_S):
        raise SimError(f"container {name} did not stop within {STOP_TIMEOUT_S} s; "
                       f"inspect it with `lxc-info -P {lxcpath} -n {name}`")


def attach(lxcpath: Path, name: str, argv: Sequence[str], *, what: str, check: bool = True,
           timeout: Optional[float] = 120, input: Optional[bytes] = None) -> subprocess.CompletedProcess:
    """Run argv in the container with a clean environment (the host's must not leak in)."""
    return run(["lxc-attach", "-P", lxcpath, "-n", name, "--clear-env", "-v", "HOME=/root",
                "-v", "LANG=C.UTF-8", "--", *argv], what=what, check=check, timeout=timeout, input=input)
