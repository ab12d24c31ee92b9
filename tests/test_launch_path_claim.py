"""The launch's path check is made again under the container's launch lock, where the rank-slot
claim is: N launches into one `out` at the same moment give one writer and clear refusals.
The preflight's check alone (it runs before the lock) let two regenerate launches with one
`out` both run to "completed", each id written twice; 0.5 s apart the second was refused.

Real `python -m agent.preflight commit` processes on this machine, started together; each
job is a shell that sleeps, so the winner is live while the others commit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

from agent.protocol import extract_payload
from controller.config import ContainerConfig
from tests._agent_util import REPO, env, payload

RUNS = [f"regen-20261201-114702-000{i}" for i in range(3)]


def _commit_request(workspace: str, run_id: str, out: str) -> dict:
    from controller.launch import start_argv

    class Ct:  # the one thing start_argv reads of a container
        config = ContainerConfig(venv=os.path.dirname(os.path.dirname(sys.executable)), workspace=workspace)

    run_dir = os.path.join(workspace, "runs", run_id)
    paths = {"reads": [os.path.join(workspace, "in.jsonl")], "writes": [out]}
    return {"workspace": workspace, "run_id": run_id, "run_dir": run_dir, "script": "exec sleep 120\n",
            "secrets_file": None, "secret": None, "paths": paths,
            "record": {"run_id": run_id, "ts": 0, "kind": "regenerate", "config": "regen", "paths": paths, "gpus": {}},
            "start_argv": start_argv(Ct, run_dir, run_id, {"startup_timeout": 0})}


def test_simultaneous_launches_into_one_out_give_one_writer_and_name_it(tmp_path):
    workspace, out = str(tmp_path / "ws"), str(tmp_path / "ws" / "data" / "answers.jsonl")
    os.makedirs(workspace)
    replies: dict[str, dict] = {}
    gate = threading.Barrier(len(RUNS))

    def commit(run_id: str) -> None:
        gate.wait()
        proc = subprocess.run([sys.executable, "-m", "agent.preflight", "commit"], capture_output=True, text=True,
                              input=json.dumps(_commit_request(workspace, run_id, out)), env=env(), cwd=REPO,
                              timeout=120)
        replies[run_id] = extract_payload(proc.stdout)

    threads = [threading.Thread(target=commit, args=(r,)) for r in RUNS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        started = [r for r, reply in replies.items() if reply.get("ok")]
        assert len(started) == 1, replies
        winner = started[0]
        for run_id, reply in replies.items():
            if run_id == winner:
                continue
            assert reply.get("conflicts") and f"run {winner} (regenerate, " in reply["error"], reply
            assert f"writes {out}, which this launch would write" in reply["error"], reply
            assert not os.path.exists(os.path.join(workspace, "runs", run_id)), run_id  # nothing left behind
    finally:
        for run_id, reply in replies.items():
            if reply.get("ok"):
                payload("stop", "--workspace", workspace, "--run", run_id, "--grace", "5")
