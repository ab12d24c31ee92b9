"""Served τ while training goes on, in a real engine: a CPU training run under the real agent
with ``--served-check-every 1`` saves three times; its agent starts a served-check job (vLLM
CPU, trainer/serve/served_job.py) for the first save, queues the second behind it and lets the
third supersede the second. Each check's record — served τ beside the τ at save, the verdict —
lands in the checkpoint's meta.json, the run's events (so `ctl status`'s history) and the
check's own stream. (`ctl served-check --run R --best` end to end, through the simulated
node's containers: tests/test_served_check_vllm_sim.py.)

Two vLLM engine starts, about a minute each on 2 cores; marked ``vllm``.
"""

from __future__ import annotations

import json
import os

import pytest

from _agent_util import PY, REPO, records, start, wait_for, wait_terminal

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RUN = "served-20260101-000000-0001"


def served_records(run_dir) -> dict[int, dict]:
    with open(os.path.join(run_dir, "events.jsonl")) as fh:
        return {e["step"]: e for e in map(json.loads, fh) if e["kind"] == "served_check"}


def meta(out, step) -> dict:
    with open(os.path.join(out, f"step_{step}", "meta.json")) as fh:
        return json.load(fh)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from trainer.__main__ import main
    from trainer.serve import served
    from _trainer_tiny import base_args

    vllm = os.environ.get("DFLASH_VLLM_PYTHON") or served.DEFAULT_VLLM_PYTHON
    if not os.access(vllm, os.X_OK):
        pytest.fail(f"{vllm} missing: run scripts/setup.sh (it builds .venv-vllm/)")
    root = tmp_path_factory.mktemp("served-agent")
    assert main(["tiny", "--out", str(root), "--samples", "120"]) == 0
    target, data, out = str(root / "target"), str(root / "data"), str(root / "out")
    args = base_args(target, data, out, "--target-layer-ids", "1,2", "--from-scratch", "--max-steps", "30",
                     "--lr", "1e-2", "--block-size", "4", "--eval-prompts", "4", "--save-interval", "10",
                     "--keep-checkpoints", "0", "--served-check-every", "1", "--vllm-python", vllm)
    args[args.index("--max-seq-len") + 1], args[args.index("--token-budget") + 1] = "200", "800"
    run_dir = os.path.join(root, "ws", "runs", RUN)
    start(run_dir, [PY, "-m", "trainer", *args], "--run-id", RUN, "--cwd", REPO)
    assert wait_terminal(run_dir, 600)["state"] == "completed"
    # the first save's check and the third's (which superseded the second) each leave a record
    wait_for(lambda: {10, 30} <= set(served_records(run_dir)), 900, interval=1.0, what="both served checks")
    # the job appends to the checked run's events last but its own agent streams its events
    # afterwards: each check's stream is whole only once that run has ended
    for rec in served_records(run_dir).values():
        wait_terminal(os.path.join(root, "ws", "runs", rec["run_id"]), 120)
    return {"root": root, "ws": root / "ws", "run_dir": run_dir, "out": out}


def test_served_tau_is_recorded_beside_tau_at_save_every_k_saves(run):
    from agent.protocol import ServedCheck
    from agent.runview import history

    recs = served_records(run["run_dir"])
    assert set(recs) == {10, 30}, recs  # step 20 was queued, then superseded by step 30
    for step, rec in recs.items():
        r = ServedCheck.from_json(rec)
        at_save = meta(run["out"], step)["eval"]["tau"]
        assert r.ok and r.verdict == "pass" and r.causes == [], rec
        assert r.tau_at_save == at_save and abs(r.tau_served - at_save) <= 0.02 * at_save, rec
        assert r.device == "cpu" and r.prompts == 4 and r.checked_run == RUN
        assert meta(run["out"], step)["served"] == r.to_json()  # the same record in the checkpoint's meta
        # the check's own stream has it too
        own = os.path.join(run["ws"], "runs", r.run_id)
        assert any(x["kind"] == "event" and x["payload"].get("kind") == "served_check"
                   and x["payload"]["step"] == step for x in records(own))
    assert "served" not in meta(run["out"], 20)
    # the agent said what it did with each due save, in the run's stream
    said = [x["payload"] for x in records(run["run_dir"])
            if x["kind"] == "event" and x["payload"].get("kind") == "agent.served_check"]
    assert said[0]["step"] == 10 and said[0]["run_id"].startswith("served-check-") and not said[0].get("queued")
    assert said[1]["step"] == 20 and said[1]["queued"]
    assert said[2]["step"] == 30 and said[2]["queued"] and said[2]["superseded_step"] == 20
    # ctl status's history: served τ beside τ at save
    h = history(run["run_dir"])
    assert [s["step"] for s in h["served"]] == [10, 30] and h["eval_step"] == [10, 20, 30]
