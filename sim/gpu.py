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
if "--query-gpu=" in args:
    fields = args.split("--query-gpu=")[1].split()[0].split(",")
    for i in range(STATE["gpus"]):
        row = {"index": i, "name": "NVIDIA H200", "uuid": f"GPU-5a{i:06d}-sim", "memory.total": 143771,
               "memory.used": 143771 - STATE["free_mib"], "memory.free": STATE["free_mib"],
               "utilization.gpu": 0, "temperature.gpu": 31, "driver_version": STATE["driver"],
               "compute_cap": "9.0"}
        print(", ".join(str(row.get(f, "[N/A]")) for f in fields))
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
        atomic_write(f"{node_smi}.json", json.dumps({"state": "ok", "gpus": st.get("gpus", 1) or 1,
                                                     "free_mib": 143000, "driver": NODE_DRIVER}), mode=0o644)
    else:
        node_smi.unlink(missing_ok=True)
        Path(f"{node_smi}.json").unlink(missing_ok=True)


def write_state(root: Path, ctid: int, kind: str, gpus: int = 1, free_mib: int = 143000) -> dict:
    if kind not in STATES:
        raise ValueError(f"GPU state {kind!r}: one of {', '.join(STATES)}")
    st = {"state": kind, "gpus": gpus, "free_mib": free_mib, "driver": NODE_DRIVER}
    state_file(root, ctid).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(str(state_file(root, ctid)), json.dumps(st) + "\n")
    return st
