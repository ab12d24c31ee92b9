"""`ctl tail`: follow a run's seq-numbered stream across SSH drops, with no gap and no duplicate.

The agent's ``follow --run ID --from SEQ`` prints every record with seq > SEQ. This loop
keeps the last seq it handed on; when the connection drops it reconnects and asks again
from there, and drops any record at or below it (a record in flight when the link broke may
arrive twice). When the follow command ends, the stream's end is *not* taken as success:
the run's state is asked (docs/research/proxmox-and-supervision.md §4.8: ray#57002 — a log
stream that closes silently while the job still runs). Ctrl-C detaches and leaves the run
alone: closing our channel ends only the follow process (pct does not forward signals, §1.1
there), never the trainer.

Written against :class:`StreamSource` so the loop is the same for SSH, a local node and tests.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from agent.protocol import EXIT_AGENT_GONE, EXIT_STREAM_RUN_FAILED, RunState
from controller.transport import ContainerNotRunning, TransportError

# Agent follow's documented exit code when the agent is gone and the run has not finished.
FOLLOW_AGENT_GONE = EXIT_AGENT_GONE
MAX_REVIVALS = 5  # agents one tail starts before it gives up on a run whose agents keep dying
# How long a follower waits for a stopped container to run again before it says the run died
# with it: a container's restart or a node's reboot comes back well within it; a `pct stop`
# by hand never does, and reconnecting to it for ever helps nobody.
STOPPED_WAIT_S = 300.0


class StreamSource(Protocol):
    """Where records come from: one follow call per connection, and the run's state."""

    def follow(self, run_id: str, after: int, on_line: Callable[[str], None], *, once: bool) -> int:
        """Run the agent's follow from ``after``; each stdout line to ``on_line``; return its
        exit code. Raises TransportError when the connection is lost."""

    def state(self, run_id: str) -> dict:
        """The run's status document (``state`` key at least)."""

    # Optional: ``revive(run_id) -> bool`` starts a new agent for a run whose agent is gone
    # (True: one is supervising now, follow again). Sources without it end the tail there.


@dataclass
class TailResult:
    """How a tail ended: ``state`` of the run (None when detached), last seq seen, drops."""

    last_seq: int
    state: Optional[str]
    reconnects: int
    detached: bool = False
    gaps: list[tuple[int, int]] = field(default_factory=list)
    status: Optional[dict] = None
    stopped: Optional[str] = None  # the container stayed stopped past the wait: pct's words for it
    run_failed: bool = False  # without follow: the stream's last status (printed or not) is a failure


def tail(source: StreamSource, run_id: str, on_record: Callable[[dict], None], *, since: int = 0,
         follow: bool = True, max_reconnects: int = 1000, backoff: Callable[[int], float] | None = None,
         sleep: Callable[[float], None] = time.sleep, on_reconnect: Callable[[int, str], None] | None = None,
         stopped_wait: float = STOPPED_WAIT_S, on_stopped: Callable[[str], None] | None = None,
         clock: Callable[[], float] = time.monotonic) -> TailResult:
    """Hand every record with seq > ``since`` to ``on_record`` exactly once, in seq order.

    ``follow=False`` prints what exists now and returns (one call to the source: ``run_id``
    None there means the latest run). ``follow=True`` goes on until the run is in a terminal
    state (asked, not assumed) or Ctrl-C. A container that is not running is waited for up to
    ``stopped_wait`` seconds (``on_stopped`` once, not a reconnect line per try); past that the
    result's ``stopped`` says so.
    """
    backoff = backoff or (lambda n: min(0.2 * (2 ** min(n, 5)), 5.0))
    last = since
    reconnects = 0
    consecutive = 0
    revivals = 0
    gaps: list[tuple[int, int]] = []
    said: dict = {}  # the stream's last status record
    stopped_since: Optional[float] = None

    def handle(line: str) -> None:
        nonlocal last, consecutive
        line = line.strip()
        if not line.startswith("{"):
            return  # not a record (a stray line from a login shell); never mistaken for one
        try:
            rec = json.loads(line)
            seq = int(rec["seq"])
        except (ValueError, KeyError, TypeError):
            return
        if seq <= last:
            return  # already handed on before the drop
        if seq != last + 1:
            gaps.append((last, seq))  # the agent promises none; if it happens, say so
        last = seq
        consecutive = 0
        if rec.get("kind") == "status" and isinstance(rec.get("payload"), dict):
            said["status"] = rec["payload"]
        on_record(rec)

    try:
        while True:
            try:
                rc = source.follow(run_id, last, handle, once=not follow)
            except ContainerNotRunning as exc:
                if not follow:
                    raise
                if stopped_since is None:
                    stopped_since = clock()
                    if on_stopped:
                        on_stopped(str(exc))
                elif clock() - stopped_since > stopped_wait:
                    return TailResult(last, None, reconnects, gaps=gaps, stopped=str(exc))
                reconnects += 1
                sleep(backoff(5))
                continue
            except TransportError as exc:
                reconnects += 1
                consecutive += 1
                if consecutive > max_reconnects:
                    raise
                if on_reconnect:
                    on_reconnect(reconnects, str(exc))
                sleep(backoff(consecutive))
                continue
            stopped_since = None
            if not follow:  # what exists now, printed: nothing is decided from the state
                return TailResult(last, None, reconnects, gaps=gaps, run_failed=rc == EXIT_STREAM_RUN_FAILED)
            if rc == 0 and _terminal((said.get("status") or {}).get("state")):
                # The stream itself ended with the run's terminal status record: that is the
                # answer, whatever the status file says now (a corrupt one looped us forever).
                status = said["status"]
            else:
                status = _state(source, run_id)
            state = status.get("state") if status else None
            if _terminal(state):
                return TailResult(last, state, reconnects, gaps=gaps, status=status)
            if rc == FOLLOW_AGENT_GONE:
                # The agent is gone and the run is not finished: the stream would never end,
                # unless a new agent takes over (the job's monitor usually got there first).
                revive = getattr(source, "revive", None)
                if revive is not None and revivals < MAX_REVIVALS and revive(run_id):
                    revivals += 1
                    continue
                return TailResult(last, state, reconnects, gaps=gaps, status=status)
            sleep(backoff(0))  # follow ended early without a terminal state: ask again
    except KeyboardInterrupt:
        return TailResult(last, None, reconnects, detached=True, gaps=gaps)


def _state(source: StreamSource, run_id: str) -> Optional[dict]:
    for attempt in range(5):
        try:
            return source.state(run_id)
        except TransportError:
            time.sleep(0.2 * (attempt + 1))
    return None


def _terminal(state: Any) -> bool:
    try:
        return RunState(state).is_terminal()
    except ValueError:
        return False


# --- rendering ---------------------------------------------------------------------------------

def _num(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else "—"


def fmt_rate(v: Any) -> str:
    if not isinstance(v, (int, float)):
        return "—"
    return f"{v / 1000:.1f}K" if v >= 1000 else f"{v:.0f}"


class Printer:
    """Turns records into lines: logs as they are, notable events, and a one-line status at
    most every ``status_every`` seconds (and at every state change)."""

    def __init__(self, write: Callable[[str], None], *, status_every: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, raw: bool = False,
                 on_step: Optional[Callable[[dict], None]] = None):
        """``on_step``: a live status display takes each step event instead (controller/
        livetail.py), and no status lines are interleaved with the log."""
        self.write = write
        self.on_step = on_step
        self.status_every = status_every
        self.clock = clock
        self.raw = raw
        self.last_status_at: Optional[float] = None
        self.step: dict = {}
        self.gpus: list = []
        self.state: Optional[str] = None
        self.steps_seen = 0
        self.status_is_last = False  # the last line written was a status line
        self.progress: Optional[dict] = None  # a data job's last progress event

    def __call__(self, rec: dict) -> None:
        if self.raw:
            self.write(json.dumps(rec, sort_keys=True))
            return
        kind, payload = rec.get("kind"), rec.get("payload") or {}
        if kind == "log":
            line = payload.get("line", "")
            rank = payload.get("rank")
            self.write(f"[rank {rank}] {line}" if rank is not None else line)
        elif kind == "event":
            self._event(payload)
        elif kind == "gpu":
            self.gpus = payload.get("gpus") or []
        elif kind == "alert":  # agent/alerts.py: what the operator was (or is being) told
            self.write(f"== alert {payload.get('kind')}: {payload.get('cause')}")
        elif kind == "status":
            state = payload.get("state")
            if state != self.state:
                self.state = state
                reason = _failure_reason(payload)
                self.write(f"== run {state}" + (f": {reason}" if reason and reason != state else ""))
        now = self.clock()
        if self.on_step is not None:
            self.status_is_last = False
        elif self.steps_seen and (self.last_status_at is None or now - self.last_status_at >= self.status_every):
            self.write(self.status_line())
            self.last_status_at = now
            self.status_is_last = True
        else:
            self.status_is_last = False

    def _event(self, ev: dict) -> None:
        kind = ev.get("kind", "")
        if kind == "step":
            self.step = ev
            self.steps_seen += 1
            if self.on_step is not None:
                self.on_step(ev)
        elif kind == "progress":  # a data job's (agent/protocol.py): shown as its status line
            self.progress = ev
            self.steps_seen += 1
        elif kind == "phase":
            self.write(f"== phase {ev.get('phase')}")
        elif kind == "checkpoint":
            self.write(f"== checkpoint step {ev.get('step')}: {ev.get('path')}")
        elif kind == "eval":
            self.write(f"== eval step {ev.get('step')}: τ {_num(ev.get('tau'), '.3f')}")
        elif kind == "error":
            where = f"rank {ev.get('rank')}" + (f" GPU {ev.get('gpu')}" if ev.get("gpu") is not None else "")
            self.write(f"!! {where}: {ev.get('error')}: {ev.get('message')}")
        elif kind == "agent.failure":
            self.write(f"!! FAILURE {ev.get('failure')}: {ev.get('reason')}")
        elif kind.startswith("agent."):
            detail = ev.get("reason") or ev.get("message") or ""
            self.write(f"== {kind[6:].replace('_', ' ')}" + (f": {detail}" if detail else ""))

    def status_line(self) -> str:
        if self.progress is not None and not self.step:
            return "-- " + " | ".join(progress_parts(self.progress))
        s = self.step
        total = s.get("total_steps")
        parts = [f"step {s.get('step', '—')}" + (f"/{total}" if total else ""),
                 f"loss {_num(s.get('loss'), '.4f')}", f"{fmt_rate(s.get('tokens_per_s'))} tok/s"]
        mems = []
        for g in self.gpus:
            used, total_mib = g.get("memory_used_mib"), g.get("memory_total_mib")
            if used is not None:
                mems.append(f"GPU{g.get('index')} {used / 1024:.1f}" + (f"/{total_mib / 1024:.0f}G" if total_mib else "G"))
        if not mems and s.get("mem_peak_mib") is not None:
            mems.append(f"peak {s['mem_peak_mib'] / 1024:.2f}G")
        if mems:
            parts.append("mem " + " ".join(mems))
        return "-- " + " | ".join(parts)


def progress_parts(p: dict, eta: bool = True) -> list[str]:
    """A data job's progress event (agent/protocol.py: progress) as short parts: how far,
    bad rows, each rate, ETA. Only the fields the job sent."""
    parts = []
    if isinstance(p.get("done"), (int, float)):
        total = p.get("total")
        pct = f" ({100 * p['done'] / total:.0f} %)" if isinstance(total, (int, float)) and total else ""
        parts.append(f"done {p['done']:,}" + (f"/{total:,}" if isinstance(total, (int, float)) else "") + pct)
        parts += [f"{key} {p[key]:,}" for key in ("failed", "skipped") if isinstance(p.get(key), (int, float))]
    elif isinstance(p.get("samples"), (int, float)):
        done, total = p.get("bytes_done"), p.get("bytes_total")
        pct = f" ({100 * done / total:.0f} % of the input)" if isinstance(done, (int, float)) and total else ""
        parts.append(f"samples {p['samples']:,}, tokens {p.get('tokens') or 0:,}" + pct)
    bad = p.get("bad")
    if isinstance(bad, dict) and bad:
        parts.append("bad rows " + ", ".join(f"{k} {v:,}" for k, v in sorted(bad.items())))
    elif isinstance(bad, (int, float)) and bad:
        parts.append(f"bad rows {bad:,}")
    for key, value in p.items():
        if key.endswith("_per_s") and isinstance(value, (int, float)):
            parts.append(f"{fmt_rate(value)} {key[:-6].replace('_', ' ')}/s")
    if eta and isinstance(p.get("eta_s"), (int, float)):
        from agent.protocol import fmt_duration

        parts.append(f"ETA {fmt_duration(p['eta_s'])}")
    return parts


def _failure_reason(status: dict) -> Optional[str]:
    failure = status.get("failure") or (status.get("result") or {}).get("failure")
    if isinstance(failure, dict):
        return failure.get("reason") or failure.get("kind")
    return failure or status.get("reason")
