"""``--serve CMD``: the regenerate job starts the inference server itself, as an operator
starts SGLang before a batch — first, health-checked until every ``--endpoint`` answers,
stopped at the end (SIGTERM to its process group, SIGKILL after a grace period).

The server runs in its own session with its output in ``DIR/serve.log``, and is asked to
die with the job (PR_SET_PDEATHSIG), so a SIGKILLed job does not leave a GPU-holding
server behind; the agent's stop sweeps it by the run's environment marker as well.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections import deque
from typing import Sequence

from trainer.regen_client import healthy

LOG = "serve.log"
PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 30.0


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


class Server:
    def __init__(self, argv: Sequence[str], out_dir: str):
        self.argv = list(argv)
        self.log_path = os.path.join(out_dir, LOG)
        self.proc: subprocess.Popen | None = None

    def start(self, endpoints: Sequence[str], timeout_s: float, log=print, stopped=lambda: False,
              api_key: str | None = None) -> float | None:
        """Start the command and wait until every endpoint is healthy; seconds it took, or
        None when ``stopped()`` turned true first (a SIGTERM while the server loads)."""
        started = time.monotonic()
        log_fh = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log_fh, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        except OSError as exc:
            raise ServeError(f"--serve {self.argv[0]}: cannot start ({exc.strerror or exc})") from None
        finally:
            log_fh.close()
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
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        return self.proc.returncode
