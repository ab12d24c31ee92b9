"""GPUs as LXC gives them, for a node that has none: each way a container loses its GPUs.

The machine has no GPU, so the driver and the GPUs themselves are emulated like pct is:
``nvidia-smi`` on the node and in the container is a script (``nvidia-smi.py`` below) that
prints what the real tool prints in each state, the real messages included. What a container
can check for itself is real: the device nodes are real character devices (major 195, as the
NVIDIA driver's) bind-mounted by ``lxc.mount.entry`` lines, as Proxmox operators pass GPUs
through; the cgroup device rule is a real ``devices.allow`` line, so without it opening
``/dev/nvidiactl`` fails with EPERM from the kernel; the user-space library is a file named
``libnvidia-ml.so.<version>``. Per container (``ctl sim gpu --container N --state S``):

- ``none``       a CPU container on a CPU node: nothing (the default);
- ``ok``         GPUs passed through and working: ``nvidia-smi`` lists them;
- ``no-devices`` the node has GPUs, the container has no ``/dev/nvidia*``;
- ``no-cgroup``  device nodes there, cgroup rule missing: ``Failed to initialize NVML: Unknown Error``;
- ``mismatch``   the node's driver was updated, the container's libraries were not:
                 ``Failed to initialize NVML: Driver/library version mismatch``.

In a working container each GPU also reports its health as nvidia-smi's queries print it
(``--query-gpu`` ECC, retired pages, clock event reasons, PCIe link, persistence mode;
``--query-remapped-rows``), healthy unless a test sets a condition of ``HEALTH`` on it
(``SimNode.set_gpu_health``: uncorrectable ECC errors with a remap pending, throttled,
power-capped, a narrower PCIe link, persistence off). NVML itself is not emulated: the
container's ``libnvidia-ml.so`` is not a real library, so the agent reads nvidia-smi, as it
does wherever NVML does not load.

The Proxmox config (``<state>/pve/lxc/<id>.conf``) gets the raw ``lxc.*`` lines a Proxmox
operator writes (``lxc.cgroup2.devices.allow``, ``lxc.mount.entry``), so ``pct config`` shows
them; the LXC config gets their equivalents for this host's cgroup version. A change restarts
the container, as a Proxmox config change needs.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from agent.protocol import atomic_write

STATES = ("none", "ok", "no-devices", "no-cgroup", "mismatch")
# What one GPU of a working container can report (``ctl sim`` tests: SimNode.set_gpu_health),
# in nvidia-smi's query names; "healthy" is an idle, sound H200.
HEALTH = {
    "healthy": {},
    "ecc": {"ecc.errors.uncorrected.volatile.total": 2, "ecc.errors.uncorrected.aggregate.total": 2,
            "remapped_rows.pending": "Yes"},
    "throttled": {"clocks_throttle_reasons.active": 0x8 | 0x20},  # HW slowdown, SW thermal slowdown
    "power-capped": {"clocks_throttle_reasons.active": 0x4},
    "pcie-degraded": {"pcie.link.width.current": 8},
    "persistence-off": {"persistence_mode": "Disabled"},
}
NODE_DRIVER = "580.159.03"
OLD_DRIVER = "570.86.15"  # what the container still has after the node's driver update
NVIDIA_MAJOR = 195
LIB_DIR = "usr/lib/x86_64-linux-gnu"

# Real nvidia-smi's words (driver 5xx) for each state, and its exit codes.
SMI = r'''#!/usr/bin/python3
"""nvidia-smi of the simulated node (sim/gpu.py): prints what the real one prints."""
import json, sys
STATE = json.loads(open(__file__ + ".json").read())
kind = STATE["state"]
if kind == "no-devices":
    print("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the "
          "latest NVIDIA driver is installed and running.")
    sys.exit(9)
if kind == "no-cgroup":
    print("Failed to initialize NVML: Unknown Error")
    sys.exit(255)
if kind == "mismatch":
    print("Failed to initialize NVML: Driver/library version mismatch")
    print(f"NVML library version: {STATE['library']}")
    sys.exit(18)
args = " ".join(sys.argv[1:])
# An idle, healthy H200 as driver 580 prints it (checked on one): no ECC errors, retired pages
# [N/A] (Hopper remaps rows instead), only the idle clock reason, PCIe gen 5 x16, persistence on.
HEALTHY = {"ecc.errors.uncorrected.volatile.total": 0, "ecc.errors.uncorrected.aggregate.total": 0,
           "retired_pages.pending": "[N/A]", "clocks_throttle_reasons.active": 0x1, "pcie.link.gen.current": 5,
           "pcie.link.gen.max": 5, "pcie.link.width.current": 16, "pcie.link.width.max": 16,
           "persistence_mode": "Enabled", "remapped_rows.pending": "No", "remapped_rows.failure": "No"}
ALIASES = {"clocks_event_reasons.active": "clocks_throttle_reasons.active", "gpu_bus_id": "pci.bus_id"}


def row(i):
    r = {"index": i, "name": "NVIDIA H200", "uuid": f"GPU-5a{i:06d}-sim", "memory.total": 143771,
         "memory.used": 143771 - STATE["free_mib"], "memory.free": STATE["free_mib"],
         "utilization.gpu": 0, "temperature.gpu": 31, "driver_version": STATE["driver"],
         "compute_cap": "9.0", "pci.bus_id": f"00000000:{0x18 + 0x10 * i:02X}:00.0", **HEALTHY}
    r.update((STATE.get("health") or {}).get(str(i)) or {})
    mask = r["clocks_throttle_reasons.active"]
    r["clocks_throttle_reasons.active"] = f"0x{mask:016x}" if isinstance(mask, int) else mask
    return r


for query in ("--query-gpu=", "--query-remapped-rows="):
    if query in args:
        fields = [ALIASES.get(f, f) for f in args.split(query)[1].split()[0].split(",")]
        for i in range(STATE["gpus"]):
            print(", ".join(str(row(i).get(f, "[N/A]")) for f in fields))
        sys.exit(0)
print(f"NVIDIA-SMI {STATE['driver']}    Driver Version: {STATE['driver']}")
for i in range(STATE["gpus"]):
    print(f"|   {i}  NVIDIA H200   |  {143771 - STATE['free_mib']}MiB / 143771MiB |")
'''


def _cgroup_key() -> str:
    """The LXC key this host's cgroup hierarchy reads (v1 where a devices controller is mounted)."""
    return "lxc.cgroup.devices.allow" if Path("/sys/fs/cgroup/devices").is_dir() else "lxc.cgroup2.devices.allow"


def state_file(root: Path, ctid: int) -> Path:
    return root / "gpu" / f"{ctid}.json"


def read_state(root: Path, ctid: int) -> dict:
    try:
        return json.loads(state_file(root, ctid).read_text())
    except (OSError, ValueError):
        return {"state": "none"}


def _device_nodes(root: Path, gpus: int) -> list[Path]:
    """Real character devices of the NVIDIA major on the node side, made once."""
    d = root / "gpu" / "dev"
    d.mkdir(parents=True, exist_ok=True)
    nodes = [(f"nvidia{i}", i) for i in range(gpus)] + [("nvidiactl", 255)]
    out = []
    for name, minor in nodes:
        path = d / name
        if not path.exists():
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, minor))
        out.append(path)
    return out


def lxc_lines(root: Path, ctid: int) -> tuple[list[str], list[str]]:
    """(LXC config lines, Proxmox config raw lines) for a container's GPU state."""
    st = read_state(root, ctid)
    kind = st["state"]
    if kind in ("none", "no-devices"):
        return [], []
    lxc, pve = [], []
    if kind != "no-cgroup":
        lxc.append(f"{_cgroup_key()} = c {NVIDIA_MAJOR}:* rwm")
        pve.append(f"lxc.cgroup2.devices.allow: c {NVIDIA_MAJOR}:* rwm")
    for node in _device_nodes(root, st.get("gpus", 1)):
        lxc.append(f"lxc.mount.entry = {node} dev/{node.name} none bind,optional,create=file 0 0")
        pve.append(f"lxc.mount.entry: /dev/{node.name} dev/{node.name} none bind,optional,create=file")
    return lxc, pve


def install(root: Path, ctid: int, rootfs: Path, node_bin: Path) -> None:
    """Put the container's and the node's nvidia-smi and libraries in line with its state."""
    st = read_state(root, ctid)
    kind = st["state"]
    smi = rootfs / "usr/local/bin/nvidia-smi"
    lib_dir = rootfs / LIB_DIR
    for old in lib_dir.glob("libnvidia-ml.so.*"):
        old.unlink()
    if kind == "none":
        smi.unlink(missing_ok=True)
        Path(f"{smi}.json").unlink(missing_ok=True)
    else:
        library = OLD_DRIVER if kind == "mismatch" else NODE_DRIVER
        atomic_write(str(smi), SMI, mode=0o755)
        atomic_write(f"{smi}.json", json.dumps(dict(st, library=library)), mode=0o644)
        atomic_write(str(lib_dir / f"libnvidia-ml.so.{library}"), "not a real library (sim/gpu.py)\n")
    # The node has GPUs when any of its containers was given some.
    states = [read_state(root, int(p.stem))["state"] for p in (root / "gpu").glob("*.json")]
    node_smi = node_bin / "nvidia-smi"
    if any(s != "none" for s in states):
        atomic_write(str(node_smi), SMI, mode=0o755)
        atomic_write(f"{node_smi}.json", json.dumps({"state": "ok", "gpus": st.get("gpus", 1) or 1, "health": st.get("health") or {},
                                                     "free_mib": 143000, "driver": NODE_DRIVER}), mode=0o644)
    else:
        node_smi.unlink(missing_ok=True)
        Path(f"{node_smi}.json").unlink(missing_ok=True)


def write_health(root: Path, ctid: int, index: int, condition: str) -> dict:
    """GPU ``index`` of container ``ctid`` reports ``condition`` (HEALTH) from now on."""
    if condition not in HEALTH:
        raise ValueError(f"GPU health {condition!r}: one of {', '.join(HEALTH)}")
    st = read_state(root, ctid)
    health = dict(st.get("health") or {})
    health[str(index)] = HEALTH[condition]
    st["health"] = health
    atomic_write(str(state_file(root, ctid)), json.dumps(st) + "\n")
    return st


def write_state(root: Path, ctid: int, kind: str, gpus: int = 1, free_mib: int = 143000) -> dict:
    if kind not in STATES:
        raise ValueError(f"GPU state {kind!r}: one of {', '.join(STATES)}")
    st = {"state": kind, "gpus": gpus, "free_mib": free_mib, "driver": NODE_DRIVER}  # healthy GPUs
    state_file(root, ctid).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(str(state_file(root, ctid)), json.dumps(st) + "\n")
    return st
