"""The simulated nodes' container network: one bridge inside a network namespace of its own.

Every sim node's containers get an ``eth0`` on the bridge ``br0`` of the network namespace
``dflash-sim`` (created by the sim, shared by all sim nodes on this machine), with a private
address in 10.77.0.0/24. The namespace has no uplink, no route and no address on the host
side, so nothing can leave the machine; containers have no default route either. This is
what multi-container jobs (torch.distributed across containers and nodes) talk over.

How a container gets its link: LXC keeps ``lxc.net.0.type = empty`` (a netns with only
``lo``); ``lxc.hook.start-host`` runs ``net-attach`` (written next to the node state dirs),
which creates a veth pair — host end ``dfl<octet>`` on the bridge, container end ``eth0`` in
the container's netns (by ``$LXC_PID``) — and sets the address. ``SimNode.up()`` runs the same
script for containers that are already running without it (started before networking
existed). The host end's name is the link to cut in a test:
``ip -n dflash-sim link set dfl201 down``.

Addresses are allocated per (node, ctid) in ``<state root>/net.json`` under a lock, so two
sim nodes never share one; the preferred last octet is ``ctid % 256``.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
from pathlib import Path
from typing import Optional

from agent.protocol import atomic_write
from sim.layout import state_root
from sim.proc import SimError, run

NETNS = "dflash-sim"
BRIDGE = "br0"
SUBNET = "10.77.0"  # /24; .1 is left unused (no gateway: nothing routes anywhere)
PREFIX = 24

ATTACH_SCRIPT = """\
#!/bin/sh
# Written by dflash-ctl's simulated node (sim/net.py). LXC start-host hook: give the
# container (pid $LXC_PID) an eth0 on the sim bridge. Args: host-veth address/prefix netns
# bridge, then LXC's own (name, section, hook type).
set -eu
veth=$1 addr=$2 netns=$3 bridge=$4
pid=${LXC_PID:?LXC_PID is not set: run as an lxc.hook.start-host}
ip -n "$netns" link del "$veth" 2>/dev/null || true
ip -n "$netns" link add "$veth" type veth peer name eth0 netns "$pid"
ip -n "$netns" link set "$veth" master "$bridge" up
nsenter -t "$pid" -n ip addr add "$addr" dev eth0
nsenter -t "$pid" -n ip link set eth0 up
# Loopback too: a real container's init brings lo up; the sim's (sim/ctsetup.py) does not, and a
# process connecting to its own eth0 address goes through lo (torchrun's store on node rank 0).
nsenter -t "$pid" -n ip link set lo up
"""


def attach_script() -> Path:
    return state_root() / "net-attach"


def _alloc_file() -> Path:
    return state_root() / "net.json"


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return run(["ip", *argv], what="ip " + " ".join(argv[:4]), check=check)


def netns_exists() -> bool:
    return Path("/run/netns", NETNS).exists()


def ensure_network() -> bool:
    """Namespace + bridge + the attach script, idempotent. True when the namespace was new."""
    state_root().mkdir(parents=True, exist_ok=True)
    atomic_write(str(attach_script()), ATTACH_SCRIPT, mode=0o755)
    created = False
    if not netns_exists():
        _ip("netns", "add", NETNS)
        created = True
    if _ip("-n", NETNS, "link", "show", BRIDGE, check=False).returncode != 0:
        _ip("-n", NETNS, "link", "add", BRIDGE, "type", "bridge")
    _ip("-n", NETNS, "link", "set", "lo", "up")
    _ip("-n", NETNS, "link", "set", BRIDGE, "up")
    return created


def expose_to(pid: int) -> None:
    """Make /run/netns/dflash-sim visible in the mount namespace of ``pid`` (sshd's private
    one, copied when sshd started — maybe before the sim had a network), so `pct start`
    over SSH runs the start hook successfully. A bind mount of our own view of the file."""
    path = f"/run/netns/{NETNS}"
    enter = ["nsenter", "-t", str(pid), "-m", "--"]
    if run([*enter, "test", "-e", path], what="netns check", check=False).returncode == 0:
        return
    run([*enter, "mkdir", "-p", "/run/netns"], what="mkdir /run/netns in sshd's namespace")
    run([*enter, "touch", path], what="netns mount point in sshd's namespace")
    run([*enter, "mount", "--bind", f"/proc/{os.getpid()}/root{path}", path],
        what="bind mount of the sim netns into sshd's namespace")


def address_of(node: str, ctid: int) -> str:
    """The container's address (allocated once, then kept), e.g. '10.77.0.200'."""
    path = _alloc_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            table = json.loads(path.read_text()) if path.exists() else {}
        except ValueError:
            table = {}
        key = f"{node}/{ctid}"
        if key not in table:
            used = set(table.values())
            prefer = ctid % 256
            candidates = ([prefer] if 2 <= prefer <= 254 else []) + list(range(2, 255))
            free = next((o for o in candidates if f"{SUBNET}.{o}" not in used), None)
            if free is None:
                raise SimError(f"the sim network {SUBNET}.0/{PREFIX} is full; remove entries of "
                               f"purged nodes from {path}")
            table[key] = f"{SUBNET}.{free}"
            atomic_write(str(path), json.dumps(table, indent=1, sort_keys=True) + "\n")
        return table[key]


def veth_of(address: str) -> str:
    """Host-side interface name (in the sim netns) of the container with this address."""
    return f"dfl{address.rsplit('.', 1)[1]}"


def hook_line(address: str) -> str:
    return (f"lxc.hook.start-host = {attach_script()} {veth_of(address)} {address}/{PREFIX} "
            f"{NETNS} {BRIDGE}")


def has_link(pid: int) -> bool:
    """eth0 with its address, and lo up."""
    proc = run(["nsenter", "-t", str(pid), "-n", "ip", "-o", "-4", "addr", "show", "dev", "eth0"],
               what="ip addr in a container", check=False)
    lo = run(["nsenter", "-t", str(pid), "-n", "ip", "-o", "link", "show", "dev", "lo"],
             what="ip link in a container", check=False)
    return proc.returncode == 0 and b"inet " in proc.stdout and b"LOOPBACK,UP" in lo.stdout


def attach_running(pid: int, address: str) -> None:
    """Give a running container (init pid) its eth0 now, exactly as the start hook would."""
    env = dict(os.environ, LXC_PID=str(pid))
    proc = subprocess.run([str(attach_script()), veth_of(address), f"{address}/{PREFIX}", NETNS, BRIDGE],
                          env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    if proc.returncode != 0:
        raise SimError(f"could not attach container pid {pid} to the sim network: "
                       f"{proc.stderr.decode(errors='replace').strip()}")


def set_link(address: str, up: bool) -> None:
    """Cut (or restore) a container's link: its bridge port goes down; packets are dropped
    silently, as on a pulled cable (no RST reaches anyone)."""
    _ip("-n", NETNS, "link", "set", veth_of(address), "up" if up else "down")


def link_state(address: str) -> Optional[str]:
    proc = _ip("-n", NETNS, "-o", "link", "show", veth_of(address), check=False)
    if proc.returncode != 0:
        return None
    return "up" if b"state UP" in proc.stdout or b",UP" in proc.stdout.split(b">")[0] else "down"
