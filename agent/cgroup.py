"""Host OOM evidence from the cgroup the agent (and its job) runs in.

cgroup v2 ``memory.events`` counts ``oom_kill`` for the subtree; it works inside an LXC
container without dmesg (docs/research/proxmox-and-supervision.md §6). cgroup v1 exposes
the same counter in ``memory.oom_control``. Sample while the job runs: the cgroup may
vanish afterwards.
"""

from __future__ import annotations

import os


def memory_events_path(pid: str | int = "self") -> str | None:
    try:
        with open(f"/proc/{pid}/cgroup") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":
            for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
                candidate = os.path.join(root + path, "memory.events")
                if os.path.exists(candidate):
                    return candidate
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            candidate = os.path.join("/sys/fs/cgroup/memory" + path, "memory.oom_control")
            if os.path.exists(candidate):
                return candidate
    return None


def oom_kills(path: str | None) -> int | None:
    """The oom_kill counter in ``path`` (memory.events or memory.oom_control), or None."""
    if not path:
        return None
    try:
        with open(path) as fh:
            for line in fh:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        return None
    return None
