"""Temp files of interrupted saves: named with their writer, removed once it is dead.

A checkpoint save writes ``step_N/.checkpoint-<tag>-….tmp`` and a drafter export
``.drafter.tmp-<tag>-…/`` beside its destination, then renames them into place; a writer
killed mid-save (kill -9, a full disk, a container restart) leaves them — full-size — and the
resume writes a new run directory, so nobody would ever remove them and they fill the disk.
The tag names the writing process (pid, start time, boot id), so a sweep removes only the temp
files of writers that are gone, never those of a save in progress in another run sharing the
root.

Swept at the start of every trainer (its output root) and by `ctl runs --prune` (every run
directory of the workspace and every run's output root). Standard library only.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Iterable

from agent import procs

# w<pid>.<start time in ticks>.<first 8 hex of the boot id>
_TAG = re.compile(r"w(\d+)\.(\d+)\.([0-9a-f]{0,8})-")
# what a tagged temp name starts with: ".checkpoint-<tag>-", ".<name>.tmp-<tag>-", ".<name>.old-<tag>-"
_TEMP = re.compile(r"^\.(?:checkpoint-|.+\.(?:tmp|old)-)(?=w\d+\.\d+\.[0-9a-f]{0,8}-)")

_mine: tuple[int, str] | None = None


def writer_tag() -> str:
    """This process's tag (recomputed after a fork)."""
    global _mine
    pid = os.getpid()
    if _mine is None or _mine[0] != pid:
        st = procs.stat(pid)
        _mine = (pid, f"w{pid}.{st['starttime'] if st else 0}.{procs.boot_id().replace('-', '')[:8]}")
    return _mine[1]


def writer_of(name: str) -> tuple[int, int, str] | None:
    """(pid, start time, boot id prefix) of a tagged temp name; None for any other name."""
    m = _TEMP.match(name)
    if not m:
        return None
    t = _TAG.match(name, m.end())
    return (int(t.group(1)), int(t.group(2)), t.group(3)) if t else None


def writer_alive(writer: tuple[int, int, str]) -> bool:
    pid, start, boot = writer
    if boot and not procs.boot_id().replace("-", "").startswith(boot):
        return False  # written before a reboot or a container restart: that writer is gone
    st = procs.stat(pid)
    return st is not None and st["starttime"] == start and st["state"] not in ("Z", "X")


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for base, _, names in os.walk(path):
        for n in names:
            try:
                total += os.path.getsize(os.path.join(base, n))
            except OSError:
                pass
    return total


def sweep(roots: Iterable[tuple[str, int]]) -> list[dict]:
    """Remove the tagged temp files and directories of dead writers found up to ``depth``
    levels below each (root, depth); returns {path, bytes} of each removed. Never follows a
    symlink, never descends into a hidden directory (a temp dir is removed whole or kept)."""
    removed, seen = [], set()
    for root, depth in roots:
        todo = [(os.path.abspath(root), 0)]
        while todo:
            directory, level = todo.pop()
            if directory in seen:
                continue
            seen.add(directory)
            try:
                entries = list(os.scandir(directory))
            except OSError:
                continue
            for entry in entries:
                writer = writer_of(entry.name)
                if writer is not None:
                    if not writer_alive(writer):
                        size = _size(entry.path)
                        try:
                            if entry.is_dir(follow_symlinks=False):
                                shutil.rmtree(entry.path)
                            else:
                                os.unlink(entry.path)
                        except FileNotFoundError:
                            continue
                        except OSError:
                            continue
                        removed.append({"path": entry.path, "bytes": size})
                    continue
                if level < depth and not entry.name.startswith(".") and entry.is_dir(follow_symlinks=False):
                    todo.append((entry.path, level + 1))
    return removed


def output_roots(output_dir: str, run_dir: str | None = None) -> list[tuple[str, int]]:
    """Where the leftovers of earlier runs writing beside ``output_dir`` lie: its parent (the
    output root of ``/workspace/out/{run_id}``: root/<run>/step_N/temp), and with the default
    ``{run_dir}/output`` the workspace's runs directory (runs/<run>/output/step_N/temp)."""
    out = os.path.abspath(output_dir)
    roots = [(os.path.dirname(out), 3)]
    if run_dir:
        parent = os.path.dirname(os.path.abspath(run_dir))
        if os.path.basename(parent) == "runs":
            roots.append((parent, 4))
    return roots
