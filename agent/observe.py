"""Observation: everything the agent learns about a running job, gathered into one
:class:`Observation` per attempt — output lines and trainer events copied into the stream
and classified, heartbeats, rank deaths and stalls, GPU samples — for the supervisor
(agent/supervisor.py) to decide on.

Reads files, writes the stream and output.log; never signals a process.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

from agent import cgroup, gpus, procs
from agent.capture import LineTail
from agent.classify import (Failure, LineClassifier, StallMonitor, ThroughputMonitor, classify_event,
                            exit_failure, split_rank)
from agent.options import Options
from agent.protocol import EXIT_USAGE, PROGRESS_META, Checkpoint, FailureKind, RankHealth, StreamKind
from agent.rundir import RunDir, read_json
from agent.stream import StreamWriter

METRICS = {"step": "step", "total_steps": "total", "loss": "loss", "tokens_per_s": "tokens_per_s",
           "epoch": "epoch", "lr": "lr"}  # step event key → RunStatus field


@dataclass
class Observation:
    """What one attempt of the job has shown so far."""

    classifier: LineClassifier
    stall: StallMonitor
    tput: ThroughputMonitor
    memory_base: cgroup.MemorySample | None = None  # the OOM counters when the attempt began
    # (time.monotonic(), sample) of the last few seconds: the kernel's host-wide counter is
    # judged over the moments around a death, not the whole attempt (another container's OOM
    # kill an hour earlier is not evidence about this SIGKILL)
    memory_recent: list = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    first_failure_at: float | None = None  # time.monotonic() of the first failure
    heartbeats: dict[int, dict] = field(default_factory=dict)
    rank_ids: dict[int, procs.Identity] = field(default_factory=dict)
    dead_ranks: dict[int, dict] = field(default_factory=dict)  # rank → {pid, gpu, ts, status}
    done_ranks: set = field(default_factory=set)  # ranks that left cleanly (None: all of them)
    phase: str | None = None
    metrics: dict = field(default_factory=dict)  # the last step event's, by RunStatus field
    started: float = field(default_factory=time.time)  # when this attempt's job was spawned
    launch: dict | None = None  # the trainer's launch event: the ranks it starts, the rendezvous
    startup_checked: bool = False  # the start-up deadline has been judged
    progress: dict | None = None  # a data job's last progress event (agent/protocol.py: progress)

    def rank_health(self, now: float) -> dict[int, RankHealth]:
        """Every rank that heartbeats, and the planned ones that have not yet ("not started")."""
        out = {int(r["rank"]): RankHealth(gpu=r.get("gpu"), role=r.get("role"), health="not started")
               for r in (self.launch or {}).get("ranks") or [] if r.get("rank") is not None}
        for rank, hb in sorted(self.heartbeats.items()):
            health = "done" if rank in self.done_ranks else "dead" if rank in self.dead_ranks else "ok"
            out[rank] = RankHealth(step=hb.get("step"), pid=hb.get("pid"), gpu=hb.get("gpu"), role=hb.get("role"),
                                   heartbeat_age_s=round(now - float(hb.get("ts") or now), 1), health=health)
        return dict(sorted(out.items()))


# How far back the kernel's host-wide oom_kill counter is compared when a death is noticed:
# a death is seen within a slow tick or two (agent/supervisor.py SLOW_EVERY), and the OOM
# killer's SIGKILL lands at once.
HOST_OOM_WINDOW_S = 3.0


class Observer:
    """Feeds an Observation. ``accepting()`` says whether a failure still counts (not while
    the run is being stopped on purpose)."""

    def __init__(self, rd: RunDir, stream: StreamWriter, opts: Options, accepting: Callable[[], bool],
                 checkpoint: Checkpoint | None = None):
        self.rd = rd
        self.stream = stream
        self.opts = opts
        self.accepting = accepting
        self.tails = {name: LineTail(path, stream.offsets.get(name, 0))
                      for name, path in (("stdout", rd.job_stdout), ("stderr", rd.job_stderr), ("events", rd.events))}
        self.output_log = open(rd.output_log, "a", encoding="utf-8")
        self.oom_path = cgroup.memory_events_path()
        self.checkpoint = checkpoint  # the latest the trainer announced, across attempts
        self.gpu: dict = {}  # the last GPU sample
        self._last_gpu = float("-inf")
        self._last_gpu_reason: str | None = None
        self.changed = True  # something status.json shows changed since the last write
        self.served_due: list[dict] = []  # served_check_due events not yet handed on (agent/servedcheck.py)
        self.seen = self.new_attempt()

    def new_attempt(self, started: float | None = None) -> Observation:
        """A fresh Observation for a job (attempt) spawned at ``started`` (time.time())."""
        self.seen = Observation(LineClassifier(), StallMonitor(self.opts.stall_timeout),
                                ThroughputMonitor(self.opts.baseline_tokens_per_s, self.opts.regression_fraction),
                                memory_base=cgroup.sample(self.oom_path),
                                started=time.time() if started is None else started)
        return self.seen

    def slot(self) -> str:
        """What a rank's "gpu" names: a GPU, or on CPU only a rank slot."""
        device = (self.seen.launch or {}).get("device")
        if device is None:
            device = "cpu" if self.gpu.get("state") == "no GPU" else "cuda"
        return "rank slot" if device == "cpu" else "GPU"

    # --- output and events -------------------------------------------------------------------
    def pump(self, final: bool = False) -> int:
        """Copy new output lines and trainer events into the stream; classify them.
        One bounded read per source (so a flood cannot starve the other checks)."""
        seen = self.seen
        records: list = []
        log_lines = []
        gpu_of_rank = {r: hb.get("gpu") for r, hb in seen.heartbeats.items()}
        now = time.time()
        stamp = f"{now:.3f}"
        for name in ("stdout", "stderr"):
            for line, end in self.tails[name].read(final=final):
                rank, body = split_rank(line)
                records.append((StreamKind.LOG.value, {"stream": name, "line": line, "rank": rank}, (name, end)))
                log_lines.append(f"{stamp} [{name}] {line}\n")
                failure = seen.classifier.feed(line, rank, gpu_of_rank, now, body)
                if failure:
                    self.add_failure(failure, batch=records)
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

    def drain(self) -> None:
        """Everything the job wrote, to the end of each file as it is now (after the job
        has ended). Bounded by today's sizes: an orphan still printing cannot hold us here."""
        target = {name: tail.size() for name, tail in self.tails.items()}
        while self.pump(final=True) and any(self.tails[n].offset < size for n, size in target.items()):
            pass

    def on_event(self, ev: dict) -> None:
        seen = self.seen
        kind = ev.get("kind")
        self.changed = True
        if kind == "phase":
            seen.phase = ev.get("phase")
            if seen.phase == "done":
                seen.done_ranks.add(ev.get("rank"))
        elif kind == "step":
            seen.metrics.update({dest: ev[key] for key, dest in METRICS.items() if key in ev})
            failure = seen.tput.feed(ev)
            if failure:
                self.add_failure(failure)
        elif kind == "checkpoint" and ev.get("path"):
            step = int(ev.get("step") or 0)
            if self.checkpoint is None or step >= self.checkpoint.step:
                self.checkpoint = Checkpoint(step, str(ev["path"]))
        elif kind == "error":
            failure = classify_event(ev)
            if failure:
                self.add_failure(failure)
        elif kind == "launch":
            seen.launch = ev
        elif kind == "served_check_due" and ev.get("checkpoint"):
            self.served_due.append(ev)
        elif kind == "progress":
            seen.progress = {**{k: v for k, v in ev.items() if k not in PROGRESS_META}, "ts": ev.get("ts")}

    def add_failure(self, failure: Failure, batch: list | None = None) -> None:
        """Record a failure and announce it in the stream (within ``batch`` when a batch of
        records is being assembled, so it lands right after the line that showed it)."""
        if not self.accepting():
            return
        self.seen.failures.append(failure)
        if self.seen.first_failure_at is None:
            self.seen.first_failure_at = time.monotonic()
        self.announce(failure, batch)

    def announce(self, failure: Failure, batch: list | None = None) -> None:
        payload = {**failure.to_json(), "kind": "agent.failure", "failure": failure.kind.value}
        if batch is not None:
            batch.append((StreamKind.EVENT.value, payload, None))
        else:
            self.stream.append([(StreamKind.EVENT.value, payload, None)])

    # --- heartbeats and ranks ----------------------------------------------------------------
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
            if self.seen.heartbeats.get(rank) != hb:
                self.changed = True
            self.seen.heartbeats[rank] = hb

    def check_ranks(self, reaped: dict[int, dict]) -> None:
        """A rank whose heartbeat pid is gone (or a zombie) has died; a death that is not a
        clean exit starts the settle clock. ``reaped``: statuses of orphans we reaped."""
        seen = self.seen
        for rank, hb in seen.heartbeats.items():
            pid = hb.get("pid")
            if not isinstance(pid, int) or rank in seen.dead_ranks:
                continue
            ident = seen.rank_ids.get(rank)
            if ident is None or ident.pid != pid:
                try:
                    ident = seen.rank_ids[rank] = procs.Identity.of(pid)
                except ProcessLookupError:
                    ident = seen.rank_ids[rank] = procs.Identity(pid, -1, procs.boot_id())
            if ident.alive():
                continue
            zs = ident.zombie_status()
            status = procs.describe_status(zs) if zs is not None else reaped.get(pid)
            seen.dead_ranks[rank] = {"pid": pid, "gpu": hb.get("gpu"), "ts": time.time(), "status": status}
            self.changed = True
            if hb.get("state") in ("done", "stopped"):
                seen.done_ranks.add(rank)  # the trainer's last heartbeat says it left cleanly
            if rank in seen.done_ranks or None in seen.done_ranks or (status and status.get("exit_code") == 0):
                continue
            if self.accepting() and seen.first_failure_at is None:
                seen.first_failure_at = time.monotonic()

    def check_stalls(self, now: float) -> None:
        seen = self.seen
        seen.stall.update(seen.heartbeats, now)
        for f in seen.stall.check(seen.heartbeats, now, seen.phase == "training"):
            if not any(x.kind == FailureKind.RANK_STALL and x.rank == f.rank for x in seen.failures):
                self.add_failure(f)

    def check_startup(self, now: float) -> None:
        """Past --startup-timeout, every rank must have sent a heartbeat: the ones that did not
        are named with the rendezvous they were to meet at and the last lines they printed
        (a hung start, such as a rendezvous nobody joins, is otherwise invisible)."""
        seen, limit = self.seen, self.opts.startup_timeout
        if limit <= 0 or seen.startup_checked or now - seen.started < limit:
            return
        seen.startup_checked = True
        planned = {int(r["rank"]): r for r in (seen.launch or {}).get("ranks") or [] if r.get("rank") is not None}
        # a data job has no ranks: its first progress event says it started
        started = seen.heartbeats or seen.progress is not None
        missing = sorted(set(planned) - set(seen.heartbeats)) if planned else ([] if started else [None])
        if not missing:
            return
        endpoint = (seen.launch or {}).get("rdzv_endpoint")
        where = f"; rendezvous {endpoint}" if endpoint else ""
        if missing == [None]:
            who, rank, gpu = "no rank", None, None
            what = "sent a heartbeat"
        else:
            roles = sorted({str(planned[r].get("role")) for r in missing})
            slots = ", ".join(str(planned[r].get("gpu")) for r in missing)
            who = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
                   f"({'/'.join(roles)} on {self.slot()}{'s' if len(missing) > 1 else ''} {slots})")
            rank, gpu = missing[0], planned[missing[0]].get("gpu")
            what = "sent no heartbeat"
        evidence = [line for r in missing for line in seen.classifier.evidence(r, 6)] \
            + seen.classifier.evidence(None, 12)
        reason = (f"start-up deadline: {who} {what} within {limit:.0f} s of the start "
                  f"(--startup-timeout){where}")
        self.add_failure(Failure(FailureKind.STARTUP_TIMEOUT, reason, rank, gpu, evidence=evidence,
                                 details={"missing_ranks": [r for r in missing if r is not None],
                                          "rdzv_endpoint": endpoint, "startup_timeout_s": limit,
                                          "heartbeats": sorted(seen.heartbeats)}))

    def sample_memory(self, now: float) -> None:
        """Every slow tick: the OOM counters, the last HOST_OOM_WINDOW_S seconds of them kept."""
        recent = self.seen.memory_recent
        recent.append((now, cgroup.sample(self.oom_path)))
        while len(recent) > 2 and recent[1][0] <= now - HOST_OOM_WINDOW_S:
            recent.pop(0)

    def oom_delta(self) -> dict | None:
        """The OOM kills the container could see (cgroup.oom_evidence): its cgroup's since the
        attempt began; the kernel's host-wide count only since a sample a few seconds before
        now (HOST_OOM_WINDOW_S), when a death was just noticed."""
        base = self.seen.memory_base
        if not base:
            return None
        now = cgroup.sample(self.oom_path)
        recent = self.seen.memory_recent
        host_base = recent[0][1].host_oom_kill if recent else base.host_oom_kill
        return cgroup.oom_evidence(base._replace(host_oom_kill=host_base), now)

    def rank_exit_failures(self, reaped: dict[int, dict], job_exit: dict | None = None) -> list[Failure]:
        """The ranks that died without a failure of their own already named: a rank whose
        exception, OOM or lost peer was seen exited *because* of it, and naming its exit too
        would put a consequence next to its cause. ``job_exit``: the job's exit status, the
        status of a rank that was the job's top process (its monitor reaped it, not us)."""
        seen = self.seen
        oom = self.oom_delta()
        explained = {f.rank for f in seen.failures if f.rank is not None}
        out = []
        for rank, dead in sorted(seen.dead_ranks.items()):
            if rank in seen.done_ranks or None in seen.done_ranks or rank in explained:
                continue
            status = dead["status"] or seen.classifier.exit_by_pid.get(dead["pid"]) \
                or seen.classifier.exit_by_rank.get(rank) or reaped.get(dead["pid"]) \
                or (job_exit if job_exit and job_exit.get("pid") == dead["pid"] else None)
            if status and status.get("exit_code") == 0:
                continue
            f = exit_failure(rank, dead["pid"], dead["gpu"], status, seen.classifier.had_traceback(rank),
                             seen.classifier.evidence(rank), oom, slot=self.slot())
            f.ts = dead["ts"]
            f.details["last_heartbeat"] = seen.heartbeats.get(rank, {}).get("ts")
            out.append(f)
        return out

    def collect(self, reaped: dict[int, dict], job_exit: dict | None = None) -> list[Failure]:
        """Every failure of this attempt: the ones seen as they happened, and the rank deaths
        named now (a death's cause is only known once its evidence has settled)."""
        return self.seen.failures + self.rank_exit_failures(reaped, job_exit)

    def job_exit_failure(self, ex: dict) -> Failure:
        """The job's own non-zero exit as a failure: of rank 0 when it was the only rank."""
        seen = self.seen
        rank = 0 if len(seen.heartbeats) == 1 else None
        had_tb = seen.classifier.had_traceback(None) or any(seen.classifier.had_traceback(r) for r in seen.heartbeats)
        gpu = seen.heartbeats.get(0, {}).get("gpu") if rank is not None else None
        f = exit_failure(rank, ex.get("pid"), gpu, ex, had_tb,
                         seen.classifier.evidence(None) or seen.classifier.evidence(rank), self.oom_delta(),
                         "the job" if rank is None else None, slot=self.slot())
        if ex.get("spawn_error"):
            f.kind, f.reason = FailureKind.JOB_EXIT, f"failed to start: {ex['spawn_error']}"
        elif ex.get("exit_code") == EXIT_USAGE and f.kind == FailureKind.JOB_EXIT:
            # Bad input is said in one line on stderr (every trainer command): that line is the reason.
            said = [line for line in f.evidence or [] if ": error: " in line]
            if said:
                f.reason = f"{f.reason} (bad input): {said[-1].strip()}"
        return f

    # --- GPUs --------------------------------------------------------------------------------
    def sample_gpus(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_gpu < self.opts.gpu_interval:
            return
        self._last_gpu = now
        try:
            sample = gpus.sample()
        except Exception as exc:  # noqa: BLE001 - a bug in sampling must not end the run: say it
            traceback.print_exc(file=sys.stderr)
            sample = {"ts": time.time(), "gpus": [], "state": "error",
                      "reason": f"GPU sampling failed: {type(exc).__name__}: {exc} (agent.log has the traceback)"}
        self.gpu = sample
        self.changed = True
        if not sample.get("gpus"):
            # said once (and again if the reason changes), not every interval
            if self._last_gpu_reason == sample.get("reason"):
                return
            self._last_gpu_reason = sample.get("reason")
        self.stream.append([(StreamKind.GPU.value, sample, None)])

    def close(self) -> None:
        self.output_log.close()
        for tail in self.tails.values():
            tail.close()

