"""The supervisor: spawn the job, watch it, classify failures, stop it, restart it.

Shape borrowed from torch.distributed.elastic's agent (STYLE.md): a state enum with a store
that refuses to leave a terminal state, and a loop that is monitor → restart while budget
remains → stop, with shutdown in ``finally``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from agent import cgroup, gpus, procs
from agent import protocol as P
from agent.capture import LineTail
from agent.classify import (Failure, LineClassifier, StallMonitor, ThroughputMonitor, classify_event,
                            exit_failure, root_cause, split_rank)
from agent.protocol import RunState, StreamKind, atomic_write_json
from agent.rundir import RunDir, read_json
from agent.state import StateStore

TICK = 0.2  # seconds between polls when nothing arrived
SLOW_EVERY = 0.5  # heartbeats, rank liveness, cgroup counter, stop request
STATUS_EVERY = 1.0
AGENT_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class AgentExit(BaseException):
    """The agent was told to go (SIGTERM/SIGINT): leave the job running, re-attachable."""


@dataclass
class Options:
    gpu_interval: float = 10.0
    stall_timeout: float = 300.0
    baseline_tokens_per_s: float | None = None
    regression_fraction: float = 0.3
    max_restarts: int = 0
    settle_s: float = 1.5  # after the first failure, collect evidence this long before deciding
    kill_grace: float = 10.0  # SIGTERM → SIGKILL when the agent itself stops a failed run

    @classmethod
    def from_spec(cls, spec: dict) -> "Options":
        known = {k: v for k, v in (spec.get("options") or {}).items() if k in cls.__dataclass_fields__}
        return cls(**known)


@dataclass
class Outcome:
    kind: str  # "exit" | "failure" | "stop"
    exit: dict | None = None
    failures: list[Failure] = field(default_factory=list)


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


_STEP_DIR = re.compile(r"^step_(\d+)$")


class Supervisor:
    def __init__(self, run_dir: RunDir, spec: dict, reattach: bool = False, lock=None):
        from agent.stream import StreamWriter

        self.rd = run_dir
        self.spec = spec
        self.run_id = spec["run_id"]
        self.opts = Options.from_spec(spec)
        self.reattach = reattach
        self.lock = lock
        self.stream = StreamWriter(run_dir.path)
        prev = read_json(run_dir.status) or {}
        state = RunState(prev.get("state", RunState.STARTING.value)) if reattach else RunState.STARTING
        self.store = StateStore(state, self._on_state)
        self.restarts = int(prev.get("restarts", 0)) if reattach else 0
        self.tails = {
            "stdout": LineTail(run_dir.job_stdout, self.stream.offsets.get("stdout", 0)),
            "stderr": LineTail(run_dir.job_stderr, self.stream.offsets.get("stderr", 0)),
            "events": LineTail(run_dir.events, self.stream.offsets.get("events", 0)),
        }
        self.output_log = open(run_dir.output_log, "a", encoding="utf-8")
        self.marker = {P.ENV_RUN_ID: self.run_id, P.ENV_RUN_DIR: run_dir.path}
        self.oom_path = cgroup.memory_events_path()
        self._reset_attempt()
        self.status = dict(prev) if reattach else {}
        self.status.update(run_id=self.run_id, run_dir=run_dir.path, restarts=self.restarts)
        self.latest_ckpt: tuple[int, str] | None = tuple(prev["checkpoint"]) if prev.get("checkpoint") else None
        self.job: procs.Identity | None = None
        self.child: subprocess.Popen | None = None
        self.child_status: dict | None = None
        self.reaped: dict[int, dict] = {}
        self.history: list[dict] = list(prev.get("failures_history", [])) if reattach else []
        self.stop_report: dict | None = None
        self.final_failure: Failure | None = None
        self._last_gpu = 0.0
        self._last_gpu_payload = None
        self._last_status_write = 0.0
        self._status_dirty = True

    # --- attempt-scoped state ---------------------------------------------------------------
    def _reset_attempt(self) -> None:
        self.classifier = LineClassifier()
        self.stall = StallMonitor(self.opts.stall_timeout)
        self.tput = ThroughputMonitor(self.opts.baseline_tokens_per_s, self.opts.regression_fraction)
        self.failures: list[Failure] = []
        self.first_failure_at: float | None = None
        self.heartbeats: dict[int, dict] = {}
        self.rank_ids: dict[int, procs.Identity] = {}
        self.dead_ranks: dict[int, dict] = {}
        self.done_ranks: set = set()
        self.oom_base = cgroup.oom_kills(self.oom_path) or 0
        self.phase: str | None = None

    # --- stream helpers --------------------------------------------------------------------
    def emit(self, kind: StreamKind, payload: dict) -> None:
        self.stream.append([(kind.value, payload, None)])

    def event(self, name: str, **payload) -> None:
        self.emit(StreamKind.EVENT, {"kind": name, "ts": time.time(), **payload})

    def _on_state(self, old: RunState, new: RunState) -> None:
        self.status["state"] = new.value
        self.write_status(force=True)
        self.emit(StreamKind.STATUS, dict(self.status))
        self.stream.sync(force=True)

    def write_status(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and (not self._status_dirty or now - self._last_status_write < STATUS_EVERY):
            return
        self.status.update(state=self.store.state.value, updated=time.time(), seq=self.stream.seq,
                           restarts=self.restarts, agent_pid=os.getpid(),
                           job_pid=self.job.pid if self.job else None,
                           ranks=self._rank_health(), failures_history=self.history)
        if self.latest_ckpt:
            self.status["checkpoint"] = list(self.latest_ckpt)
        atomic_write_json(self.rd.status, self.status)
        self._last_status_write = now
        self._status_dirty = False

    def _rank_health(self) -> dict:
        now = time.time()
        out = {}
        for rank, hb in sorted(self.heartbeats.items()):
            health = "dead" if rank in self.dead_ranks else "ok"
            if rank in self.done_ranks:
                health = "done"
            out[str(rank)] = {"step": hb.get("step"), "pid": hb.get("pid"), "gpu": hb.get("gpu"),
                              "role": hb.get("role"), "heartbeat_age_s": round(now - float(hb.get("ts") or now), 1),
                              "health": health}
        return out

    # --- spawn / attach -----------------------------------------------------------------------
    def spawn(self, argv: list[str], resume_from: str | None = None) -> None:
        for name in (P.JOB_EXIT,):
            try:
                os.unlink(os.path.join(self.rd.path, name))
            except FileNotFoundError:
                pass
        env = agent_env()
        env.update({P.ENV_RUN_DIR: self.rd.path, P.ENV_RUN_ID: self.run_id, "PYTHONUNBUFFERED": "1"})
        if resume_from:
            env[P.ENV_RESUME_FROM] = resume_from
        # The job writes into files, never into a pipe of ours: it must outlive the agent.
        with open(self.rd.job_stdout, "ab") as out, open(self.rd.job_stderr, "ab") as err:
            self.child = subprocess.Popen(
                [sys.executable, "-m", "agent", "_monitor", "--run-dir", self.rd.path, "--", *argv],
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                cwd=self.spec.get("cwd") or "/", start_new_session=True)
        self.child_status = None
        self.job = procs.Identity.of(self.child.pid, marker=self.run_id)
        atomic_write_json(self.rd.job_pid, dict(self.job.to_json(), argv=argv, attempt=self.restarts))
        self.status["argv"] = argv

    def attach(self) -> bool:
        """Re-attach to the job recorded in job.pid; False when none was ever started."""
        data = read_json(self.rd.job_pid)
        if not data:
            return False
        self.job = procs.Identity.from_json(data)
        self.child = None
        return True

    def start(self) -> None:
        if self.reattach and self.attach():
            self.event("agent.reattached", agent_pid=os.getpid(), job_pid=self.job.pid,
                       job_alive=self.job.alive(), seq_before=self.stream.seq,
                       offsets=dict(self.stream.offsets))
            if self.store.state in (RunState.STARTING, RunState.RESTARTING) and self.job.alive():
                self.store.set(RunState.RUNNING)  # the previous agent died right after spawning
            return
        self.event("agent.started", agent_pid=os.getpid(), argv=self.spec["argv"], options=self.spec.get("options"))
        self.spawn(self.spec["argv"])
        self.store.set(RunState.RUNNING)

    # --- reading ---------------------------------------------------------------------------
    def drain(self) -> None:
        """Everything the job wrote, to the end of each file as it is now (after the job
        has ended). Bounded by today's sizes: an orphan still printing cannot hold us here."""
        target = {name: tail.size() for name, tail in self.tails.items()}
        while self.pump(final=True) and any(self.tails[n].offset < size for n, size in target.items()):
            pass

    def pump(self, final: bool = False) -> int:
        """Copy new output lines and trainer events into the stream; classify them.
        One bounded read per source (so a flood cannot starve the other checks)."""
        records = []
        log_lines = []
        gpu_of_rank = {r: hb.get("gpu") for r, hb in self.heartbeats.items()}
        now = time.time()
        stamp = f"{now:.3f}"
        LOG = StreamKind.LOG.value
        for name in ("stdout", "stderr"):
            for line, end in self.tails[name].read(final=final):
                rank, body = split_rank(line)
                records.append((LOG, {"stream": name, "line": line, "rank": rank}, (name, end)))
                log_lines.append(f"{stamp} [{name}] {line}\n")
                failure = self.classifier.feed(line, rank, gpu_of_rank, now, body)
                if failure:
                    self.add_failure(failure, defer_event=records)
        events = []
        for line, end in self.tails["events"].read(final=final):
            try:
                ev = json.loads(line)
            except ValueError:
                ev = None
            if not isinstance(ev, dict):
                records.append((StreamKind.EVENT.value, {"kind": "unparsed", "line": line}, ("events", end)))
                continue
            records.append((StreamKind.EVENT.value, ev, ("events", end)))
            events.append(ev)
        if records:
            self.stream.append(records, ts=now)
        if log_lines:
            self.output_log.write("".join(log_lines))
            self.output_log.flush()
        for ev in events:
            self.on_event(ev)
        return len(records)

    def on_event(self, ev: dict) -> None:
        kind = ev.get("kind")
        self._status_dirty = True
        if kind == "phase":
            self.phase = ev.get("phase")
            self.status["phase"] = self.phase
            if self.phase == "done":
                self.done_ranks.add(ev.get("rank"))
        elif kind == "step":
            for key in ("step", "total_steps", "loss", "tokens_per_s", "epoch", "lr"):
                if key in ev:
                    self.status["total" if key == "total_steps" else key] = ev[key]
            failure = self.tput.feed(ev)
            if self.tput.current() is not None:
                self.status["steady_tokens_per_s"] = round(self.tput.current(), 1)
            if failure:
                self.add_failure(failure)
        elif kind == "checkpoint" and ev.get("path"):
            step = int(ev.get("step") or 0)
            if self.latest_ckpt is None or step >= self.latest_ckpt[0]:
                self.latest_ckpt = (step, str(ev["path"]))
        elif kind == "error":
            failure = classify_event(ev)
            if failure:
                self.add_failure(failure)

    def add_failure(self, failure: Failure, defer_event: list | None = None) -> None:
        if self.store.state in (RunState.STOPPING,) or self.store.terminal:
            return
        self.failures.append(failure)
        if self.first_failure_at is None:
            self.first_failure_at = time.monotonic()
        payload = {"kind": "agent.failure", "failure": failure.kind, **failure.to_json()}
        payload["kind"] = "agent.failure"
        if defer_event is not None:
            defer_event.append((StreamKind.EVENT.value, payload, None))
        else:
            self.emit(StreamKind.EVENT, payload)

    # --- periodic checks ---------------------------------------------------------------------
    def read_heartbeats(self) -> None:
        try:
            names = os.listdir(self.rd.heartbeat_dir)
        except FileNotFoundError:
            return
        for name in names:
            if not name.startswith("rank-"):
                continue
            hb = read_json(os.path.join(self.rd.heartbeat_dir, name))
            if not isinstance(hb, dict):
                continue  # torn or replaced mid-read: next round
            try:
                rank = int(hb.get("rank", name[5:]))
            except ValueError:
                continue
            if self.heartbeats.get(rank) != hb:
                self._status_dirty = True
            self.heartbeats[rank] = hb

    def check_ranks(self) -> None:
        """A rank whose heartbeat pid is gone (or a zombie) has died."""
        for rank, hb in self.heartbeats.items():
            pid = hb.get("pid")
            if not isinstance(pid, int) or rank in self.dead_ranks:
                continue
            ident = self.rank_ids.get(rank)
            if ident is None or ident.pid != pid:
                try:
                    ident = self.rank_ids[rank] = procs.Identity.of(pid)
                except ProcessLookupError:
                    ident = self.rank_ids[rank] = procs.Identity(pid, -1, procs.boot_id())
            if ident.alive():
                continue
            status = None
            zs = ident.zombie_status()
            if zs is not None:
                status = procs.describe_status(zs)
            elif pid in self.reaped:
                status = self.reaped[pid]
            self.dead_ranks[rank] = {"pid": pid, "gpu": hb.get("gpu"), "ts": time.time(), "status": status}
            self._status_dirty = True
            if hb.get("state") in ("done", "stopped"):
                self.done_ranks.add(rank)  # the trainer's last heartbeat says it left cleanly
            if rank in self.done_ranks or None in self.done_ranks or (status and status.get("exit_code") == 0):
                continue
            if self.store.state == RunState.STOPPING:
                continue
            if self.first_failure_at is None:
                self.first_failure_at = time.monotonic()

    def rank_exit_failures(self, oom_delta: int) -> list[Failure]:
        out = []
        for rank, dead in sorted(self.dead_ranks.items()):
            if rank in self.done_ranks or None in self.done_ranks:
                continue
            status = dead["status"] or self.classifier.exit_by_pid.get(dead["pid"]) \
                or self.classifier.exit_by_rank.get(rank) or self.reaped.get(dead["pid"])
            if status and status.get("exit_code") == 0:
                continue
            f = exit_failure(rank, dead["pid"], dead["gpu"], status, self.classifier.had_traceback(rank),
                             self.classifier.evidence(rank), oom_delta)
            f.ts = dead["ts"]
            f.details["last_heartbeat"] = self.heartbeats.get(rank, {}).get("ts")
            out.append(f)
        return out

    def oom_delta(self) -> int:
        now = cgroup.oom_kills(self.oom_path)
        return max(0, (now or 0) - self.oom_base) if now is not None else 0

    def reap(self) -> None:
        for pid, status in procs.reap_children():
            info = procs.describe_status(status)
            if self.child is not None and pid == self.child.pid:
                self.child_status = info
            else:
                self.reaped[pid] = info

    def job_exit(self) -> dict | None:
        """The job's exit status once it has ended, else None."""
        info = read_json(self.rd.job_exit)
        if info is not None:
            return info
        if self.job is None:
            return {"exit_code": None, "signal": None, "error": "no job"}
        if self.child_status is not None or not self.job.alive():
            time.sleep(0.05)  # the monitor writes job.exit.json just before it exits
            info = read_json(self.rd.job_exit)
            if info is not None:
                return info
            return {"exit_code": None, "signal": (self.child_status or {}).get("signal"),
                    "error": "job monitor ended without recording the job's exit status",
                    "monitor": self.child_status}
        return None

    def sample_gpus(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_gpu < self.opts.gpu_interval:
            return
        self._last_gpu = now
        sample = gpus.sample()
        self.status["gpus"] = sample.get("gpus")
        self.status["gpu_state"] = sample.get("state")
        if sample.get("state") == "no GPU":
            # said once (and again if the reason changes), not every interval
            if self._last_gpu_payload == sample.get("reason"):
                return
            self._last_gpu_payload = sample.get("reason")
            self.status["gpu_reason"] = sample.get("reason")
        self.emit(StreamKind.GPU, sample)

    def stop_requested(self) -> dict | None:
        return read_json(self.rd.stop_request)

    # --- the loop ----------------------------------------------------------------------------
    def monitor(self) -> Outcome:
        next_slow = 0.0
        while True:
            n = self.pump()
            now = time.monotonic()
            if now >= next_slow:
                next_slow = now + SLOW_EVERY
                self.reap()
                req = self.stop_requested()
                if req is not None:
                    return Outcome("stop", exit=None)
                self.read_heartbeats()
                self.check_ranks()
                self.stall.update(self.heartbeats, now)
                for f in self.stall.check(self.heartbeats, now, self.phase == "training"):
                    if not any(x.kind == "rank_stall" and x.rank == f.rank for x in self.failures):
                        self.add_failure(f)
                ex = self.job_exit()
                if ex is not None:
                    self.drain()
                    return Outcome("exit", exit=ex, failures=self._collect())
            if self.first_failure_at is not None and now - self.first_failure_at >= self.opts.settle_s:
                return Outcome("failure", failures=self._collect())
            self.sample_gpus()
            self.write_status()
            self.stream.sync()
            if n == 0:
                time.sleep(TICK)

    def _collect(self) -> list[Failure]:
        return self.failures + self.rank_exit_failures(self.oom_delta())

    def run(self, on_started=None) -> None:
        """monitor → restart while budget remains → stop; shutdown always runs."""
        try:
            self.start()
            if on_started:
                on_started(self)
            self.sample_gpus(force=True)
            while not self.store.terminal:
                outcome = self.monitor()
                if outcome.kind == "stop":
                    self.do_stop()
                elif outcome.kind == "exit":
                    self.on_exit(outcome)
                else:
                    self.on_failure(outcome.failures)
        except BaseException as exc:  # the agent's own bug must still end the run cleanly
            import traceback

            traceback.print_exc()
            if not self.store.terminal and not isinstance(exc, (KeyboardInterrupt, AgentExit)):
                self.final_failure = Failure("job_exit", f"agent error: {type(exc).__name__}: {exc}")
                self.terminate(self.opts.kill_grace, why="agent error")
                self.finish(RunState.FAILED)
            raise
        finally:
            self.shutdown()

    def on_exit(self, outcome: Outcome) -> None:
        ex = outcome.exit or {}
        code, sig = ex.get("exit_code"), ex.get("signal")
        self.event("agent.job_exit", **ex)
        self.status["exit"] = ex
        if code == 0:
            self.finish(RunState.COMPLETED)
            return
        if code == 75:  # trainer.flags.EXIT_STOPPED: stopped on request after a checkpoint
            self.store.set(RunState.STOPPING)
            self.finish(RunState.STOPPED)
            return
        failures = list(outcome.failures)
        failures.append(self._job_exit_failure(ex))
        self.on_failure(failures)

    def _job_exit_failure(self, ex: dict) -> Failure:
        rank = 0 if len(self.heartbeats) <= 1 and self.heartbeats else None
        had_tb = self.classifier.had_traceback(None) or any(self.classifier.had_traceback(r) for r in self.heartbeats)
        what = "the job" if rank is None else None
        f = exit_failure(rank, ex.get("pid"), self.heartbeats.get(rank, {}).get("gpu") if rank is not None else None,
                         ex, had_tb, self.classifier.evidence(None) or self.classifier.evidence(rank),
                         self.oom_delta(), what)
        if ex.get("spawn_error"):
            f.kind, f.reason = "job_exit", f"failed to start: {ex['spawn_error']}"
        if rank is None and f.kind == "rank_exit":
            f.kind = "job_exit"
        return f

    def on_failure(self, failures: list[Failure]) -> None:
        cause = root_cause(failures)
        if cause is None:
            cause = Failure("job_exit", "the job failed for an unknown reason")
        # Emit the rank/exit failures that were only named at decision time.
        for f in failures:
            if f.kind in ("rank_exit", "host_oom", "job_exit") and f not in self.failures:
                self.emit(StreamKind.EVENT, {**f.to_json(), "kind": "agent.failure", "failure": f.kind})
        self.history.append({"attempt": self.restarts, "root_cause": cause.to_json(),
                             "failures": [f.reason for f in sorted(failures, key=lambda f: f.ts)]})
        self.status["last_error"] = cause.reason
        self.final_failure = cause
        # fail fast: one failed or stalled rank stops every rank
        self.terminate(self.opts.kill_grace, why=f"failure: {cause.reason}")
        if self.store.state == RunState.STOPPING or self.store.terminal:
            return
        if self.restarts < self.opts.max_restarts:
            self.restart(cause)
        else:
            self.finish(RunState.FAILED)

    def restart(self, cause: Failure) -> None:
        self.store.set(RunState.RESTARTING)
        self.restarts += 1
        ckpt = self.find_checkpoint()
        argv = resume_argv(self.spec["argv"], ckpt) if ckpt else list(self.spec["argv"])
        self.event("agent.restart", attempt=self.restarts, max_restarts=self.opts.max_restarts,
                   checkpoint=ckpt, argv=argv, after=cause.reason)
        self._reset_attempt()
        try:
            for name in os.listdir(self.rd.heartbeat_dir):
                os.unlink(os.path.join(self.rd.heartbeat_dir, name))
        except FileNotFoundError:
            pass
        self.final_failure = None
        self.spawn(argv, resume_from=ckpt)
        self.store.set(RunState.RUNNING)

    def find_checkpoint(self) -> str | None:
        """Latest checkpoint of this run: from its checkpoint events, else OUTPUT/step_N/."""
        best: tuple[int, str] | None = None
        if self.latest_ckpt and os.path.exists(self.latest_ckpt[1]):
            best = self.latest_ckpt
        out_dir = _flag_value(self.spec["argv"], "--output-dir")
        if out_dir:
            base = out_dir if os.path.isabs(out_dir) else os.path.join(self.spec.get("cwd") or "/", out_dir)
            try:
                for name in os.listdir(base):
                    m = _STEP_DIR.match(name)
                    path = os.path.join(base, name, "checkpoint.pt")
                    if m and os.path.exists(path) and (best is None or int(m.group(1)) > best[0]):
                        best = (int(m.group(1)), path)
            except OSError:
                pass
        return best[1] if best else None

    # --- stopping ------------------------------------------------------------------------------
    def do_stop(self) -> None:
        req = self.stop_requested() or {}
        grace = float(req.get("grace", 30))
        self.store.set(RunState.STOPPING)
        self.event("agent.stop_requested", grace=grace, by=req.get("by"))
        self.terminate(grace, why="stop requested")
        ex = self.job_exit() or {}
        self.status["exit"] = ex
        self.finish(RunState.STOPPED)

    def _tree(self) -> set[int]:
        roots = [self.job.pid] if self.job else []
        if self.child is not None:
            roots.append(os.getpid())  # as subreaper we inherit the job's orphans
        return procs.descendants(roots, self.marker)

    def terminate(self, grace: float, why: str) -> dict:
        """SIGTERM the job's group and every descendant, wait ``grace``, SIGKILL the rest,
        verify by scanning /proc that nothing carrying the run's marker or under its tree is
        left. SIGTERM to the group alone is not enough: torchrun workers run in their own
        sessions (research §2, §4.1 skypilot#3742, §4.5 ray#31274, §4.9 pytorch PR#113231)."""
        started = time.time()
        report: dict = {"why": why, "grace_s": grace, "signals": [], "survivors": []}
        monitor_pid = self.job.pid if self.job and self.job.alive() else None
        tree = self._tree()
        if self.job and self.job.alive():
            procs.killpg(self.job.pid, signal.SIGTERM)
            tree.add(self.job.pid)
        sent = procs.send(tree, signal.SIGTERM)
        report["signals"].append({"signal": "SIGTERM", "pids": sent, "ts": time.time()})
        deadline = time.monotonic() + grace
        workers = set(tree) - {monitor_pid}
        while time.monotonic() < deadline:
            self.pump()
            self.reap()
            workers = {p for p in self._tree() if p != monitor_pid}
            if not workers:
                break
            time.sleep(0.1)
        for attempt in range(5):
            workers = {p for p in self._tree() if p != monitor_pid}
            if not workers:
                break
            sent = procs.send(workers, signal.SIGKILL)
            report["signals"].append({"signal": "SIGKILL", "pids": sent, "ts": time.time()})
            procs.wait_gone(workers, 2.0)
        # The monitor leaves by itself once its last child is reaped; give it a moment to
        # record the job's status, then make sure.
        if monitor_pid is not None:
            deadline = time.monotonic() + 2.0
            while self.job.alive() and time.monotonic() < deadline:
                self.reap()
                time.sleep(0.05)
            if self.job.alive():
                procs.send([monitor_pid], signal.SIGKILL)
                report["signals"].append({"signal": "SIGKILL", "pids": [monitor_pid], "ts": time.time()})
                procs.wait_gone([monitor_pid], 2.0)
        self.reap()
        left = self._tree()
        if self.job and self.job.alive():
            left.add(self.job.pid)
        report["survivors"] = sorted(left)
        report["graceful"] = not any(s["signal"] == "SIGKILL" for s in report["signals"])
        report["duration_s"] = round(time.time() - started, 3)
        self.drain()
        self.stop_report = report
        self.event("agent.stop", **report)
        return report

    # --- the end -----------------------------------------------------------------------------
    def finish(self, state: RunState) -> None:
        if self.store.terminal:
            return
        cause = self.final_failure if state == RunState.FAILED else None
        result = {
            "run_id": self.run_id, "state": state.value, "ended": time.time(),
            "reason": cause.reason if cause else {RunState.COMPLETED: "completed",
                                                  RunState.STOPPED: "stopped on request"}.get(state, state.value),
            "root_cause": cause.to_json() if cause else None,
            "exit": self.status.get("exit"), "restarts": self.restarts, "stop": self.stop_report,
            "failures_history": self.history, "checkpoint": self.latest_ckpt[1] if self.latest_ckpt else None,
        }
        if cause:
            self.status["last_error"] = cause.reason
        self.status["reason"] = result["reason"]
        atomic_write_json(self.rd.result, result)
        self.store.set(state)  # writes status.json and the final status record

    def shutdown(self) -> None:
        """Always: nothing of a finished run keeps running; the stream is durable."""
        try:
            if self.store.terminal and self._tree():
                self.terminate(2.0, why="leftover processes after the run ended")
                self.emit(StreamKind.STATUS, dict(self.status))  # the last record stays the status
        finally:
            self.write_status(force=True)
            self.stream.close()
            self.output_log.close()
            for tail in self.tails.values():
                tail.close()
