"""The agent's small verbs, run for real: gpus, fingerprint, list, status."""

from __future__ import annotations

import os

from tests._agent_util import PY, PRINTER, kill_all, payload, start, wait_terminal


def test_gpus_without_a_gpu_says_no_gpu_and_why():
    reply = payload("gpus")
    assert reply["state"] == "no GPU" and reply["gpus"] == []
    assert "NVML" in reply["reason"] or "pynvml" in reply["reason"]


def test_fingerprint_is_taken_by_the_python_it_describes_in_the_one_shape(tmp_path):
    # agent/envfp.py's shape, the same the launch preflight records and envgen names
    # generations by: {name: version} packages, torch from its version.py, a 12-hex id
    import json

    from agent import envfp

    out = tmp_path / "fp.json"
    reply = payload("fingerprint", "--python", PY, "--write", str(out))
    assert reply["executable"] == PY or os.path.samefile(reply["executable"], PY)
    assert reply["python"].count(".") == 2
    assert reply["packages"]["pytest"] and all(k == envfp.canonical_name(k) for k in reply["packages"])
    assert len(reply["id"]) == 12 and reply["id"] == envfp.fingerprint_id(reply)
    assert reply["torch"] is None or set(reply["torch"]) == {"version", "cuda", "hip", "build"}
    assert "driver" in reply
    assert json.loads(out.read_text()) == {k: v for k, v in reply.items() if k not in ("ok", "protocol")}


def test_agent_process_never_imports_torch(tmp_path):
    import subprocess
    from tests._agent_util import env, REPO
    code = ("import sys, agent.cli, agent.supervisor, agent.envfp, agent.gpus, agent.daemon;"
            "print('torch' in sys.modules, 'pydantic' in sys.modules)")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=env(), cwd=REPO).stdout
    assert out.strip() == "False False"


def test_list_and_status_report_runs_and_states(tmp_path):
    ws = tmp_path / "ws"
    run_dir = str(ws / "runs" / "r7-20261201-114702-0007")
    try:
        start(run_dir, [PY, PRINTER, "10", "1000"], "--run-id", "r7-20261201-114702-0007")
        wait_terminal(run_dir, 30)
        runs = payload("list", "--workspace", str(ws))["runs"]
        assert [(r["run_id"], r["state"]) for r in runs] == [("r7-20261201-114702-0007", "completed")]
        st = payload("status", "--run", "r7-20261201-114702-0007", "--workspace", str(ws))
        assert st["status"]["state"] == "completed" and st["result"]["reason"] == "completed"
    finally:
        kill_all(run_dir)


def test_start_refuses_a_finished_run_and_an_empty_command(tmp_path):
    run_dir = str(tmp_path / "ws" / "runs" / "r8")
    try:
        start(run_dir, [PY, PRINTER, "1", "1000"])
        wait_terminal(run_dir, 30)
        reply = payload("start", "--run-dir", run_dir, "--", PY, PRINTER, "1", check=False)
        assert reply["ok"] is False and "already ended" in reply["error"]
        reply = payload("start", "--run-dir", str(tmp_path / "other"), check=False)
        assert reply["ok"] is False and "no job command" in reply["error"]
    finally:
        kill_all(run_dir)


def test_a_command_that_cannot_start_fails_with_that_reason(tmp_path):
    run_dir = str(tmp_path / "ws" / "runs" / "r9")
    try:
        start(run_dir, ["/nonexistent/binary", "--x"])
        res = wait_terminal(run_dir, 30)
        assert res["state"] == "failed" and res["reason"].startswith("failed to start")
    finally:
        kill_all(run_dir)
