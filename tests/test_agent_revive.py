"""Supervision that never leaves a run alone, with real processes on this machine:
the job's monitor brings a killed agent back and the stream loses and repeats nothing; a rank
failure after that is still classified; a follower goes on through it; a job that ends while
no agent runs is still finalized; ranks that never start fail the run at the start-up
deadline with the ranks, the rendezvous and their last lines named. (The same in sim
containers, through ctl: tests/test_launch_supervision_sim.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess

from tests._agent_util import (FAKE, PRINTER, PY, REPO, agent, agent_pid, env, heartbeats, no_run_pids, read_json,
                               records, run_dir, start, status, wait_for, wait_terminal)  # noqa: F401 (fixture)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(") ", 1)[1][0] not in "ZX"
    except OSError:
        return False


def _kill_agent_and_wait_for_the_next(run_dir) -> int:
    """kill -9 of the agent; the new one's pid once it supervises (it has written status.json)."""
    old = agent_pid(run_dir)
    os.kill(old, signal.SIGKILL)
    # Alive, or already gone because the run ended: the monitor's delay doubles with each
    # revival inside a minute, so the job may finish before it, and the monitor then starts
    # one agent to finalize the run (which exits at once).
    return wait_for(lambda: (p := status(run_dir).get("agent_pid")) != old and p
                    and (_alive(p) or status(run_dir).get("state") in ("completed", "failed", "stopped")) and p, 30,
                    what="the job's monitor to start a new agent")


def test_the_jobs_monitor_brings_a_killed_agent_back_and_the_stream_loses_and_repeats_nothing(run_dir):
    start(run_dir, [PY, PRINTER, "15000", "1500"])  # ~10 s of output
    for _ in range(3):
        wait_for(lambda: status(run_dir).get("state") == "running", 30, what="a supervised run")
        _kill_agent_and_wait_for_the_next(run_dir)
    res = wait_terminal(run_dir, timeout=120)
    assert res["state"] == "completed"
    recs = records(run_dir)
    assert [r["seq"] for r in recs] == list(range(1, len(recs) + 1))
    assert [r["payload"]["line"] for r in recs if r["kind"] == "log" and r["payload"]["stream"] == "stdout"] \
        == [f"line {i}" for i in range(15000)]
    back = status(run_dir)["reattaches"]
    assert len(back) == 3 and all(b["by"].startswith("the job's monitor") for b in back)
    assert all("died" in b["why"] and str(b["previous_agent_pid"]) in b["why"] for b in back)
    events = [r["payload"] for r in recs if r["payload"].get("kind") == "agent.reattached"]
    assert [e["by"] for e in events] == [b["by"] for b in back]
    assert no_run_pids(run_dir)


def test_a_rank_failure_after_the_agent_came_back_is_still_classified(run_dir):
    start(run_dir, [PY, FAKE, "--ranks", "2", "--step-time", "0.1"])
    hbs = wait_for(lambda: (h := heartbeats(run_dir)) and len(h) == 2 and h, 30, what="two ranks")
    _kill_agent_and_wait_for_the_next(run_dir)
    os.kill(hbs[1]["pid"], signal.SIGKILL)
    res = wait_terminal(run_dir, timeout=60)
    assert res["state"] == "failed" and res["root_cause"]["rank"] == 1, res
    assert res["root_cause"]["kind"] == "rank_exit" and "rank 1" in res["reason"]
    assert "rank slot 1" in res["reason"]  # on CPU a rank's "gpu" names a slot, and says so
    assert no_run_pids(run_dir)


def test_a_follower_goes_on_through_an_agent_kill_to_the_end_of_the_run(run_dir):
    start(run_dir, [PY, PRINTER, "8000", "1500"])
    follower = subprocess.Popen([PY, "-m", "agent", "follow", "--run-dir", run_dir, "--from", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env(), cwd=REPO)
    try:
        wait_for(lambda: status(run_dir).get("state") == "running", 30)
        _kill_agent_and_wait_for_the_next(run_dir)
        out, err = follower.communicate(timeout=120)
    finally:
        follower.kill()
    assert follower.returncode == 0, err
    got = [json.loads(line) for line in out.splitlines()]
    assert [r["seq"] for r in got] == list(range(1, len(records(run_dir)) + 1))
    end = max(i for i, r in enumerate(got) if r["kind"] == "status")
    assert got[end]["payload"]["state"] == "completed"
    assert {r["kind"] for r in got[end + 1:]} <= {"alert"}  # only the run's completion alert may follow


def test_a_job_that_fails_while_no_agent_runs_is_finalized_by_a_new_agent(run_dir):
    start(run_dir, [PY, FAKE, "--ranks", "0", "--step-time", "0.1"])
    hb = wait_for(lambda: heartbeats(run_dir).get(0), 30, what="rank 0")
    os.kill(agent_pid(run_dir), signal.SIGKILL)
    os.kill(hb["pid"], signal.SIGKILL)  # nobody watches when the job dies
    res = wait_terminal(run_dir, timeout=60)
    assert res["state"] == "failed" and res["exit"]["signal"] == 9
    assert res["root_cause"]["kind"] == "rank_exit" and "killed by signal 9 (not by us)" in res["reason"]
    assert status(run_dir)["reattaches"]


def test_revive_0_leaves_the_run_to_a_reattach_by_hand(run_dir):
    start(run_dir, [PY, FAKE, "--ranks", "0", "--step-time", "0.2"], "--revive", "0")
    wait_for(lambda: status(run_dir).get("state") == "running", 30)
    old = agent_pid(run_dir)
    os.kill(old, signal.SIGKILL)
    reply = agent("start", "--run-dir", run_dir, "--reattach", "--auto", check=False)
    assert reply.returncode == 1 and "--revive 0" in reply.stdout
    assert agent_pid(run_dir) == old  # nobody started one


def test_ranks_that_never_start_fail_at_the_start_up_deadline_named_with_the_rendezvous(run_dir):
    start(run_dir, [PY, FAKE, "--ranks", "3", "--step-time", "0.2", "--rdzv-endpoint", "10.77.0.99:29400",
                    "--never-start", "1,2"], "--startup-timeout", "5")
    res = wait_terminal(run_dir, timeout=60)
    rc = res["root_cause"]
    assert rc["kind"] == "startup_timeout" and rc["rank"] == 1, res
    assert res["reason"] == ("start-up deadline: ranks 1, 2 (drafter on rank slots 1, 2) sent no heartbeat within "
                             "5 s of the start (--startup-timeout); rendezvous 10.77.0.99:29400")
    assert "[rank1]: waiting for the rendezvous at 10.77.0.99:29400" in rc["evidence"]
    assert rc["details"]["missing_ranks"] == [1, 2] and rc["details"]["heartbeats"] == [0]
    assert no_run_pids(run_dir)


def test_while_ranks_have_not_started_status_shows_them_as_not_started(run_dir):
    start(run_dir, [PY, FAKE, "--ranks", "2", "--step-time", "0.2", "--rdzv-endpoint", "127.0.0.1:29400",
                    "--never-start", "1"])
    ranks = wait_for(lambda: (r := status(run_dir).get("ranks") or {}) and r.get("0", {}).get("health") == "ok"
                     and r, 30, what="rank 0 up")
    assert ranks["1"] == {"step": None, "pid": None, "gpu": 1, "role": "drafter", "heartbeat_age_s": None,
                          "health": "not started"}
    assert status(run_dir)["launch"]["rdzv_endpoint"] == "127.0.0.1:29400"


def test_a_job_that_never_heartbeats_fails_at_the_deadline(run_dir):
    start(run_dir, [PY, "-c", "import time; print('loading', flush=True); time.sleep(600)"], "--startup-timeout", "3")
    res = wait_terminal(run_dir, timeout=60)
    assert res["root_cause"]["kind"] == "startup_timeout"
    assert res["reason"].startswith("start-up deadline: no rank sent a heartbeat within 3 s")
    assert "loading" in res["root_cause"]["evidence"]
    assert read_json(os.path.join(run_dir, "result.json"))["stop"]["survivors"] == []


def test_status_finds_a_run_nobody_supervises_and_starts_an_agent_for_it(run_dir, tmp_path):
    # The agent and the job's monitor both gone (so the monitor cannot bring the agent back):
    # the next look at the run (`ctl status` → agent.runview status) starts one.
    start(run_dir, [PY, FAKE, "--ranks", "0", "--step-time", "0.2"])
    wait_for(lambda: heartbeats(run_dir).get(0), 30, what="rank 0")
    monitor = read_json(os.path.join(run_dir, "job.pid"))["pid"]
    os.kill(monitor, signal.SIGKILL)
    os.kill(agent_pid(run_dir), signal.SIGKILL)
    wait_for(lambda: not _alive(monitor), 10, what="the monitor to go")
    ws = os.path.dirname(os.path.dirname(run_dir))
    reply = json.loads(subprocess.run([PY, "-m", "agent.runview", "status", "--workspace", ws, "--run", "r1-20261201-114702-0001"],
                                      capture_output=True, text=True, env=env(), cwd=REPO).stdout.splitlines()[1])
    assert reply["revived"]["ok"] and reply["revived"]["reattached"] is True
    res = wait_terminal(run_dir, 60)  # the job's monitor is gone, so its exit status is lost: failed
    assert res["state"] == "failed"
    assert status(run_dir)["reattaches"][-1]["by"] == "ctl status"
    assert no_run_pids(run_dir)
