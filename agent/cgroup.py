"""OOM-kill evidence from what a container can read: its memory cgroup and the kernel's count.

cgroup v2 ``memory.events`` counts ``oom_kill`` for the subtree; it works inside an LXC
container without dmesg (docs/research/proxmox-and-supervision.md §6). cgroup v1 exposes
the same counter in ``memory.oom_control`` (the victim's own cgroup only: v1 does not count
up the tree). Either counts every OOM kill of a process in the cgroup, the kernel's global
OOM killer's too, so a rise there is evidence whatever limit ran out; the limit and peak
along the path up from the agent's cgroup say whether it was the container's own.

A container may show no cgroup file at all (no cgroup mount: the simulated node's). The
kernel's own ``oom_kill`` in /proc/vmstat, which no container runtime virtualizes, still
counts every OOM kill on the host: a SIGKILL while it rose is *possibly* the host's OOM
killer (another process on the host may have been its victim), and said so, no more.
Sample while the job runs: the cgroup may vanish afterwards.
"""

from __future__ import annotations

import os
from typing import NamedTuple

VMSTAT = "/proc/vmstat"
# A cgroup's peak this close to its limit means the limit was what ran out.
LIMIT_REACHED_FRACTION = 0.97


def _cgroup_paths(pid: str | int) -> tuple[str | None, str | None]:
    """(cgroup v2 path, v1 memory path) of ``pid`` as /proc/<pid>/cgroup names them."""
    v2 = v1 = None
    try:
        with open(f"/proc/{pid}/cgroup") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None, None
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _memory_dirs(pid: str | int = "self") -> list[tuple[str, str]]:
    """(directory, "v2"|"v1") of the process's memory cgroup, then each parent up to the root
    this mount shows, keeping those that hold memory files."""
    v2, v1 = _cgroup_paths(pid)
    out: list[tuple[str, str]] = []
    for root, path, version, probe in ((("/sys/fs/cgroup", "/sys/fs/cgroup/unified"), v2, "v2", "memory.events"),
                                       (("/sys/fs/cgroup/memory",), v1, "v1", "memory.oom_control")):
        if path is None:
            continue
        for base in root:
            d = os.path.normpath(base + path)
            while True:
                if os.path.exists(os.path.join(d, probe)):
                    out.append((d, version))
                if d == base or len(d) <= len(base):
                    break
                d = os.path.dirname(d)
            if out:
                return out
    return out


def memory_events_path(pid: str | int = "self") -> str | None:
    """The oom_kill counter's file of the process's own memory cgroup (or, on v2, the nearest
    parent that has one: v2 counts up the tree), or None."""
    dirs = _memory_dirs(pid)
    if not dirs:
        return None
    d, version = dirs[0]
    if version == "v1" and d != os.path.normpath("/sys/fs/cgroup/memory" + (_cgroup_paths(pid)[1] or "")):
        return None  # a v1 parent does not count its children's kills
    return os.path.join(d, "memory.events" if version == "v2" else "memory.oom_control")


def oom_kills(path: str | None) -> int | None:
    """The oom_kill counter in ``path`` (memory.events, memory.oom_control or /proc/vmstat), or None."""
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


def _read_int(path: str) -> int | None:
    try:
        with open(path) as fh:
            text = fh.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _limit_and_peak(pid: str | int = "self") -> tuple[int | None, int | None]:
    """(the lowest memory limit on the path up from the process's cgroup, the peak of the
    cgroup that has it), or Nones where nothing is readable. v1's unlimited is a huge number."""
    best: tuple[int | None, int | None] = (None, None)
    for d, version in _memory_dirs(pid):
        names = ("memory.max", "memory.peak") if version == "v2" else ("memory.limit_in_bytes",
                                                                       "memory.max_usage_in_bytes")
        limit = _read_int(os.path.join(d, names[0]))
        if limit is not None and limit < (1 << 60) and (best[0] is None or limit < best[0]):
            best = (limit, _read_int(os.path.join(d, names[1])))
    return best


class MemorySample(NamedTuple):
    """What the agent reads at an attempt's start and again when a process of it died."""

    cgroup_oom_kill: int | None  # the job's memory cgroup's counter (None: not visible here)
    host_oom_kill: int | None  # the kernel's, /proc/vmstat
    limit_bytes: int | None  # the lowest limit on the path up from the cgroup
    peak_bytes: int | None  # that cgroup's peak usage


def sample(path: str | None) -> MemorySample:
    """``path``: memory_events_path() of the agent, found once."""
    limit, peak = _limit_and_peak() if path else (None, None)
    return MemorySample(oom_kills(path), oom_kills(VMSTAT), limit, peak)


def oom_evidence(before: MemorySample, after: MemorySample) -> dict | None:
    """What the counters say about a SIGKILL between the two samples, or None when no OOM
    kill happened anywhere the container can see:
    ``cgroup_oom_kills`` (the cgroup's rise, None where it is not visible), ``host_oom_kills``
    (the kernel's rise), ``limit_bytes``, ``peak_bytes``, ``limit_reached`` (None: unknown)."""
    def rise(a: int | None, b: int | None) -> int | None:
        return None if a is None or b is None else max(0, b - a)

    in_cgroup, on_host = rise(before.cgroup_oom_kill, after.cgroup_oom_kill), rise(before.host_oom_kill,
                                                                                     after.host_oom_kill)
    if not in_cgroup and not (in_cgroup is None and on_host):
        return None  # a visible cgroup counter that did not rise clears the OOM killer
    reached = None
    if after.limit_bytes and after.peak_bytes is not None:
        reached = after.peak_bytes >= LIMIT_REACHED_FRACTION * after.limit_bytes
    return {"cgroup_oom_kills": in_cgroup, "host_oom_kills": on_host, "limit_bytes": after.limit_bytes,
            "peak_bytes": after.peak_bytes, "limit_reached": reached}
