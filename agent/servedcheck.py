"""Served checks of a training run's checkpoints: the served-check job kind (trainer/kinds.py,
trainer/serve/served_job.py) started under the agent like any job, at most one at a time per run.

Two ways in, one path:

* every ``--served-check-every`` saves the trainer says ``served_check_due`` in its events; the
  run's agent (agent/supervisor.py) calls :func:`request` — the trainer never waits;
* ``ctl served-check --run R`` calls ``python3 -m agent.servedcheck start`` (:func:`main`): the
  job's own start checks (``--preflight``), the GPU rule, then :func:`request`.

Per checked run, ``<run dir>/served-check.json`` (under its flock) holds the live check and the
one queued behind it: a newer save supersedes a queued one (the older checkpoint's τ matters
less than the newer's), never the live one. :func:`poll` starts the queued one once the live
one has ended; the run's agent polls while the run lives, and the check's own agent as it
ends (so the last save's check still starts after the training and its agent are gone).

A check runs as its own run (``runs/served-check-…``): its agent, stream, status and stop are
every job's. Its start strips the checked run's marker from the environment, so stopping that
run never sweeps up the check, and records the GPU it holds in the launch record, so no launch
takes it meanwhile (agent/preflight.py ``busy``).

Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from agent import knowngood, procs, protocol
from agent.rundir import Lock, RunDir, agent_alive, agent_live_or_none, finished, read_json

STATE = "served-check.json"
LOCK = "served-check.lock"
KIND = "served-check"  # trainer/kinds.py SERVED_CHECK (the agent never imports the trainer)
NAME = "served-check"  # run ids: served-check-YYYYmmdd-HHMMSS-xxxx


def workspace_of(rd: RunDir) -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(rd.path)))


def live(check_run_dir: str) -> bool:
    rd = RunDir(check_run_dir)
    return os.path.exists(rd.spec) and not finished(rd) and bool(agent_alive(rd) or agent_live_or_none(rd.job_pid))


def job_argv(req: dict, checked: RunDir) -> list[str]:
    argv = [sys.executable, "-m", "trainer", "served-check-job", "--checkpoint", str(req["checkpoint"]),
            "--report-to", checked.path, "--threads", str(int(req.get("threads") or 1))]
    if req.get("gpu") is not None:
        argv += ["--gpu", str(int(req["gpu"]))]
    if req.get("vllm_python"):
        argv += ["--vllm-python", str(req["vllm_python"])]
    return argv


def start(checked: RunDir, req: dict) -> dict:
    """A served-check run for ``req`` (checkpoint, gpu, threads, vllm_python, step) under its
    own agent; its id and directory, or an error."""
    from agent.job import agent_env

    workspace = workspace_of(checked)
    run_id = protocol.new_run_id(NAME)
    run_dir = os.path.join(workspace, "runs", run_id)
    env = {k: v for k, v in agent_env().items() if k not in (protocol.ENV_RUN_ID, protocol.ENV_RUN_DIR)}
    argv = [sys.executable, "-m", "agent", "start", "--run-dir", run_dir, "--run-id", run_id, "--cwd", run_dir,
            "--", *job_argv(req, checked)]
    # An agent is a child subreaper: with the bit on, the check's double-forked agent would be
    # re-parented to this one and swept up as a leftover when this run ends (agent/monitor.py
    # revive does the same for the same reason).
    reaper = procs.is_child_subreaper()
    if reaper:
        procs.set_child_subreaper(False)
    try:
        p = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env, timeout=120)
    finally:
        if reaper:
            procs.set_child_subreaper(True)
    try:
        reply = protocol.extract_payload(p.stdout)
    except ValueError:
        reply = {"ok": False, "error": (p.stderr.strip() or f"agent start exited {p.returncode}")[-400:]}
    if not reply.get("ok"):
        return {"ok": False, "error": f"the served check did not start: {reply.get('error')}"}
    gpu = req.get("gpu")
    knowngood.write_launch_record(workspace, {"run_id": run_id, "kind": KIND, "started": time.time(),
                                              "checked_run": checked.run_id, "step": req.get("step"),
                                              "gpus": {"served_check": [int(gpu)] if gpu is not None else []}})
    return {"ok": True, "run_id": run_id, "run_dir": run_dir, "step": req.get("step")}


def _locked(checked: RunDir, fn):
    lock = Lock(os.path.join(checked.path, LOCK))
    if not lock.acquire(timeout=30.0):
        return {"ok": False, "error": f"{checked.path}/{LOCK} is held by another served-check start; try again"}
    try:
        state = read_json(os.path.join(checked.path, STATE)) or {}
        before = json.dumps(state, sort_keys=True)
        reply = fn(state)
        if json.dumps(state, sort_keys=True) != before:
            protocol.atomic_write_json(os.path.join(checked.path, STATE), state)
        return reply
    finally:
        lock.release()


def request(checked: RunDir, req: dict, *, queue: bool = True) -> dict:
    """Start a check of ``req``'s checkpoint now, or, while one of this run is live, queue it in
    place of whatever was queued (``queue=False``: refuse instead, naming the live one)."""
    def go(state: dict) -> dict:
        current = state.get("live")
        if current and live(current["run_dir"]):
            if not queue:
                return {"ok": False, "busy": current,
                        "error": f"a served check of run {checked.run_id} is running (run {current['run_id']}, step "
                                 f"{current.get('step')}): wait for it (`ctl tail --run {current['run_id']}`)"}
            superseded, state["pending"] = state.get("pending"), dict(req, queued=time.time())
            return {"ok": True, "queued": True, "live": current, "superseded": superseded}
        reply = start(checked, req)
        if reply["ok"]:
            state["live"] = {k: reply[k] for k in ("run_id", "run_dir", "step")}
        return reply
    return _locked(checked, go)


def poll(checked: RunDir, ending: str | None = None) -> dict | None:
    """Start the queued check once the live one has ended (``ending``: the live run that is
    ending now, as its job says); the start's reply, or None when nothing started."""
    if not os.path.exists(os.path.join(checked.path, STATE)):
        return None

    def go(state: dict):
        current, pending = state.get("live"), state.get("pending")
        if current and current["run_id"] != ending and live(current["run_dir"]):
            return None
        state["live"] = None
        if not pending:
            return None
        state["pending"] = None
        reply = start(checked, pending)
        if reply["ok"]:
            state["live"] = {k: reply[k] for k in ("run_id", "run_dir", "step")}
        return reply
    return _locked(checked, go)


def after_check(spec: dict, run_id: str) -> dict | None:
    """A served-check run ``run_id`` (its ``spec``) has ended: start the check queued behind it
    for the same run. Called by the check's own agent, since the checked run's agent may be
    gone by now (the last save's check still runs); None for any other run."""
    argv = list(spec.get("argv") or [])
    if "served-check-job" not in argv or "--report-to" not in argv[:-1]:
        return None
    return poll(RunDir(argv[argv.index("--report-to") + 1]), ending=run_id)


# --- ctl served-check: python3 -m agent.servedcheck start --workspace W --run R … ----------------
def preflight(req: dict, checked: RunDir, timeout: float = 300.0) -> dict:
    """The job's own start checks (``--preflight``): the checkpoint it resolves and its τ at
    save, or the job's one-line refusal."""
    from agent.job import agent_env

    argv = job_argv(req, checked) + ["--preflight"]
    if req.get("best"):
        argv.append("--best")
    if req.get("step") is not None:
        argv += ["--step", str(req["step"])]
    env = {k: v for k, v in agent_env().items() if k not in (protocol.ENV_RUN_ID, protocol.ENV_RUN_DIR)}
    p = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env, timeout=timeout)
    try:
        return protocol.extract_payload(p.stdout)
    except ValueError:
        lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
        return {"ok": False, "error": (lines[-1] if lines else f"the served check's preflight exited {p.returncode}")}


def start_on_demand(workspace: str, run: str, req: dict) -> dict:
    from agent import preflight as pf

    try:
        checked = RunDir(protocol.run_path(workspace, run))
    except protocol.BadRunId as exc:
        return {"ok": False, "error": str(exc)}
    spec = read_json(checked.spec)
    if not spec:
        return {"ok": False, "error": f"no run {run!r} in {workspace}/runs; `ctl runs` lists them"}
    rec = read_json(knowngood.launch_record_path(workspace, run)) or {}
    if (rec.get("kind") or "train") != "train":
        return {"ok": False, "error": f"run {run} is a {rec['kind']} job: a served check checks a training run's "
                                      "checkpoints; name the training run"}
    if req.get("gpu") is not None:
        held = pf.busy(workspace, [int(req["gpu"])], True)
        if held:
            return {"ok": False, "error": f"--gpu {req['gpu']}: " + "; ".join(held).replace(
                "give this run other GPUs, or pass --share-gpus to start it anyway",
                "reserve another GPU for the check, or leave --gpu out to check on CPU")}
    found = preflight(dict(req, checkpoint=checked.path), checked)
    if not found.get("ok"):
        return {"ok": False, "error": found.get("error")}
    job = {k: req.get(k) for k in ("gpu", "threads", "vllm_python")}
    return dict(request(checked, dict(job, checkpoint=found["checkpoint"], step=found["step"]), queue=False),
                tau_at_save=found.get("tau_at_save"), checkpoint=found["checkpoint"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m agent.servedcheck")
    sub = p.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("start", help="start a served check of a training run's checkpoint (ctl served-check)")
    s.add_argument("--workspace", default=os.environ.get(protocol.ENV_WORKSPACE) or protocol.DEFAULT_WORKSPACE)
    s.add_argument("--run", required=True)
    s.add_argument("--step", type=int)
    s.add_argument("--best", action="store_true")
    s.add_argument("--gpu", type=int)
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--vllm-python")
    args = p.parse_args(argv)
    req = {"step": args.step, "best": args.best, "gpu": args.gpu, "threads": args.threads,
           "vllm_python": args.vllm_python}
    reply = start_on_demand(args.workspace, args.run, req)
    sys.stdout.write(protocol.wrap_payload(reply))
    sys.stdout.flush()
    return 0 if reply.get("ok") else protocol.EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
