"""The supervisor: the decisions of a run — start it, watch it, and on each outcome finish,
restart or stop it.

Shape borrowed from torch.distributed.elastic's agent, a small state machine that has proven
itself (torch/distributed/elastic/agent/server/api.py; docs/research/proxmox-and-supervision.md
§2): a state enum with a store that refuses to leave a terminal state, and a loop that is
monitor → restart while budget remains → stop, with shutdown in ``finally``. The job's
processes are agent/job.py's; what is known about them is agent/observe.py's; status.json
and result.json are the typed records of agent/protocol.py.
"""

from __future__ import annotations

import enum
import os
import time
import traceback
from dataclasses import dataclass, field

from agent.classify import Failure, root_cause
from agent.job import JobProcess, agent_env, find_checkpoint, resume_argv  # noqa: F401 (re-exported)
from agent.observe import Observer
from agent.options import Options
from agent.protocol import EXIT_STOPPED, FailureKind, RunResult, RunState, RunStatus, StreamKind
from agent.rundir import RunDir, read_json
from agent.state import StateStore
from agent.stream import StreamWriter

TICK = 0.2  # seconds between polls when nothing arrived
SLOW_EVERY = 0.5  # heartbeats, rank liveness, cgroup counter, stop request
STATUS_EVERY = 1.0
DEAD_RANK_GRACE = 2.0  # SIGTERM → SIGKILL after a failure with a dead rank (see on_failure)


class AgentExit(BaseException):
    """The agent was told to go (SIGTERM/SIGINT): leave the job running, re-attachable."""


class OutcomeKind(str, enum.Enum):
    EXIT = "exit"  # the job ended by itself
    FAILURE = "failure"  # a failure was seen and its evidence has settled
    STOP = "stop"  # a stop was requested


@dataclass
class Outcome:
    kind: OutcomeKind
    exit: dict | None = None
    failures: list[Failure] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.kind = OutcomeKind(self.kind)


class Supervisor:
    def __init__(self, run_dir: RunDir, spec: dict, reattach: bool = False, lock=None,
                 by: str | None = None, why: str | None = None):
        self.rd = run_dir
        self.spec = spec
        self.run_id = spec["run_id"]
        self.opts = Options.from_spec(spec)
        self.reattach = reattach
        self.reattach_by, self.reattach_why = by, why
        self.lock = lock
        self.stream = StreamWriter(run_dir.path)
        prev = RunStatus.load(run_dir.status) if reattach else RunStatus()
        self.store = StateStore(prev.state or RunState.STARTING, self._on_state)
        self.status = prev
        self.status.run_id, self.status.run_dir = self.run_id, run_dir.path
        self.restarts = prev.restarts
        self.history = prev.failures_history
        self.job = JobProcess(run_dir, self.run_id, spec.get("cwd"))
        self.obs = Observer(run_dir, self.stream, self.opts, self._accepting_failures, prev.checkpoint)
        self.stop_report: dict | None = None
        self.final_failure: Failure | None = None
        self._last_status_write = 0.0
        self.alerts = self._alert_watch()

    def _alert_watch(self):
        """The run's alerts (agent/alertwatch.py); None when they cannot be set up — a fault
        there is said in agent.log and never stops the supervision of the run."""
        from agent.alertwatch import AlertWatch

        try:
            return AlertWatch(self.rd.path, self.run_id, self.stream.append, lambda: self.stream.sync(force=True))
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            return None

    def poll_alerts(self) -> None:
        watch = getattr(self, "alerts", None)  # a state change may come before it is set up
        if watch is None:
            return
        try:
            watch.poll()
        except Exception:  # noqa: BLE001 - see _alert_watch
            traceback.print_exc()

    def served_checks(self) -> None:
        """Hand each save due a served check to agent/servedcheck.py (start it, or queue it
        behind the live one), and start a queued one whose predecessor ended. A fault here is
        said in the stream and agent.log and never touches the training."""
        from agent import servedcheck

        try:
            while self.obs.served_due:
                ev = self.obs.served_due.pop(0)
                req = {k: ev.get(k) for k in ("checkpoint", "step", "gpu", "threads", "vllm_python")}
                reply = servedcheck.request(self.rd, req)
                self.event("agent.served_check", step=ev.get("step"), **{k: reply.get(k) for k in (
                    "ok", "run_id", "queued", "error") if reply.get(k) is not None},
                    **({"superseded_step": reply["superseded"].get("step")} if reply.get("superseded") else {}))
            started = servedcheck.poll(self.rd)
            if started:
                self.event("agent.served_check", step=started.get("step"), ok=started.get("ok"),
                           **{k: started[k] for k in ("run_id", "error") if started.get(k)})
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            self.event("agent.served_check", ok=False, error=f"{type(exc).__name__}: {exc}")

    def _accepting_failures(self) -> bool:
        return self.store.state != RunState.STOPPING and not self.store.terminal

    # --- the stream and status.json ----------------------------------------------------------
    def event(self, name: str, **payload) -> None:
        self.stream.append([(StreamKind.EVENT.value, {"kind": name, "ts": time.time(), **payload}, None)])

    def _on_state(self, old: RunState, new: RunState) -> None:
        self.write_status(force=True)
        self.stream.append([(StreamKind.STATUS.value, self.status.to_json(), None)])
        self.stream.sync(force=True)
        self.poll_alerts()  # a run that ended is told at once, not at the next slow round

    def write_status(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and (not self.obs.changed or now - self._last_status_write < STATUS_EVERY):
            return
        st, seen = self.status, self.obs.seen
        st.state, st.updated, st.seq = self.store.state, time.time(), self.stream.seq
        st.restarts, st.agent_pid, st.job_pid = self.restarts, os.getpid(), self.job.pid
        st.ranks, st.failures_history, st.launch = seen.rank_health(time.time()), self.history, seen.launch
        st.phase = seen.phase or st.phase
        for key, value in seen.metrics.items():
            setattr(st, key, value)
        steady = seen.tput.current()
        if steady is not None:
            st.steady_tokens_per_s = round(steady, 1)
        if self.obs.gpu:
            st.gpus, st.gpu_state = self.obs.gpu.get("gpus"), self.obs.gpu.get("state")
            st.gpu_reason = self.obs.gpu.get("reason")
        st.checkpoint = self.obs.checkpoint
        st.progress = seen.progress or st.progress
        st.save(self.rd.status)
        self._last_status_write = now
        self.obs.changed = False

    # --- start ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self.reattach and self.job.attach() and (restart := self.job.restarted()):
            self.died_with_host(restart)
            return
        if self.reattach and self.job.ident is not None:
            previous = self.status.agent_pid
            record = {"ts": time.time(), "by": self.reattach_by or "agent start",
                      "why": self.reattach_why or f"its agent (pid {previous}) was gone",
                      "agent_pid": os.getpid(), "previous_agent_pid": previous, "seq": self.stream.seq}
            self.status.reattaches.append(record)
            self.obs.seen.started, self.obs.seen.launch = self.job.spawned, self.status.launch
            self.event("agent.reattached", agent_pid=os.getpid(), job_pid=self.job.pid,
                       job_alive=self.job.alive(), seq_before=self.stream.seq,
                       offsets=dict(self.stream.offsets), by=record["by"], why=record["why"])
            if self.store.state in (RunState.STARTING, RunState.RESTARTING) and self.job.alive():
                self.store.set(RunState.RUNNING)  # the previous agent died right after spawning
            return
        self.event("agent.started", agent_pid=os.getpid(), argv=self.spec["argv"], options=self.spec.get("options"))
        self.spawn(self.spec["argv"])
        self.store.set(RunState.RUNNING)

    def died_with_host(self, restart: dict) -> None:
        """The container restarted (or the node rebooted) under the run: every process of it
        is gone, nothing is to be stopped or restarted here; the run ends FAILED saying so, at
        its last completed step (without this, the first status after a restart said healthy)."""
        import datetime

        step = self.status.step
        at = restart.get("at")
        when = datetime.datetime.fromtimestamp(at, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC") \
            if at else "an unknown time"
        what = "the container restarted" if restart["kind"] == "container" else "the node rebooted"
        ckpt = self.obs.checkpoint
        reason = (f"{what} at {when}; the run died at step {step if step is not None else 0}"
                  + (f"; its last checkpoint is step {ckpt.step}: {ckpt.path}" if ckpt else "; it has no checkpoint"))
        self.status.host_restart = dict(restart, step=step)
        self.obs.seen.launch = self.status.launch
        self.obs.read_heartbeats()
        for rank, hb in self.obs.seen.heartbeats.items():
            self.obs.seen.dead_ranks[rank] = {"pid": hb.get("pid"), "gpu": hb.get("gpu"), "ts": time.time(),
                                              "status": None}
        kind = FailureKind.CONTAINER_RESTART if restart["kind"] == "container" else FailureKind.NODE_REBOOT
        self.final_failure = Failure(kind, reason, details=dict(restart, step=step))
        self.event("agent.reattached", agent_pid=os.getpid(), job_pid=self.job.pid, job_alive=False,
                   seq_before=self.stream.seq, offsets=dict(self.stream.offsets), by=self.reattach_by or "agent start",
                   why=reason)
        self.obs.announce(self.final_failure)
        self.status.exit = {"exit_code": None, "signal": None, "error": reason}
        self.history.append({"attempt": self.restarts, "root_cause": self.final_failure.to_json(),
                             "failures": [reason]})
        self.finish(RunState.FAILED)

    def spawn(self, argv: list[str], resume_from: str | None = None) -> None:
        self.job.spawn(argv, self.restarts, resume_from)
        self.obs.seen.started = self.job.spawned
        self.status.argv = argv

    # --- the loop ----------------------------------------------------------------------------
    def run(self, on_started=None) -> None:
        """monitor → restart while budget remains → stop; shutdown always runs."""
        try:
            self.start()
            if on_started:
                on_started(self)
            self.obs.sample_gpus(force=True)
            while not self.store.terminal:
                outcome = self.monitor()
                if outcome.kind == OutcomeKind.STOP:
                    self.do_stop()
                elif outcome.kind == OutcomeKind.EXIT:
                    self.on_exit(outcome)
                else:
                    self.on_failure(outcome.failures)
        except BaseException as exc:  # the agent's own bug must still end the run cleanly
            traceback.print_exc()
            if not self.store.terminal and not isinstance(exc, (KeyboardInterrupt, AgentExit)):
                self.final_failure = Failure(FailureKind.JOB_EXIT, f"agent error: {type(exc).__name__}: {exc}")
                self.stop_job(self.opts.kill_grace, why="agent error")
                self.finish(RunState.FAILED)
            raise
        finally:
            self.shutdown()

    def monitor(self) -> Outcome:
        next_slow = 0.0
        while True:
            n = self.obs.pump()
            now = time.monotonic()
            if now >= next_slow:
                next_slow = now + SLOW_EVERY
                self.job.reap()
                if read_json(self.rd.stop_request) is not None:
                    return Outcome(OutcomeKind.STOP)
                self.obs.read_heartbeats()
                self.obs.sample_memory(now)
                self.obs.check_ranks(self.job.reaped)
                self.obs.check_stalls(now)
                self.obs.check_startup(time.time())
                self.poll_alerts()
                self.served_checks()
                ex = self.job.exit_status()
                if ex is not None:
                    self.obs.drain()
                    return Outcome(OutcomeKind.EXIT, exit=ex, failures=self.obs.collect(self.job.reaped, ex))
            first = self.obs.seen.first_failure_at
            if first is not None and now - first >= self.opts.settle:
                return Outcome(OutcomeKind.FAILURE, failures=self.obs.collect(self.job.reaped))
            self.obs.sample_gpus()
            self.write_status()
            self.stream.sync()
            if n == 0:
                time.sleep(TICK)

    # --- decisions -----------------------------------------------------------------------------
    def on_exit(self, outcome: Outcome) -> None:
        ex = outcome.exit or {}
        self.event("agent.job_exit", **ex)
        self.status.exit = ex
        if ex.get("exit_code") == 0:
            self.finish(RunState.COMPLETED)
            return
        if ex.get("exit_code") == EXIT_STOPPED:  # stopped on request after a checkpoint
            self.store.set(RunState.STOPPING)
            self.finish(RunState.STOPPED)
            return
        # One record per death: when a rank's death (or another failure) already explains
        # the job's exit, the exit is its consequence, not a second failure (without this, a
        # one-rank run's kill -9 gave "rank slot 0" and "GPU 0" records for one death).
        self.on_failure(outcome.failures or [self.obs.job_exit_failure(ex)])

    def on_failure(self, failures: list[Failure]) -> None:
        cause = root_cause(failures) or Failure(FailureKind.JOB_EXIT, "the job failed for an unknown reason")
        # Announce the rank/exit failures that were only named at decision time.
        for f in failures:
            if f.kind in (FailureKind.RANK_EXIT, FailureKind.HOST_OOM, FailureKind.JOB_EXIT) \
                    and f not in self.obs.seen.failures:
                self.obs.announce(f)
        self.history.append({"attempt": self.restarts, "root_cause": cause.to_json(),
                             "failures": [f.reason for f in sorted(failures, key=lambda f: f.ts)]})
        self.status.last_error = cause.reason
        self.final_failure = cause
        # Fail fast: one failed or stalled rank stops every rank. With a rank dead, the rest
        # cannot agree on a stop and checkpoint (the trainer's stop is a collective), so the
        # grace for that is cut short: seen with 5+3 ranks, survivors blocked in sends to the
        # dead rank held the stop for the whole --kill-grace; a failed run must stop within 10 s.
        dead = bool(self.obs.seen.dead_ranks) or any(
            f.kind in (FailureKind.RANK_EXIT, FailureKind.HOST_OOM) for f in failures)
        grace = min(self.opts.kill_grace, DEAD_RANK_GRACE) if dead else self.opts.kill_grace
        self.stop_job(grace, why=f"failure: {cause.reason}")
        if self.store.state == RunState.STOPPING or self.store.terminal:
            return
        if self.restarts < self.opts.max_restarts:
            self.restart(cause)
        else:
            self.finish(RunState.FAILED)

    def restart(self, cause: Failure) -> None:
        self.store.set(RunState.RESTARTING)
        self.restarts += 1
        ckpt = find_checkpoint(self.spec["argv"], self.spec.get("cwd"), self.obs.checkpoint)
        argv = resume_argv(self.spec["argv"], ckpt) if ckpt else list(self.spec["argv"])
        self.event("agent.restart", attempt=self.restarts, max_restarts=self.opts.max_restarts,
                   checkpoint=ckpt, argv=argv, after=cause.reason)
        self.obs.new_attempt()
        try:
            for name in os.listdir(self.rd.heartbeat_dir):
                os.unlink(os.path.join(self.rd.heartbeat_dir, name))
        except FileNotFoundError:
            pass
        self.final_failure = None
        self.spawn(argv, resume_from=ckpt)
        self.store.set(RunState.RUNNING)

    def do_stop(self) -> None:
        req = read_json(self.rd.stop_request) or {}
        grace = float(req.get("grace", 30))
        self.store.set(RunState.STOPPING)
        self.event("agent.stop_requested", grace=grace, by=req.get("by"))
        self.stop_job(grace, why="stop requested")
        self.status.exit = self.job.exit_status() or {}
        self.finish(RunState.STOPPED)

    def stop_job(self, grace: float, why: str) -> dict:
        """Every process of the job stopped (agent/job.py), the output read to its end, and the
        stop report in the stream."""
        report = self.job.terminate(grace, why, waiting=self.obs.pump)
        self.obs.drain()
        self.stop_report = report
        self.event("agent.stop", **report)
        return report

    # --- the end -----------------------------------------------------------------------------
    def finish(self, state: RunState) -> None:
        if self.store.terminal:
            return
        cause = self.final_failure if state == RunState.FAILED else None
        reason = cause.reason if cause else {RunState.COMPLETED: "completed",
                                             RunState.STOPPED: "stopped on request"}.get(state, state.value)
        result = RunResult(run_id=self.run_id, state=state, ended=time.time(), reason=reason,
                           root_cause=cause.to_json() if cause else None, exit=self.status.exit,
                           restarts=self.restarts, stop=self.stop_report, failures_history=self.history,
                           checkpoint=self.obs.checkpoint)
        if cause:
            self.status.last_error = cause.reason
        self.status.reason = reason
        result.save(self.rd.result)
        self.store.set(state)  # writes status.json and the final status record
        self.next_served_check()

    def next_served_check(self) -> None:
        """A served-check run hands on to the check queued behind it (agent/servedcheck.py)."""
        from agent import servedcheck

        try:
            servedcheck.after_check(self.spec, self.run_id)
        except Exception:  # noqa: BLE001 - the queued check is lost, never this run's ending
            traceback.print_exc()

    def shutdown(self) -> None:
        """Always: nothing of a finished run keeps running; the stream is durable."""
        try:
            if self.store.terminal and self.job.tree():
                self.stop_job(2.0, why="leftover processes after the run ended")
                # the last record stays the status
                self.stream.append([(StreamKind.STATUS.value, self.status.to_json(), None)])
        finally:
            self.write_status(force=True)
            self.stream.close()
            self.obs.close()
