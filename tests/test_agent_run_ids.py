"""The agent's own verbs refuse a `--run` that is not a run id with the same validator as ctl
(agent/protocol.py run_id_problem): ctl checks first, but the agent is also run by hand and by
older controllers, and a path given as a run id must never be resolved in the container."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.protocol import EXIT_USAGE, extract_payload

REPO = Path(__file__).resolve().parent.parent
RUN = "tiny-20261201-114702-3fa9"
BAD = ["", "../../etc", f"../runs/{RUN}", f"./{RUN}", "-x"]


def _agent(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture()
def workspace(tmp_path):
    """A workspace with one run (a spec and nothing running), so `../runs/<id>` would find it."""
    run = tmp_path / "runs" / RUN
    run.mkdir(parents=True)
    (run / "spec.json").write_text(json.dumps({"run_id": RUN, "argv": ["true"]}))
    return tmp_path


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("verb", [("agent", "stop"), ("agent", "status"), ("agent", "follow"),
                                  ("agent.runview", "status"), ("agent.runview", "stream"),
                                  ("agent.recovery", "survivors"), ("agent.recovery", "run-info"),
                                  ("agent.recovery", "history")])
def test_every_agent_verb_refuses_a_bad_run_id_in_one_line(workspace, verb, bad):
    module, name = verb
    ws = ["--workspace", str(workspace)]
    args = (ws + [name] if module == "agent.recovery" else [name] + ws) + [f"--run={bad}"]
    before = sorted(p.relative_to(workspace) for p in workspace.rglob("*"))
    proc = _agent(module, *args)
    assert proc.returncode == EXIT_USAGE, (verb, bad, proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    reply = extract_payload(proc.stdout)
    assert reply["ok"] is False and reply["error"].startswith(f"--run {bad!r}: "), reply
    assert sorted(p.relative_to(workspace) for p in workspace.rglob("*")) == before  # nothing written
