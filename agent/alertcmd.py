"""The alert verbs ctl calls in a container (`python3 -m agent.alertcmd VERB`), each one round
trip, JSON request on stdin, sentinel-wrapped JSON reply:

    configure --run-dir D     {config, secrets}: notify.json and the 0600 secrets file
    overview --workspace W    {channels: {name: filter}, handover_s}: every run's row for `ctl status
                              --all` / `ctl watch`, and the alerts ctl should deliver itself on
                              the channels (of the operator's config) whose filter takes them
    ack --run-dir D           {acks: [{id, channel, ok, error}]}: deliveries made by ctl watch
    evidence --run-dir D      {refers_to, ts, reading, alert, channels}: what ctl watch found in the
                              node's kernel log about a failure alert (node_evidence.jsonl); the
                              reply names the channels that owe its alert

Secrets come only on stdin (never argv) and go only into the secrets file.
"""

from __future__ import annotations

import json
import os
import sys
import time

from agent.alerts import Alert, AlertKind, Thresholds
from agent.alertwatch import (HANDOVER_S, Outbox, add_node_evidence, load_notify, node_evidence, owed, pending,
                              run_alerts, write_notify)
from agent.protocol import RunStatus, wrap_payload
from agent.rundir import RunDir, agent_alive


def summary(run_dir: str) -> dict:
    """The alerts of a run for `ctl status`: how many, the last, and those that reached no
    channel of the container's (a container without a route out, a receiver down)."""
    alerts = run_alerts(run_dir)
    channels = load_notify(run_dir).get("channels") or {}
    outbox = Outbox(run_dir)
    undelivered = []
    for a, left in pending(run_dir, channels, outbox) if channels else [(a, []) for a in alerts]:
        errors = [outbox.state.get((a.id, n), {}).get("error") for n in left]
        undelivered.append({"id": a.id, "kind": a.kind, "ts": a.ts, "cause": a.cause, "channels": left,
                            "error": next((e for e in errors if e), None)
                            if channels else "no channel is configured in the container"})
    # an alert delivered by ctl watch on its own channels is delivered, whatever the container's
    done_by_ctl = {i for (i, _), st in outbox.state.items() if st.get("ok") and st.get("by") == "ctl watch"}
    undelivered = [u for u in undelivered if u["id"] not in done_by_ctl]
    return {"count": len(alerts), "last": alerts[-1].to_json() if alerts else None, "undelivered": undelivered,
            "channels": sorted(channels)}


def _row(rd: RunDir) -> dict:
    st = RunStatus()
    try:
        st = RunStatus.load(rd.status)
    except ValueError:
        pass
    now = time.time()
    ages = [r.heartbeat_age_s for r in st.ranks.values() if r.heartbeat_age_s is not None]
    health = "ok"
    if any(r.health == "dead" for r in st.ranks.values()):
        health = "rank dead"
    elif st.state and not st.terminal and not agent_alive(rd):
        health = "no agent"
    elif st.last_error and not st.terminal:
        health = "failing"
    step_age = (now - st.updated + min(ages)) if ages and st.updated else None
    return {"run_id": rd.run_id, "state": st.state.value if st.state else None, "step": st.step, "total": st.total,
            "tokens_per_s": st.steady_tokens_per_s or st.tokens_per_s, "step_age_s": step_age, "health": health,
            "reason": st.reason or st.last_error, "updated": st.updated, "progress": st.progress}


def _filters(channels) -> dict:
    """The request's channels: name -> filter (notify.channel_filter); a bare list of names
    (an older ctl) is every kind on each."""
    if isinstance(channels, dict):
        return {str(k): v if isinstance(v, dict) else {} for k, v in channels.items()}
    return {str(name): {} for name in channels or []}


def overview(workspace: str, channels, handover_s: float = HANDOVER_S, all_runs: bool = False) -> dict:
    """Every live run (and, for delivery, every run with alerts not yet delivered on the
    operator's channels) of the workspace."""
    base = os.path.join(workspace, "runs")
    channels = _filters(channels)
    rows, deliver, evidence_due = [], [], []
    now = time.time()
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        rd = RunDir(os.path.join(base, name))
        if not os.path.exists(rd.spec):
            continue
        row = _row(rd)
        live = row["state"] not in ("completed", "failed", "stopped")
        outbox = Outbox(rd.path)
        alerts = run_alerts(rd.path)
        row["last_alert"] = alerts[-1].to_json() if alerts else None
        container_channels = set(load_notify(rd.path).get("channels") or {})
        alive = agent_alive(rd)
        for a in alerts:
            left = owed(a, channels, outbox)
            if not left:
                continue
            # The container's own agent goes first; ctl takes over what it could not do:
            # a channel the container does not have, an agent gone, a failed attempt, or an
            # alert older than the hand-over time.
            tried = any(not st["ok"] for (i, _), st in outbox.state.items() if i == a.id)
            theirs = [c for c in left if c in container_channels]
            # node evidence is the controller's own alert: no agent will send it
            if theirs and alive and not tried and now - a.ts < handover_s and a.kind != AlertKind.NODE_EVIDENCE.value:
                left = [c for c in left if c not in container_channels]
            if left:
                deliver.append({"run_dir": rd.path, "alert": a.to_json(), "channels": left})
        if live or all_runs or any(d["run_dir"] == rd.path for d in deliver):
            rows.append(row)
        evidence_due += _evidence_due(rd, alerts, now)
    return {"ok": True, "workspace": workspace, "runs": rows, "deliver": deliver, "evidence_due": evidence_due}


EVIDENCE_MAX_AGE_S = 86400.0  # older failures are not looked up again (a watch started days later)


def _evidence_due(rd: RunDir, alerts: list, now: float) -> list[dict]:
    """The run's failed/stalled alerts whose moment nobody has looked up in the node's kernel
    log yet, with the root cause that says when it was (result.json)."""
    from agent.protocol import RunResult

    looked = {d["refers_to"] for d in node_evidence(rd.path)}
    due = [a for a in alerts if a.kind in (AlertKind.FAILED.value, AlertKind.STALLED.value) and a.id not in looked
           and now - a.ts < EVIDENCE_MAX_AGE_S]
    if not due:
        return []
    try:
        res = RunResult.load(rd.result)
    except (OSError, ValueError):
        res = None
    cause = (res.root_cause if res else None) or {}
    return [{"run_dir": rd.path, "run_id": rd.run_id, "alert": a.to_json(), "root_cause": cause} for a in due]


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python3 -m agent.alertcmd")
    p.add_argument("verb", choices=("configure", "overview", "ack", "evidence"))
    p.add_argument("--run-dir")
    p.add_argument("--workspace")
    args = p.parse_args(argv)
    raw = sys.stdin.read() if not sys.stdin.isatty() else ""
    try:
        req = json.loads(raw) if raw.strip() else {}
    except ValueError as exc:
        print(wrap_payload({"ok": False, "error": f"the request on stdin is not JSON ({exc})"}))
        return 2
    if args.verb == "configure":
        rd = RunDir(args.run_dir)
        config = req.get("config") or {}
        try:
            Thresholds.from_json(config.get("thresholds"), "notify.thresholds")
        except ValueError as exc:
            print(wrap_payload({"ok": False, "error": str(exc)}))
            return 2
        write_notify(rd.path, rd.run_id, config, {k: str(v) for k, v in (req.get("secrets") or {}).items()})
        print(wrap_payload({"ok": True, "run_dir": rd.path}))
        return 0
    if args.verb == "overview":
        print(wrap_payload(overview(args.workspace, req.get("channels") or {},
                                    float(req.get("handover_s") or HANDOVER_S), bool(req.get("all")))))
        return 0
    rd = RunDir(args.run_dir)
    if args.verb == "evidence":
        if not isinstance(req.get("refers_to"), str):
            print(wrap_payload({"ok": False, "error": "evidence: the request names no refers_to alert id"}))
            return 2
        added = add_node_evidence(rd.path, {k: req.get(k) for k in ("refers_to", "ts", "reading", "alert")})
        alert = Alert.from_json(req.get("alert"))
        names = owed(alert, _filters(req.get("channels")), Outbox(rd.path)) if added and alert else []
        print(wrap_payload({"ok": True, "added": added, "channels": names}))
        return 0
    outbox = Outbox(rd.path)
    for ack in req.get("acks") or []:
        outbox.record(str(ack["id"]), str(ack["channel"]), bool(ack.get("ok")), "ctl watch", ack.get("error"))
    print(wrap_payload({"ok": True}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
