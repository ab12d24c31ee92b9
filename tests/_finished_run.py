"""A finished run in a sim container, for the tests of what reads one (`ctl status`, `ctl tail`)."""

from __future__ import annotations

import time

import pytest

from agent.protocol import RunStatus
from controller.agentcall import AgentCaller


def finish_a_true_run(caller: AgentCaller, run_dir: str) -> dict:
    """Starts `true` under the agent at ``run_dir`` and waits for its terminal status (the
    agent notices the job's end within a tick or two); that status."""
    caller.call("agent", ["start", "--run-dir", run_dir, "--", "true"], check=True)
    for _ in range(300):
        status = caller.call("agent", ["status", "--run-dir", run_dir], check=True)
        if RunStatus.from_json(status["status"] or {}).terminal:
            return status
        time.sleep(0.2)
    pytest.fail(f"the run of `true` did not end: {status}")
