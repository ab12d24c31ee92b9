"""Alerts of a container with no route to the receiver (a sim container reaches nothing on the
host): its agent raises and tries; `ctl status` shows the alert as not delivered; `ctl watch`
on the operator's side delivers it, once, and records that so nobody sends it again."""

from __future__ import annotations

import os
import posixpath
import subprocess
import sys

from pathlib import Path

import pytest
from _agent_util import wait_for

from agent.protocol import new_run_id
from controller import config as cfg
from controller.agentcall import AgentCaller
from controller.container import Container
from controller.ssh import SSHRunner
from tests._alert_receiver import Receiver, sim_notify_config

pytestmark = pytest.mark.sim

REPO = Path(__file__).resolve().parent.parent
FAKE = REPO / "tests" / "jobs" / "fake_trainer.py"
CT = 200
TOKEN = "hook-T0KEN-41c2e9"


@pytest.fixture
def receiver():
    r = Receiver(path=f"/hook/{TOKEN}")
    yield r
    r.down()


@pytest.fixture
def notify_config(sim_node, tmp_path, receiver):
    path = sim_notify_config(sim_node, tmp_path / "config.toml", CT)
    return path


def _ctl(*argv, config, env_extra):
    env = dict(os.environ, DFLASH_CTL_CONFIG=str(config), DFLASH_CTL_SSH_CONFIG="none", PYTHONPATH=str(REPO),
               **env_extra)
    return subprocess.run([sys.executable, "-c", "from controller.cli import main; main()", *argv],
                          capture_output=True, text=True, env=env, cwd=str(REPO), timeout=180)


def test_an_isolated_containers_alert_is_shown_undelivered_and_ctl_watch_delivers_it_once(notify_config, receiver,
                                                                                         monkeypatch):
    from controller.alertsetup import configure_run
    from controller.status import render_status
    from controller.commands.watch import resolve_run

    monkeypatch.setenv("ALERT_WEBHOOK_URL", receiver.url)
    conf = cfg.load(notify_config)
    name, node = conf.node("sim")
    run_id = new_run_id("alerts")  # the grammar ctl checks (agent/protocol.py)
    with SSHRunner.for_node(name, node) as runner:
        ct = Container(runner, name, node, CT)
        caller = AgentCaller(ct)
        bundle = caller.ensure_bundle()
        run_dir = posixpath.join(ct.config.workspace, "runs", run_id)
        job = posixpath.join(ct.config.workspace, "alert-jobs", "fake_trainer.py")
        ct.exec(["mkdir", "-p", posixpath.dirname(job)], check=True)
        ct.write_file(job, FAKE.read_bytes())
        try:
            ct.exec(["env", f"PYTHONPATH={bundle}", ct.config.python, "-m", "agent", "start", "--run-dir", run_dir,
                     "--", "python3", job, "--ranks", "1", "--steps", "5", "--step-time", "0.1"], check=True)
            assert configure_run(caller, ct, run_id, run_dir, say=lambda line: None)

            def shown():
                lines = render_status(resolve_run(ct, caller, run_id), ct.ctid, ct.node_name)
                return [l for l in lines if l.startswith("ALERT    not delivered: completed")] and lines
            lines = _wait(shown, 60, "the undelivered alert in ctl status")
            assert any("cannot reach the receiver" in l for l in lines), lines
            assert not receiver.arrivals

            table = _ctl("status", "--all", config=notify_config, env_extra={})
            assert run_id[:30] in table.stdout and "completed" in table.stdout, table.stdout + table.stderr

            watched = _ctl("watch", "--rounds", "1", config=notify_config,
                           env_extra={"ALERT_WEBHOOK_URL": receiver.url})
            assert watched.returncode == 0, watched.stderr
            # ctl watch follows every run of the node, earlier tests' too: this run's alerts are the ones under test
            assert [a["kind"] for a in receiver.alerts().values() if a["run"] == run_id] == ["completed"]
            again = _ctl("watch", "--rounds", "1", config=notify_config, env_extra={"ALERT_WEBHOOK_URL": receiver.url})
            mine = [a for a in receiver.arrivals if a.get("run") == run_id]
            assert again.returncode == 0 and len(mine) == 1  # acknowledged: not sent twice
            lines = render_status(resolve_run(ct, caller, run_id), ct.ctid, ct.node_name)
            assert not [l for l in lines if l.startswith("ALERT")], lines
            # the token: not in the run dir, the stream, the logs, the status reply, ctl's output
            grep = ct.exec(["grep", "-rl", TOKEN, run_dir])
            assert grep.stdout.strip() == "", grep.stdout
            status_json = _ctl("status", "--container", str(CT), "--run", run_id, "--json", config=notify_config,
                               env_extra={})
            assert TOKEN not in status_json.stdout and '"alerts"' in status_json.stdout
            assert TOKEN not in watched.stdout + watched.stderr
        finally:
            ct.exec(["rm", "-rf", run_dir, posixpath.dirname(job)])


def _wait(predicate, timeout, what):
    return wait_for(predicate, timeout, interval=0.5, what=what)
