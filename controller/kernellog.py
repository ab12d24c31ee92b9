"""The node's own kernel log: what the host saw when a rank died or a GPU stopped answering.

A container cannot read its node's kernel log (no /dev/kmsg, no journal of the host); the
controller can, over the connection it already has. It reads a window of it
(``journalctl -k -o json``, else ``dmesg --time-format iso``; through ``sudo -n`` where the
node config says ``sudo = true``) and names what it finds:

- the host OOM killer, from its ``oom-kill:`` line (which container, by the cgroup
  ``task_memcg=/lxc/<ctid>/…``; which constraint) and its ``Killed process`` line;
- ``NVRM: Xid`` errors, by code, with the meaning from :data:`XID` (the one table of them);
- a GPU fallen off the bus without an Xid, and the driver saying a GPU needs a reset.

No claim without a record: every :class:`Finding` carries the kernel lines it rests on, and
a line that does not name its container (an OOM kill of another container, or one whose
cgroup is not in the line) is not attributed to this one.

Formats followed (docs/sim.md lists where each was checked): journalctl's JSON export
(``__REALTIME_TIMESTAMP`` in µs since the epoch, ``MESSAGE``), its ``short-iso`` lines
(``2026-12-05T19:41:04+0000 host kernel: …``, ``+00:00`` from systemd 254), dmesg's
``--time-format iso`` (``2026-12-05T19:41:04,842881+00:00 …``); the kernel's
``mm/oom_kill.c`` messages and the NVIDIA driver's Xid lines.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Optional

from controller.pct import SUDO


@dataclass(frozen=True)
class XidCode:
    """One NVIDIA Xid code: what it means and whose fault it usually is. ``reset``: the GPU
    needs a reset (or the node a reboot) before it can be trusted again.
    Source: NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors)."""

    code: int
    meaning: str
    cause: str  # "application" | "memory" | "hardware" | "firmware" | "driver"
    reset: bool = False


XID: dict[int, XidCode] = {x.code: x for x in (
    XidCode(13, "graphics engine exception: usually the program (an illegal access or instruction)", "application"),
    XidCode(31, "GPU memory page fault: usually the program (an illegal address)", "application"),
    XidCode(43, "GPU stopped processing: a fault of the program's channel; the GPU itself is fine", "application"),
    XidCode(48, "double-bit ECC error (DBE): an uncorrectable memory error", "memory", reset=True),
    XidCode(63, "ECC page retirement or row remapping recorded: a reset applies it", "memory", reset=True),
    XidCode(64, "ECC page retirement or row remapping failed", "memory", reset=True),
    XidCode(74, "NVLink error", "hardware", reset=True),
    XidCode(79, "GPU has fallen off the bus: it no longer answers (power, heat, PCIe, hardware)", "hardware",
            reset=True),
    XidCode(92, "high single-bit ECC error rate", "memory"),
    XidCode(94, "contained ECC error: the program that touched the memory was stopped; the rest runs on",
            "memory"),
    XidCode(95, "uncontained ECC error: every program on the GPU is affected", "memory", reset=True),
    XidCode(119, "GSP RPC timeout: the GPU System Processor stopped answering", "firmware", reset=True),
    XidCode(120, "GSP error: the GPU System Processor failed", "firmware", reset=True),
    XidCode(154, "GPU recovery action changed: the driver says what the GPU now needs (reset or reboot)",
            "driver", reset=True),
)}


def pci_key(text: Optional[str]) -> Optional[tuple[int, int, int]]:
    """(domain, bus, device) of a PCI address as the driver's Xid line ("0000:3b:00") or NVML
    ("00000000:3B:00.0") writes it, so the two can be compared."""
    m = re.fullmatch(r"(?:PCI:)?(?:([0-9A-Fa-f]+):)?([0-9A-Fa-f]+):([0-9A-Fa-f]+)(?:\.[0-7])?", (text or "").strip())
    return (int(m.group(1) or "0", 16), int(m.group(2), 16), int(m.group(3), 16)) if m else None


def xid_meaning(code: int) -> str:
    x = XID.get(code)
    return x.meaning if x else "not in dflash-ctl's table: see NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors)"


@dataclass(frozen=True)
class KernelRecord:
    """One kernel log line and when the node logged it (seconds since the epoch)."""

    ts: float
    message: str


@dataclass(frozen=True)
class Finding:
    """What the kernel log says, in one line, and the kernel lines it rests on.
    ``kind``: ``host_oom``, ``xid``, ``gpu_fallen_off`` or ``gpu_reset``."""

    kind: str
    ts: float
    summary: str
    records: tuple[str, ...]
    details: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"kind": self.kind, "ts": self.ts, "summary": self.summary, "records": list(self.records),
                "details": dict(self.details)}

    @classmethod
    def from_json(cls, doc: dict) -> "Finding":
        return cls(str(doc["kind"]), float(doc["ts"]), str(doc["summary"]), tuple(doc.get("records") or ()),
                   dict(doc.get("details") or {}))


# --- the three output formats --------------------------------------------------------------

def parse_journal_json(text: str) -> list[KernelRecord]:
    """``journalctl -o json``: one object a line; MESSAGE is a string, or a list of byte
    values when it is not valid UTF-8 (journalctl's export rule)."""
    out = []
    for line in text.splitlines():
        try:
            doc = json.loads(line)
            ts = int(doc["__REALTIME_TIMESTAMP"]) / 1e6
        except (ValueError, KeyError, TypeError):
            continue
        msg = doc.get("MESSAGE")
        if isinstance(msg, list):
            msg = bytes(b & 0xFF for b in msg if isinstance(b, int)).decode("utf-8", "replace")
        if isinstance(msg, str):
            out.append(KernelRecord(ts, msg))
    return out


_ISO = r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:[.,](\d+))?(Z|[+-]\d\d:?\d\d)"
_SHORT_ISO = re.compile(r"^" + _ISO + r"\s+\S+\s+kernel:\s?(.*)$")
_DMESG_ISO = re.compile(r"^" + _ISO + r"\s(.*)$")


def _iso_ts(stamp: str, frac: Optional[str], zone: str) -> float:
    zone = "+00:00" if zone == "Z" else zone if ":" in zone else f"{zone[:3]}:{zone[3:]}"
    ts = datetime.fromisoformat(stamp + zone).timestamp()
    return ts + (int(frac) / 10 ** len(frac) if frac else 0.0)


def parse_text(text: str) -> list[KernelRecord]:
    """``journalctl -k -o short-iso`` or ``dmesg --time-format iso`` lines. A line without a
    stamp continues the record before it (dmesg prints a multi-line message that way)."""
    out: list[KernelRecord] = []
    for line in text.splitlines():
        m = _SHORT_ISO.match(line) or _DMESG_ISO.match(line)
        if m:
            out.append(KernelRecord(_iso_ts(m.group(1), m.group(2), m.group(3)), m.group(4)))
        elif out and line.strip() and not line.startswith("-- "):  # "-- No entries --", "-- Boot …"
            out.append(KernelRecord(out[-1].ts, line.strip()))
    return out


# --- what the lines say --------------------------------------------------------------------

# mm/oom_kill.c dump_oom_summary (kernel >= 4.19):
#   oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=ns,mems_allowed=0,oom_memcg=/lxc/200,
#   task_memcg=/lxc/200/ns/user.slice,task=python3,pid=1234,uid=100000
_OOM_SUMMARY = re.compile(r"oom-kill:(\S+)")
# __oom_kill_process: "Memory cgroup out of memory: Killed process 1234 (python3) total-vm:…kB, anon-rss:…kB, …"
# ("Out of memory: Killed process …" when the whole node ran out).
_OOM_KILLED = re.compile(r"(Memory cgroup out of memory|Out of memory): Killed process (\d+) \(([^)]*)\)"
                         r"(?:.*?anon-rss:(\d+)kB)?")
_MEMCG_USAGE = re.compile(r"^memory: usage (\d+)kB, limit (\d+)kB")
# Proxmox puts a container's processes under /lxc/<ctid>/ (cgroup v2: /lxc/<ctid>/ns/…);
# LXC's own default is /lxc.payload.<name>/.
_LXC_CGROUP = re.compile(r"^/lxc(?:/|\.payload\.)(\d+)(?:/|$)")
_XID = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f:.]+)\): (\d+)(.*)$")
_XID_PID = re.compile(r"pid=('?)([^,']*)\1")
_XID_NAME = re.compile(r"name=([^,]*)")
_FALLEN = re.compile(r"NVRM: (?:The NVIDIA GPU|GPU at PCI:|GPU) ?([0-9A-Fa-f:.]+)?.*fallen off the bus", re.I)
_NVRM_GPU = re.compile(r"NVRM: The NVIDIA GPU ([0-9A-Fa-f:.]+)")
_RESET = re.compile(r"NVRM: .*(NV_ERR_RESET_REQUIRED|NV_ERR_GPU_IN_FULLCHIP_RESET|GPU Reset Required|"
                    r"Node Reboot Required)")


def _fields(summary: str) -> dict[str, str]:
    out = {}
    for part in summary.split(","):
        key, sep, value = part.partition("=")
        if sep:
            out[key] = value
    return out


def _clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


def _gib(kib: int) -> str:
    return f"{kib / 2**20:.1f} GiB"


def findings(records: list[KernelRecord], ctid: Optional[str] = None) -> list[Finding]:
    """What ``records`` say, in log order. With ``ctid``, an OOM kill is named only when its
    cgroup shows it was in that container."""
    out: list[Finding] = []
    usage: Optional[tuple[int, int, str]] = None  # (usage kB, limit kB, line) of the report being read
    pending_oom: Optional[tuple[KernelRecord, dict]] = None
    last_gpu: Optional[str] = None
    for rec in records:
        msg = rec.message
        m = _MEMCG_USAGE.match(msg)
        if m:
            usage = (int(m.group(1)), int(m.group(2)), msg)
            continue
        m = _OOM_SUMMARY.search(msg)
        if m:
            pending_oom = (rec, _fields(m.group(1)))
            continue
        m = _OOM_KILLED.search(msg)
        if m:
            found = _oom_finding(rec, m, pending_oom, usage, ctid)
            if found:
                out.append(found)
            pending_oom, usage = None, None
            continue
        m = _XID.search(msg)
        if m:
            out.append(_xid_finding(rec, m))
            continue
        m = _NVRM_GPU.search(msg)
        if m:
            last_gpu = m.group(1)
        if "fallen off the bus" in msg:
            g = _FALLEN.search(msg)
            pci = (g.group(1).rstrip(":.") if g and g.group(1) else None) or last_gpu
            if any(f.kind == "xid" and f.details.get("code") == 79 and rec.ts - f.ts < 10 for f in out):
                continue  # the driver's words after its own Xid 79: one event, named once
            out.append(Finding("gpu_fallen_off", rec.ts, f"GPU {pci or '(PCI address not in the line)'} fell off "
                               f"the bus at {_clock(rec.ts)} (the driver's words; no Xid line with it)",
                               (msg,), {"pci": pci}))
            continue
        m = _RESET.search(msg)
        if m:
            out.append(Finding("gpu_reset", rec.ts, f"the driver says a GPU needs a reset at {_clock(rec.ts)} "
                               f"({m.group(1)})", (msg,), {"what": m.group(1)}))
    return out


def _oom_finding(rec: KernelRecord, m: re.Match, summary: Optional[tuple[KernelRecord, dict]],
                 usage: Optional[tuple[int, int, str]], ctid: Optional[str]) -> Optional[Finding]:
    pid, name = int(m.group(2)), m.group(3)
    fields = summary[1] if summary and summary[1].get("pid") == str(pid) else {}
    cg = _LXC_CGROUP.match(fields.get("task_memcg", ""))
    container = cg.group(1) if cg else None
    if ctid is not None and container != str(ctid):
        return None  # another container's, or a kill whose cgroup the log does not show: no claim
    constraint = fields.get("constraint") or "unknown"
    lines = ([summary[0].message] if fields else []) + ([usage[2]] if usage else []) + [rec.message]
    if constraint == "CONSTRAINT_MEMCG" or m.group(1) == "Memory cgroup out of memory":
        why = "the container's memory limit was reached"
        if usage and fields.get("oom_memcg", "").startswith(f"/lxc/{container}"):
            why += f" ({_gib(usage[0])} used of {_gib(usage[1])})"
    elif constraint == "CONSTRAINT_NONE":
        why = "the node itself ran out of memory"
    else:
        why = f"constraint {constraint}"
    rss = f", {_gib(int(m.group(4)))} resident" if m.group(4) else ""
    where = f" in container {container}" if container else ""
    text = (f"the node's OOM killer killed pid {pid} ({name}){where} at {_clock(rec.ts)}{rss}: {why}")
    return Finding("host_oom", rec.ts, text, tuple(lines),
                   {"pid": pid, "process": name, "container": container, "constraint": constraint,
                    "cgroup_limit_kib": usage[1] if usage else None, "anon_rss_kib": int(m.group(4)) if m.group(4) else None})


def _xid_finding(rec: KernelRecord, m: re.Match) -> Finding:
    pci, code, rest = m.group(1), int(m.group(2)), m.group(3)
    pid_m, name_m = _XID_PID.search(rest), _XID_NAME.search(rest)
    pid = pid_m.group(2) if pid_m else None
    name = name_m.group(1).strip() if name_m else None
    who = ""
    if pid and pid.isdigit():
        who = f" (pid {pid}{' ' + name if name and name != '<unknown>' else ''})"
    x = XID.get(code)
    tail = "; the GPU needs a reset before it can be trusted" if x and x.reset else ""
    text = f"Xid {code} on GPU PCI:{pci} at {_clock(rec.ts)}{who}: {xid_meaning(code)}{tail}"
    return Finding("xid", rec.ts, text, (rec.message,),
                   {"code": code, "pci": pci, "pid": int(pid) if pid and pid.isdigit() else None, "process": name,
                    "cause": x.cause if x else None, "reset": bool(x and x.reset)})


# --- reading it on the node ----------------------------------------------------------------

@dataclass
class Reading:
    """One read of the node's kernel log: the findings, and how it was read (or why not)."""

    since: float
    until: float
    source: Optional[str] = None  # "journalctl -k", "dmesg"
    findings: list[Finding] = field(default_factory=list)
    error: Optional[str] = None

    def to_json(self) -> dict:
        return {"since": self.since, "until": self.until, "source": self.source, "error": self.error,
                "findings": [f.to_json() for f in self.findings]}

    @classmethod
    def from_json(cls, doc: dict) -> "Reading":
        return cls(float(doc["since"]), float(doc["until"]), doc.get("source"),
                   [Finding.from_json(f) for f in doc.get("findings") or []], doc.get("error"))

    def lines(self) -> list[str]:
        """``ctl status``'s lines: each finding, or that the log was read and said nothing of
        the kind, or why it could not be read."""
        span = f"{_clock(self.since)}–{_clock(self.until)}"
        if self.error:
            return [f"node     kernel log not read ({self.error})"]
        if not self.findings:
            return [f"node     kernel log ({self.source}, {span}): no OOM kill, Xid or GPU reset"]
        return [f"node     kernel ({self.source}): {f.summary}" for f in self.findings]


_NOT_SHOWN = "not seeing messages from other users and the system"


def commands(node, since: Optional[float], until: Optional[float] = None) -> list[tuple[str, list[str]]]:
    """(source, argv) to try in order; ``since`` None: the whole of this boot (``-k`` implies
    ``-b``; dmesg's buffer is this boot's). ``@<epoch>`` is systemd.time's own syntax for an
    absolute time, so no clock format or time zone of the node is involved."""
    prefix = list(SUDO) if node.sudo else []
    window = (["--since", f"@{int(since)}"] if since is not None else []) + \
        (["--until", f"@{int(until) + 1}"] if until is not None else [])
    return [("journalctl -k", prefix + [node.journalctl, "-k", *window, "-o", "json", "--no-pager"]),
            ("dmesg", prefix + [node.dmesg, "--time-format", "iso"])]


def read(runner, node, since: Optional[float], until: Optional[float] = None, ctid: Optional[str] = None) -> Reading:
    """The node's kernel log from ``since`` (None: this boot's start) to ``until`` (epoch
    seconds), read through ``runner`` (the node's), and what it says about container ``ctid``."""
    end = until if until is not None else time.time()
    errors = []
    for source, argv in commands(node, since, until):
        try:
            result = runner.run(argv)
        except Exception as exc:  # noqa: BLE001 - a transport failure is this read's answer, not a crash
            errors.append(f"{source}: {str(exc).splitlines()[0][:160]}")
            continue
        if not result.ok:
            errors.append(f"{source}: exit {result.returncode}: {(result.stderr.strip() or result.stdout.strip())[:160]}")
            continue
        if _NOT_SHOWN in result.stderr:
            # journalctl shows a user outside groups adm/systemd-journal no system messages,
            # and says so only in this hint: an empty answer here is not "nothing happened"
            errors.append(f"{source}: shows this user no kernel messages: set sudo = true for the node (with a "
                          f"sudoers rule for {node.journalctl}) or add the user to group adm or systemd-journal")
            continue
        records = parse_journal_json(result.stdout) if source.startswith("journalctl") else parse_text(result.stdout)
        records = [r for r in records if (since is None or since <= r.ts) and r.ts <= end + 1]
        return Reading(since or 0.0, end, source, findings(records, ctid))
    return Reading(since or 0.0, end, None, [], "; ".join(errors))


# How much of the log is "around that moment": the kernel logs an OOM kill or an Xid before
# the agent notices the rank is gone (its poll, a heartbeat), and a GPU that stops answering
# stalls its rank until the stall timeout; so from shortly before the rank's last sign of
# life to shortly after the failure was named.
BEFORE_S = 120.0
AFTER_S = 30.0

# Root causes whose moment the node's log may explain: a rank gone, stalled, or its GPU lost.
DEATHS = ("rank_exit", "host_oom", "rank_stall", "nccl_timeout", "job_exit", "startup_timeout")


def window(root_cause: dict) -> Optional[tuple[float, float]]:
    """(since, until) around a failure's moment, or None for a failure the node cannot explain."""
    if not isinstance(root_cause, dict) or root_cause.get("kind") not in DEATHS:
        return None
    ts = root_cause.get("ts")
    if not isinstance(ts, (int, float)):
        return None
    last = (root_cause.get("details") or {}).get("last_heartbeat")
    start = min(ts, last) if isinstance(last, (int, float)) else ts
    return start - BEFORE_S, ts + AFTER_S


GPU_LOST_LOOKBACK_S = 600.0  # a live run's GPU that stopped answering: the last ten minutes of the log


def _memory_limit(ct) -> Optional[str]:
    """The container's configured memory (and swap) limit, as `pct config` shows it."""
    try:
        result = ct.pct("config", ct.ctid)
    except Exception:  # noqa: BLE001 - the finding stands without it
        return None
    keys = dict(line.split(":", 1) for line in result.stdout.splitlines() if ":" in line) if result.ok else {}
    mem, swap = keys.get("memory", "").strip(), keys.get("swap", "").strip()
    if not mem.isdigit():
        return None
    return f"memory {mem} MiB" + (f" + swap {swap} MiB" if swap.isdigit() else "") + f" (pct config {ct.ctid})"


def _with_limit(ct, reading: Reading) -> Reading:
    """A host OOM kill's finding gains the container's configured limit (`pct config`)."""
    from dataclasses import replace

    if any(f.kind == "host_oom" for f in reading.findings):
        limit = _memory_limit(ct)
        if limit:
            reading.findings = [replace(f, summary=f"{f.summary}; its limit: {limit}",
                                        details=dict(f.details, limit=limit)) if f.kind == "host_oom" else f
                                for f in reading.findings]
    return reading


def for_failure(ct, root_cause: dict, fallback_ts: Optional[float] = None) -> Optional[Reading]:
    """The node's log around a failure (its root cause's moment; else the alert's time, for a
    failure recorded without one); None when the failure is not a death the node can explain."""
    cause = dict(root_cause or {})
    if not isinstance(cause.get("ts"), (int, float)) and fallback_ts is not None:
        cause["ts"] = fallback_ts
    span = window(cause)
    if span is None:
        return None
    return _with_limit(ct, read(ct.runner, ct.node, span[0], span[1], ctid=str(ct.ctid)))


def evidence_alert(failure, reading: Reading):
    """The ``node_evidence`` alert for a failure alert (agent/alerts.py ``Alert``): its cause
    the failure's, then what the node's kernel log names; its id stable per failure alert."""
    from agent.alerts import SEVERITY, Alert, AlertKind, alert_id

    kind = AlertKind.NODE_EVIDENCE
    named = "; ".join(f.summary for f in reading.findings)
    return Alert(id=alert_id(failure.run, kind.value, failure.id), kind=kind.value, run=failure.run, ts=time.time(),
                 cause=f"{failure.cause} — the node's kernel log ({reading.source}): {named}", next=failure.next,
                 container=failure.container, node=failure.node, severity=SEVERITY[kind], step=failure.step,
                 details={"refers_to": failure.id, "source": reading.source, "since": reading.since,
                          "until": reading.until, "findings": [f.to_json() for f in reading.findings]})


def for_run(ct, reply: dict, now: Optional[float] = None) -> Optional[Reading]:
    """The node's kernel log around the moment a run's rank died or its GPU stopped
    answering, read for ``ctl status`` (``reply``: agent.runview's); None when the run had
    no such moment."""
    from agent.protocol import RunResult, RunState, RunStatus

    st = RunStatus.from_json(reply.get("status"))
    res = RunResult.from_json(reply.get("result"))
    span = window((res.root_cause if res else None) or {}) if st.state == RunState.FAILED else None
    if span is None and any(isinstance(g, dict) and g.get("state") == "invalid" for g in st.gpus or []):
        now = now or time.time()
        span = (now - GPU_LOST_LOOKBACK_S, now)
    if span is None:
        return None
    return _with_limit(ct, read(ct.runner, ct.node, span[0], span[1], ctid=str(ct.ctid)))
