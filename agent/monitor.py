"""The job monitor: a tiny process between the agent and the job (`python3 -m agent _monitor`).

Why it exists: after the agent dies and re-attaches, the job is no longer the agent's child,
so the agent cannot waitpid() it and would never learn its exit status. The monitor is the
job's parent, lives in the job's session, outlives the agent, and writes the status to
job.exit.json (the same role as conmon for podman). It is also a child subreaper, so an
orphaned worker is re-parented here, inside the run's tree, rather than to init.

It ignores SIGTERM/SIGINT/SIGHUP (handlers, not SIG_IGN, so the job does not inherit the
ignore across exec): `agent stop` signals the whole process group, the job saves and exits,
and the monitor survives to record that.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from agent import procs
from agent.protocol import EXIT_FAILURE, EXIT_SPAWN_FAILED, JOB_EXIT, atomic_write_json


def _noop(signum, frame):  # noqa: ARG001
    pass


def main(run_dir: str, argv: list[str]) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _noop)
    procs.set_child_subreaper()
    exit_path = os.path.join(run_dir, JOB_EXIT)
    started = time.time()
    try:
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    except OSError as exc:
        # "failed to start" is not "exited non-zero" (Ray's supervisor separates them)
        print(f"agent: could not start {argv[0]!r}: {exc}", file=sys.stderr, flush=True)
        atomic_write_json(exit_path, {"pid": None, "exit_code": EXIT_SPAWN_FAILED, "signal": None,
                                      "signal_name": None, "spawn_error": str(exc), "started": started,
                                      "ended": time.time()})
        return EXIT_SPAWN_FAILED
    code = None
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break  # no children left: the job and every orphan it left are gone
        except InterruptedError:
            continue
        if pid == child.pid and code is None:
            info = procs.describe_status(status)
            info.update(pid=pid, started=started, ended=time.time())
            atomic_write_json(exit_path, info)
            code = info["exit_code"] if info["exit_code"] is not None else 128 + info["signal"]
    return code if code is not None else EXIT_FAILURE
