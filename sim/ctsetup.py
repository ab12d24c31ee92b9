"""What a simulated container gets at every start, as a Proxmox container does: its
``/etc/hostname`` and ``/etc/hosts``, and an init (PID 1) that reaps orphans.

**/etc/hostname and /etc/hosts.** pve-container's prestart hook (``src/lxc-pve-prestart-hook``
→ ``PVE::LXC::Setup::Base::pre_start_hook``) calls ``set_hostname`` at every start: it writes
the name part of the CT's ``hostname`` to ``/etc/hostname`` and, through
``update_etc_hosts`` and ``ct_modify_file``, keeps one section of ``/etc/hosts`` between
``# --- BEGIN PVE ---`` and ``# --- END PVE ---`` lines: ``127.0.0.1 localhost.localnet
localhost`` and ``::1 localhost.localnet localhost`` unless the file outside that section
already maps those addresses, then ``<primary ip> <hostname>`` when net0 has a static address
(``PVE::LXC::get_primary_ips``), else ``127.0.1.1 <hostname>``. The section replaces an
older one in place, or is appended; a file ``/etc/.pve-ignore.hosts`` (or
``.pve-ignore.hostname``) makes it leave that file alone (``ct_is_file_ignored``). Proxmox
does this inside the container's root (``protected_call`` forks and chroots), so a symlink in
the container cannot make it write a host file; the sim chroots too. Read at pve-container
94f5585 (``src/PVE/LXC/Setup/Base.pm``). The sim's containers have a static address on
eth0 (sim/net.py), so theirs is ``10.77.0.<n> <node>-ct<id>``; the search domains Proxmox
takes from the node's resolv.conf are left out (the sim node has no DNS).

Without this, a container had no /etc/hosts: neither ``localhost`` nor its own name resolved
(torchrun's ``--standalone`` rendezvous hung on both).

**Init.** A Debian minbase rootfs has no init system, and the sim used ``sleep infinity`` as
PID 1, which never calls wait(): every killed process's orphans stayed zombies under PID 1.
``dflash-sim-init`` reaps them, as any init does. It is bind-mounted read-only from the node's
state directory, so it survives a rollback to a snapshot taken before it existed.

**/dev/shm.** A Proxmox container's init (systemd in every Debian/Ubuntu template) mounts a
tmpfs on ``/dev/shm``; the sim's init does not mount anything, and LXC's own ``/dev`` is a
500 KB tmpfs without it. POSIX shared memory needs it: vLLM's engine core failed to start in a
container (``shm_open`` of its shared-memory broadcast queue: ``FileNotFoundError``). The LXC
config mounts one, as the template's init would.

All of these are set in the container's LXC config (``lxc.hook.pre-start``, ``lxc.mount.entry``,
``lxc.init.cmd``), so every start path — ``SimNode.up()``, ``pct start`` over SSH, ``pct
rollback --start 1`` — gets them, like every ``lxc-start`` on Proxmox runs its prestart hook.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from agent.protocol import atomic_write
from sim.layout import state_root
from sim.proc import SimError

INIT_IN_CT = "/usr/local/sbin/dflash-sim-init"

HOOK_SCRIPT = """\
#!/bin/sh
# Written by dflash-ctl's simulated node (sim/ctsetup.py). LXC pre-start hook: what
# pve-container's prestart hook does for /etc/hostname and /etc/hosts, run chrooted into the
# container's root filesystem. Args: rootfs hostname ip, then LXC's own.
set -eu
exec chroot "$1" /usr/bin/python3 -I - "$2" "$3" < "$(dirname "$0")/ct-setup.py"
"""

# Runs inside the container's root (chroot), under the container's python.
SETUP_SCRIPT = r'''
import os, re, sys

hostname, ip = sys.argv[1], sys.argv[2]
HEAD, TAIL = "# --- BEGIN PVE ---\n", "# --- END PVE ---\n"


def ignored(path):
    d, name = os.path.split(path)
    return os.path.isfile(os.path.join(d, ".pve-ignore." + name))


def read(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


def write(path, text):
    tmp = path + ".tmp-dflash-sim"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def modify(path, data):  # ct_modify_file: replace our section in place, or append it
    old = read(path)
    section = HEAD + data + TAIL
    if old is None:
        write(path, section)
        return
    lines = old.split("\n")
    beg = next((i for i, l in enumerate(lines) if re.match(r"^#\s*---\s*BEGIN\s*PVE\s*", l)), None)
    end = next((i for i, l in enumerate(lines) if beg is not None and i > beg
                and re.match(r"^#\s*---\s*END\s*PVE\s*", l, re.I)), None)
    if beg is not None and end is not None:
        lines[beg:end + 1] = [section.rstrip("\n")]
        write(path, "\n".join(lines).rstrip("\n") + "\n")
    else:
        write(path, old.rstrip("\n") + "\n" + section)


namepart = hostname.split(".", 1)[0]
if not ignored("/etc/hosts"):
    outside = re.sub(r"^\s*# --- BEGIN PVE ---.*?^\s*# --- END PVE ---[^\n]*", "", read("/etc/hosts") or "",
                     flags=re.M | re.S)
    data = ""
    if not re.search(r"^[ \t]*127\.0\.0\.1[ \t]+", outside, re.M):
        data += "127.0.0.1 localhost.localnet localhost\n"
    if not re.search(r"^[ \t]*::1[ \t]+", outside, re.M):
        data += "::1 localhost.localnet localhost\n"
    names = f"{hostname} {namepart}" if "." in hostname else hostname
    data += f"{ip} {names}\n" if ip else f"127.0.1.1 {names}\n"
    modify("/etc/hosts", data)
if not ignored("/etc/hostname"):
    write("/etc/hostname", namepart + "\n")
'''

INIT_SCRIPT = """\
#!/usr/bin/python3 -I
# PID 1 of a dflash-ctl simulated container (sim/ctsetup.py): reap every orphan re-parented
# to us, as an init does. SIGCHLD stays blocked and is waited for, so an exit between two
# reaping passes is never missed. SIGTERM (a clean stop) ends the container.
import os, signal

signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
while True:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
    signal.sigtimedwait({signal.SIGCHLD}, 60)
"""


def _hook() -> Path:
    return state_root() / "ct-setup"


def ensure_scripts() -> None:
    """The hook, its setup script and the init, beside the node state dirs (idempotent)."""
    state_root().mkdir(parents=True, exist_ok=True)
    atomic_write(str(_hook()), HOOK_SCRIPT, mode=0o755)
    atomic_write(str(state_root() / "ct-setup.py"), SETUP_SCRIPT, mode=0o644)
    atomic_write(str(state_root() / "dflash-sim-init"), INIT_SCRIPT, mode=0o755)


def config_lines(rootfs: Path, hostname: str, ip: str) -> list[str]:
    """LXC config lines: the pre-start hook, the init's read-only bind mount and /dev/shm."""
    return [f"lxc.hook.pre-start = {_hook()} {rootfs} {hostname} {ip}",
            f"lxc.mount.entry = {state_root() / 'dflash-sim-init'} {INIT_IN_CT.lstrip('/')} none "
            "bind,ro,create=file 0 0",
            "lxc.mount.entry = tmpfs dev/shm tmpfs rw,nosuid,nodev,mode=1777,create=dir 0 0"]


def apply_now(rootfs: Path, hostname: str, ip: str) -> None:
    """What the hook does at a start, for a container that is already running."""
    proc = subprocess.run([str(_hook()), str(rootfs), hostname, ip], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise SimError(f"writing /etc/hosts and /etc/hostname into {rootfs} failed: {proc.stderr.strip()[-400:]}")
