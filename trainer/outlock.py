"""One writer per output directory: the lock a data job (prepare, regenerate) holds beside
its ``--out`` for its whole life, whoever started it (a launch's job, a command typed by
hand). Two writers of one out broke what each promises: regenerate's every id exactly once
(two launches at the same moment wrote each id twice), prepare's all-or-nothing output.

``.<name>.<job>-lock`` beside the out: a POSIX lock, which the kernel drops when its process
dies (SIGKILL too) and forked children (workers, a server) do not inherit. Standard library only.
"""

from __future__ import annotations

import errno
import os


class OutBusy(ValueError):
    """Another job holds the lock: one line naming the out, the lock and what to do."""


def claim(out: str, job: str) -> tuple[int, str] | None:
    """Hold the lock of ``out`` for ``job``; OutBusy when another process holds it. None where
    the file system has no locks (nothing can be claimed there). ``out``'s parent must exist."""
    import fcntl

    path = os.path.join(os.path.dirname(os.path.abspath(out)), f".{os.path.basename(os.path.abspath(out))}.{job}-lock")
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EACCES, errno.EAGAIN):  # a file system without locks
                try:
                    os.unlink(path)
                except OSError:
                    pass
                return None
            raise OutBusy(f"{out}: another {job} is writing it now (it holds {path}); wait for it to end "
                          "or choose another --out") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:  # else the holder before us removed the file as we opened it: take the new one
            return fd, path
        os.close(fd)


def release(held: tuple[int, str] | None) -> None:
    if held is None:
        return
    fd, path = held
    try:
        os.unlink(path)  # before the close: whoever opens it next gets a new file and checks the inode
    except FileNotFoundError:
        pass
    os.close(fd)
