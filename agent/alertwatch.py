"""The agent's side of alerts: it reads the run's own stream, raises alerts (agent/alerts.py)
into it, and delivers them from the container (agent/notify.py) with retries.

Files, all in the run directory but the secrets:

- ``notify.json``: what the controller configured for this run — channels (environment
  variable NAMES only), thresholds, where the run is (node, container) and the next-command
  templates. Written by ``python3 -m agent.alerts_cli configure``; absent: alerts are still
  raised into the stream (``ctl watch`` delivers them from the operator's side).
- ``deliveries.jsonl``: the delivery log, one line per attempt ``{id, channel, ok, ts, by,
  error}``, appended with fsync before the next attempt. An alert is delivered on a channel
  once an ``ok`` line says so; until then every reader (a re-attached agent, ``ctl watch``)
  sees it pending. Killed mid-send, an agent has written no ``ok``: its successor sends again
  (at least once), and the receiver drops the repeat by the id in the body.
- ``node_evidence.jsonl``: what the controller found in the node's own kernel log around a
  failure (``ctl watch``: controller/kernellog.py), one line per failure alert it looked at
  ``{refers_to, ts, reading, alert}``, appended with fsync before its ``node_evidence``
  alert (if any) is sent. The container cannot read its node's log, so these alerts are
  the operator side's: ``ctl watch`` delivers them, and every reader counts them with the
  stream's (:func:`run_alerts`).
- ``<workspace>/.dflash-ctl/secrets/<run>.notify.env`` (0600, outside the run directory):
  the values of those variables, NAME=VALUE lines, written by ``configure`` from its stdin.

Why the watcher reads the stream file rather than being told by the supervisor: the stream is
the one record of what happened, so a new agent that re-reads it after a crash raises exactly
the alerts that were due and are not yet there (ids are stable), and nothing else.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Callable

from agent.alerts import ALERT_RECORD, Alert, AlertRules, Thresholds
from agent.notify import takes
from agent.protocol import STREAM, atomic_write

NOTIFY = "notify.json"
DELIVERIES = "deliveries.jsonl"
NODE_EVIDENCE = "node_evidence.jsonl"
SECRETS_DIR = os.path.join(".dflash-ctl", "secrets")
BACKOFF_FIRST_S = 1.0  # first retry after this; doubles per failed attempt ...
BACKOFF_MAX_S = 30.0  # ... up to this (a receiver back after a minute gets the alert within 30 s)
LINGER_S = 300.0  # after the run ended, the agent keeps delivering this long, then ctl watch's turn
HANDOVER_S = 20.0  # ctl watch sends an alert the agent has not delivered within this time


def secrets_path(run_dir: str, run_id: str) -> str:
    """The run's notify secrets file: under its workspace (<workspace>/runs/<id> is the run dir)."""
    workspace = os.path.dirname(os.path.dirname(os.path.abspath(run_dir)))
    return os.path.join(workspace, SECRETS_DIR, f"{run_id}.notify.env")


def read_env_file(path: str) -> dict[str, str]:
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        name, sep, value = line.partition("=")
        if sep and name:
            out[name] = value
    return out


def load_notify(run_dir: str) -> dict:
    try:
        with open(os.path.join(run_dir, NOTIFY), encoding="utf-8") as fh:
            doc = json.load(fh)
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


class Outbox:
    """deliveries.jsonl: what was tried, what arrived."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, DELIVERIES)
        self.state: dict[tuple[str, str], dict] = {}
        self._offset = 0
        self.refresh()

    def refresh(self) -> None:
        """Take in lines appended since the last read (by anyone: `ctl watch` acks too)."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self._offset += end
        for raw in data[:end].splitlines():
            try:
                rec = json.loads(raw)
                key = (str(rec["id"]), str(rec["channel"]))
            except (ValueError, KeyError, TypeError):
                continue
            st = self.state.setdefault(key, {"ok": False, "attempts": 0, "last_ts": 0.0, "error": None})
            if st["ok"]:
                continue
            st["attempts"] += 1
            st["last_ts"] = float(rec.get("ts") or 0)
            st["ok"] = bool(rec.get("ok"))
            st["error"] = rec.get("error")
            st["by"] = rec.get("by")

    def delivered(self, alert_id: str, channel: str) -> bool:
        return self.state.get((alert_id, channel), {}).get("ok", False)

    def due(self, alert_id: str, channel: str, now: float) -> bool:
        st = self.state.get((alert_id, channel))
        if st is None:
            return True
        if st["ok"]:
            return False
        wait = min(BACKOFF_FIRST_S * 2 ** (st["attempts"] - 1), BACKOFF_MAX_S)
        return now - st["last_ts"] >= wait

    def record(self, alert_id: str, channel: str, ok: bool, by: str, error: str | None = None) -> None:
        line = json.dumps({"id": alert_id, "channel": channel, "ok": ok, "ts": round(time.time(), 3), "by": by,
                           "error": error}) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        self.refresh()


def stream_alerts(run_dir: str) -> list[Alert]:
    """Every alert record in the run's stream, in order."""
    out = []
    try:
        fh = open(os.path.join(run_dir, STREAM), "rb")
    except FileNotFoundError:
        return out
    with fh:
        for raw in fh:
            if b'"kind":"alert"' not in raw or not raw.endswith(b"\n"):
                continue
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            a = Alert.from_json(rec.get("payload"))
            if a is not None and rec.get("kind") == ALERT_RECORD:
                out.append(a)
    return out


def node_evidence(run_dir: str) -> list[dict]:
    """The lines of node_evidence.jsonl (torn or foreign lines skipped)."""
    out = []
    try:
        fh = open(os.path.join(run_dir, NODE_EVIDENCE), "rb")
    except FileNotFoundError:
        return out
    with fh:
        for raw in fh:
            try:
                doc = json.loads(raw)
            except ValueError:
                continue
            if isinstance(doc, dict) and isinstance(doc.get("refers_to"), str):
                out.append(doc)
    return out


def add_node_evidence(run_dir: str, doc: dict) -> bool:
    """Append one look at the node's log (fsynced); False when that failure was looked at
    already (two watchers, a retried call: one record, one alert id)."""
    if any(d["refers_to"] == doc["refers_to"] for d in node_evidence(run_dir)):
        return False
    fd = os.open(os.path.join(run_dir, NODE_EVIDENCE), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(doc, sort_keys=True) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def run_alerts(run_dir: str) -> list[Alert]:
    """The run's alerts: the stream's, then the controller's node evidence, by time."""
    extra = [a for a in (Alert.from_json(d.get("alert")) for d in node_evidence(run_dir)) if a is not None]
    return stream_alerts(run_dir) + sorted(extra, key=lambda a: a.ts)


def pending(run_dir: str, channels: dict, outbox: Outbox | None = None) -> list[tuple[Alert, list[str]]]:
    """(alert, channels it has not reached) for every alert of the run not yet delivered on
    every channel that takes its kind."""
    outbox = outbox or Outbox(run_dir)
    out = []
    for a in run_alerts(run_dir):
        left = owed(a, channels, outbox)
        if left:
            out.append((a, left))
    return out


def owed(alert: Alert, channels: dict, outbox: Outbox) -> list[str]:
    """The channels (name -> channel, or just its filter) that take ``alert`` and have not
    had it: for the agent's own channels and for ``ctl watch``'s alike."""
    return [name for name, ch in channels.items() if takes(ch, alert) and not outbox.delivered(alert.id, name)]


class Deliverer(threading.Thread):
    """Sends the alerts it is given on every configured channel until each arrives; one
    attempt at a time, in order; a failure waits its back-off. Writes deliveries.jsonl only."""

    def __init__(self, run_dir: str, run_id: str, by: str = "agent"):
        super().__init__(name="alert-delivery", daemon=True)
        self.run_dir, self.run_id, self.by = run_dir, run_id, by
        self.outbox = Outbox(run_dir)
        self.alerts: dict[str, Alert] = {}
        self.channels: dict[str, dict] = {}
        self.env: dict[str, str] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()

    def configure(self, channels: dict) -> None:
        env = dict(os.environ)
        env.update(read_env_file(secrets_path(self.run_dir, self.run_id)))
        with self._lock:
            self.channels, self.env = dict(channels), env
        self._wake.set()

    def add(self, alert: Alert) -> None:
        with self._lock:
            self.alerts[alert.id] = alert
        self._wake.set()

    def idle(self) -> bool:
        """Nothing is left that a channel could still take."""
        with self._lock:
            items = list(self.alerts.values())
            channels = dict(self.channels)
        return all(self.outbox.delivered(a.id, n) for a in items for n, ch in channels.items() if takes(ch, a))

    def run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            try:
                self.round()
            except Exception:  # noqa: BLE001 - delivery must never take the agent down
                import traceback

                traceback.print_exc()

    def round(self) -> None:
        with self._lock:
            items = sorted(self.alerts.values(), key=lambda a: a.ts)
            channels, env = dict(self.channels), self.env
        if not channels:
            return
        from agent.notify import SendError, send

        self.outbox.refresh()
        for a in items:
            for name, ch in channels.items():
                if self._stop.is_set():
                    return
                if not takes(ch, a) or not self.outbox.due(a.id, name, time.time()):
                    continue
                try:
                    send(a, ch, env)
                except SendError as exc:
                    self.outbox.record(a.id, name, False, self.by, str(exc))
                    continue
                self.outbox.record(a.id, name, True, self.by)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()


class AlertWatch:
    """Owned by the supervisor: ``poll()`` now and then (and after every state change); it
    appends alert records through ``append`` (the supervisor's stream writer, which holds the
    stream) and hands them to the delivery thread."""

    def __init__(self, run_dir: str, run_id: str, append: Callable[[list], int], sync: Callable[[], None]):
        self.run_dir, self.run_id = run_dir, run_id
        self.append, self.sync = append, sync
        self._notify_mtime: float | None = None
        self.config = load_notify(run_dir)
        self.rules = self._rules()
        self.deliverer = Deliverer(run_dir, run_id)
        self._offset = 0
        self._next_disk = 0.0
        self._configure()
        # Replay: the alerts already in the stream are known (delivered or not); the rules
        # re-learn the run and raise what was due but never written (an agent killed between).
        for a in stream_alerts(run_dir):
            self.rules.raised.add(a.id)
            self.deliverer.add(a)
        self.deliverer.start()

    def _rules(self) -> AlertRules:
        try:
            thresholds = Thresholds.from_json(self.config.get("thresholds"))
        except ValueError:
            thresholds = Thresholds()  # checked by ctl before it was written; a hand edit: defaults
        return AlertRules(self.run_id, thresholds, self.config.get("where"), self.config.get("commands"))

    def _configure(self) -> None:
        path = os.path.join(self.run_dir, NOTIFY)
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            mtime = None
        if mtime == self._notify_mtime:
            return
        self._notify_mtime = mtime
        self.config = load_notify(self.run_dir)
        rules = self._rules()
        rules.raised = self.rules.raised
        # where/commands/thresholds change; what was learnt about the run is kept
        self.rules.t, self.rules.where, self.rules.commands = rules.t, rules.where, rules.commands
        self.deliverer.configure(self.config.get("channels") or {})

    def poll(self) -> list[Alert]:
        self._configure()
        raised: list[Alert] = []
        for rec in self._new_records():
            raised += self.rules.feed(rec)
        now = time.time()
        if now >= self._next_disk:
            self._next_disk = now + self.rules.t.disk_interval_s
            try:
                st = os.statvfs(self.run_dir)
                raised += self.rules.disk(self.run_dir, st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize, now)
            except OSError:
                pass
        if raised:
            # written and made durable before any delivery is tried
            self.append([(ALERT_RECORD, a.to_json(), None) for a in raised])
            self.sync()
            for a in raised:
                self.deliverer.add(a)
        return raised

    def _new_records(self) -> list[dict]:
        try:
            with open(os.path.join(self.run_dir, STREAM), "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self._offset += end
        out = []
        for raw in data[:end].split(b"\n"):
            # the log lines are most of the stream and never raise an alert: skip them unparsed
            if not raw or b'"kind":"log"' in raw[:64]:
                continue
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
        return out

    def close(self, linger_s: float = 0.0) -> None:
        """Stop delivering; with ``linger_s``, first keep trying that long while anything is pending."""
        deadline = time.monotonic() + linger_s
        while linger_s and time.monotonic() < deadline and not self.deliverer.idle() and self.deliverer.channels:
            time.sleep(0.2)
        self.deliverer.stop()
        self.deliverer.join(timeout=15)


def write_notify(run_dir: str, run_id: str, config: dict, secrets: dict[str, str]) -> None:
    """``configure``: notify.json (names only) into the run directory and the secrets file (0600)
    beside the run's other secrets."""
    if secrets:
        path = secrets_path(run_dir, run_id)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        os.chmod(os.path.dirname(path), 0o700)
        atomic_write(path, "".join(f"{k}={v}\n" for k, v in sorted(secrets.items())), 0o600)
    atomic_write(os.path.join(run_dir, NOTIFY), json.dumps(config, sort_keys=True, indent=1) + "\n")
