"""Process facts from /proc: identity that survives PID reuse, the run's process tree,
signals to every descendant, and the child-subreaper bit.

Linux only; standard library only. Every reader tolerates a process vanishing between the
directory listing and the read (that race is the normal case while a job is dying).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Iterable

from agent.records import asdict, record

PR_SET_CHILD_SUBREAPER = 36


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def node_boot_time() -> float | None:
    """When the node (the kernel) booted, as time.time(): from CLOCK_BOOTTIME (no container
    runtime virtualizes it, unlike lxcfs's /proc/stat), else btime of /proc/stat."""
    try:
        return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    except (AttributeError, OSError):
        pass
    try:
        with open("/proc/stat", "rb") as fh:
            for line in fh:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


# A node reboot moves the node's boot time by at least the reboot; a clock step of NTP by
# seconds. (The boot id cannot tell: LXC gives each container start a boot id of its own.)
NODE_BOOT_SLACK_S = 10.0


def boot_marks() -> dict:
    """What names this boot of the node and of the container we run in: the kernel's boot
    id and boot time, the start time of pid 1 of our pid namespace (the container's init:
    a container restart gives it a new one, a node reboot a new boot id) and the namespace
    itself. Recorded with a run's job; compared by ``restart_since``."""
    init = stat(1)
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = None
    return {"boot_id": boot_id(), "node_boot": node_boot_time(),
            "init_start": init["starttime"] if init else None, "pidns": pidns}


def restart_since(marks: dict | None) -> dict | None:
    """Whether the node rebooted or the container restarted since ``marks`` (boot_marks() of
    then) were taken: {"kind": "node"|"container", "at": time.time() of the new boot}, or None."""
    if not isinstance(marks, dict):
        return None
    now = boot_marks()
    then_boot = marks.get("node_boot")
    if isinstance(then_boot, (int, float)) and now["node_boot"] is not None \
            and abs(now["node_boot"] - then_boot) > NODE_BOOT_SLACK_S:
        return {"kind": "node", "at": now["node_boot"]}
    moved = marks.get("init_start") is not None and now["init_start"] is not None \
        and marks["init_start"] != now["init_start"]
    if moved or any(marks.get(k) and now[k] and marks[k] != now[k] for k in ("pidns", "boot_id")):
        at = None
        if now["node_boot"] is not None and now["init_start"] is not None:
            at = now["node_boot"] + now["init_start"] / os.sysconf("SC_CLK_TCK")
        return {"kind": "container", "at": at}
    return None


def stat(pid: int) -> dict | None:
    """Fields of /proc/<pid>/stat we use, or None when the process is gone.

    comm may hold spaces and parentheses, so split after the *last* ')' (proc(5)).
    ``exit_code`` (field 52, Linux ≥ 3.5) is the waitpid status, meaningful for zombies.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read().decode("utf-8", "replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rest = raw[raw.rfind(")") + 2:].split()
    # rest[0] is field 3 (state)
    out = {
        "state": rest[0],
        "ppid": int(rest[1]),
        "pgid": int(rest[2]),
        "sid": int(rest[3]),
        "utime": int(rest[11]),
        "stime": int(rest[12]),
        "starttime": int(rest[19]),
    }
    out["exit_code"] = int(rest[49]) if len(rest) > 49 else None
    return out


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [p.decode("utf-8", "replace") for p in fh.read().split(b"\0") if p]
    except OSError:
        return []


def environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            raw = fh.read()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env


def cpu_seconds(pid: int) -> float | None:
    st = stat(pid)
    if st is None:
        return None
    return (st["utime"] + st["stime"]) / os.sysconf("SC_CLK_TCK")


@record(frozen=True)
class Identity:
    """A pid that cannot be confused with a later process reusing the number.

    SkyPilot guards stored PIDs with a command-line marker and boot time
    (docs/research/proxmox-and-supervision.md §2, sky/skylet/job_lib.py); we keep pid + start
    time in clock ticks since boot + boot id, which together name exactly one process, and the
    run marker for humans reading ps.
    """

    pid: int
    starttime: int
    boot_id: str
    marker: str = ""

    @classmethod
    def of(cls, pid: int, marker: str = "") -> "Identity":
        st = stat(pid)
        if st is None:
            raise ProcessLookupError(f"pid {pid} is gone")
        return cls(pid, st["starttime"], boot_id(), marker)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> "Identity":
        return cls(int(obj["pid"]), int(obj["starttime"]), str(obj.get("boot_id", "")), str(obj.get("marker", "")))

    def alive(self) -> bool:
        """Running (not a zombie) and really the same process."""
        if self.boot_id and self.boot_id != boot_id():
            return False  # the machine rebooted: every stored pid is stale
        st = stat(self.pid)
        return st is not None and st["starttime"] == self.starttime and st["state"] not in ("Z", "X")

    def zombie_status(self) -> int | None:
        st = stat(self.pid)
        if st is None or st["starttime"] != self.starttime or st["state"] not in ("Z", "X"):
            return None
        return st["exit_code"]


def set_child_subreaper(on: bool = True) -> bool:
    """Orphaned descendants are re-parented to us instead of init, so none escapes the
    tree we sweep at stop (skypilot PR#9672, ray PR#42992:
    docs/research/proxmox-and-supervision.md §4.3, §4.7)."""
    import ctypes  # here, not at the top: the read-only views (agent.runview) import procs and never need it

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1 if on else 0, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def is_child_subreaper() -> bool:
    import ctypes

    try:
        out = ctypes.c_int(0)
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER + 1, ctypes.byref(out), 0, 0, 0) == 0 and out.value != 0
    except (OSError, AttributeError):
        return False


def all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def parents() -> dict[int, int]:
    table = {}
    for pid in all_pids():
        st = stat(pid)
        if st is not None:
            table[pid] = st["ppid"]
    return table


def descendants(roots: Iterable[int], marker: dict[str, str] | None = None,
                exclude: Iterable[int] = ()) -> set[int]:
    """Every live process below ``roots`` (by parent links) plus every process whose
    environment carries all of ``marker``'s KEY=VALUE pairs.

    The environment marker catches what the tree misses: a grandchild that double-forked
    away while no subreaper was alive, re-parented to init (torchrun workers run with
    start_new_session, so killpg of the top group misses them:
    docs/research/proxmox-and-supervision.md §2, §4.1, §4.9). Zombies are left out: they hold
    no resources and cannot be signalled.
    """
    table = parents()
    skip = set(exclude) | {os.getpid()}
    children: dict[int, list[int]] = {}
    for pid, ppid in table.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    todo = [r for r in roots if r in table]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    if marker:
        for pid in table:
            if pid in found or pid in skip:
                continue
            env = environ(pid)
            if env and all(_same(k, env.get(k), v) for k, v in marker.items()):
                found.add(pid)
    live = set()
    for pid in found - skip:
        st = stat(pid)
        if st is not None and st["state"] not in ("Z", "X"):
            live.add(pid)
    return live


def _same(key: str, got: str | None, want: str) -> bool:
    # a directory may be spelled with a trailing slash or "//" by whoever rendered the env
    if got is None:
        return False
    if key.endswith("_DIR"):
        return os.path.normpath(got) == os.path.normpath(want)
    return got == want


def send(pids: Iterable[int], sig: int) -> list[int]:
    """Signal each pid; the ones that were really signalled (some may have just exited)."""
    sent = []
    for pid in sorted(pids):
        try:
            os.kill(pid, sig)
            sent.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return sent


def killpg(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def reap_children() -> list[tuple[int, int]]:
    """Collect every exited child without blocking: (pid, wait status)."""
    out = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        out.append((pid, status))
    return out


def describe_status(status: int) -> dict:
    """A waitpid status as {"exit_code": n} or {"signal": n, "signal_name": "SIGKILL"}."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return {"exit_code": None, "signal": sig, "signal_name": signal_name(sig)}
    return {"exit_code": os.WEXITSTATUS(status), "signal": None, "signal_name": None}


def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def wait_gone(pids: Iterable[int], timeout: float, poll: float = 0.05) -> set[int]:
    """Wait until none of ``pids`` is alive (zombies count as gone); the survivors."""
    pending = set(pids)
    deadline = time.monotonic() + timeout
    while True:
        pending = {p for p in pending if (st := stat(p)) is not None and st["state"] not in ("Z", "X")}
        if not pending or time.monotonic() >= deadline:
            return pending
        reap_children()
        time.sleep(poll)
