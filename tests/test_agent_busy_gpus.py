"""A launch onto GPUs (or CPU rank slots) that a live run in the container holds is refused by
the preflight, one line naming the run and what it holds, unless --share-gpus (two launches on
one GPU each planned for the whole memory — the story's shortfall, on purpose)."""

from __future__ import annotations

import os

from agent import knowngood, preflight, procs
from agent.protocol import RunState, RunStatus, atomic_write_json


def _live_run(ws, run_id: str, target, drafter, *, job_alive: bool = True, state=RunState.RUNNING) -> None:
    rd = os.path.join(ws, "runs", run_id)
    os.makedirs(rd)
    RunStatus(run_id=run_id, state=state).save(os.path.join(rd, "status.json"))
    if job_alive:  # the job (here: this test process) runs, though no agent supervises it
        atomic_write_json(os.path.join(rd, "job.pid"), procs.Identity.of(os.getpid()).to_json())
    knowngood.write_launch_record(str(ws), {"run_id": run_id, "gpus": {"target": target, "drafter": drafter}})


def _check(ws, target, drafter, **extra):
    return preflight.check({"workspace": str(ws), "run_id": "new", "start": {"kind": "scratch"},
                            "flags": {"device": "cpu", "target_gpus": target, "drafter_gpus": drafter}, **extra})


def test_a_live_run_on_a_requested_rank_slot_refuses_the_launch_in_one_line(tmp_path):
    _live_run(tmp_path, "old", [0, 1], [2])
    _live_run(tmp_path, "ended", [3], [3], state=RunState.FAILED)
    _live_run(tmp_path, "gone", [4], [4], job_alive=False)  # no agent, no job: holds nothing
    reply = _check(tmp_path, [1, 3, 4], [2])
    held = [e for e in reply["errors"] if "is live" in e]
    assert held == ["run old is live (running) in this container on rank slots 1,2: stop it first "
                    "(`ctl kill-and-rollback --run old`), give this run other GPUs, or pass --share-gpus to start "
                    "it anyway"]


def test_share_gpus_turns_the_refusal_into_a_warning(tmp_path):
    _live_run(tmp_path, "old", [0], [0])
    reply = _check(tmp_path, [0], [0], share_gpus=True)
    assert not any("is live" in e for e in reply["errors"])
    assert "run old is live (running) in this container on rank slot 0: shared, as --share-gpus asks" in reply["warnings"]
