"""`ctl served-check` as an operator runs it against the simulated node: bad input is refused in
one line with exit 2 and nothing started in the container — an unknown run (the agent's answer)
and a run that has not saved yet (the served-check job's own start checks, run in the container).

The served checks themselves, in vLLM CPU under the real agent: tests/test_served_check_vllm.py.
"""

from __future__ import annotations

import subprocess
import uuid

import pytest

from controller import config as cfg
from controller.agentcall import AgentCaller
from controller.container import Container
from controller.ssh import SSHRunner

from tests._ctl_subprocess import CTL, REPO, no_torch_env
from tests._finished_run import finish_a_true_run

pytestmark = pytest.mark.sim

CT = "200"
RUN_ID = f"unsaved-20261201-000000-{uuid.uuid4().hex[:4]}"
RUN_DIR = f"/workspace/runs/{RUN_ID}"


@pytest.fixture(scope="module")
def container(sim_node, ctl_config):
    name, node = cfg.load(ctl_config).node("sim")
    with SSHRunner.for_node(name, node) as runner:
        ct = Container(runner, name, node, CT)
        finish_a_true_run(AgentCaller(ct), RUN_DIR)
        yield ct
        ct.exec(["rm", "-rf", RUN_DIR], check=True)


def ctl(ctl_config, tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CTL, "served-check", "--container", CT, *args], capture_output=True, text=True,
                          env=no_torch_env(ctl_config, tmp_path), cwd=str(REPO), stdin=subprocess.DEVNULL, timeout=300)


def served_runs(ct) -> list[str]:
    out = ct.exec(["ls", "/workspace/runs"], check=True).stdout
    return sorted(n for n in out.split() if n.startswith("served-check-"))


def test_ctl_served_check_refuses_an_unknown_run(container, ctl_config, tmp_path):
    before = served_runs(container)
    p = ctl(ctl_config, tmp_path, "--run", "nosuch-20261201-000000-abcd")
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "no run 'nosuch-20261201-000000-abcd' in /workspace/runs" in p.stderr and "Traceback" not in p.stderr
    assert served_runs(container) == before


def test_ctl_served_check_refuses_a_run_that_has_not_saved(container, ctl_config, tmp_path):
    before = served_runs(container)
    p = ctl(ctl_config, tmp_path, "--run", RUN_ID, "--best")
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "has no best checkpoint" in p.stderr and "--eval-prompts" in p.stderr, p.stderr
    p = ctl(ctl_config, tmp_path, "--run", RUN_ID)
    assert p.returncode == 2 and "the run has not saved yet" in p.stderr, p.stderr
    assert served_runs(container) == before
