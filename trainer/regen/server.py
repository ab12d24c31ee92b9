"""``--serve CMD``: the regenerate job starts the inference server itself, as an operator
starts SGLang before a batch — first, health-checked until every ``--endpoint`` answers,
stopped at the end (SIGTERM to its process group, SIGKILL after a grace period).

The server runs in its own session (its own process group) with its output in
``DIR/serve.log``. A SIGKILLed job must not leave a GPU-holding server behind, and a signal
to the server alone is not enough: vLLM's API server, sent SIGTERM while its engine is
starting, finishes starting and serves for good, its engine core and workers with it (vLLM
0.32 installs a start-up SIGTERM handler that should interrupt it, and the interrupt is lost;
tests/test_regenerate_vllm.py). So a guard process watches the job: it holds the read end of a pipe only the
job writes to, and when that pipe closes — the job gone, however it went — it stops the
server's whole group as the job would have (SIGTERM, ``stop_grace`` seconds, SIGKILL).
PR_SET_PDEATHSIG still sends the server SIGTERM at once. The agent's stop sweeps the job's
process tree as well (it is the job's subreaper); not by the environment marker alone, since
vLLM's engine core and workers rename themselves (setproctitle), which overwrites what
/proc/PID/environ shows.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections import deque
from typing import Sequence

LOG = "serve.log"
PR_SET_PDEATHSIG = 1


class ServeError(RuntimeError):
    """The server did not come up; one line naming what happened, with its last log lines."""


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the agent's sweep still stops it


def _tail(path: str, n: int = 5) -> str:
    try:
        with open(path, errors="replace") as fh:
            return " | ".join(line.rstrip() for line in deque(fh, n) if line.strip())
    except OSError:
        return ""


def _signal_group(pgid: int, sig: int) -> bool:
    """Signal a process group; False when nothing of it is left."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def stop_group(pgid: int, grace: float, leader: subprocess.Popen | None = None) -> None:
    """SIGTERM the group, up to ``grace`` seconds for all of it to exit (the leader, then an
    engine or a resource tracker still cleaning up), SIGKILL what is left."""
    deadline = time.monotonic() + grace
    if not _signal_group(pgid, signal.SIGTERM):
        return
    if leader is not None:
        try:
            leader.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    while time.monotonic() < deadline and _signal_group(pgid, 0):
        time.sleep(0.2)
    _signal_group(pgid, signal.SIGKILL)


def guard(argv: Sequence[str]) -> int:
    """``python -m trainer.regen.server PGID GRACE``, stdin the job's pipe: on EOF (the job is
    gone, or stopped the server itself and closed it) stop whatever is left of the group.
    SIGTERM and SIGINT are ignored: a stop of the job's tree must not end the guard before it
    has stopped the server."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pgid, grace = int(argv[0]), float(argv[1])
    sys.stdin.buffer.read()
    stop_group(pgid, grace)
    return 0


class Server:
    def __init__(self, argv: Sequence[str], out_dir: str, stop_grace: float):
        self.argv = list(argv)
        self.log_path = os.path.join(out_dir, LOG)
        self.stop_grace = stop_grace
        self.proc: subprocess.Popen | None = None
        self.guard: subprocess.Popen | None = None

    def start(self, endpoints: Sequence[str], timeout_s: float, log=print, stopped=lambda: False,
              api_key: str | None = None) -> float | None:
        """Start the command and wait until every endpoint is healthy; seconds it took, or
        None when ``stopped()`` turned true first (a SIGTERM while the server loads)."""
        from trainer.regen.client import healthy  # here: the guard (this module's main) needs no httpx

        started = time.monotonic()
        log_fh = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log_fh, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        except OSError as exc:
            raise ServeError(f"--serve {self.argv[0]}: cannot start ({exc.strerror or exc})") from None
        finally:
            log_fh.close()
        # started after the server, so the server never holds the pipe's write end (close_fds)
        try:
            self.guard = subprocess.Popen([sys.executable, "-m", "trainer.regen.server", str(self.proc.pid),
                                           str(self.stop_grace)],
                                          stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True)
        except OSError as exc:
            self.stop()
            raise ServeError(f"--serve: cannot start the guard that stops the server if this job dies ({exc})") from None
        log(f"regenerate: started the server (pid {self.proc.pid}): {' '.join(self.argv)}; log in {self.log_path}")
        waiting = list(endpoints)
        while waiting:
            if stopped():
                return None
            if self.proc.poll() is not None:
                raise ServeError(f"--serve: the server exited {self.proc.returncode} before {waiting[0]} was healthy; "
                                 f"its log ({self.log_path}) ends: {_tail(self.log_path)}")
            if time.monotonic() - started > timeout_s:
                self.stop()
                raise ServeError(f"--serve: {waiting[0]} was not healthy within --serve-timeout {timeout_s:g} s; "
                                 f"its log ({self.log_path}) ends: {_tail(self.log_path)}")
            waiting = [e for e in waiting if not healthy(e, timeout=2.0, api_key=api_key)]
            if waiting:
                time.sleep(0.5)
        took = time.monotonic() - started
        log(f"regenerate: the server is healthy after {took:.1f} s")
        return took

    def stop(self) -> int | None:
        """Stop the server's whole process group; its exit code (None if never started)."""
        if self.proc is None:
            return None
        stop_group(self.proc.pid, self.stop_grace, self.proc)
        self.proc.wait()
        if self.guard is not None:  # nothing left to stop: EOF, and it exits
            self.guard.stdin.close()
            self.guard.wait()
        return self.proc.returncode


if __name__ == "__main__":
    sys.exit(guard(sys.argv[1:]))
