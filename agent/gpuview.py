"""Why a container sees fewer GPUs than its run names, from inside it (stdlib only).

On LXC a GPU reaches a container through three things the node sets up, and each breaks on
its own (docs/research/proxmox-and-supervision.md §1.3):

- the device nodes (``/dev/nvidia0…``, ``/dev/nvidiactl``, ``/dev/nvidia-uvm``), bind-mounted
  by ``lxc.mount.entry`` lines or created by ``devN:`` entries: missing → no GPU at all;
- the cgroup device rule (``lxc.cgroup2.devices.allow: c 195:* rwm`` and the uvm major): the
  nodes are there but opening one fails with EPERM;
- user-space driver libraries in the container that match the node's kernel module: after a
  host driver update they do not, and NVML says "Driver/library version mismatch".

:func:`diagnose` gathers the facts the container can see; the controller adds the node's own
driver version and turns them into the cause and the fix (controller/gpucheck.py).
"""

from __future__ import annotations

import errno
import glob
import os
import re
from typing import Optional

# Where Debian/Ubuntu and RHEL put the driver's user-space libraries.
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/nvidia/lib64")
_LIB = re.compile(r"^libnvidia-ml\.so\.(\d+\.\d+(?:\.\d+)?)$")
_MODULE = re.compile(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)")


def device_nodes() -> list[str]:
    return sorted(glob.glob("/dev/nvidia*"))


def open_error(path: str) -> Optional[str]:
    """errno name of opening ``path`` read-write (None: it opened). EPERM is the cgroup's
    refusal; ENXIO/ENODEV mean no driver behind the node."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    os.close(fd)
    return None


def library_versions() -> list[str]:
    """Versions of libnvidia-ml.so.<version> installed in the container."""
    found = set()
    for d in LIB_DIRS:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            m = _LIB.match(name)
            if m:
                found.add(m.group(1))
    return sorted(found)


def kernel_module_version() -> Optional[str]:
    """The node's kernel module version, as /proc shows it (the container shares the node's
    kernel; LXC leaves /proc/driver visible)."""
    try:
        with open("/proc/driver/nvidia/version") as fh:
            m = _MODULE.search(fh.read())
    except OSError:
        return None
    return m.group(1) if m else None


def diagnose() -> dict:
    nodes = device_nodes()
    probe = next((n for n in nodes if n.endswith("nvidiactl")), nodes[0] if nodes else None)
    return {
        "device_nodes": nodes,
        "open_error": open_error(probe) if probe else None,
        "opened": probe,
        "libraries": library_versions(),
        "kernel_module": kernel_module_version(),
    }
