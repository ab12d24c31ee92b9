"""Failure classification: from log lines, trainer events, heartbeats and exit statuses to
one named failure with rank, GPU, a one-line reason and the evidence lines.

Pure logic, no I/O: the supervisor feeds observations in; tests feed strings in.
"""

from __future__ import annotations

import math
import re
import signal
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from agent.protocol import EXIT_STOPPED, FailureKind

# --- per-line rank --------------------------------------------------------------------------
# torch ≥ 2.2 prefixes worker lines with "[rank3]:"; torchrun --tee/-t with "[default3]:"
# (role + local rank). Either names the rank that printed the line.
_RANK_PREFIX = re.compile(r"^\[(?:rank|default|[A-Za-z_]+?)(\d+)\]:\s?")
_RANK_IN_TEXT = re.compile(r"\[(?:Rank|rank) (\d+)\]")


def split_rank(line: str) -> tuple[int | None, str]:
    m = _RANK_PREFIX.match(line)
    if m:
        return int(m.group(1)), line[m.end():]
    return None, line


# --- CUDA OOM -------------------------------------------------------------------------------
_UNITS = {"B": 1 / 2**20, "KiB": 1 / 1024, "KB": 1 / 1024, "MiB": 1.0, "MB": 1.0,
          "GiB": 1024.0, "GB": 1024.0, "TiB": 2**20, "TB": 2**20}
_SIZE = r"([\d.]+)\s*(B|KiB|KB|MiB|MB|GiB|GB|TiB|TB)"
_OOM_MARK = re.compile(r"CUDA out of memory|OutOfMemoryError")
_OOM_TRIED = re.compile(r"Tried to allocate " + _SIZE)
_OOM_GPU = re.compile(r"GPU (\d+)")
# torch ≥ 2.1: "GPU 3 has a total capacity of 79.15 GiB of which 1.59 GiB is free."
# torch < 2.1: "(GPU 0; 7.93 GiB total capacity; 6.98 GiB already allocated; 4.56 MiB free; ...)"
_OOM_TOTAL = [re.compile(r"total capacity of " + _SIZE), re.compile(_SIZE + r" total capacity")]
_OOM_FREE = [re.compile(r"of which " + _SIZE + r" is free"), re.compile(_SIZE + r" free")]


def _mib(m: re.Match | None) -> float | None:
    return float(m.group(1)) * _UNITS[m.group(2)] if m else None


def parse_cuda_oom(text: str) -> dict | None:
    """The numbers in torch's CUDA OOM message; shortfall = requested − free, in MiB (ceil)."""
    if not _OOM_MARK.search(text):
        return None
    gpu = _OOM_GPU.search(text)
    tried = _mib(_OOM_TRIED.search(text))
    total = next((v for p in _OOM_TOTAL if (v := _mib(p.search(text))) is not None), None)
    free = next((v for p in _OOM_FREE if (v := _mib(p.search(text))) is not None), None)
    short = math.ceil(tried - free) if tried is not None and free is not None else None
    return {"gpu": int(gpu.group(1)) if gpu else None, "tried_mib": tried, "free_mib": free,
            "total_mib": total, "short_mib": short}


def oom_reason(info: dict, gpu: int | None = None) -> str:
    where = info.get("gpu") if info.get("gpu") is not None else gpu
    where_s = f"GPU {where}" if where is not None else "an unknown GPU"
    if info.get("short_mib") is not None:
        return f"CUDA OOM on {where_s}, short by {info['short_mib']} MiB"
    if info.get("tried_mib") is not None:
        return f"CUDA OOM on {where_s} (tried to allocate {info['tried_mib']:.0f} MiB)"
    return f"CUDA OOM on {where_s}"


# --- NCCL / collective timeouts (docs/research/proxmox-and-supervision.md §4.10) ------------
_NCCL = re.compile(
    r"Watchdog caught collective operation timeout"
    r"|ran for \d+ milliseconds before timing out"
    r"|watchdog got stuck for \d+ seconds"
    r"|Heartbeat monitor timed out"
    r"|NCCL (?:communicator|operation|watchdog).*(?:timeout|timed out)"
    r"|DistBackendError.*[Tt]imeout")
_NCCL_OP = re.compile(r"OpType=(\w+)")
_NCCL_MS = re.compile(r"Timeout\(ms\)=(\d+)")

# torchrun's own report of a dead worker (torch/distributed/elastic/multiprocessing/api.py):
#   "failed (exitcode: -9) local_rank: 2 (pid: 1234) of binary: /usr/bin/python"
_TORCHRUN_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_SIGNAL_RECEIVED = re.compile(r"Signal (\d+) \((SIG\w+)\) received by PID (\d+)")
_TRACEBACK = "Traceback (most recent call last)"


@dataclass
class Failure:
    """One classified failure. ``reason`` is the one line printed first."""

    kind: FailureKind
    reason: str
    rank: int | None = None
    gpu: int | None = None
    pid: int | None = None
    ts: float = field(default_factory=time.time)
    evidence: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.kind = FailureKind(self.kind)  # a misspelt kind is a bug: raise here, not downstream

    def to_json(self) -> dict:
        return dict(asdict(self), kind=self.kind.value)


# A rank that lost its connection to a peer (or heard nothing from it) reports the peer's
# failure, not its own: seen in one container, the peer's own failure is the root cause
# (a kill -9 of one drafter rank was reported as its neighbour's lost connection, noticed first).
_CONSEQUENCES = (FailureKind.PEER_FAILURE, FailureKind.NETWORK_FAILURE)


def root_cause(failures: list[Failure]) -> Failure | None:
    """The earliest failure (torchelastic reports the earliest error file as root cause).

    Rank deaths are seen by polling, so several can be noticed in one pass: the rank that
    really died first and the ones its launcher then terminated. A death whose status is
    unknown is likely such collateral and counts as a second later; among the rest, the rank
    whose last heartbeat is oldest went silent first.

    A rank that exited with the trainer's "stopped on request" code or by SIGTERM was told
    to stop — by its launcher or its peers reacting to the real failure — so it is ranked
    after every failure that was not such a reaction, however early it was noticed (seen
    under load: the survivors' exit 75 was polled before the SIGKILLed rank's death). A lost
    peer comes after the peer's own failure and before those reactions."""
    def key(f: Failure):
        collateral = f.details.get("exit_code") == EXIT_STOPPED or f.details.get("signal") == signal.SIGTERM
        penalty = 1.0 if f.details.get("status_unknown") else 0.0
        return (2 if collateral else 1 if f.kind in _CONSEQUENCES else 0, f.ts + penalty,
                f.details.get("last_heartbeat") or f.ts)
    return min(failures, key=key) if failures else None


class LineClassifier:
    """Feeds on (rank, line) and keeps what later decisions need: recent lines per rank,
    which ranks printed a traceback, what torchrun said about dead workers."""

    def __init__(self, keep: int = 40):
        self.recent: dict[int | None, deque[str]] = {}
        self.keep = keep
        self.traceback_ranks: set[int | None] = set()
        self.exit_by_rank: dict[int, dict] = {}
        self.exit_by_pid: dict[int, dict] = {}

    def _evidence(self, rank: int | None, n: int = 12) -> list[str]:
        return list(self.recent.get(rank, ()))[-n:]

    def feed(self, line: str, rank: int | None = None, gpu_of_rank: dict | None = None,
             ts: float | None = None, body: str | None = None) -> Failure | None:
        """One output line; ``rank``/``body`` when the caller already split the prefix."""
        if body is None:
            rank, body = split_rank(line)
        ring = self.recent.get(rank)
        if ring is None:
            ring = self.recent[rank] = deque(maxlen=self.keep)
        ring.append(line)
        ts = time.time() if ts is None else ts
        if _TRACEBACK in body:
            self.traceback_ranks.add(rank)
        # cheap substring tests first: at 10k lines/s the regexes are the agent's main cost
        if "exitcode" in body and (m := _TORCHRUN_FAILED.search(body)):
            info = _exit_info(int(m.group(1)))
            info.update(local_rank=int(m.group(2)), pid=int(m.group(3)), line=line)
            self.exit_by_rank[int(m.group(2))] = info
            self.exit_by_pid[int(m.group(3))] = info
        if "received by PID" in body and (m := _SIGNAL_RECEIVED.search(body)):
            info = {"exit_code": None, "signal": int(m.group(1)), "signal_name": m.group(2), "line": line}
            self.exit_by_pid.setdefault(int(m.group(3)), info)
        if "out of memory" in body or "OutOfMemoryError" in body:
            info = parse_cuda_oom(body)
            if info is not None:
                gpu = info["gpu"]
                if gpu is None and gpu_of_rank and rank in gpu_of_rank:
                    gpu = gpu_of_rank[rank]
                return Failure(FailureKind.CUDA_OOM, _with_rank(oom_reason(info, gpu), rank), rank, gpu, None, ts,
                               self._evidence(rank), info)
        if ("imeout" in body or "timing out" in body or "timed out" in body or "stuck" in body) \
                and _NCCL.search(body):
            if rank is None and (m := _RANK_IN_TEXT.search(body)):
                rank = int(m.group(1))
            details = {}
            if m := _NCCL_OP.search(body):
                details["op"] = m.group(1)
            if m := _NCCL_MS.search(body):
                details["timeout_ms"] = int(m.group(1))
            gpu = (gpu_of_rank or {}).get(rank)
            op = f" in {details['op']}" if "op" in details else ""
            return Failure(FailureKind.NCCL_TIMEOUT, _with_rank(f"NCCL collective timeout{op}", rank), rank, gpu,
                           None, ts,
                           self._evidence(rank) or [line], details)
        return None

    def had_traceback(self, rank: int | None) -> bool:
        return rank in self.traceback_ranks

    def evidence(self, rank: int | None, n: int = 12) -> list[str]:
        return self._evidence(rank, n)


def _with_rank(reason: str, rank: int | None) -> str:
    return f"{reason} (rank {rank})" if rank is not None else reason


def _exit_info(code: int) -> dict:
    # torchrun reports a signalled worker as a negative exit code
    if code < 0:
        from agent.procs import signal_name
        return {"exit_code": None, "signal": -code, "signal_name": signal_name(-code)}
    return {"exit_code": code, "signal": None, "signal_name": None}


# --- a job across containers: a broken connection to a peer rank vs a network that stopped
# delivering (gloo's TCP transport; NCCL's socket errors read the same). A peer that died
# closes its sockets, so its partners fail within seconds with a reset ("peer failure":
# the root cause is that peer, in its own container); a cut link delivers nothing and no
# RST, so the partners fail only at --dist-timeout ("network failure").
_PEER_LOST = re.compile(r"Connection (?:reset|closed) by peer|Broken pipe|ECONNRESET|EPIPE"
                        r"|remote process exited or there was a network error")
_NET_DOWN = re.compile(r"Timed out waiting \d+ ?ms for (?:send|recv)|No route to host|Network is unreachable"
                       r"|Connection timed out|Socket Timeout|Timeout waiting for key|connect\(\) timed out"
                       r"|The client socket has timed out")
_PEER_ADDR = re.compile(r"\[([0-9a-fA-F.:]+)\]:(\d+)")


def classify_comm(message: str) -> tuple[FailureKind, dict] | None:
    """(PEER_FAILURE | NETWORK_FAILURE, details) for a communication error, else None."""
    addr = _PEER_ADDR.search(message)
    details = {"peer": addr.group(1)} if addr else {}
    if _PEER_LOST.search(message):
        return FailureKind.PEER_FAILURE, details
    if _NET_DOWN.search(message):
        m = re.search(r"Timed out waiting (\d+) ?ms for (send|recv)", message)
        if m:
            details.update(timeout_ms=int(m.group(1)), op=m.group(2))
        return FailureKind.NETWORK_FAILURE, details
    return None


def classify_event(event: dict, ts: float | None = None) -> Failure | None:
    """A trainer ``error`` event (events.jsonl) as a failure."""
    if event.get("kind") != "error":
        return None
    rank, gpu = event.get("rank"), event.get("gpu")
    message = str(event.get("message", ""))
    evidence = [message] + [l for l in str(event.get("traceback", "")).splitlines()[-8:] if l]
    ts = float(event.get("ts") or ts or time.time())
    error = event.get("error")
    if error == "cuda_oom":
        info = parse_cuda_oom(message) or {"gpu": gpu}
        g = info.get("gpu") if info.get("gpu") is not None else gpu
        return Failure(FailureKind.CUDA_OOM, _with_rank(oom_reason(info, gpu), rank), rank, g, event.get("pid"), ts,
                       evidence, info)
    if error in ("rows_failed", "accounting"):  # a data job's failure, said by the job itself
        kind = FailureKind.ROWS_FAILED if error == "rows_failed" else FailureKind.DATA_JOB
        details = {k: event[k] for k in ("failed", "total") if k in event}
        return Failure(kind, message[:500], None, None, event.get("pid"), ts, evidence, details)
    if error == "nccl_timeout":
        return Failure(FailureKind.NCCL_TIMEOUT, _with_rank("NCCL collective timeout", rank), rank, gpu,
                       event.get("pid"), ts, evidence)
    comm = classify_comm(message)
    if comm is not None:
        kind, details = comm
        peer = f" (peer {details['peer']})" if details.get("peer") else ""
        if kind == FailureKind.PEER_FAILURE:
            reason = (f"peer failure: lost the connection to another rank{peer}; the root cause is in the "
                      "container of that rank")
        else:
            op = f" in {details['op']}" if details.get("op") else ""
            wait = f" after {details['timeout_ms'] / 1000:.0f} s" if details.get("timeout_ms") else ""
            reason = f"network failure: no answer from another rank{peer}{op}{wait} (link down or peer unreachable)"
        return Failure(kind, _with_rank(reason, rank), rank, gpu, event.get("pid"), ts, evidence, details)
    return Failure(FailureKind.RANK_EXIT, _with_rank(f"exception: {message[:200]}", rank), rank, gpu,
                   event.get("pid"), ts, evidence)


def _bytes_mib(n: int | None) -> str:
    return f"{n / 2**20:,.0f} MiB" if n is not None else "?"


def _oom_reason(who_full: str, oom: dict) -> str:
    """The OOM kill said with exactly the evidence agent/cgroup.py oom_evidence found."""
    limit, peak = oom.get("limit_bytes"), oom.get("peak_bytes")
    if oom.get("cgroup_oom_kills"):
        said = f"host OOM kill: {who_full} killed (cgroup oom_kill counter +{oom['cgroup_oom_kills']})"
        if oom.get("limit_reached"):
            return f"{said}; its memory cgroup's limit ({_bytes_mib(limit)}) was reached (peak {_bytes_mib(peak)})"
        if oom.get("limit_reached") is False:
            return (f"{said}; its memory cgroup's limit ({_bytes_mib(limit)}) was not reached (peak {_bytes_mib(peak)}): "
                    "the host ran out of memory")
        return said
    return (f"{who_full} killed by signal 9: possibly the host's OOM killer (the kernel's oom_kill counter rose "
            f"by {oom['host_oom_kills']} while it ran; no memory cgroup counter is visible in this container, "
            "so the victim is not certain: the node's kernel log says)")


def exit_failure(rank: int | None, pid: int | None, gpu: int | None, status: dict | None,
                 had_traceback: bool, evidence: list[str], oom: dict | None = None,
                 what: str | None = None, slot: str = "GPU") -> Failure:
    """A process (a rank, or the whole job) that ended badly, said as what is known.

    OOM only with evidence (``oom``: agent/cgroup.py oom_evidence over the attempt): the
    cgroup's oom_kill counter rose (the kernel's OOM kill of a process in this cgroup,
    whichever limit ran out; CUDA OOM text is classified from the lines, not here), or — for
    a SIGKILL where no cgroup counter is visible — the kernel's own counter rose, said as
    "possibly the host's OOM killer". A SIGKILL without either is not an OOM: an operator's
    or another tool's ``kill -9`` reads exactly the same (an external kill -9 was once
    reported as "host_oom (suspected)"), so it is named "killed by signal 9 (not by us)" —
    the agent never signals a rank before it has classified the failure. ``slot``: what
    ``gpu`` names ("GPU", or "rank slot" on CPU); None names no device at all.
    """
    who = what or (f"rank {rank}" if rank is not None else "the job")
    device = f"{slot} {gpu}" if gpu is not None and slot else ""
    where = ", ".join(x for x in (f"pid {pid}" if pid else "", device) if x)
    who_full = f"{who} ({where})" if where else who
    status = status or {}
    sig = status.get("signal")
    if oom and (oom.get("cgroup_oom_kills") or (sig == 9 and oom.get("host_oom_kills"))):
        return Failure(FailureKind.HOST_OOM, _oom_reason(who_full, oom), rank, gpu, pid, evidence=evidence,
                       details=dict(status, **oom, suspected=not oom.get("cgroup_oom_kills")))
    details = dict(status)
    if sig:
        reason = f"{who_full} killed by signal {sig} (not by us)"
        details["by_us"] = False
    elif status.get("exit_code") is not None:
        reason = f"{who_full} exited with code {status['exit_code']}"
    else:
        reason = f"{who_full} exited (status unknown: not our child)"
        details["status_unknown"] = True
    return Failure(FailureKind.RANK_EXIT if rank is not None else FailureKind.JOB_EXIT, reason, rank, gpu, pid,
                   evidence=evidence, details=details)


# --- heartbeats: stalls -------------------------------------------------------------------------
class StallMonitor:
    """A rank whose heartbeat (step, ts) has not changed for ``timeout`` s while another rank's
    has is stalled (a silent hang otherwise lasts until the NCCL timeout:
    docs/research/proxmox-and-supervision.md §4.10, §4.11). All ranks silent for ``timeout`` s
    during training is a hang of the whole job."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.last: dict[int, tuple] = {}
        self.changed_at: dict[int, float] = {}

    def update(self, heartbeats: dict[int, dict], now: float) -> None:
        for rank, hb in heartbeats.items():
            key = (hb.get("step"), hb.get("ts"))
            if self.last.get(rank) != key:
                self.last[rank] = key
                self.changed_at[rank] = now

    def check(self, heartbeats: dict[int, dict], now: float, training: bool) -> list[Failure]:
        if self.timeout <= 0 or not self.changed_at:
            return []
        silent = {r: now - t for r, t in self.changed_at.items() if now - t > self.timeout}
        moving = [r for r in self.changed_at if r not in silent]
        out = []
        if silent and (moving or training):
            for rank, quiet in sorted(silent.items()):
                hb = heartbeats.get(rank, {})
                why = "while other ranks progress" if moving else "(all ranks silent)"
                reason = (f"rank {rank} stalled: no heartbeat progress for {quiet:.0f} s at step "
                          f"{hb.get('step')} {why}")
                out.append(Failure(FailureKind.RANK_STALL, reason, rank, hb.get("gpu"), hb.get("pid"),
                                   details={"silent_s": round(quiet, 1), "step": hb.get("step"),
                                            "moving_ranks": sorted(moving)}))
        return out


# --- throughput regression ------------------------------------------------------------------
class ThroughputMonitor:
    """Steady-state tokens/s (median of the last ``window`` step events per rank, after
    ``warmup`` events) summed over ranks, against a baseline (the story: 20 → 5.4 Ktok/s
    with nobody told why, docs/design.md)."""

    def __init__(self, baseline: float | None, fraction: float, warmup: int = 3, window: int = 5):
        self.baseline, self.fraction, self.warmup, self.window = baseline, fraction, warmup, window
        self.seen: dict[Any, int] = {}
        self.values: dict[Any, deque] = {}

    def current(self) -> float | None:
        full = [v for v in self.values.values() if len(v) >= self.window]
        if not full:
            return None
        return sum(statistics.median(v) for v in full)

    def feed(self, event: dict) -> Failure | None:
        tps = event.get("tokens_per_s")
        if tps is None:
            return None
        rank = event.get("rank")
        self.seen[rank] = self.seen.get(rank, 0) + 1
        if self.seen[rank] <= self.warmup:
            return None
        self.values.setdefault(rank, deque(maxlen=self.window)).append(float(tps))
        if not self.baseline:
            return None
        # only judge once every rank that reports has a full window
        if any(len(v) < self.window for v in self.values.values()):
            return None
        now = self.current()
        limit = self.baseline * (1 - self.fraction)
        if now is not None and now < limit:
            drop = 1 - now / self.baseline
            reason = (f"throughput regression: {now:,.0f} tokens/s vs baseline {self.baseline:,.0f} "
                      f"(-{drop:.0%}, allowed -{self.fraction:.0%})")
            return Failure(FailureKind.THROUGHPUT_REGRESSION, reason, None, None, None,
                           details={"tokens_per_s": now, "baseline": self.baseline, "fraction": self.fraction,
                                    "step": event.get("step")})
        return None
