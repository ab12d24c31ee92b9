"""Known good: only a run that reached steady state and did not fail
becomes the container's baseline; one that ended in a failure never does, and a provisional
baseline whose run fails later is taken back (the previous one returns)."""

from __future__ import annotations

import json
import os

from agent import knowngood
from agent.protocol import RunResult, RunState, RunStatus


def _run(ws, run_id: str, ts: float, steps: int, state: RunState | None, config: str = "tiny") -> str:
    run = os.path.join(ws, "runs", run_id)
    os.makedirs(run)
    with open(os.path.join(run, "events.jsonl"), "w") as fh:
        for step in range(1, steps + 1):
            fh.write(json.dumps({"kind": "step", "rank": 0, "step": step, "tokens_per_s": 1000.0}) + "\n")
    if state is not None:
        RunStatus(run_id=run_id, state=state, step=steps).save(os.path.join(run, "status.json"))
        if state.is_terminal():
            RunResult(run_id=run_id, state=state).save(os.path.join(run, "result.json"))
    knowngood.write_launch_record(ws, {"run_id": run_id, "ts": ts, "config": config,
                                       "baseline": {"steady_steps": 3, "throughput_tolerance": 0.25}})
    return run


def _finish(run: str, state: RunState) -> None:
    RunStatus(run_id=os.path.basename(run), state=state).save(os.path.join(run, "status.json"))
    RunResult(run_id=os.path.basename(run), state=state).save(os.path.join(run, "result.json"))


def test_a_run_that_ended_in_a_failure_never_becomes_known_good(tmp_path):
    ws = str(tmp_path)
    _run(ws, "good", 1.0, 10, RunState.COMPLETED)
    _run(ws, "failed", 2.0, 10, RunState.FAILED)  # steady for 10 steps, then failed
    doc = knowngood.update(ws)
    assert doc["env"]["run_id"] == "good" and doc["configs"]["tiny"]["run_id"] == "good"
    assert "failed" in doc["checked"]


def test_a_provisional_baseline_whose_run_fails_later_is_taken_back(tmp_path):
    ws = str(tmp_path)
    _run(ws, "good", 1.0, 10, RunState.COMPLETED)
    assert knowngood.update(ws)["env"]["run_id"] == "good"
    live = _run(ws, "live", 2.0, 10, RunState.RUNNING)
    doc = knowngood.update(ws)
    assert doc["env"]["run_id"] == "live" and doc["pending"] == ["live"]  # 2 × 3 steady steps, still going
    _finish(live, RunState.FAILED)
    doc = knowngood.update(ws)
    assert doc["env"]["run_id"] == "good" and doc["configs"]["tiny"]["run_id"] == "good" and doc["pending"] == []
    # and a provisional one that completes stays
    ok = _run(ws, "later", 3.0, 10, RunState.RUNNING)
    knowngood.update(ws)
    _finish(ok, RunState.COMPLETED)
    doc = knowngood.update(ws)
    assert doc["env"]["run_id"] == "later" and doc["pending"] == []


def test_too_few_steady_steps_is_not_yet_known_good(tmp_path):
    ws = str(tmp_path)
    _run(ws, "short", 1.0, 5, RunState.RUNNING)  # needs 1 + 2 × 3 step events
    assert knowngood.update(ws)["env"] is None
