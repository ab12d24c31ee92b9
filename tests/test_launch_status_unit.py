"""`ctl status` rendering: a failure shows first as its named reason; rates against the
baseline; per-GPU role, utilisation, memory and temperature."""

from __future__ import annotations

from controller.status import eta_seconds, render_runs, render_status


def reply(**status):
    return {"run_id": "r2", "latest": True, "agent_alive": True, "spec": {"created": 1000.0},
            "gpus": {"target": [0, 1], "drafter": [2]},
            "baseline": {"run_id": "r1", "steady": {"tokens_per_s": 20000.0}},
            "status": {"state": "running", "phase": "training", "step": 50, "total": 200, "updated": 1100.0,
                       "loss": 1.25, "tokens_per_s": 5400.0,
                       "ranks": {"0": {"role": "target", "gpu": 0, "health": "ok", "step": 50, "heartbeat_age_s": 0.5}},
                       "gpus": [{"index": 0, "utilization_gpu_pct": 97, "memory_used_mib": 71680, "memory_total_mib": 81920,
                                 "temperature_gpu_c": 66},
                                {"index": 2, "utilization_gpu_pct": 3, "memory_used_mib": 1024, "memory_total_mib": 81920,
                                 "temperature_gpu_c": 40}], **status}}


def test_a_running_run_shows_progress_eta_rate_vs_baseline_ranks_and_gpus():
    lines = render_status(reply(), "200", "pve1")
    text = "\n".join(lines)
    assert "state    running, phase training — agent alive" in text
    assert "step     50/200 (25 %), ETA 5m00s" in text
    assert "tok/s    5.4K vs baseline 20.0K of run r1: 27 %" in text
    assert "rank 0   target on GPU 0: ok, step 50" in text
    assert "GPU 0    target: util 97 %, mem 70.0/80.0 GiB, 66 °C" in text
    assert "GPU 2    drafter: util 3 %" in text


def test_a_failure_shows_first_as_its_named_reason():
    r = reply(state="failed")
    r["result"] = {"reason": "rank 6 (GPU 6) CUDA out of memory: tried to allocate 200 MiB",
                   "root_cause": {"kind": "cuda_oom", "reason": "rank 6 (GPU 6) CUDA out of memory: tried to allocate 200 MiB"}}
    lines = render_status(r, "200", "pve1")
    assert lines[1] == "FAILED   cuda_oom: rank 6 (GPU 6) CUDA out of memory: tried to allocate 200 MiB"


def test_eta_needs_progress():
    assert eta_seconds({"step": 0, "total": 10}, 0.0) is None
    assert eta_seconds({"step": 5, "total": 10, "updated": 150.0}, 100.0) == 50.0


def test_runs_marks_unfinished_runs_without_an_agent():
    lines = render_runs({"runs": [{"run_id": "a", "state": "completed", "step": 24, "agent_alive": False},
                                  {"run_id": "b", "state": "running", "step": 3, "agent_alive": False}]}, "200")
    assert lines[2].split()[1] == "running*" and "re-attach" in lines[-1]


def test_status_says_when_who_and_why_an_agent_took_over_and_shows_ranks_not_started():
    r = reply(reattaches=[{"ts": 1000.0, "by": "the job's monitor (pid 41)", "why": "its agent (pid 40) died",
                           "agent_pid": 52, "previous_agent_pid": 40, "seq": 9}],
              gpu_state="no GPU", gpus=[],
              ranks={"0": {"role": "target", "gpu": 0, "health": "ok", "step": 5, "heartbeat_age_s": 0.5},
                     "1": {"role": "drafter", "gpu": 1, "health": "not started"}})
    text = "\n".join(render_status(r, "200", "pve1"))
    assert "agent    re-attached: last at " in text and "by the job's monitor (pid 41): its agent (pid 40) died" in text
    assert "rank 1   drafter on rank slot 1 (CPU): not started" in text
    r["revived"] = {"ok": True, "agent_pid": 77}
    assert "ctl status started one (pid 77)" in "\n".join(render_status(r, "200", "pve1"))


def test_a_start_up_failure_shows_its_reason_then_the_ranks_last_lines():
    r = reply(state="failed")
    r["result"] = {"state": "failed", "reason": "start-up deadline: rank 1 (drafter on rank slot 0) sent no heartbeat",
                   "root_cause": {"kind": "startup_timeout", "reason": "start-up deadline: rank 1 (drafter on rank "
                                  "slot 0) sent no heartbeat", "evidence": [f"line {i}" for i in range(9)]}}
    lines = render_status(r, "200", "pve1")
    assert lines[1].startswith("FAILED   startup_timeout: start-up deadline: rank 1")
    assert lines[2:7] == [f"         | line {i}" for i in range(4, 9)]
