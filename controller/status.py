"""`ctl status` and `ctl runs` rendering: plain functions from the in-container views
(agent/runview.py, the agent's list) to lines. A failure shows as its named reason first."""

from __future__ import annotations

import re
import time
from typing import Any, Optional

from agent.protocol import RunResult, RunState, RunStatus, fmt_duration  # noqa: F401 (livetail imports it here)
from controller.tail import fmt_rate, progress_parts


def _run_started(reply: dict) -> Optional[float]:
    created = (reply.get("spec") or {}).get("created")
    return float(created) if isinstance(created, (int, float)) else None


def eta_seconds(status: RunStatus | dict, started: Optional[float], now: Optional[float] = None) -> Optional[float]:
    """Remaining time from the average step time so far (includes start-up: a fair upper bound
    early on, accurate later). ``status``: the record, or its status.json document."""
    if not isinstance(status, RunStatus):
        status = RunStatus.from_json(status)
    step, total = status.step, status.total
    if not isinstance(step, (int, float)) or not isinstance(total, (int, float)) or step <= 0 or not started:
        return None
    elapsed = (status.updated or now or time.time()) - started
    if elapsed <= 0:
        return None
    return max(0.0, (total - step) * elapsed / step)


def _chart(series) -> str:
    """The series over the run as an inline chart, with its range (controller/sparkline.py)."""
    values = [v for v in (series or []) if isinstance(v, (int, float))]
    if len(values) < 2:
        return ""
    from controller.sparkline import sparkline

    lo, hi = min(values), max(values)
    span = f"{lo:.3g}…{hi:.3g}" if hi < 1000 else f"{fmt_rate(lo)}…{fmt_rate(hi)}"
    return f"   {sparkline(values, 24)}  ({span} over the run)"


def restart_message(reply: dict, ctid: str, node: Optional[str]) -> Optional[str]:
    """"container 200 restarted at …; the run died at step N; resume with `ctl launch …`" when
    the run's container restarted (or its node rebooted) under it (agent.runview's
    ``host_restart``), else None."""
    from controller.resume import resume_line

    restart = reply.get("host_restart")
    if not isinstance(restart, dict):
        return None
    at = restart.get("at")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at)) if isinstance(at, (int, float)) else "an unknown time"
    what = (f"container {ctid} restarted at {when}" if restart.get("kind") == "container"
            else f"node {node} rebooted at {when} (and container {ctid} with it)")
    st = RunStatus.from_json(reply.get("status"))
    step = restart.get("step") if restart.get("step") is not None else (st.step or 0)
    ckpt = {"path": st.checkpoint.path} if st.checkpoint else None
    line = resume_line(ctid, node, reply.get("resume"), ckpt)
    return f"{what}; the run died at step {step}; resume with `{line}`"


SERVED_SHOWN = 3  # the newest served checks `ctl status` lists


def served_lines(served: list[dict]) -> list[str]:
    """The served checks beside τ at save (agent/protocol.py ServedCheck), newest last: served τ,
    the reference, the verdict; a failed one names its first cause."""
    lines = []
    for r in served[-SERVED_SHOWN:]:
        tau, ref = r.get("tau_served"), r.get("tau_at_save")
        vs = (f" vs {ref:.3f} at save ({100 * (tau / ref - 1):+.1f} %)" if isinstance(tau, (int, float))
              and isinstance(ref, (int, float)) and ref else "")
        what = f"{tau:.3f}" if isinstance(tau, (int, float)) else "—"
        cause = f": {r['causes'][0]}" if not r.get("ok") and r.get("causes") else ""
        lines.append(f"served   τ {what}{vs} at step {r.get('step')} on {r.get('device') or '?'}: "
                     f"{'PASS' if r.get('ok') else (r.get('verdict') or 'fail').upper()}{cause}")
    return lines


def render_status(reply: dict, ctid: str, node: str) -> list[str]:
    st = RunStatus.from_json(reply.get("status"))
    res = RunResult.from_json(reply.get("result"))
    state = st.state.value if st.state else ("ended" if res else "unknown")
    terminal = st.terminal
    lines = [f"run      {reply.get('run_id')}  (container {ctid} on node {node}"
             + (", latest" if reply.get("latest") else "") + ")"]
    reason = _reason(st, res)
    died = restart_message(reply, ctid, node)
    if died:
        # Never "running — agent alive" for a run whose every process went with its container.
        lines.append(f"FAILED   {died}")
        lines.append(f"state    {state if terminal else f'{state} (recorded; nothing of it runs)'}")
        if st.checkpoint:
            lines.append(f"ckpt     step {st.checkpoint.step}: {st.checkpoint.path}")
        return lines
    if st.state == RunState.FAILED and reason:
        lines.append(f"FAILED   {reason}")
        lines += [f"         | {line}" for line in ((res.root_cause or {}).get("evidence") or [])[-EVIDENCE_LINES:]]
    lines += node_evidence_lines(reply.get("node_evidence"))
    phase = f", phase {st.phase}" if st.phase else ""
    alive = "" if terminal else (" — agent alive" if reply.get("agent_alive") else " — AGENT NOT RUNNING")
    lines.append(f"state    {state}{phase}{alive}")
    lines += _supervision(st, reply.get("revived"), now=time.time())
    if st.progress:  # a data job (trainer/kinds.py): done / failed / rates / ETA
        kind = reply.get("kind")
        lines.append(f"progress {' · '.join(progress_parts(st.progress, eta=not terminal))}"
                     + (f"  ({kind} job)" if kind else ""))
    if st.step is not None:
        pct = f" ({100 * st.step / st.total:.0f} %)" if st.total else ""
        eta = "" if terminal else f", ETA {fmt_duration(eta_seconds(st, _run_started(reply)))}"
        lines.append(f"step     {st.step}" + (f"/{st.total}" if st.total else "") + pct + eta)
    hist = reply.get("history") or {}
    if st.loss is not None:
        lines.append(f"loss     {st.loss:.4f}" + (f"  (lr {st.lr:.2e})" if isinstance(st.lr, (int, float)) else "")
                     + _chart(hist.get("loss")))
    taus = [t for t in (hist.get("tau") or []) if isinstance(t, (int, float))]
    if taus:  # τ at each save (--eval-prompts): what serving buys, and the checkpoint that serves best
        best = hist.get("best") or {}
        at = (hist.get("eval_step") or [None])[-1]
        lines.append(f"tau      {taus[-1]:.3f}" + (f" at step {at}" if at is not None else "")
                     + (f"  (best {best['tau']:.3f} at step {best['step']}: `ctl export --best`)"
                        if isinstance(best.get("tau"), (int, float)) else "") + _chart(taus))
    lines += served_lines(hist.get("served") or [])
    rate = st.steady_tokens_per_s or st.tokens_per_s
    if rate is not None:
        baseline = reply.get("baseline") or {}
        base = (baseline.get("steady") or {}).get("tokens_per_s")
        if baseline.get("run_id") == reply.get("run_id"):
            vs = f" (steady {fmt_rate(base)}: this run is the known-good baseline)"
        elif base:
            vs = f" vs baseline {fmt_rate(base)} of run {baseline.get('run_id')}: {100 * rate / base:.0f} %"
        else:
            vs = " (no baseline for this config yet)"
        lines.append(f"tok/s    {fmt_rate(rate)}{vs}" + _chart(hist.get("tokens_per_s")))
    cpu = st.gpu_state == "no GPU"
    for rank, r in sorted(st.ranks.items()):
        where = (f"rank slot {r.gpu} (CPU)" if cpu else f"GPU {r.gpu}") if r.gpu is not None else "CPU"
        lines.append(f"rank {rank}   {r.role or '?'} on {where}: {r.health}, step {r.step}, "
                     f"heartbeat {r.heartbeat_age_s} s ago")
    roles = _roles(reply, st)
    if st.gpus:
        for g in st.gpus:
            mem = g.get("memory_used_mib"), g.get("memory_total_mib")
            role = "+".join(r for r, ids in roles.items() if g.get("index") in ids) or "unused"
            lines.append(f"GPU {g.get('index')}    {role}: util {g.get('utilization_gpu_pct', '—')} %, mem "
                         f"{_gib(mem[0])}/{_gib(mem[1])} GiB, {g.get('temperature_gpu_c', '—')} °C")
    elif st.gpu_state or st.gpu_reason:
        lines.append(f"GPUs     none ({st.gpu_reason or st.gpu_state})")
    if st.checkpoint:
        lines.append(f"ckpt     step {st.checkpoint.step}: {st.checkpoint.path}")
    if st.state != RunState.FAILED and reason and terminal:
        lines.append(f"result   {reason}")
    lines += alert_lines(reply.get("alerts"), now=time.time())
    return lines


def node_evidence_lines(doc: Optional[dict]) -> list[str]:
    """What the node's kernel log said around the failure (controller/kernellog.py), with the
    kernel lines each finding rests on."""
    if not isinstance(doc, dict):
        return []
    from controller.kernellog import Reading

    reading = Reading.from_json(doc)
    lines = reading.lines()[:1] if not reading.findings else []
    for f, line in zip(reading.findings, reading.lines()):
        lines.append(line)
        lines += [f"         | {r}" for r in f.records[-3:]]
    return lines


def alert_lines(alerts: Optional[dict], now: float) -> list[str]:
    """The run's alerts (agent/alertcmd.py summary): the last one, and every one that reached
    no channel yet, which `ctl watch` delivers from this side."""
    if not alerts or not alerts.get("count"):
        return []
    last = alerts.get("last") or {}
    ago = fmt_duration(now - last["ts"]) if isinstance(last.get("ts"), (int, float)) else "?"
    lines = [f"alerts   {alerts['count']} raised; last {last.get('kind')} {ago} ago: {last.get('cause')}"]
    for u in alerts.get("undelivered") or []:
        lines.append(f"ALERT    not delivered: {u.get('kind')}: {u.get('cause')} ({u.get('error') or 'pending'}); "
                     "`ctl watch` delivers it from here")
    return lines


EVIDENCE_LINES = 5  # of the root cause's evidence (its rank's last output lines) under FAILED


def _supervision(st: RunStatus, revived: Optional[dict], now: float) -> list[str]:
    """When and why an agent took over this run after its agent was gone."""
    lines = []
    if revived and revived.get("ok"):
        lines.append(f"agent    none was supervising this run: ctl status started one (pid {revived.get('agent_pid')})")
    elif revived:
        lines.append(f"agent    none is supervising this run and none could be started: {revived.get('error')}")
    if st.reattaches:
        last = st.reattaches[-1]
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last.get("ts") or now))
        times = f" ({len(st.reattaches)} times)" if len(st.reattaches) > 1 else ""
        lines.append(f"agent    re-attached{times}: last at {when} ({fmt_duration(now - (last.get('ts') or now))} "
                     f"ago) by {last.get('by')}: {last.get('why')}")
    return lines


def _gib(mib: Any) -> str:
    return f"{mib / 1024:.1f}" if isinstance(mib, (int, float)) else "—"


def _reason(st: RunStatus, res: Optional[RunResult]) -> Optional[str]:
    cause = (res.root_cause if res else None) or {}
    reason = cause.get("reason") or (res.reason if res else None) or st.reason or st.last_error
    if cause.get("kind") and reason and cause["kind"] not in reason:
        reason = f"{cause['kind']}: {reason}"
    return reason


_GPU_FLAG = re.compile(r"--(target|drafter)-gpus$")


def _roles(reply: dict, st: RunStatus) -> dict[str, list[int]]:
    """GPU roles from the launch record, else from the job argv when it is the trainer's own."""
    if isinstance(reply.get("gpus"), dict):
        return {k: list(v) for k, v in reply["gpus"].items()}
    argv = list(st.argv or (reply.get("spec") or {}).get("argv") or [])
    out: dict[str, list[int]] = {}
    for i, tok in enumerate(argv[:-1]):
        m = _GPU_FLAG.match(tok)
        if m:
            out[m.group(1)] = [int(x) for x in argv[i + 1].split(",") if x.strip().isdigit()]
    return out


def render_runs(reply: dict, ctid: str) -> list[str]:
    runs = reply.get("runs") or []
    if not runs:
        return [f"no runs in container {ctid} ({reply.get('workspace')}/runs)"]
    lines = [f"{'RUN':<36} {'STATE':<10} {'STEP':>6}  REASON"]
    for r in runs:
        step = "" if r.get("step") is None else str(r["step"])
        state = r.get("state") or "?"
        if not r.get("agent_alive") and not (r.get("state") and RunState(r["state"]).is_terminal()):
            state += "*"
        lines.append(f"{r['run_id']:<36} {state:<10} {step:>6}  {r.get('reason') or ''}")
    if any(l.split()[1].endswith("*") for l in lines[1:] if len(l.split()) > 1):
        lines.append("* no agent is supervising this unfinished run: `ctl status --run ID` starts one that re-attaches")
    return lines
