"""The agent supervising the real trainer (tiny CPU target): heartbeats and step events
reach status.json, a clean finish is COMPLETED (ranks leaving are not failures), and
`agent stop` makes the trainer save and exit 75 → STOPPED, with its checkpoint recorded."""

from __future__ import annotations

import os
import sys

import pytest

from tests._agent_util import (PY, kill_all, no_run_pids, payload, records, start, status, wait_for,
                               wait_terminal)

pytestmark = pytest.mark.slow

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from _trainer_tiny import tiny_setup

    root = tmp_path_factory.mktemp("agent-trainer")
    target, data = tiny_setup(str(root))
    return target, data


def _trainer(tiny, out, *extra):
    from _trainer_tiny import base_args

    return [PY, "-m", "trainer", *base_args(tiny[0], tiny[1], out, *extra)]


@pytest.fixture
def run_dir(tmp_path):
    d = str(tmp_path / "ws" / "runs" / "t1")
    yield d
    kill_all(d)


def test_real_trainer_runs_to_completion_under_the_agent(tiny, run_dir, tmp_path):
    start(run_dir, _trainer(tiny, str(tmp_path / "out"), "--from-scratch", "--max-steps", "6"),
          "--cwd", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = wait_terminal(run_dir, timeout=300)
    assert res["state"] == "completed", res
    st = status(run_dir)
    assert st["step"] == 6 and st["ranks"]["0"]["health"] == "done"
    kinds = {r["payload"].get("kind") for r in records(run_dir) if r["kind"] == "event"}
    assert {"phase", "step", "checkpoint"} <= kinds
    assert res["checkpoint"]["step"] == 6 and res["checkpoint"]["path"].endswith(os.path.join("step_6", "checkpoint.pt"))
    assert no_run_pids(run_dir)


def test_stop_makes_the_real_trainer_save_and_exit_75(tiny, run_dir, tmp_path):
    start(run_dir, _trainer(tiny, str(tmp_path / "out"), "--from-scratch", "--epochs", "200"),
          "--cwd", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    wait_for(lambda: (status(run_dir).get("step") or 0) >= 2, 300, what="two steps")
    reply = payload("stop", "--run-dir", run_dir, "--grace", "120")
    assert reply["state"] == "stopped"
    res = reply["result"]
    assert res["exit"]["exit_code"] == 75, res
    assert res["stop"]["graceful"] is True and res["stop"]["survivors"] == []
    assert res["checkpoint"] and os.path.exists(res["checkpoint"]["path"])
    assert no_run_pids(run_dir)
