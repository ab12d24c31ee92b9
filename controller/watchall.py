"""`ctl status --all` and `ctl watch`: every live run on every configured node and container
in one table (rate, step age, health, last alert), and — for `ctl watch` — the operator's
side of alert delivery: an alert the container could not deliver (no route out, a receiver
down, a secret not set there, its agent gone) is sent from here, through this machine's
channels, and acknowledged in the run's delivery log so nobody sends it again.

One connection per node, kept for the whole watch (paramiko's, as `ctl tail --follow`); each
round is one agent call per container (agent/alertcmd.py overview) plus one per run whose
alerts were delivered from here (ack).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from agent.alerts import Alert
from agent.protocol import fmt_duration
from controller import config as cfg
from controller import notifyconfig

WATCH_INTERVAL_S = 5.0


@dataclass
class Target:
    node_name: str
    node: cfg.NodeConfig
    ctid: str
    channels: dict = field(default_factory=dict)


def targets(conf: cfg.Config, node: Optional[str] = None) -> list[Target]:
    out = []
    for name, n in conf.nodes.items():
        if node and name != node:
            continue
        for ctid in sorted(n.containers, key=str):
            out.append(Target(name, n, str(ctid), notifyconfig.for_container(n, ctid)["channels"]))
    return out


def channel_filters(channels: dict) -> dict:
    """What the container needs of the operator's channels to say which of them owe an alert
    (agent/alertwatch.py ``owed``: the filter is applied there, for every alert ctl watch sends)."""
    from agent.notify import channel_filter

    return {name: channel_filter(ch) for name, ch in channels.items()}


def overview_request(channels: dict, all_runs: bool = False) -> dict:
    return {"channels": channel_filters(channels), "all": all_runs}


@dataclass
class Round:
    rows: list[dict] = field(default_factory=list)  # each with node, container
    delivered: list[tuple[str, str]] = field(default_factory=list)  # (alert id, channel)
    failed: list[str] = field(default_factory=list)  # one line each
    errors: list[str] = field(default_factory=list)  # containers that did not answer


class Watcher:
    """Holds one runner per node across rounds; ``round()`` polls every target once."""

    def __init__(self, conf: cfg.Config, node: Optional[str] = None, deliver: bool = True, all_runs: bool = False,
                 trust_new_host_key: bool = False, environ=os.environ):
        self.targets = targets(conf, node)
        self.deliver, self.all_runs = deliver, all_runs
        self.trust = trust_new_host_key
        self.environ = environ
        self.runners: dict[str, object] = {}

    def _container(self, t: Target):
        from controller.container import Container
        from controller.session import open_runner

        runner = self.runners.get(t.node_name)
        if runner is None:
            runner = self.runners[t.node_name] = open_runner(t.node_name, t.node, trust_new_host_key=self.trust,
                                                             one_shot=not self.deliver)
        return Container(runner, t.node_name, t.node, t.ctid)

    def close(self) -> None:
        for r in self.runners.values():
            try:
                r.close()
            except Exception:  # noqa: BLE001 - closing what may be broken already
                pass
        self.runners.clear()

    def round(self) -> Round:
        from agent.notify import SendError, send
        from controller.agentcall import AgentCaller

        out = Round()
        for t in self.targets:
            try:
                ct = self._container(t)
                caller = AgentCaller(ct)
                # also without delivering: a run with alerts to deliver is listed
                reply = caller.call("agent.alertcmd", ["overview", "--workspace", ct.config.workspace],
                                    request=overview_request(t.channels, self.all_runs), what="the runs' overview")
            except Exception as exc:  # noqa: BLE001 - one silent node must not hide the others
                out.errors.append(f"{t.node_name}:{t.ctid}: {str(exc).splitlines()[0][:200]}")
                self.runners.pop(t.node_name, None)
                continue
            for row in reply.get("runs") or []:
                out.rows.append(dict(row, node=t.node_name, container=t.ctid))
            acks: dict[str, list[dict]] = {}
            todo = [(Alert.from_json(d.get("alert")), d["run_dir"], d.get("channels") or [])
                    for d in (reply.get("deliver") or [] if self.deliver else [])]
            if self.deliver:
                todo += self._node_evidence(t, ct, caller, reply.get("evidence_due") or [], out)
            for alert, run_dir, names in todo:
                if alert is None:
                    continue
                for name in names:
                    ch = t.channels.get(name)
                    if ch is None:
                        continue
                    try:
                        send(alert, ch, self.environ)
                    except SendError as exc:
                        out.failed.append(f"{alert.kind} of run {alert.run} via {name}: {exc}")
                        acks.setdefault(run_dir, []).append({"id": alert.id, "channel": name, "ok": False,
                                                             "error": str(exc)})
                        continue
                    out.delivered.append((alert.id, name))
                    acks.setdefault(run_dir, []).append({"id": alert.id, "channel": name, "ok": True})
            for run_dir, items in acks.items():
                try:
                    caller.call("agent.alertcmd", ["ack", "--run-dir", run_dir], request={"acks": items},
                                what="the delivery record")
                except Exception as exc:  # noqa: BLE001 - delivered anyway; the next round sends again
                    out.errors.append(f"{t.node_name}:{t.ctid}: delivered, but not recorded: "
                                      f"{str(exc).splitlines()[0][:160]}")
        return out


    def _node_evidence(self, t: Target, ct, caller, due: list[dict], out: Round) -> list[tuple]:
        """For each failed/stalled alert nobody has looked up yet: read the node's kernel log
        around its moment, record what it says in the run (before anything is sent) and,
        when it names something, return a ``node_evidence`` alert to deliver now."""
        from controller import kernellog

        alerts = []
        for d in due:
            failure = Alert.from_json(d.get("alert"))
            if failure is None:
                continue
            reading = kernellog.for_failure(ct, d.get("root_cause") or {}, failure.ts)
            alert = kernellog.evidence_alert(failure, reading) if reading and reading.findings else None
            doc = {"refers_to": failure.id, "ts": time.time(), "reading": reading.to_json() if reading else None,
                   "alert": alert.to_json() if alert else None, "channels": channel_filters(t.channels)}
            try:
                added = caller.call("agent.alertcmd", ["evidence", "--run-dir", d["run_dir"]], request=doc,
                                    what="the node's evidence")
            except Exception as exc:  # noqa: BLE001 - looked up again next round
                out.errors.append(f"{t.node_name}:{t.ctid}: node evidence not recorded: {str(exc).splitlines()[0][:160]}")
                continue
            if alert and added.get("added"):
                alerts.append((alert, d["run_dir"], added.get("channels") or []))
        return alerts


def table(rows: list[dict], now: Optional[float] = None) -> list[str]:
    """One line per run: where, run, state, step, rate, step age, health, last alert."""
    from controller.tail import fmt_rate

    now = now or time.time()
    head = f"{'NODE:CT':<12} {'RUN':<34} {'STATE':<10} {'STEP':>11} {'RATE':>9} {'STEP AGE':>8}  {'HEALTH':<10} LAST ALERT"
    lines = [head]
    for r in rows:
        step = "" if r.get("step") is None else f"{r['step']}" + (f"/{r['total']}" if r.get("total") else "")
        rate = fmt_rate(r["tokens_per_s"]) if isinstance(r.get("tokens_per_s"), (int, float)) else "—"
        age = fmt_duration(r["step_age_s"]) if isinstance(r.get("step_age_s"), (int, float)) else "—"
        last = r.get("last_alert") or {}
        alert = f"{last.get('kind')} {fmt_duration(now - last['ts'])} ago" if last.get("ts") else "—"
        lines.append(f"{r['node'] + ':' + r['container']:<12} {r['run_id'][:34]:<34} {str(r.get('state')):<10} "
                     f"{step:>11} {rate:>9} {age:>8}  {r.get('health') or '':<10} {alert}")
    if len(lines) == 1:
        lines.append("(no live run on any configured container)")
    return lines


def watch(conf: cfg.Config, echo: Callable[[str], None], *, node: Optional[str] = None, interval: float = WATCH_INTERVAL_S,
          rounds: Optional[int] = None, trust_new_host_key: bool = False, live: Optional[bool] = None) -> int:
    """`ctl watch`: rounds until interrupted (or ``rounds``); on a terminal the table is
    redrawn in place, otherwise each round prints what it delivered and the table."""
    live = sys.stdout.isatty() if live is None else live
    w = Watcher(conf, node, deliver=True, trust_new_host_key=trust_new_host_key)
    n = 0
    try:
        while rounds is None or n < rounds:
            r = w.round()
            n += 1
            stamp = time.strftime("%H:%M:%S")
            lines = table(r.rows)
            notes = [f"delivered {i} via {c}" for i, c in r.delivered] + [f"not delivered: {x}" for x in r.failed] \
                + [f"no answer: {e}" for e in r.errors]
            if live:
                echo("\x1b[H\x1b[2J" + f"ctl watch  {stamp}  (every {interval:g} s; Ctrl-C ends)")
                for line in lines + notes:
                    echo(line)
            else:
                for line in notes:
                    echo(f"{stamp} {line}")
            if rounds is not None and n >= rounds:
                if not live:
                    for line in lines:
                        echo(line)
                break
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
    finally:
        w.close()
    return 0


def status_all(conf: cfg.Config, echo: Callable[[str], None], node: Optional[str] = None, json_out: bool = False,
               trust_new_host_key: bool = False) -> int:
    """`ctl status --all`: one round without delivering."""
    w = Watcher(conf, node, deliver=False, trust_new_host_key=trust_new_host_key)
    try:
        r = w.round()
    finally:
        w.close()
    if json_out:
        import json

        echo(json.dumps({"runs": r.rows, "errors": r.errors}, sort_keys=True, indent=1))
    else:
        for line in table(r.rows) + [f"no answer: {e}" for e in r.errors]:
            echo(line)
    return 1 if r.errors else 0
