"""The stream's promises: seq monotonic and durable; a follower that reconnects with its last
seq sees no gap and no duplicate; kill -9 of the agent loses and repeats nothing; status.json
is never seen half-written."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time

import pytest

from agent.protocol import atomic_write_json
from tests._agent_util import (PRINTER, PY, REPO, FAKE, agent_pid, env, kill_all, no_run_pids, payload,
                               records, start, status, wait_for, wait_terminal)


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "ws" / "runs" / "r1-20261201-114702-0001"
    yield str(d)
    kill_all(str(d))


def _contract(rec: dict) -> dict:
    return {k: rec[k] for k in ("seq", "ts", "kind", "payload")}


def _follow_proc(run_dir: str, after: int) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "agent", "follow", "--run-dir", run_dir, "--from", str(after)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env(), cwd=REPO)


def test_follower_killed_at_20_random_points_reassembles_the_exact_stream(run_dir):
    rng = random.Random(1234)
    start(run_dir, [PY, PRINTER, "12000", "1500"])  # ~8 s of output
    got: list[dict] = []
    last = 0
    for _ in range(20):
        proc = _follow_proc(run_dir, last)
        time.sleep(rng.uniform(0.05, 0.4))
        proc.kill()  # the client's connection dies mid-stream, maybe mid-line
        out, _ = proc.communicate()
        for raw in out.split(b"\n"):
            try:
                rec = json.loads(raw)
            except ValueError:
                continue  # the torn last line of a killed follower: asked again next time
            assert rec["seq"] == last + 1, f"gap or duplicate: {last} → {rec['seq']}"
            got.append(rec)
            last = rec["seq"]
    proc = _follow_proc(run_dir, last)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    for raw in out.splitlines():
        rec = json.loads(raw)
        assert rec["seq"] == last + 1
        got.append(rec)
        last = rec["seq"]
    truth = [_contract(r) for r in records(run_dir)]
    assert got == truth
    end = max(i for i, r in enumerate(got) if r["kind"] == "status")
    assert got[end]["payload"]["state"] == "completed"
    assert {r["kind"] for r in got[end + 1:]} <= {"alert"}  # only the run's completion alert may follow
    lines = [r["payload"]["line"] for r in got if r["kind"] == "log"]
    assert lines == [f"line {i}" for i in range(12000)]


# The tests of a run with no agent turn the job monitor's revival off (--revive 0): they
# exercise what happens while nobody supervises, which the monitor otherwise ends within a
# second (tests/test_agent_revive.py).
NO_REVIVAL = ("--revive", "0")


def test_agent_kill9_and_reattach_three_times_loses_and_repeats_no_line(run_dir):
    start(run_dir, [PY, PRINTER, "15000", "1500"], *NO_REVIVAL)  # ~10 s of output
    for round_ in range(3):
        time.sleep(1.0)
        pid = agent_pid(run_dir)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z",
                 10, what="the agent to die")
        time.sleep(0.7)  # the job keeps printing into its files while no agent runs
        # `start` on an existing run whose agent is gone re-attaches too (no --reattach needed)
        verb = ["--reattach"] if round_ != 1 else []
        reply = payload("start", "--run-dir", run_dir, *verb)
        assert reply["reattached"] is True and reply["agent_pid"] != pid
    res = wait_terminal(run_dir, timeout=120)
    assert res["state"] == "completed"
    recs = records(run_dir)
    assert [r["seq"] for r in recs] == list(range(1, len(recs) + 1))
    lines = [r["payload"]["line"] for r in recs if r["kind"] == "log"]
    assert lines == [f"line {i}" for i in range(15000)]
    reattached = [r for r in recs if r["payload"].get("kind") == "agent.reattached"]
    assert len(reattached) == 3 and all(r["payload"]["job_alive"] for r in reattached)
    assert no_run_pids(run_dir)


def test_a_flood_printed_just_before_exit_is_captured_to_the_last_line(run_dir):
    # regression: the final read after the job's exit was one bounded chunk, so the tail
    # of a fast printer was lost and the chunk's last line was cut in two
    start(run_dir, [PY, PRINTER, "300000", "1e9"])
    res = wait_terminal(run_dir, timeout=240)
    assert res["state"] == "completed"
    lines = [r["payload"]["line"] for r in records(run_dir) if r["kind"] == "log"]
    assert len(lines) == 300000 and lines == [f"line {i}" for i in range(300000)]


def test_status_json_is_never_seen_half_written_while_the_agent_rewrites_it(run_dir):
    start(run_dir, [PY, FAKE, "--ranks", "2", "--steps", "60", "--step-time", "0.05"])
    path = os.path.join(run_dir, "status.json")
    reads, bad = 0, []
    states = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            continue
        reads += 1
        try:
            doc = json.loads(data)
        except ValueError:
            bad.append(data[:200])
            continue
        states.add(doc["state"])
        if doc["state"] == "completed":
            break
    assert bad == []
    assert "completed" in states and reads > 1000


def test_atomic_status_write_hammered_by_a_reader_process(tmp_path):
    """The same guarantee at a write rate far above the agent's (thousands of rewrites)."""
    path = str(tmp_path / "status.json")
    atomic_write_json(path, {"n": -1})
    reader = subprocess.Popen([PY, "-c", """
import json, sys, time
path = sys.argv[1]; bad = 0; reads = 0
while True:
    with open(path, 'rb') as fh:
        data = fh.read()
    reads += 1
    try:
        doc = json.loads(data)
    except ValueError:
        bad += 1; continue
    if doc["n"] == 499:
        break
print(reads, bad)
""", path], stdout=subprocess.PIPE, text=True)
    big = "x" * 20000  # bigger than one page: a torn write would show
    for n in range(500):
        atomic_write_json(path, {"n": n, "pad": big})
    out, _ = reader.communicate(timeout=60)
    reads, bad = map(int, out.split())
    assert bad == 0 and reads > 100


def test_follow_of_a_finished_run_prints_everything_then_exits_0(run_dir):
    start(run_dir, [PY, PRINTER, "50", "1000"])
    wait_terminal(run_dir, 30)
    assert no_run_pids(run_dir)
    proc = subprocess.run([PY, "-m", "agent", "follow", "--run", "r1-20261201-114702-0001", "--workspace",
                           os.path.dirname(os.path.dirname(run_dir)), "--from", "10"],
                          capture_output=True, env=env(), cwd=REPO, timeout=30)
    assert proc.returncode == 0
    seqs = [json.loads(l)["seq"] for l in proc.stdout.splitlines()]
    assert seqs[0] == 11 and seqs == list(range(11, len(records(run_dir)) + 1))
    assert all(set(json.loads(l)) == {"seq", "ts", "kind", "payload"} for l in proc.stdout.splitlines())


def test_follow_says_so_and_exits_3_when_the_agent_is_gone_and_the_run_is_not_finished(run_dir):
    start(run_dir, [PY, FAKE, "--ranks", "0", "--step-time", "0.2"], *NO_REVIVAL)
    wait_for(lambda: status(run_dir).get("state") == "running", 30)
    os.kill(agent_pid(run_dir), signal.SIGKILL)
    proc = subprocess.run([PY, "-m", "agent", "follow", "--run-dir", run_dir, "--from", "0"],
                          capture_output=True, env=env(), cwd=REPO, timeout=60)
    assert proc.returncode == 3
    assert b"--reattach" in proc.stderr


def test_a_job_that_failed_while_no_agent_ran_is_finalized_on_reattach(run_dir):
    from tests._agent_util import heartbeats

    start(run_dir, [PY, FAKE, "--ranks", "0", "--step-time", "0.1"], *NO_REVIVAL)
    hb = wait_for(lambda: heartbeats(run_dir).get(0), 30, what="rank 0")
    os.kill(agent_pid(run_dir), signal.SIGKILL)
    os.kill(hb["pid"], signal.SIGKILL)  # the job dies while nobody watches
    wait_for(lambda: os.path.exists(os.path.join(run_dir, "job.exit.json")), 30, what="the monitor's record")
    payload("start", "--run-dir", run_dir)  # re-attach
    res = wait_terminal(run_dir, 30)
    assert res["state"] == "failed" and res["exit"]["signal"] == 9
    assert res["root_cause"]["kind"] == "rank_exit"
    recs = records(run_dir)
    assert [r["seq"] for r in recs] == list(range(1, len(recs) + 1))


@pytest.mark.parametrize("code,expect", [(0, 0), (3, 6)])
def test_stream_once_exits_6_for_a_failed_run_even_from_past_its_last_record(tmp_path, code, expect):
    """`agent.runview stream --from N` (what `ctl tail --since N` runs): the exit code says the
    run failed even when its final status record lies at or before N and nothing is printed."""
    ws = tmp_path / "ws"
    rd = str(ws / "runs" / "r1-20261201-114702-0001")
    try:
        start(rd, [PY, "-c", f"import sys; print('hello'); sys.exit({code})"], *NO_REVIVAL)
        res = wait_terminal(rd, 30)
        assert res["state"] == ("completed" if code == 0 else "failed")
        # A record after the final status, as a re-attached agent's GPU sample lands there.
        n = len(records(rd))
        with open(os.path.join(rd, "stream.jsonl"), "a") as fh:
            fh.write(json.dumps({"seq": n + 1, "ts": time.time(), "kind": "event",
                                 "payload": {"kind": "gpus", "gpus": {"state": "no GPU"}}},
                                separators=(",", ":")) + "\n")
        last = len(records(rd))
        assert last == n + 1
        for after in (0, last):
            proc = subprocess.run([PY, "-m", "agent.runview", "stream", "--workspace", str(ws), "--run", "r1-20261201-114702-0001",
                                   "--from", str(after)], capture_output=True, env=env(), cwd=REPO, timeout=30)
            assert proc.returncode == expect, (after, proc.stderr)
            assert len(proc.stdout.splitlines()) == last - after
            # `agent follow` (ctl tail --follow) ends at the final status too, with what came
            # after it, rather than calling a finished run's gone agent a hang (exit 3)
            proc = subprocess.run([PY, "-m", "agent", "follow", "--run-dir", rd, "--from", str(after)],
                                  capture_output=True, env=env(), cwd=REPO, timeout=60)
            assert proc.returncode == 0, (after, proc.stderr)
            assert len(proc.stdout.splitlines()) == last - after
    finally:
        kill_all(rd)
