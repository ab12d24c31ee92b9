"""The served-check job kind under the real agent (agent/servedcheck.py, trainer/serve/served_job.py):
bad input refused in one line before anything starts — an unknown run, a run that has not
saved, one trained without --eval-prompts (no held-out prompts, no τ at save), no vLLM where
the job runs, a GPU a live run holds, a --served-check-gpu that is one of the training's own.

The served checks themselves (vLLM CPU) are tests/test_served_check_vllm.py.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from _agent_util import PY, REPO, env, start
from _trainer_tiny import base_args, tiny_setup

pytestmark = pytest.mark.slow


def served_start(ws, run, *extra) -> dict:
    from agent.protocol import extract_payload

    p = subprocess.run([PY, "-m", "agent.servedcheck", "start", "--workspace", str(ws), "--run", run, *extra],
                       capture_output=True, text=True, env=env(), cwd=REPO, timeout=300)
    reply = extract_payload(p.stdout)
    assert (p.returncode == 0) == bool(reply.get("ok")), (p.stdout, p.stderr)
    return reply


def spec_run(ws, run_id: str) -> str:
    """A run directory with its spec, as ctl launch leaves one (the checks read nothing else first)."""
    d = os.path.join(ws, "runs", run_id)
    os.makedirs(d)
    with open(os.path.join(d, "spec.json"), "w") as fh:
        json.dump({"run_id": run_id, "argv": ["true"], "created": 0}, fh)
    return d


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A training run (in a workspace's runs/) saved without --eval-prompts."""
    from trainer.__main__ import main

    root = tmp_path_factory.mktemp("served-job")
    target, data = tiny_setup(str(root))
    ws = root / "ws"
    run_dir = spec_run(ws, "plain-20260101-000000-0001")
    assert main(base_args(target, data, str(root / "out"), "--from-scratch", "--max-steps", "2",
                          "--run-dir", run_dir)) == 0
    return {"ws": ws, "run": "plain-20260101-000000-0001", "run_dir": run_dir, "out": str(root / "out")}


def test_unknown_run_is_refused(trained):
    reply = served_start(trained["ws"], "nosuch-20260101-000000-abcd")
    assert reply["error"].startswith("no run 'nosuch-20260101-000000-abcd' in ") and "ctl runs" in reply["error"]


def test_a_run_that_has_not_saved_is_refused(trained):
    spec_run(trained["ws"], "fresh-20260101-000000-0002")
    reply = served_start(trained["ws"], "fresh-20260101-000000-0002")
    assert "no complete checkpoint there" in reply["error"] and "has not saved yet" in reply["error"], reply


def test_a_run_without_eval_prompts_is_refused(trained):
    reply = served_start(trained["ws"], trained["run"])
    assert "no τ measured at save" in reply["error"] and "--eval-prompts N" in reply["error"], reply
    assert not os.listdir(os.path.join(trained["ws"], "runs")) or all(
        not n.startswith("served-check-") for n in os.listdir(os.path.join(trained["ws"], "runs")))


def test_no_vllm_where_the_job_runs_says_what_to_install(trained, tmp_path):
    from trainer import checkpoint as ckpt_io
    from trainer.serve import served_job
    from trainer.serve.served import ServedError

    # a checkpoint with a τ at save, so the engine is the next thing the job checks
    step = ckpt_io.steps(trained["out"])[-1][1]
    meta = ckpt_io.read_meta(step)
    ckpt_io.atomic_write_json(os.path.join(step, ckpt_io.META), {**meta, "eval": {"tau": 1.0, "prompts": 4}})
    try:
        args = served_job.build_parser().parse_args(["--checkpoint", trained["run_dir"], "--vllm-python",
                                                     str(tmp_path / "nope" / "python")])
        with pytest.raises(ServedError) as info:
            served_job.plan(args)
        assert "no vLLM here" in str(info.value) and "pip install vllm" in str(info.value) \
            and "--vllm-python /opt/vllm/bin/python" in str(info.value), info.value
    finally:
        ckpt_io.atomic_write_json(os.path.join(step, ckpt_io.META), meta)


def test_a_runs_checks_serve_in_the_engine_the_run_named(trained, tmp_path):
    """`ctl served-check --run R` without --vllm-python serves in the vLLM the run was launched
    with (its --vllm-python, in the checkpoint's meta): before, it looked only at
    $DFLASH_VLLM_PYTHON and beside the agent bundle, where an operator's container has none."""
    from trainer import checkpoint as ckpt_io
    from trainer.serve import served_job
    from trainer.serve.served import ServedError

    step = ckpt_io.steps(trained["out"])[-1][1]
    meta = ckpt_io.read_meta(step)
    named = str(tmp_path / "engine" / "bin" / "python")
    config = {**meta["config"], "vllm_python": named}
    ckpt_io.atomic_write_json(os.path.join(step, ckpt_io.META),
                              {**meta, "config": config, "eval": {"tau": 1.0, "prompts": 4}})
    parse = served_job.build_parser().parse_args
    try:
        with pytest.raises(ServedError) as info:  # named but not there: the refusal names it
            served_job.plan(parse(["--checkpoint", trained["run_dir"]]))
        assert f"--vllm-python {named}: not an interpreter" in str(info.value), info.value
        os.makedirs(os.path.dirname(named))
        os.symlink(PY, named)
        assert served_job.plan(parse(["--checkpoint", trained["run_dir"]])).python == named
        # the flag still wins over the run's own
        assert served_job.plan(parse(["--checkpoint", trained["run_dir"], "--vllm-python", PY])).python == PY
    finally:
        ckpt_io.atomic_write_json(os.path.join(step, ckpt_io.META), meta)


def test_a_gpu_a_live_run_holds_is_refused(trained):
    from agent import knowngood

    live = os.path.join(trained["ws"], "runs", "holder-20260101-000000-0003")
    start(live, [PY, "-c", "import time; time.sleep(60)"], "--run-id", "holder-20260101-000000-0003")
    knowngood.write_launch_record(str(trained["ws"]), {"run_id": "holder-20260101-000000-0003", "kind": "train",
                                                      "gpus": {"target": [3], "drafter": [3]}})
    try:
        reply = served_start(trained["ws"], trained["run"], "--gpu", "3")
        assert reply["error"].startswith("--gpu 3: run holder-20260101-000000-0003 is live") \
            and "leave --gpu out to check on CPU" in reply["error"], reply
    finally:
        subprocess.run([PY, "-m", "agent", "stop", "--run-dir", live, "--grace", "2"], env=env(), cwd=REPO,
                       capture_output=True, timeout=120)


def test_served_check_gpu_among_the_trainings_is_refused():
    from trainer import flags

    values = {f.dest: f.default for f in flags.FLAGS}
    values.update(target_gpus=(0,), drafter_gpus=(1,), from_scratch=True, target_model="t", data_dir="d",
                  output_dir="o", served_check_every=2, served_check_gpu=1, eval_prompts=4)
    problems = flags.check(values)
    assert any(p.startswith("--served-check-gpu 1 is one of the training's GPUs") for p in problems), problems
    values.update(served_check_gpu=2, eval_prompts=0)
    problems = flags.check(values)
    assert [p for p in problems if "served-check" in p] == [
        "--served-check-every 2 needs --eval-prompts N: a served check serves the held-out prompts and holds "
        "served τ to the τ measured on them at save"]
