"""The job's processes: start it under its monitor, re-attach to it, reap, read its exit
status, stop every process of it, and find the checkpoint a restart resumes from.

The supervisor (agent/supervisor.py) decides; this module only does. Process facts come
from agent/procs.py (identity that survives PID reuse, the /proc tree, signals).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from typing import Callable

from agent import procs
from agent import protocol
from agent.protocol import Checkpoint, atomic_write_json
from agent.rundir import RunDir, read_json

AGENT_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STEP_DIR = re.compile(r"^step_(\d+)$")


def agent_env() -> dict:
    """The agent package must be importable from any cwd (the daemon and monitor chdir)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (AGENT_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return env


def resume_argv(argv: list[str], checkpoint: str) -> list[str]:
    """The job's argv with its start decision replaced by --resume-from CHECKPOINT.

    An argv without a start flag (``bash start.sh``) is left as it is: appending a second
    start decision would conflict with the one inside the script, which reads
    $DFLASH_RESUME_FROM instead."""
    out: list[str] = []
    placed = False
    i = 0
    while i < len(argv):
        tok = argv[i]
        name = tok.split("=", 1)[0]
        if name in ("--from-scratch", "--resume-from", "--init-from"):
            if not placed:
                out += ["--resume-from", checkpoint]
                placed = True
            i += 1 if (name == "--from-scratch" or "=" in tok) else 2
            continue
        out.append(tok)
        i += 1
    return out


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, tok in enumerate(argv):
        if tok == flag and i + 1 < len(argv):
            return argv[i + 1]
        if tok.startswith(flag + "="):
            return tok.split("=", 1)[1]
    return None


def find_checkpoint(argv: list[str], cwd: str | None, announced: Checkpoint | None) -> str | None:
    """The run's latest checkpoint: the newest the trainer announced, or a newer
    OUTPUT/step_N/checkpoint.pt under the argv's --output-dir."""
    best: tuple[int, str] | None = None
    if announced and os.path.exists(announced.path):
        best = (announced.step, announced.path)
    out_dir = _flag_value(argv, "--output-dir")
    if out_dir:
        base = out_dir if os.path.isabs(out_dir) else os.path.join(cwd or "/", out_dir)
        try:
            for name in os.listdir(base):
                m = _STEP_DIR.match(name)
                path = os.path.join(base, name, "checkpoint.pt")
                if m and os.path.exists(path) and (best is None or int(m.group(1)) > best[0]):
                    best = (int(m.group(1)), path)
        except OSError:
            pass
    return best[1] if best else None


class JobProcess:
    """The job of one run: ``agent _monitor -- ARGV`` in a session of its own (the monitor
    is the job's parent and records its exit status in job.exit.json: agent/monitor.py)."""

    def __init__(self, rd: RunDir, run_id: str, cwd: str | None):
        self.rd = rd
        self.run_id = run_id
        self.cwd = cwd
        self.marker = {protocol.ENV_RUN_ID: run_id, protocol.ENV_RUN_DIR: rd.path}
        self.ident: procs.Identity | None = None  # the monitor
        self.child: subprocess.Popen | None = None  # set when this agent spawned it
        self.child_status: dict | None = None
        self.reaped: dict[int, dict] = {}  # orphans re-parented to us (subreaper) and reaped
        self.spawned: float | None = None  # time.time() of the current attempt's spawn

    @property
    def pid(self) -> int | None:
        return self.ident.pid if self.ident else None

    def alive(self) -> bool:
        return self.ident is not None and self.ident.alive()

    def spawn(self, argv: list[str], attempt: int, resume_from: str | None = None) -> None:
        try:
            os.unlink(self.rd.job_exit)
        except FileNotFoundError:
            pass
        env = agent_env()
        env.update({**self.marker, "PYTHONUNBUFFERED": "1"})
        if resume_from:
            env[protocol.ENV_RESUME_FROM] = resume_from
        # The job writes into files, never into a pipe of ours: it must outlive the agent.
        with open(self.rd.job_stdout, "ab") as out, open(self.rd.job_stderr, "ab") as err:
            self.child = subprocess.Popen(
                [sys.executable, "-m", "agent", "_monitor", "--run-dir", self.rd.path, "--", *argv],
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                cwd=self.cwd or "/", start_new_session=True)
        self.child_status = None
        self.ident = procs.Identity.of(self.child.pid, marker=self.run_id)
        self.spawned = time.time()
        atomic_write_json(self.rd.job_pid, dict(self.ident.to_json(), argv=argv, attempt=attempt, spawned=self.spawned,
                                                boot=procs.boot_marks()))

    def restarted(self) -> dict | None:
        """The container restart or node reboot since the job was spawned (every process of
        it died then), or None."""
        return procs.restart_since((read_json(self.rd.job_pid) or {}).get("boot"))

    def attach(self) -> bool:
        """Re-attach to the job recorded in job.pid; False when none was ever started."""
        data = read_json(self.rd.job_pid)
        if not data:
            return False
        self.ident = procs.Identity.from_json(data)
        self.spawned = float(data.get("spawned") or time.time())
        self.child = None
        return True

    def reap(self) -> None:
        for pid, status in procs.reap_children():
            info = procs.describe_status(status)
            if self.child is not None and pid == self.child.pid:
                self.child_status = info
            else:
                self.reaped[pid] = info

    def exit_status(self) -> dict | None:
        """The job's exit status once it has ended, else None."""
        info = read_json(self.rd.job_exit)
        if info is not None:
            return info
        if self.ident is None:
            return {"exit_code": None, "signal": None, "error": "no job"}
        if self.child_status is not None or not self.ident.alive():
            time.sleep(0.05)  # the monitor writes job.exit.json just before it exits
            info = read_json(self.rd.job_exit)
            if info is not None:
                return info
            return {"exit_code": None, "signal": (self.child_status or {}).get("signal"),
                    "error": "job monitor ended without recording the job's exit status",
                    "monitor": self.child_status}
        return None

    def tree(self) -> set[int]:
        """Every live process of the job: below the monitor, below us when we spawned it (as
        subreaper we inherit its orphans), and every process carrying the run's marker."""
        # only a monitor that is still ours: after a container restart its pid is another's
        roots = [self.ident.pid] if self.ident and (self.ident.alive() or self.ident.zombie_status() is not None) else []
        if self.child is not None:
            roots.append(os.getpid())
        return procs.descendants(roots, self.marker)

    def terminate(self, grace: float, why: str, waiting: Callable[[], None] = lambda: None) -> dict:
        """SIGTERM the job's group and every descendant, wait ``grace`` (calling ``waiting``
        meanwhile, so output keeps flowing into the stream), SIGKILL the rest, verify by
        scanning /proc that nothing carrying the run's marker or under its tree is left.
        SIGTERM to the group alone is not enough: torchrun workers run in their own sessions
        (docs/research/proxmox-and-supervision.md §2, §4.1 skypilot#3742, §4.5 ray#31274,
        §4.9 pytorch PR#113231)."""
        started = time.time()
        report: dict = {"why": why, "grace_s": grace, "signals": [], "survivors": []}
        monitor_pid = self.ident.pid if self.alive() else None
        tree = self.tree()
        if monitor_pid is not None:
            procs.killpg(monitor_pid, signal.SIGTERM)
            tree.add(monitor_pid)
        sent = procs.send(tree, signal.SIGTERM)
        report["signals"].append({"signal": "SIGTERM", "pids": sent, "ts": time.time()})
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            waiting()
            self.reap()
            if not {p for p in self.tree() if p != monitor_pid}:
                break
            time.sleep(0.1)
        for _ in range(5):
            workers = {p for p in self.tree() if p != monitor_pid}
            if not workers:
                break
            sent = procs.send(workers, signal.SIGKILL)
            report["signals"].append({"signal": "SIGKILL", "pids": sent, "ts": time.time()})
            procs.wait_gone(workers, 2.0)
        # The monitor leaves by itself once its last child is reaped; give it a moment to
        # record the job's status, then make sure.
        if monitor_pid is not None:
            deadline = time.monotonic() + 2.0
            while self.alive() and time.monotonic() < deadline:
                self.reap()
                time.sleep(0.05)
            if self.alive():
                procs.send([monitor_pid], signal.SIGKILL)
                report["signals"].append({"signal": "SIGKILL", "pids": [monitor_pid], "ts": time.time()})
                procs.wait_gone([monitor_pid], 2.0)
        self.reap()
        left = self.tree()
        if self.alive():
            left.add(self.ident.pid)
        report["survivors"] = sorted(left)
        report["graceful"] = not any(s["signal"] == "SIGKILL" for s in report["signals"])
        report["duration_s"] = round(time.time() - started, 3)
        return report
