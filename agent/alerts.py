"""Alerts: the one record a run sends its operator, and the rules that raise it.

An alert is a stream record (kind ``alert``) written — and fsynced — before anything tries
to deliver it, so a delivery that is cut off (the agent killed, the receiver down, no route
out of the container) is retried from the stream, never lost. Its id is derived from what it
is about (run, kind, the attempt or step that raised it), not drawn at random: an agent that
re-reads the stream after a crash raises the same alert with the same id, so it finds it
already there, and a receiver de-duplicates by the id in the body.

:class:`AlertRules` is pure: it is fed the run's stream records (and disk readings) in order
and returns the alerts they raise; the agent (agent/alertwatch.py) feeds it, tests feed dicts.
Thresholds are :class:`Thresholds`, each with its default and why (docs/alerts.md has the table).

Standard library only: imported in the container (agent) and on the operator's machine (ctl).
"""

from __future__ import annotations

import enum
import hashlib
import math
import statistics
import time
from collections import deque
from typing import Any

from agent.records import Factory, asdict, fields, record

ALERT_RECORD = "alert"  # the stream kind of an alert record (agent.protocol.StreamKind.ALERT)


class AlertKind(str, enum.Enum):
    """What an alert tells. The failure kinds of agent/classify.py map onto these (a stall
    ends a run as ``stalled``, not as a second ``failed``: one event, one alert)."""

    COMPLETED = "completed"
    FAILED = "failed"
    STALLED = "stalled"
    RESTARTED = "restarted"  # a failure the agent restarted from (--max-restarts)
    LOSS_NONFINITE = "loss_nonfinite"
    THROUGHPUT_DROP = "throughput_drop"
    DISK_LOW = "disk_low"
    DATA_DONE = "data_done"
    DATA_FAILING = "data_failing"
    TAU_DROP = "tau_drop"
    # raised by the controller, not the agent: what the node's kernel log says about a
    # failed/stalled alert's moment (controller/kernellog.py; the container cannot read it)
    NODE_EVIDENCE = "node_evidence"


SEVERITY = {AlertKind.COMPLETED: "info", AlertKind.DATA_DONE: "info", AlertKind.RESTARTED: "warning",
            AlertKind.THROUGHPUT_DROP: "warning", AlertKind.DISK_LOW: "warning", AlertKind.TAU_DROP: "warning",
            AlertKind.DATA_FAILING: "warning", AlertKind.LOSS_NONFINITE: "error", AlertKind.FAILED: "error",
            AlertKind.STALLED: "error", AlertKind.NODE_EVIDENCE: "error"}


@record(frozen=True)
class Thresholds:
    """When a watched quantity becomes an alert. Names carry their units."""

    # The run's own steady rate: the median of the summed per-rank rates over this many step
    # events after warm-up. A drop is judged against it, not against another run's baseline,
    # so a first run of a config is watched too (the story: 20 -> 5.4 Ktok/s, nobody told).
    steady_steps: int = 20
    warmup_steps: int = 3  # step events per rank before rates count (compile, cache warm-up)
    throughput_drop_fraction: float = 0.3  # below steady x (1 - this) ...
    throughput_drop_for_s: float = 120.0  # ... continuously for this long (one slow step is noise)
    disk_free_fraction: float = 0.05  # free space of the run's filesystem below 5 % ...
    disk_free_gib: float = 20.0  # ... and below 20 GiB (a 27B checkpoint is tens of GiB)
    disk_interval_s: float = 60.0  # how often the agent reads the filesystem's free space
    data_fail_fraction: float = 0.05  # a data job: failed / (done + failed) above 5 % ...
    data_fail_min_rows: int = 50  # ... once this many rows were tried (the first few are noise)
    tau_drop_fraction: float = 0.1  # acceptance length (eval tau) lower than the previous save's by 10 %

    @classmethod
    def from_json(cls, doc: Any, where: str = "thresholds") -> "Thresholds":
        """Known keys checked (a number where a number goes), unknown keys refused by name."""
        doc = doc or {}
        if not isinstance(doc, dict):
            raise ValueError(f"{where}: must be a table (got {doc!r})")
        known = {f.name: f for f in fields(cls)}
        out = {}
        for key, value in doc.items():
            if key not in known:
                raise ValueError(f"{where}.{key}: unknown threshold (known: {', '.join(sorted(known))})")
            want = type(known[key].default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 \
                    or (want is int and not isinstance(value, int)):
                raise ValueError(f"{where}.{key}: must be a non-negative {'integer' if want is int else 'number'} "
                                 f"(got {value!r})")
            out[key] = want(value)
        return cls(**out)

    def to_json(self) -> dict:
        return asdict(self)


@record
class Alert:
    """One alert: what happened to which run where, its root cause (one line), and the exact
    command to run next. ``id`` is stable for the same event (see the module docstring)."""

    id: str
    kind: str
    run: str
    ts: float
    cause: str
    next: str
    container: str | None = None
    node: str | None = None
    severity: str = "info"
    step: int | None = None
    details: dict = Factory(dict)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Any) -> "Alert | None":
        if not isinstance(doc, dict) or not isinstance(doc.get("id"), str) or not isinstance(doc.get("kind"), str):
            return None
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in doc.items() if k in known}
        kw.setdefault("run", ""), kw.setdefault("ts", 0.0), kw.setdefault("cause", ""), kw.setdefault("next", "")
        return cls(**kw)

    def title(self) -> str:
        where = f"{self.node}:{self.container}" if self.node and self.container else (self.container or "")
        return f"[{self.severity}] run {self.run}{' on ' + where if where else ''}: {self.kind.replace('_', ' ')}"

    def text(self) -> str:
        """The human form every channel shows: title, cause, next command, the id (the
        receiver's de-duplication key, in the body of every channel)."""
        return f"{self.title()}\n{self.cause}\nnext: {self.next}\nalert id: {self.id}"


def alert_id(run: str, kind: str, key: str) -> str:
    return hashlib.sha256(f"{run}\0{kind}\0{key}".encode()).hexdigest()[:20]


def _finite(value: Any) -> bool | None:
    """True/False for a number or the strings a trainer may print ("nan", "inf"); None for
    anything that is not a loss value at all."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return math.isfinite(value)
    if isinstance(value, str):
        try:
            return math.isfinite(float(value))
        except ValueError:
            return None
    return None


# Failure kinds (agent/protocol.py FailureKind values) that end a run as their own alert kind.
_CAUSE_KIND = {"rank_stall": AlertKind.STALLED, "throughput_regression": AlertKind.THROUGHPUT_DROP}


class AlertRules:
    """Stream records in, alerts out. ``where``: {"node", "container"}; ``commands``: the
    next-command templates the controller wrote (``status``, ``tail``, ``resume`` with
    ``{checkpoint}``, ``export``), each optional."""

    def __init__(self, run: str, thresholds: Thresholds | None = None, where: dict | None = None,
                 commands: dict | None = None):
        self.run = run
        self.t = thresholds or Thresholds()
        self.where = where or {}
        self.commands = commands or {}
        self.raised: set[str] = set()
        self.attempt = 0
        self.checkpoint: dict | None = None
        self.step: int | None = None
        self._reset_attempt()
        self._last_tau: tuple[int, float] | None = None
        self._data_failing = False

    def _reset_attempt(self) -> None:
        self._seen: dict[Any, int] = {}
        self._rates: dict[Any, deque] = {}
        self._totals: list[float] = []
        self.steady: float | None = None
        self._low_since: float | None = None
        self._nan_raised = False

    # --- the next command ------------------------------------------------------------------
    def _cmd(self, name: str, **values) -> str | None:
        template = self.commands.get(name)
        if not template:
            return None
        try:
            return template.format(run=self.run, **values)
        except (KeyError, IndexError, ValueError):
            return template

    def _status_cmd(self) -> str:
        return self._cmd("status") or f"ctl status --run {self.run}"

    def _tail_cmd(self) -> str:
        return self._cmd("tail") or f"ctl tail --run {self.run}"

    def _resume_cmd(self) -> str:
        ckpt = (self.checkpoint or {}).get("path")
        if ckpt:
            line = self._cmd("resume", checkpoint=ckpt)
            if line:
                return line
            return f"ctl launch … --resume-from {ckpt} (see `{self._status_cmd()}`)"
        return f"{self._status_cmd()} (no checkpoint to resume from: the launch starts again --from-scratch)"

    # --- raising ------------------------------------------------------------------------------
    def _alert(self, kind: AlertKind, key: str, ts: float, cause: str, nxt: str, **details) -> Alert | None:
        aid = alert_id(self.run, kind.value, key)
        if aid in self.raised:
            return None
        self.raised.add(aid)
        return Alert(id=aid, kind=kind.value, run=self.run, ts=ts, cause=cause, next=nxt,
                     container=self._str(self.where.get("container")), node=self._str(self.where.get("node")),
                     severity=SEVERITY[kind], step=self.step, details=details)

    @staticmethod
    def _str(v: Any) -> str | None:
        return None if v is None else str(v)

    def feed(self, rec: dict) -> list[Alert]:
        """One stream record ({seq, ts, kind, payload})."""
        kind, payload = rec.get("kind"), rec.get("payload")
        ts = float(rec.get("ts") or time.time())
        if not isinstance(payload, dict):
            return []
        if kind == ALERT_RECORD:
            if isinstance(payload.get("id"), str):
                self.raised.add(payload["id"])
            return []
        if kind == "status":
            return self._status(payload, ts)
        if kind != "event":
            return []
        ev = payload.get("kind")
        if ev == "step":
            return self._step(payload, ts)
        if ev == "checkpoint" and payload.get("path"):
            self.checkpoint = {"step": payload.get("step"), "path": payload["path"]}
        elif ev == "eval":
            return self._eval(payload, ts)
        elif ev == "progress":
            return self._progress(payload, ts)
        elif ev == "agent.restart":
            return self._restart(payload, ts)
        return []

    def disk(self, path: str, free_bytes: int, total_bytes: int, ts: float) -> list[Alert]:
        """A reading of the run's filesystem: nearly full when both limits are crossed."""
        if total_bytes <= 0:
            return []
        gib = free_bytes / 2**30
        low = free_bytes / total_bytes < self.t.disk_free_fraction and gib < self.t.disk_free_gib
        if not low:
            return []
        # once per attempt: freeing space and filling it again in one attempt is one story
        a = self._alert(AlertKind.DISK_LOW, f"{self.attempt}:{path}", ts,
                        f"disk nearly full: {gib:.1f} GiB free of {total_bytes / 2**30:.0f} GiB "
                        f"({100 * free_bytes / total_bytes:.1f} %) on {path}; the next checkpoint may not fit",
                        f"{self._status_cmd()}; free space or lower the kept checkpoints",
                        path=path, free_bytes=free_bytes, total_bytes=total_bytes)
        return [a] if a else []

    # --- the rules ----------------------------------------------------------------------------
    def _status(self, st: dict, ts: float) -> list[Alert]:
        state = st.get("state")
        if isinstance(st.get("checkpoint"), dict) and st["checkpoint"].get("path"):
            self.checkpoint = st["checkpoint"]
        if isinstance(st.get("step"), int):
            self.step = st["step"]
        if state == "completed":
            ckpt = (self.checkpoint or {}).get("path")
            cause = "completed" + (f" at step {self.step}" if self.step is not None else "") \
                + (f"; last checkpoint {ckpt}" if ckpt else "")
            nxt = self._cmd("export") or self._status_cmd()
            a = self._alert(AlertKind.COMPLETED, "end", ts, cause, nxt)
            return [a] if a else []
        if state != "failed":
            return []
        history = st.get("failures_history") or []
        root = (history[-1].get("root_cause") if history and isinstance(history[-1], dict) else None) or {}
        fkind = root.get("kind")
        kind = _CAUSE_KIND.get(fkind, AlertKind.FAILED)
        reason = st.get("reason") or st.get("last_error") or root.get("reason") or "failed for an unknown reason"
        if fkind and fkind not in reason:
            reason = f"{fkind}: {reason}"
        nxt = f"{self._resume_cmd()}; the log: {self._tail_cmd()}"
        a = self._alert(kind, "end", ts, reason, nxt, failure=fkind, rank=root.get("rank"), gpu=root.get("gpu"),
                        pid=root.get("pid"), evidence=(root.get("evidence") or [])[-5:])
        return [a] if a else []

    def _restart(self, ev: dict, ts: float) -> list[Alert]:
        self.attempt = int(ev.get("attempt") or self.attempt + 1)
        self._reset_attempt()
        ckpt = ev.get("checkpoint")
        frm = f"from checkpoint {ckpt}" if ckpt else "from scratch (no checkpoint)"
        a = self._alert(AlertKind.RESTARTED, f"attempt {self.attempt}", ts,
                        f"{ev.get('after') or 'a failure'}; the agent restarted the run {frm} (attempt "
                        f"{self.attempt} of {ev.get('max_restarts')})", self._tail_cmd(), checkpoint=ckpt)
        return [a] if a else []

    def _step(self, ev: dict, ts: float) -> list[Alert]:
        out = []
        if isinstance(ev.get("step"), int):
            self.step = ev["step"]
        if "loss" in ev and _finite(ev["loss"]) is False and not self._nan_raised:
            self._nan_raised = True
            a = self._alert(AlertKind.LOSS_NONFINITE, f"{self.attempt}", ts,
                            f"loss is {ev['loss']} at step {ev.get('step')} (rank {ev.get('rank')}): the weights "
                            f"may be ruined from here; resume from the checkpoint before it",
                            f"{self._tail_cmd()}; then stop and resume: {self._resume_cmd()}", loss=str(ev["loss"]))
            if a:
                out.append(a)
        a = self._throughput(ev, ts)
        if a:
            out.append(a)
        return out

    def _throughput(self, ev: dict, ts: float) -> Alert | None:
        tps = ev.get("tokens_per_s")
        if isinstance(tps, bool) or not isinstance(tps, (int, float)) or not math.isfinite(tps):
            return None
        rank = ev.get("rank")
        self._seen[rank] = self._seen.get(rank, 0) + 1
        if self._seen[rank] <= self.t.warmup_steps:
            return None
        window = self._rates.setdefault(rank, deque(maxlen=5))
        window.append(float(tps))
        if any(len(w) < w.maxlen for w in self._rates.values()):
            return None
        now = sum(statistics.median(w) for w in self._rates.values())
        if self.steady is None:
            self._totals.append(now)
            if len(self._totals) >= self.t.steady_steps:
                self.steady = statistics.median(self._totals)
            return None
        limit = self.steady * (1 - self.t.throughput_drop_fraction)
        if now >= limit:
            self._low_since = None
            return None
        self._low_since = self._low_since if self._low_since is not None else ts
        if ts - self._low_since < self.t.throughput_drop_for_s:
            return None
        slow = sorted((r for r, w in self._rates.items() if len(self._rates) > 1
                       and statistics.median(w) < 0.75 * max(statistics.median(x) for x in self._rates.values())),
                      key=lambda r: (r is None, r))
        who = f"; slowest rank{'s' if len(slow) > 1 else ''}: {', '.join(map(str, slow))}" if slow else ""
        return self._alert(AlertKind.THROUGHPUT_DROP, f"{self.attempt}", ts,
                           f"throughput {now:,.0f} tokens/s, {100 * (1 - now / self.steady):.0f} % below this run's "
                           f"own steady {self.steady:,.0f} for {ts - self._low_since:.0f} s{who} (a lost or slowed "
                           f"rank, a throttled GPU)", self._status_cmd(),
                           tokens_per_s=round(now, 1), steady_tokens_per_s=round(self.steady, 1), slow_ranks=slow)

    def _eval(self, ev: dict, ts: float) -> list[Alert]:
        tau, step = ev.get("tau"), ev.get("step")
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau):
            return []
        prev, self._last_tau = self._last_tau, (step, float(tau))
        if prev is None or prev[1] <= 0 or tau >= prev[1] * (1 - self.t.tau_drop_fraction):
            return []
        a = self._alert(AlertKind.TAU_DROP, f"{step}", ts,
                        f"acceptance length tau fell from {prev[1]:.2f} (step {prev[0]}) to {tau:.2f} (step {step}), "
                        f"-{100 * (1 - tau / prev[1]):.0f} %", self._status_cmd(), tau=tau, previous_tau=prev[1],
                        previous_step=prev[0])
        return [a] if a else []

    def _progress(self, ev: dict, ts: float) -> list[Alert]:
        out = []
        done, failed = ev.get("done"), ev.get("failed")
        if isinstance(done, int) and isinstance(failed, int) and not self._data_failing:
            tried = done + failed
            if tried >= self.t.data_fail_min_rows and failed / tried > self.t.data_fail_fraction:
                self._data_failing = True
                a = self._alert(AlertKind.DATA_FAILING, f"{self.attempt}", ts,
                                f"data job failing: {failed} of {tried} rows failed ({100 * failed / tried:.1f} %, "
                                f"above {100 * self.t.data_fail_fraction:.0f} %)", self._tail_cmd(),
                                done=done, failed=failed, by_cause=ev.get("skipped_by_cause"))
                if a:
                    out.append(a)
        if ev.get("final") and not ev.get("stopped"):
            a = self._alert(AlertKind.DATA_DONE, "final", ts,
                            f"data job done: {done} done, {failed} failed, {ev.get('skipped')} skipped of "
                            f"{ev.get('total')}", self._status_cmd(), done=done, failed=failed)
            if a:
                out.append(a)
        return out
