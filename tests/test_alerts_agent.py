"""Alerts from the agent, with real processes and a real HTTP receiver on 127.0.0.1: each event
of a run reaches the receiver exactly once (after de-duplication by id), with its root cause
and next command; delivery survives a receiver that is down and an agent killed mid-send;
secrets stay out of argv, the run directory, the stream, the logs and the status reply."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests._agent_util import (FAKE, PY, agent_pid, env, heartbeats, kill_all, records, start, wait_for,
                               wait_terminal)
from tests._alert_receiver import Receiver

TOKEN = "s3cr3t-T0KEN-9f8e7d"
RUN = "r1-20261201-114702-0001"  # the grammar of the ids ctl launch makes


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "ws" / "runs" / RUN
    yield str(d)
    kill_all(str(d))


@pytest.fixture
def receiver():
    r = Receiver(path=f"/hook/{TOKEN}")  # the token is in the URL, as Slack's and most webhooks' are
    yield r
    try:
        r.down()
    except Exception:  # noqa: BLE001 - already down
        pass


def configure(run_dir, receiver, thresholds=None, url_var="ALERT_WEBHOOK_URL"):
    """What ctl does right after the start: the channels (names only) and the secret on stdin."""
    config = {"channels": {"hook": {"type": "webhook", "url_env": url_var}},
              "thresholds": thresholds or {}, "where": {"node": "n1", "container": "200"},
              "commands": {"status": "ctl status --node n1 --container 200 --run {run}",
                           "tail": "ctl tail --node n1 --container 200 --run {run}",
                           "resume": "ctl launch --node n1 --container 200 --config run.toml --resume-from {checkpoint}"}}
    req = {"config": config, "secrets": {url_var: receiver.url}}
    proc = subprocess.run([PY, "-m", "agent.alertcmd", "configure", "--run-dir", run_dir], input=json.dumps(req),
                          capture_output=True, text=True, env=env(), timeout=60)
    assert proc.returncode == 0, proc.stderr


def launch(run_dir, receiver, job_args, *opts, thresholds=None):
    start(run_dir, [PY, FAKE, *job_args], *opts)
    configure(run_dir, receiver, thresholds)


def stream_alerts(run_dir):
    return [r["payload"] for r in records(run_dir) if r["kind"] == "alert"]


def test_a_completed_run_sends_exactly_one_alert_with_its_next_command(run_dir, receiver):
    launch(run_dir, receiver, ["--ranks", "1", "--steps", "6", "--step-time", "0.05", "--output-dir",
                               os.path.join(run_dir, "..", "out"), "--save-interval", "3"])
    wait_terminal(run_dir)
    got = wait_for(lambda: receiver.of_kind("completed"), 30, what="the completed alert")
    time.sleep(1.0)
    assert len(receiver.alerts()) == 1, receiver.alerts()
    a = got[0]
    assert a["run"] == RUN and a["node"] == "n1" and a["container"] == "200"
    assert "completed at step 6" in a["cause"] and "step_6" in a["cause"]
    assert a["next"] == f"ctl status --node n1 --container 200 --run {RUN}"
    assert a["id"] in a["text"]
    # the alert was a stream record before it was sent
    assert [x["id"] for x in stream_alerts(run_dir)] == [a["id"]]


def test_kill9_of_a_rank_sends_one_failed_alert_naming_rank_and_resume_line(run_dir, receiver):
    out = os.path.join(run_dir, "..", "out")
    launch(run_dir, receiver, ["--ranks", "2", "--step-time", "0.1", "--output-dir", out, "--save-interval", "2"])
    hbs = wait_for(lambda: (h := heartbeats(run_dir)) and len(h) == 2 and all(x["step"] >= 3 for x in h.values())
                   and h, 30, what="two ranks past step 3")
    t0 = time.time()
    os.kill(hbs[1]["pid"], signal.SIGKILL)
    got = wait_for(lambda: receiver.of_kind("failed"), 20, what="the failed alert")
    assert receiver.arrived_at[0] - t0 < 10
    wait_terminal(run_dir)
    time.sleep(1.0)
    assert list(receiver.alerts().values()) == got, receiver.alerts()
    a = got[0]
    assert "rank 1" in a["cause"] and "killed by signal 9" in a["cause"], a["cause"]
    assert a["next"].startswith("ctl launch --node n1 --container 200 --config run.toml --resume-from ")
    assert f"ctl tail --node n1 --container 200 --run {RUN}" in a["next"]
    assert a["details"]["rank"] == 1 and a["severity"] == "error"


def test_sigstop_of_a_rank_sends_one_stalled_alert(run_dir, receiver):
    launch(run_dir, receiver, ["--ranks", "2", "--step-time", "0.1"], "--stall-timeout", "2", "--kill-grace", "2")
    hbs = wait_for(lambda: (h := heartbeats(run_dir)) and len(h) == 2 and all(x["step"] >= 2 for x in h.values())
                   and h, 30, what="two ranks past step 2")
    os.kill(hbs[0]["pid"], signal.SIGSTOP)
    got = wait_for(lambda: receiver.of_kind("stalled"), 30, what="the stalled alert")
    wait_terminal(run_dir)
    time.sleep(1.0)
    assert list(receiver.alerts().values()) == got, receiver.alerts()
    assert "rank 0 stalled" in got[0]["cause"], got[0]["cause"]


def test_a_nan_loss_sends_one_alert_and_the_run_goes_on(run_dir, receiver):
    launch(run_dir, receiver, ["--ranks", "1", "--steps", "12", "--step-time", "0.05", "--nan-at", "4"])
    wait_terminal(run_dir)
    wait_for(lambda: receiver.of_kind("completed"), 30, what="the completed alert")
    time.sleep(0.5)
    nan = receiver.of_kind("loss_nonfinite")
    assert len(nan) == 1 and len(receiver.alerts()) == 2, receiver.alerts()
    assert "loss is nan at step 4" in nan[0]["cause"], nan[0]["cause"]


def test_one_of_two_ranks_slowed_sends_one_throughput_drop_naming_it(run_dir, receiver):
    launch(run_dir, receiver, ["--ranks", "2", "--steps", "90", "--step-time", "0.05", "--every-rank-steps",
                               "--slow-rank", "1", "--slow-after", "30", "--slow-tokens-per-s", "5400"],
           thresholds={"warmup_steps": 2, "steady_steps": 10, "throughput_drop_for_s": 1.0})
    wait_terminal(run_dir, timeout=60)
    wait_for(lambda: receiver.of_kind("completed"), 30, what="the completed alert")
    time.sleep(0.5)
    drops = receiver.of_kind("throughput_drop")
    assert len(drops) == 1 and len(receiver.alerts()) == 2, receiver.alerts()
    assert "slowest rank: 1" in drops[0]["cause"] and "below this run's own steady 40,000" in drops[0]["cause"]


EVAL_JOB = r"""
import json, os, sys, time
n = int(sys.argv[1]); pause = float(sys.argv[2])
path = os.path.join(os.environ["DFLASH_RUN_DIR"], "events.jsonl")
for i in range(2 * n + 1):
    with open(path, "a") as fh:  # tau up, down, up ...: n drops between saves
        fh.write(json.dumps({"kind": "eval", "step": i, "tau": 3.0 if i % 2 == 0 else 2.0, "ts": time.time()}) + "\n")
    time.sleep(pause)
"""


def test_fifty_events_through_a_flaky_receiver_none_missed_none_repeated(run_dir, receiver):
    receiver.fail_every = 3  # every third request is answered 500 after it was read: a retry follows
    start(run_dir, [PY, "-c", EVAL_JOB, "50", "0.02"])
    configure(run_dir, receiver)
    wait_terminal(run_dir)
    want = {a["id"] for a in stream_alerts(run_dir) if a["kind"] == "tau_drop"}
    assert len(want) == 50
    wait_for(lambda: want <= set(receiver.alerts()), 90, what="all 50 alerts")
    got = receiver.alerts()
    assert {i for i, a in got.items() if a["kind"] == "tau_drop"} == want  # 0 missed, 0 extra
    assert len(receiver.arrivals) == len(got)  # 500s are not arrivals: nothing counted twice


def test_a_receiver_down_for_60s_gets_the_alert_when_it_is_back(run_dir, receiver):
    receiver.down()
    launch(run_dir, receiver, ["--ranks", "1", "--steps", "4", "--step-time", "0.05"])
    wait_terminal(run_dir)
    time.sleep(60)
    assert not receiver.arrivals
    tried = [json.loads(l) for l in open(os.path.join(run_dir, "deliveries.jsonl"))]
    assert tried and not any(t["ok"] for t in tried)
    assert all(TOKEN not in (t["error"] or "") for t in tried)
    receiver.up()
    wait_for(lambda: receiver.of_kind("completed"), 45, what="the alert after the receiver came back")


def test_the_agent_killed_mid_delivery_loses_nothing(run_dir, receiver):
    receiver.hold_first_s = 6.0  # the first send waits for its answer; the agent dies meanwhile
    launch(run_dir, receiver, ["--ranks", "1", "--steps", "150", "--step-time", "0.1", "--nan-at", "3"],
           "--revive", "1")
    wait_for(lambda: receiver.requests >= 1, 30, what="the first delivery attempt")
    first = agent_pid(run_dir)
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: receiver.of_kind("loss_nonfinite"), 40, what="the alert from the revived agent")
    assert agent_pid(run_dir) != first
    wait_terminal(run_dir, timeout=60)
    wait_for(lambda: receiver.of_kind("completed"), 30, what="the completed alert")
    assert len(receiver.alerts()) == 2


def test_no_secret_in_argv_run_dir_stream_logs_or_status(run_dir, receiver):
    receiver.fail_every = 2
    launch(run_dir, receiver, ["--ranks", "2", "--steps", "30", "--step-time", "0.05", "--nan-at", "2"])
    wait_for(lambda: receiver.of_kind("loss_nonfinite"), 30, what="an alert")
    ps = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True).stdout
    assert TOKEN not in ps
    wait_terminal(run_dir)
    wait_for(lambda: receiver.of_kind("completed"), 30, what="the completed alert")
    for root, _, files in os.walk(run_dir):
        for name in files:
            with open(os.path.join(root, name), "rb") as fh:
                assert TOKEN.encode() not in fh.read(), name
    status = subprocess.run([PY, "-m", "agent.runview", "status", "--workspace", os.path.dirname(os.path.dirname(run_dir)),
                             "--run", RUN], capture_output=True, text=True, env=env(), timeout=60)
    assert status.returncode == 0 and '"alerts"' in status.stdout and TOKEN not in status.stdout
    # the value lives only in the 0600 secrets file beside the run's other secrets
    secrets = os.path.join(os.path.dirname(os.path.dirname(run_dir)), ".dflash-ctl", "secrets", f"{RUN}.notify.env")
    assert oct(os.stat(secrets).st_mode & 0o777) == "0o600"
