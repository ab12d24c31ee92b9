"""Proxmox container snapshots for `ctl launch --snapshot` and `ctl kill-and-rollback
--to snapshot:NAME`: take, list, roll back (then start and wait until the container answers).

Facts this follows (docs/research/proxmox-and-supervision.md §1.2):
- a snapshot needs snapshot-capable storage (ZFS, btrfs, LVM-thin, Ceph); on ``dir``
  storage pct refuses with "snapshot feature is not available". We cannot know in advance
  without pvesm, so we ask pct and translate its refusal into a plain sentence;
- only volume mount points are snapshotted: bind mounts (a shared /workspace, a model dir)
  are not rolled back, everything in the root filesystem is;
- ``pct rollback`` hard-stops a running container (lxc-stop --kill, no grace), so the run
  must be stopped *before* (controller/rollback.py does that) and the container started after.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Optional

from controller import pct
from controller.container import Container, ContainerError

PREFIX = "ctl-"
_NOT_AVAILABLE = re.compile(r"snapshot feature is not available", re.I)
_ALREADY = re.compile(r"already used|already exists", re.I)
# pve-configid: a letter, then letters, digits, '-' and '_' (pve-common JSONSchema.pm).
_VALID = re.compile(r"^[a-z][a-z0-9_-]+$", re.I)
_TREE_LINE = re.compile(r"^\s*`->\s+(\S+)\s*(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)?\s*(.*?)\s*$")
_VENV_ID = re.compile(r"\bvenv ([0-9a-f]{12})\b")


class SnapshotError(ContainerError):
    """A snapshot operation failed; nothing else was changed."""


class SnapshotUnsupported(SnapshotError):
    """The container's storage cannot take snapshots."""


class SnapshotMissing(SnapshotError):
    pass


@dataclass(frozen=True)
class Snapshot:
    name: str
    taken: Optional[str]
    description: str

    @property
    def venv_id(self) -> Optional[str]:
        """The venv generation recorded in the description by take_snapshot, if any."""
        m = _VENV_ID.search(self.description)
        return m.group(1) if m else None


def name_problem(name: str) -> Optional[str]:
    """Why Proxmox would refuse ``name`` as a snapshot name (pve-snapshot-name: the
    pve-configid format, at most 40 characters), or None."""
    if not _VALID.match(name) or len(name) > 40:
        return ("a Proxmox snapshot name is a letter, then letters, digits, '-' or '_', at most 40 characters "
                "(`ctl kill-and-rollback --dry-run` lists the container's snapshots)")
    return None


def snapshot_name(run_id: str) -> str:
    """``ctl-<run>`` made valid for Proxmox (letters, digits, - and _; at most 40 chars)."""
    body = re.sub(r"[^a-z0-9_-]+", "-", run_id.lower()).strip("-") or "run"
    return (PREFIX + body)[:40].rstrip("-")


def _unsupported(ct: Container, detail: str) -> SnapshotUnsupported:
    return SnapshotUnsupported(
        f"container {ct.ctid} on node {ct.node_name} cannot be snapshotted: its root filesystem is on "
        f"storage without snapshot support (pct: {detail.strip()}). Snapshots need ZFS, btrfs, LVM-thin "
        f"or Ceph storage. Roll back with venv generations instead (`ctl env list --container {ct.ctid}`).")


def _pct(ct: Container, *args: str):
    return ct.pct(*args)


def take_snapshot(ct: Container, run_id: str, venv_id: Optional[str] = None) -> Snapshot:
    """``pct snapshot <ctid> ctl-<run>``; raises SnapshotUnsupported on non-snapshot storage."""
    name = snapshot_name(run_id)
    description = f"dflash-ctl: before run {run_id}" + (f"; venv {venv_id}" if venv_id else "")
    result = _pct(ct, "snapshot", ct.ctid, name, "--description", description)
    if result.failed:
        text = result.stderr + result.stdout
        if _NOT_AVAILABLE.search(text):
            raise _unsupported(ct, _NOT_AVAILABLE.search(text).group(0))
        if _ALREADY.search(text):
            raise SnapshotError(f"container {ct.ctid} already has a snapshot named {name}; pick another run "
                                f"id or remove it with `{pct.command_text(ct.node, 'delsnapshot', ct.ctid, name)}` on the node")
        raise SnapshotError(f"`{result.command}` failed on node {ct.node_name}: "
                            f"{result.tail('stderr', 3) or f'exit code {result.returncode}'}")
    return Snapshot(name, time.strftime("%Y-%m-%d %H:%M:%S"), description)


def undo_launch_snapshot(ct: Container, snap: Snapshot, say=print) -> None:
    """Remove the snapshot a launch took when that launch did not start (best effort: the
    launch's own error is what the operator must see, so a failure here is only reported)."""
    result = _pct(ct, "delsnapshot", ct.ctid, snap.name)
    if result.failed:
        say(f"note: could not remove snapshot {snap.name} of the launch that did not start "
            f"({result.tail('stderr', 1) or f'exit code {result.returncode}'}); remove it with "
            f"`{pct.command_text(ct.node, 'delsnapshot', ct.ctid, snap.name)}` on node {ct.node_name}")
    else:
        say(f"snapshot {snap.name} removed: the launch did not start")


def list_snapshots(ct: Container) -> list[Snapshot]:
    result = _pct(ct, "listsnapshot", ct.ctid)
    if result.failed:
        ct.status()  # a missing container raises its own clear message
        raise SnapshotError(f"cannot list the snapshots of {ct}: {result.tail('stderr', 3)}")
    out = []
    for line in result.stdout.splitlines():
        m = _TREE_LINE.match(line)
        if m and m.group(1) != "current":
            out.append(Snapshot(m.group(1), m.group(2), m.group(3) or ""))
    return out


def find_snapshot(ct: Container, name: str) -> Snapshot:
    snaps = list_snapshots(ct)
    for snap in snaps:
        if snap.name == name:
            return snap
    known = ", ".join(s.name for s in snaps) or "none"
    raise SnapshotMissing(f"snapshot {name!r} does not exist on container {ct.ctid} (node {ct.node_name}; "
                          f"its snapshots: {known}). `ctl launch --snapshot` takes one named ctl-<run>.")


def rollback(ct: Container, name: str, wait_s: float = 120.0) -> float:
    """``pct rollback`` (hard-stops the container), ``pct start``, wait until a command runs
    in it. Returns the seconds the container took to answer again."""
    why = name_problem(name)
    if why:
        raise SnapshotMissing(f"{name!r}: {why}")
    result = _pct(ct, "rollback", ct.ctid, name)
    if result.failed:
        text = result.stderr + result.stdout
        if _NOT_AVAILABLE.search(text):
            raise _unsupported(ct, _NOT_AVAILABLE.search(text).group(0))
        raise SnapshotError(f"`{result.command}` failed on node {ct.node_name}: {result.tail('stderr', 3)}; "
                            f"check the container with `{pct.command_text(ct.node, 'status', ct.ctid)}`")
    return start_and_wait(ct, wait_s)


def start_and_wait(ct: Container, wait_s: float = 120.0) -> float:
    t0 = time.monotonic()
    if ct.status() != "running":
        result = _pct(ct, "start", ct.ctid)
        if result.failed and "already running" not in result.stderr:
            raise SnapshotError(f"the rollback of {ct} succeeded but `{result.command}` failed: "
                                f"{result.tail('stderr', 3)}; start it by hand")
    while True:
        if ct.status() == "running" and ct.pct("exec", ct.ctid, "--", "true").ok:
            return time.monotonic() - t0
        if time.monotonic() - t0 > wait_s:
            raise SnapshotError(f"{ct} was rolled back and started but does not answer after {wait_s:.0f} s; "
                                f"look at it with `{pct.command_text(ct.node, 'status', ct.ctid)}` on the node")
        time.sleep(0.5)


def launch_snapshot(ct: Container, run_id: str, say=print) -> Snapshot:
    """For `ctl launch --snapshot`: ``pct snapshot <ctid> ctl-<run>`` before the run starts,
    its description naming the venv generation, so a rollback can verify it. On storage
    without snapshots the launch is refused (controller.launch.LaunchRefused) with that plain
    reason: the operator asked for a safety net that this container cannot have."""
    from controller import envgen_client as eg
    from controller.launch import LaunchRefused

    venv_id = eg.envgen(ct, "fingerprint").get("id")
    try:
        snap = take_snapshot(ct, run_id, venv_id)
    except SnapshotError as exc:
        raise LaunchRefused(f"{exc} Nothing was started.") from None
    say(f"snapshot {snap.name} of container {ct.ctid} taken (venv {venv_id}); undo everything after it with "
        f"`ctl kill-and-rollback --container {ct.ctid} --to snapshot:{snap.name}`")
    return snap
