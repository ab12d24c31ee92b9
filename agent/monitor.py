"""The job monitor: a tiny process between the agent and the job (`python3 -m agent _monitor`).

Why it exists: after the agent dies and re-attaches, the job is no longer the agent's child,
so the agent cannot waitpid() it and would never learn its exit status. The monitor is the
job's parent, lives in the job's session, outlives the agent, and writes the status to
job.exit.json (the same role as conmon for podman). It is also a child subreaper, so an
orphaned worker is re-parented here, inside the run's tree, rather than to init.

It also brings the agent back (``--revive`` seconds after the agent's death, 0: never): a
run must never go on unsupervised, with no heartbeat checks, no failure classification and
no stream: a dead rank would go unnoticed. The agent's death is seen by its lock (agent.lock
is free: the kernel drops an flock when its holder dies, even by SIGKILL); the new agent
re-attaches as `agent start --reattach` would and records who brought it back and why. If the
job ends while no agent runs, one is started too, so the run is finalized.

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
from agent import protocol
from agent.options import Options
from agent.protocol import EXIT_FAILURE, EXIT_SPAWN_FAILED, atomic_write_json
from agent.rundir import RunDir, agent_alive, finished, read_json

POLL = 0.2  # seconds between reaping passes
GRACE = 5.0  # a new agent gets this long to take its lock before it counts as gone
MAX_DELAY = 300.0


def _noop(signum, frame):  # noqa: ARG001
    pass


class AgentGuard:
    """Starts a new agent when the run's agent is gone, with a doubling delay when the new
    ones keep dying soon after their start (an agent that crashes at start-up must not be
    restarted in a tight loop)."""

    def __init__(self, rd: RunDir, delay: float):
        self.rd = rd
        self.base = self.delay = delay
        self.gone_since: float | None = None
        self.quiet_until = 0.0
        self.last_revival: float | None = None

    def check(self) -> None:
        if self.base <= 0:
            return
        if agent_alive(self.rd):
            self.gone_since, self.quiet_until = None, 0.0
            if self.last_revival is not None and time.monotonic() - self.last_revival > 60:
                self.delay = self.base  # the last revival held: start over with the short delay
            return
        now = time.monotonic()
        if now < self.quiet_until:
            return  # the agent just started has not taken its lock yet
        if self.gone_since is None:
            self.gone_since = now
        if now - self.gone_since < self.delay or finished(self.rd):
            return
        self.revive(now - self.gone_since)

    def revive(self, gone_for: float) -> None:
        from agent import daemon

        previous = (read_json(self.rd.agent_pid) or {}).get("pid")
        why = f"its agent (pid {previous}) died; the job's monitor saw it gone for {gone_for:.1f} s"
        print(f"agent monitor: {why}; starting a new agent", file=sys.stderr, flush=True)
        env = {k: v for k, v in os.environ.items()
               if k not in (protocol.ENV_RUN_ID, protocol.ENV_RUN_DIR, protocol.ENV_RESUME_FROM)}
        # Not a subreaper while it detaches: the new agent must not become a child of ours,
        # i.e. part of the job's tree that it will stop (its double fork re-parents it upward).
        procs.set_child_subreaper(False)
        try:
            daemon.launch(self.rd, reattach=True, by=f"the job's monitor (pid {os.getpid()})", why=why,
                          wait=False, env=env)
        finally:
            procs.set_child_subreaper(True)
        self.gone_since = None
        now = time.monotonic()
        if self.last_revival is not None and now - self.last_revival < 60:
            self.delay = min(MAX_DELAY, max(self.delay, 1.0) * 2)
        self.last_revival = now
        self.quiet_until = now + GRACE


def main(run_dir: str, argv: list[str]) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _noop)
    procs.set_child_subreaper()
    rd = RunDir(run_dir)
    guard = AgentGuard(rd, Options.from_spec(read_json(rd.spec) or {}).revive)
    started = time.time()
    try:
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    except OSError as exc:
        # "failed to start" is not "exited non-zero" (Ray's supervisor separates them)
        print(f"agent: could not start {argv[0]!r}: {exc}", file=sys.stderr, flush=True)
        atomic_write_json(rd.job_exit, {"pid": None, "exit_code": EXIT_SPAWN_FAILED, "signal": None,
                                        "signal_name": None, "spawn_error": str(exc), "started": started,
                                        "ended": time.time()})
        return EXIT_SPAWN_FAILED
    code = None
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break  # no children left: the job and every orphan it left are gone
        except InterruptedError:
            continue
        if pid == 0:
            guard.check()
            time.sleep(POLL)
            continue
        if pid == child.pid and code is None:
            info = procs.describe_status(status)
            info.update(pid=pid, started=started, ended=time.time())
            atomic_write_json(rd.job_exit, info)
            code = info["exit_code"] if info["exit_code"] is not None else 128 + info["signal"]
    # The job is over. With no agent left to read its exit, the run would never be finalized.
    if guard.base > 0 and not agent_alive(rd) and not finished(rd):
        guard.revive(0.0)
    return code if code is not None else EXIT_FAILURE
