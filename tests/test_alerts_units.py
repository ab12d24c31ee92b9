"""The alert rules, thresholds, channels and [notify] levels on their own: fed records and
tables, checked for what they raise and refuse."""

from __future__ import annotations

import json
import sys

import pytest

from agent.alerts import AlertRules, Thresholds
from agent.notify import SendError, check_channel, send
from controller import notifyconfig


def status(state, **kw):
    return {"kind": "status", "ts": 100.0, "payload": {"state": state, **kw}}


def ev(kind, ts=100.0, **kw):
    return {"kind": "event", "ts": ts, "payload": {"kind": kind, **kw}}


def test_a_stall_that_ends_the_run_is_one_stalled_alert_however_often_the_status_repeats():
    rules = AlertRules("r1")
    root = {"kind": "rank_stall", "reason": "rank 0 stalled: no heartbeat progress for 3 s", "rank": 0}
    st = status("failed", reason=root["reason"], failures_history=[{"attempt": 0, "root_cause": root}])
    got = rules.feed(st) + rules.feed(st)
    assert [a.kind for a in got] == ["stalled"]
    assert got[0].cause.startswith("rank_stall: rank 0 stalled") and "ctl tail --run r1" in got[0].next


def test_a_replayed_stream_raises_nothing_already_in_it_and_what_was_missed():
    recs = [ev("step", step=1, loss=float("nan"), tokens_per_s=1.0), status("completed", step=1)]
    first = AlertRules("r1")
    alerts = [a for r in recs for a in first.feed(r)]
    assert [a.kind for a in alerts] == ["loss_nonfinite", "completed"]
    # the agent died after writing the first alert only: its successor raises the second, same id
    # (agent/alertwatch.py reads the alert ids already in the stream before it replays it)
    again = AlertRules("r1")
    again.raised.add(alerts[0].id)
    replay = [recs[0], {"kind": "alert", "ts": 1, "payload": alerts[0].to_json()}, recs[1]]
    assert [a.id for r in replay for a in again.feed(r)] == [alerts[1].id]


def test_tau_drop_between_saves_and_a_failing_data_job_and_a_full_disk():
    rules = AlertRules("r1", Thresholds(tau_drop_fraction=0.1, data_fail_min_rows=10))
    assert rules.feed(ev("eval", step=100, tau=3.0)) == []
    assert rules.feed(ev("eval", step=200, tau=2.8)) == []  # -7 %: within
    drop = rules.feed(ev("eval", step=300, tau=2.4))
    assert [a.kind for a in drop] == ["tau_drop"] and "from 2.80 (step 200) to 2.40" in drop[0].cause
    assert rules.feed(ev("progress", done=9, failed=0)) == []
    bad = rules.feed(ev("progress", done=8, failed=2))
    assert [a.kind for a in bad] == ["data_failing"] and "2 of 10 rows failed" in bad[0].cause
    assert rules.feed(ev("progress", done=8, failed=3)) == []  # told once
    assert [a.kind for a in rules.feed(ev("progress", done=8, failed=3, skipped=0, total=11, final=True))] \
        == ["data_done"]
    assert rules.disk("/ws", 50 * 2**30, 1000 * 2**30, 1.0) == []  # 5 %: not below
    assert [a.kind for a in rules.disk("/ws", 10 * 2**30, 1000 * 2**30, 1.0)] == ["disk_low"]


def test_thresholds_refuse_an_unknown_name_and_a_negative_value_by_name():
    with pytest.raises(ValueError, match=r"notify.thresholds.throughput_drop: unknown threshold"):
        Thresholds.from_json({"throughput_drop": 0.2}, "notify.thresholds")
    with pytest.raises(ValueError, match=r"thresholds.steady_steps: must be a non-negative integer"):
        Thresholds.from_json({"steady_steps": -1})
    assert Thresholds.from_json({"throughput_drop_for_s": 30}).throughput_drop_for_s == 30.0


def test_a_secret_pasted_where_its_variable_name_goes_is_refused():
    with pytest.raises(ValueError, match=r"notify.channels.hook.url_env: must be the NAME"):
        check_channel("hook", {"type": "webhook", "url_env": "https://hooks.slack.com/services/T0/B0/xyz"})
    with pytest.raises(ValueError, match=r"notify.channels.m.to: required"):
        check_channel("m", {"type": "email", "host": "smtp", "sender": "a@b"})


def test_the_command_channel_gets_the_body_on_stdin_and_a_missing_secret_is_a_named_failure(tmp_path):
    out = tmp_path / "got.json"
    alert = AlertRules("r1").feed(status("completed", step=3))[0]
    send(alert, {"type": "command", "argv": [sys.executable, "-c",
                                             f"import sys; open({str(out)!r}, 'w').write(sys.stdin.read())"]}, {})
    body = json.loads(out.read_text())
    assert body["id"] == alert.id and body["kind"] == "completed" and body["version"] == 1
    with pytest.raises(SendError, match=r"\$HOOK_URL is not set"):
        send(alert, {"type": "webhook", "url_env": "HOOK_URL"}, {})


def test_container_notify_over_node_over_file_and_a_channel_switched_off():
    from controller import config as cfg

    conf = cfg.Config(notify={"channels": {"hook": {"type": "webhook", "url_env": "A"},
                                           "mail": {"type": "email", "host": "h", "sender": "s", "to": ["t"]}},
                              "thresholds": {"steady_steps": 10}},
                      nodes={"n": {"host": "n1", "notify": {"thresholds": {"warmup_steps": 1}},
                                   "containers": {"200": {"notify": {"channels": {"mail": {"type": "email",
                                                                                          "enabled": False,
                                                                                          "host": "h", "sender": "s",
                                                                                          "to": ["t"]}}}}}}})
    node = conf.nodes["n"]
    eff = notifyconfig.for_container(node, 200, {"thresholds": {"steady_steps": 5}})
    assert sorted(eff["channels"]) == ["hook"]
    assert eff["thresholds"] == {"steady_steps": 5, "warmup_steps": 1}
    assert sorted(notifyconfig.for_container(node, 201)["channels"]) == ["hook", "mail"]
    with pytest.raises(ValueError, match=r"notify.channels.x.type"):
        cfg.Config(notify={"channels": {"x": {"type": "pager"}}})


def test_ctl_tail_prints_an_alert_record():
    from controller.tail import Printer

    out = []
    alert = AlertRules("r1").feed(status("completed", step=3))[0]
    Printer(out.append)({"seq": 9, "ts": 1.0, "kind": "alert", "payload": alert.to_json()})
    assert out == ["== alert completed: completed at step 3"]


def test_ctl_watch_is_owed_an_alert_only_on_the_channels_whose_kinds_take_it(tmp_path):
    """`ctl watch` asks the container which alerts it owes on the operator's channels; a
    channel's ``kinds`` is part of that question (it was ignored: every alert went to every
    channel, and a finished run stayed listed as owing what no channel would take)."""
    import subprocess

    from agent.alertwatch import Outbox
    from controller.watchall import overview_request
    from tests._agent_util import PY, env

    run = "r1-20261201-114702-0001"
    rd = tmp_path / "ws" / "runs" / run
    rd.mkdir(parents=True)
    (rd / "spec.json").write_text(json.dumps({"run_id": run}))
    (rd / "status.json").write_text(json.dumps({"state": "completed"}))
    rules = AlertRules(run)
    nan, done = (rules.feed(ev("step", step=4, loss=float("nan"), tokens_per_s=1.0))
                 + rules.feed(status("completed", step=9)))
    (rd / "stream.jsonl").write_text("".join(json.dumps({"seq": i, "ts": a.ts, "kind": "alert", "payload": a.to_json()},
                                                        separators=(",", ":")) + "\n" for i, a in enumerate([nan, done])))
    channels = {"slack": {"type": "slack", "url_env": "SLACK_URL", "kinds": ["loss_nonfinite", "failed"]},
                "hook": {"type": "webhook", "url_env": "HOOK_URL"}}

    def overview():
        proc = subprocess.run([PY, "-m", "agent.alertcmd", "overview", "--workspace", str(tmp_path / "ws")],
                              input=json.dumps(overview_request(channels)), capture_output=True, text=True,
                              env=env(), timeout=60, check=True)
        from agent.protocol import extract_payload

        return extract_payload(proc.stdout)

    got = overview()
    assert {d["alert"]["kind"]: d["channels"] for d in got["deliver"]} == {"loss_nonfinite": ["slack", "hook"],
                                                                          "completed": ["hook"]}
    assert "SLACK_URL" not in json.dumps(overview_request(channels))  # only the filter travels
    out = Outbox(str(rd))
    for a, name in ((nan, "slack"), (nan, "hook"), (done, "hook")):
        out.record(a.id, name, True, "ctl watch")
    got = overview()
    assert got["deliver"] == [] and got["runs"] == []  # nothing owed: the finished run is not listed


def test_the_evidence_verb_names_the_channels_that_take_a_node_evidence_alert_once(tmp_path):
    import subprocess

    from agent.alerts import Alert
    from agent.protocol import extract_payload
    from controller.watchall import channel_filters
    from tests._agent_util import PY, env

    rd = tmp_path / "ws" / "runs" / "r1-20261201-114702-0001"
    rd.mkdir(parents=True)
    alert = Alert(id="e1", kind="node_evidence", run="r1", ts=1.0, cause="host OOM", next="ctl status")
    channels = channel_filters({"slack": {"type": "slack", "url_env": "S", "kinds": ["failed"]},
                                "team": {"type": "slack", "url_env": "T", "kinds": ["failed", "node_evidence"]},
                                "hook": {"type": "webhook", "url_env": "H"}})
    req = json.dumps({"refers_to": "f1", "ts": 2.0, "reading": None, "alert": alert.to_json(), "channels": channels})

    def evidence():
        proc = subprocess.run([PY, "-m", "agent.alertcmd", "evidence", "--run-dir", str(rd)], input=req,
                              capture_output=True, text=True, env=env(), timeout=60, check=True)
        return extract_payload(proc.stdout)

    assert evidence()["channels"] == ["team", "hook"]
    again = evidence()
    assert again["added"] is False and again["channels"] == []  # looked up once: sent once
