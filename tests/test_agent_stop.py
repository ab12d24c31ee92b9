"""`agent stop`: SIGTERM, grace, SIGKILL of every descendant — including grandchildren in
their own sessions, which killpg of the job's group misses (skypilot#3742, pytorch PR#113231)."""

from __future__ import annotations

import os
import signal

import pytest

from tests._agent_util import (no_run_pids, FAKE, PY, agent_pid, heartbeats, kill_all, payload, records, run_pids,
                               start, status, wait_for, wait_terminal)


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "ws" / "runs" / "r1"
    yield str(d)
    kill_all(str(d))


def _worker_session_pids(run_dir) -> set[int]:
    sids = set()
    for pid in run_pids(run_dir):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                raw = fh.read()
            sids.add(int(raw[raw.rfind(")") + 2:].split()[3]))
        except OSError:
            pass
    return sids


def test_stop_leaves_no_process_of_a_job_whose_grandchildren_run_in_their_own_sessions(run_dir):
    start(run_dir, [PY, FAKE, "--ranks", "2", "--grandchildren", "--step-time", "0.2"])
    wait_for(lambda: len(heartbeats(run_dir)) == 2, 30, what="two ranks")
    # agent, monitor, launcher, 2 workers, 2 sleepers; workers and sleepers in sessions of their own
    wait_for(lambda: len(run_pids(run_dir)) >= 7, 30, what="the whole tree")
    assert len(_worker_session_pids(run_dir)) >= 5
    reply = payload("stop", "--run-dir", run_dir, "--grace", "10")
    assert reply["state"] == "stopped"
    stop = reply["result"]["stop"]
    assert stop["survivors"] == []
    assert no_run_pids(run_dir), f"processes of the run survived stop: {run_pids(run_dir)}"
    kinds = [r["payload"].get("kind") for r in records(run_dir) if r["kind"] == "event"]
    assert "agent.stop_requested" in kinds and "agent.stop" in kinds
    assert records(run_dir)[-1]["kind"] == "status" and records(run_dir)[-1]["payload"]["state"] == "stopped"
    # the workers saved and exited 75 on SIGTERM: the launcher reported "stopped"
    assert reply["result"]["exit"]["exit_code"] == 75


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored_and_says_so(run_dir):
    start(run_dir, [PY, FAKE, "--ranks", "2", "--grandchildren", "--ignore-term", "--step-time", "0.2"])
    wait_for(lambda: len(heartbeats(run_dir)) == 2, 30, what="two ranks")
    reply = payload("stop", "--run-dir", run_dir, "--grace", "1")
    stop = reply["result"]["stop"]
    assert [s["signal"] for s in stop["signals"]][0] == "SIGTERM"
    killed = {pid for s in stop["signals"] if s["signal"] == "SIGKILL" for pid in s["pids"]}
    worker_pids = {hb["pid"] for hb in heartbeats(run_dir).values()}
    assert worker_pids <= killed
    assert stop["survivors"] == [] and stop["graceful"] is False
    assert no_run_pids(run_dir), run_pids(run_dir)


def test_stop_works_when_the_agent_is_dead(run_dir):
    # --revive 0: no new agent from the job's monitor, so the stop itself takes the agent's place
    start(run_dir, [PY, FAKE, "--ranks", "2", "--grandchildren", "--step-time", "0.2"], "--revive", "0")
    wait_for(lambda: len(heartbeats(run_dir)) == 2, 30, what="two ranks")
    os.kill(agent_pid(run_dir), signal.SIGKILL)
    reply = payload("stop", "--run-dir", run_dir, "--grace", "5")
    assert reply["state"] == "stopped" and "no agent" in reply["by"]
    assert no_run_pids(run_dir), run_pids(run_dir)
    seqs = [r["seq"] for r in records(run_dir)]
    assert seqs == list(range(1, len(seqs) + 1))
