"""Fail-fast classification with real processes: one dead, OOMed, stalled or timed-out rank
stops the whole run, and the result names the rank, the GPU and the reason."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests._agent_util import (no_run_pids, FAKE, PY, heartbeats, kill_all, records, run_pids, start, wait_for,
                               wait_terminal)


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "ws" / "runs" / "r1"
    yield str(d)
    kill_all(str(d))


def _failures(run_dir):
    return [r["payload"] for r in records(run_dir)
            if r["kind"] == "event" and r["payload"].get("kind") == "agent.failure"]


def test_kill9_of_one_of_four_workers_stops_the_run_within_10s_naming_the_rank(run_dir):
    start(run_dir, [PY, FAKE, "--ranks", "4", "--step-time", "0.2"])
    hbs = wait_for(lambda: (h := heartbeats(run_dir)) and len(h) == 4 and h, 30, what="four ranks")
    victim = hbs[2]["pid"]
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    res = wait_terminal(run_dir, timeout=10)
    assert time.monotonic() - t0 < 10
    assert res["state"] == "failed"
    assert "rank 2" in res["reason"], res["reason"]
    assert res["root_cause"]["rank"] == 2 and res["root_cause"]["gpu"] == 2
    assert res["root_cause"]["pid"] == victim
    # an external SIGKILL with no OOM evidence is said as such, never "host_oom (suspected)"
    assert res["root_cause"]["kind"] == "rank_exit"
    assert "killed by signal 9 (not by us)" in res["reason"], res["reason"]
    assert res["stop"]["survivors"] == []
    assert no_run_pids(run_dir), run_pids(run_dir)


def test_cuda_oom_traceback_becomes_reason_with_gpu_and_shortfall(run_dir):
    start(run_dir, [PY, FAKE, "--ranks", "2", "--oom-rank", "1", "--oom-at", "3",
                    "--oom-tried", "2.00 GiB", "--oom-free", "1.59 GiB", "--step-time", "0.1"])
    res = wait_terminal(run_dir, timeout=30)
    # 2.00 GiB − 1.59 GiB = 419.84 MiB → short by 420 MiB
    assert res["reason"].startswith("CUDA OOM on GPU 1, short by 420 MiB"), res["reason"]
    rc = res["root_cause"]
    assert rc["kind"] == "cuda_oom" and rc["rank"] == 1 and rc["gpu"] == 1
    assert rc["details"]["tried_mib"] == 2048.0 and rc["details"]["total_mib"] > 81000
    assert any("Traceback" in line for line in rc["evidence"])
    assert any("CUDA out of memory" in line for line in rc["evidence"])


def test_nccl_watchdog_timeout_line_is_named(run_dir):
    start(run_dir, [PY, FAKE, "--ranks", "2", "--nccl-rank", "0", "--nccl-at", "2", "--step-time", "0.1"])
    res = wait_terminal(run_dir, timeout=30)
    rc = res["root_cause"]
    assert rc["kind"] == "nccl_timeout" and rc["rank"] == 0
    assert rc["details"] == {"op": "ALLREDUCE", "timeout_ms": 600000}
    assert "NCCL collective timeout" in res["reason"] and "rank 0" in res["reason"]


def test_rank_without_heartbeat_progress_while_others_progress_is_a_stall(run_dir):
    start(run_dir, [PY, FAKE, "--ranks", "2", "--stall-rank", "1", "--stall-at", "3", "--step-time", "0.1"],
          "--stall-timeout", "2")
    res = wait_terminal(run_dir, timeout=30)
    rc = res["root_cause"]
    assert rc["kind"] == "rank_stall" and rc["rank"] == 1, res
    assert "rank 1 stalled" in res["reason"] and "at step 3" in res["reason"]
    assert no_run_pids(run_dir), run_pids(run_dir)


def test_an_external_kill9_is_killed_by_signal_9_not_by_us_in_one_record_naming_no_gpu(run_dir):
    # --ranks 0: the job's top process is the only rank (no launcher to report anything).
    # This once read "host_oom (suspected)", in two records ("rank slot 0" and "GPU 0").
    start(run_dir, [PY, FAKE, "--ranks", "0", "--step-time", "0.1"])
    hb = wait_for(lambda: heartbeats(run_dir).get(0), 30, what="rank 0")
    os.kill(hb["pid"], signal.SIGKILL)
    res = wait_terminal(run_dir, timeout=15)
    rc = res["root_cause"]
    assert rc["kind"] == "rank_exit", res
    assert res["reason"] == f"rank 0 (pid {hb['pid']}, rank slot 0) killed by signal 9 (not by us)"
    assert rc["details"]["signal"] == 9 and rc["details"]["by_us"] is False
    assert res["exit"]["signal"] == 9
    failures = _failures(run_dir)
    assert len(failures) == 1, [f["reason"] for f in failures]
    assert all("GPU" not in f["reason"] for f in failures)
    assert len(res["failures_history"][0]["failures"]) == 1


def test_steady_state_throughput_below_baseline_is_a_regression(run_dir):
    start(run_dir, [PY, FAKE, "--ranks", "1", "--slow-after", "6", "--tokens-per-s", "20000",
                    "--slow-tokens-per-s", "5400", "--step-time", "0.05"],
          "--baseline-tokens-per-s", "20000", "--regression-fraction", "0.3")
    res = wait_terminal(run_dir, timeout=30)
    rc = res["root_cause"]
    assert rc["kind"] == "throughput_regression", res
    assert rc["details"]["tokens_per_s"] == 5400
    assert "5,400 tokens/s vs baseline 20,000" in res["reason"]


def test_no_regression_when_throughput_holds(run_dir):
    start(run_dir, [PY, FAKE, "--ranks", "1", "--steps", "15", "--tokens-per-s", "19000", "--step-time", "0.05"],
          "--baseline-tokens-per-s", "20000", "--regression-fraction", "0.3")
    res = wait_terminal(run_dir, timeout=30)
    assert res["state"] == "completed", res
    assert _failures(run_dir) == []


def test_max_restarts_resumes_from_the_runs_latest_checkpoint(run_dir, tmp_path):
    out = str(tmp_path / "out")
    start(run_dir, [PY, FAKE, "--ranks", "1", "--steps", "12", "--save-interval", "3", "--oom-rank", "0",
                    "--oom-at", "7", "--fail-until-resumed", "--output-dir", out, "--from-scratch",
                    "--step-time", "0.05"],
          "--max-restarts", "1")
    res = wait_terminal(run_dir, timeout=60)
    assert res["state"] == "completed", res
    assert res["restarts"] == 1
    assert res["failures_history"][0]["root_cause"]["kind"] == "cuda_oom"
    restart = [r["payload"] for r in records(run_dir) if r["payload"].get("kind") == "agent.restart"]
    ckpt = os.path.join(out, "step_6", "checkpoint.pt")
    assert restart and restart[0]["checkpoint"] == ckpt
    assert "--from-scratch" not in restart[0]["argv"]
    i = restart[0]["argv"].index("--resume-from")
    assert restart[0]["argv"][i + 1] == ckpt
    lines = [r["payload"]["line"] for r in records(run_dir) if r["kind"] == "log"]
    assert f"[rank0]: starting at step 6 (resume={ckpt})" in lines
    states = [r["payload"]["state"] for r in records(run_dir) if r["kind"] == "status"]
    assert states == ["running", "restarting", "running", "completed"]


def test_restart_budget_exhausted_fails_with_the_last_root_cause(run_dir, tmp_path):
    start(run_dir, [PY, FAKE, "--ranks", "1", "--oom-rank", "0", "--oom-at", "2", "--from-scratch",
                    "--output-dir", str(tmp_path / "out"), "--step-time", "0.05"], "--max-restarts", "1")
    res = wait_terminal(run_dir, timeout=60)
    assert res["state"] == "failed" and res["restarts"] == 1
    assert res["reason"].startswith("CUDA OOM on GPU 0")
    assert len(res["failures_history"]) == 2
