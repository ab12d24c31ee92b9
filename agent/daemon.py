"""Detaching: the agent that supervises a run must outlive the SSH session (`pct exec`)
that started it, so `agent start` double-forks, the middle process calls setsid(), and the
grandchild execs a fresh interpreter as the daemon (`python3 -m agent _daemon`) with stdin
on /dev/null and stdout/stderr on agent.log: nothing of the caller's channel stays open,
so the caller's `pct exec` returns at once (docs/research/proxmox-and-supervision.md §1.1:
no signal forwarding, daemonize long jobs). The daemon reports "started" (or the error)
back through a pipe.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time

from agent.protocol import atomic_write_json
from agent.rundir import Lock, RunDir, read_json


def launch(rd: RunDir, reattach: bool, timeout: float = 60.0, *, by: str | None = None, why: str | None = None,
           wait: bool = True, env: dict | None = None) -> dict:
    """Start the daemon for ``rd``; its first report ({"ok": ...}) or an error record.

    ``by``/``why``: who re-attaches and why (recorded in status.json's ``reattaches``).
    ``wait=False``: return once the daemon is detached, without its report (the job's
    monitor, which must go back to reaping). ``env``: the daemon's environment."""
    # Here, not at the top: `ctl status` and `ctl tail` import this module for revive_if_gone
    # and seldom start an agent; its process machinery (ctypes, subprocess) is their start-up.
    from agent.job import agent_env

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # first child
        try:
            os.close(r)
            os.setsid()
            if os.fork() > 0:
                os._exit(0)
            # grandchild: not a session leader, so it can never acquire a controlling tty
            os.chdir(rd.path)
            log = os.open(rd.agent_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.closerange(3, w)
            os.closerange(w + 1, 65536)
            os.set_inheritable(w, True)
            argv = [sys.executable, "-m", "agent", "_daemon", "--run-dir", rd.path, "--ready-fd", str(w)]
            if reattach:
                argv.append("--reattach")
            argv += [*(["--by", by] if by else []), *(["--why", why] if why else [])]
            os.execve(sys.executable, argv, env or agent_env())
        except BaseException:  # noqa: BLE001 - never return into the caller's code in a child
            os._exit(127)
    os.close(w)
    os.waitpid(pid, 0)
    if not wait:
        os.close(r)
        return {"ok": True, "detached": True}
    data = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            chunk = os.read(r, 65536)
            if not chunk:
                break
            data += chunk
            if b"\n" in data:
                break
    finally:
        os.close(r)
    if not data.strip():
        tail = ""
        try:
            with open(rd.agent_log, "rb") as fh:
                fh.seek(0, 2)
                fh.seek(max(0, fh.tell() - 2000))
                tail = fh.read().decode("utf-8", "replace")
        except OSError:
            pass
        return {"ok": False, "error": f"the agent daemon did not report within {timeout:.0f} s; "
                                      f"see {rd.agent_log}", "agent_log_tail": tail}
    return json.loads(data.splitlines()[0])


def revive_if_gone(rd: RunDir, by: str, why: str | None = None) -> dict | None:
    """An automatic re-attach (`ctl status`, `ctl tail`): when the run has not ended and no
    agent holds its lock, start one that re-attaches, and return its report; None when an
    agent is there, the run has ended, or the run's --revive is 0 (re-attach by hand)."""
    from agent.options import Options
    from agent.rundir import agent_alive

    from agent.rundir import finished

    spec = read_json(rd.spec)
    if not spec or agent_alive(rd) or finished(rd) or Options.from_spec(spec).revive <= 0:
        return None
    previous = (read_json(rd.agent_pid) or {}).get("pid")
    return launch(rd, reattach=True, by=by, why=why or f"{by} found no agent supervising the run "
                                                      f"(its last agent was pid {previous})")


def _raise_exit(signum, frame):  # noqa: ARG001
    from agent.supervisor import AgentExit

    raise AgentExit(f"signal {signum}")


def main(run_dir: str, ready_fd: int | None, reattach: bool, by: str | None = None, why: str | None = None) -> int:
    from agent import procs
    from agent.supervisor import AgentExit, Supervisor

    rd = RunDir(run_dir)

    def ready(obj: dict) -> None:
        nonlocal ready_fd
        if ready_fd is None:
            return
        try:
            os.write(ready_fd, (json.dumps(obj) + "\n").encode())
        except BrokenPipeError:
            pass  # started by one who does not wait for the report (the job's monitor)
        finally:
            os.close(ready_fd)
            ready_fd = None

    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _raise_exit)
    signal.signal(signal.SIGINT, _raise_exit)
    procs.set_child_subreaper()
    lock = Lock(rd.agent_lock)
    if not lock.acquire(timeout=5.0):
        ready({"ok": False, "error": f"another agent is supervising {rd.path} (it holds {rd.agent_lock})"})
        return 1
    spec = read_json(rd.spec)
    if not spec:
        ready({"ok": False, "error": f"{rd.spec} is missing or unreadable"})
        return 1
    from agent.rundir import finished

    if reattach and finished(rd):
        ready({"ok": False, "error": f"run {spec.get('run_id')} in {rd.path} has ended; its records are final"})
        lock.release()
        return 1
    from agent.protocol import CorruptFile

    atomic_write_json(rd.agent_pid, procs.Identity.of(os.getpid(), marker=spec["run_id"]).to_json())
    try:
        sup = Supervisor(rd, spec, reattach=reattach, lock=lock, by=by, why=why)
    except CorruptFile as exc:
        ready({"ok": False, "error": str(exc)})
        lock.release()
        return 1

    def started(s: Supervisor) -> None:
        ready({"ok": True, "run_id": s.run_id, "run_dir": rd.path, "agent_pid": os.getpid(),
               "job_pid": s.job.pid if s.job else None, "state": s.store.state.value,
               "reattached": reattach, "seq": s.stream.seq})

    try:
        sup.run(on_started=started)
    except AgentExit:
        return 0
    finally:
        if ready_fd is not None:
            ready({"ok": False, "error": f"the agent failed while starting; see {rd.agent_log}"})
        lock.release()
        _finish_alerts(sup)
    return 0


def _finish_alerts(sup) -> None:
    """After the run ended (and the stream is let go), keep delivering what is still pending
    for a while (a receiver that is down now may be back); what is left then is `ctl watch`'s.
    Killed by a signal (a stop of the agent itself), it leaves at once: its successor delivers."""
    from agent.alertwatch import LINGER_S

    if sup.alerts is None:
        return
    sup.alerts.close(linger_s=LINGER_S if sup.store.terminal else 0.0)
