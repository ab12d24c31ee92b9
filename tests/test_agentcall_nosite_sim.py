"""The read-only agent calls start the container's python without site.

`ctl status` and `ctl tail` run `agent.runview` from the bundle, standard library only, so
their interpreter starts with -S (controller/agentcall.py NO_SITE_CALLS): no site-packages
scan, no .pth files. Shown here as an operator would notice it: with the venv's
site-packages made unusable (a .pth that ends every interpreter that reads it), `ctl status`
and `ctl tail` still answer, their pct exec argv carries -S, and a call that needs the venv
(anything else) still reads site — the breakage is real.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from controller import config as cfg
from controller.agentcall import AgentCaller, interpreter_flags
from controller.container import Container
from controller.ssh import SSHRunner

from tests._finished_run import finish_a_true_run

REPO = Path(__file__).resolve().parent.parent
CT = "200"
RUN_ID = f"nosite-20261202-000000-{uuid.uuid4().hex[:4]}"  # the run-id grammar (agent/protocol.py)
RUN_DIR = f"/workspace/runs/{RUN_ID}"
POISON_EXIT = 97
POISON = f"import os; os._exit({POISON_EXIT})\n"  # site exec()s a .pth line that starts with "import"


@pytest.mark.parametrize("module, args, flags", [
    ("agent.runview", ["status", "--workspace", "/w"], ["-S"]),
    ("agent.runview", ["stream", "--workspace", "/w", "--from", "0"], ["-S"]),
    ("agent", ["follow", "--workspace", "/w"], ["-S"]),
    ("agent", ["start", "--run-dir", "/w/runs/x", "--", "true"], []),  # the job may need the venv
    ("agent", ["status", "--run-dir", "/w/runs/x"], []),
    ("agent.envgen", ["plan"], []),
    ("agent.netinfo", [], []),
    ("trainer", ["train"], []),
])
def test_only_the_read_only_views_drop_site(module, args, flags):
    assert interpreter_flags(module, args) == flags


def sessions(node) -> list[str]:
    """The commands the sim's sshd ran, one a line (sim/sshd.py's login shell logs each)."""
    path = Path(node.paths.log) / "ssh-sessions.log"
    return path.read_text().splitlines() if path.exists() else []


def ctl(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DFLASH_CTL_SSH_CONFIG="none")
    return subprocess.run([sys.executable, "-c", "from controller.cli import main; main()", *args], capture_output=True, text=True, env=env,
                          cwd=str(REPO), stdin=subprocess.DEVNULL, timeout=300)


@pytest.mark.sim
def test_status_and_tail_answer_with_the_venvs_site_packages_broken(sim_node, ctl_config):
    name, node = cfg.load(ctl_config).node("sim")
    with SSHRunner.for_node(name, node) as runner:
        ct = Container(runner, name, node, CT)
        caller = AgentCaller(ct)
        finish_a_true_run(caller, RUN_DIR)
        python = ct.config.python
        found = ct.exec([python, "-c", "import site; print(site.getsitepackages()[0])"])
        assert found.ok, found.stderr
        pth = f"{found.stdout.strip()}/zz-nosite-test-{uuid.uuid4().hex[:6]}.pth"
        assert ct.exec(["sh", "-c", 'printf %s "$1" > "$2"', "sh", POISON, pth]).ok
        try:
            assert ct.exec([python, "-c", "pass"]).returncode == POISON_EXIT  # site is really unusable
            before = len(sessions(sim_node))
            shown = ctl("status", "--container", CT, "--run", RUN_ID)
            assert shown.returncode == 0, shown.stdout + shown.stderr
            assert RUN_ID in shown.stdout and "completed" in shown.stdout, shown.stdout
            tailed = ctl("tail", "--container", CT, "--run", RUN_ID)
            assert tailed.returncode == 0, tailed.stdout + tailed.stderr
            assert "== run completed" in tailed.stdout, tailed.stdout
            calls = [argv for argv in map(shlex.split, sessions(sim_node)[before:]) if "agent.runview" in argv]
            assert {argv[argv.index("agent.runview") + 1] for argv in calls} == {"status", "stream"}, calls
            assert all(argv[argv.index("-m") - 1] == "-S" for argv in calls), calls
        finally:
            assert ct.exec(["rm", "-f", pth]).ok
            ct.exec(["rm", "-rf", RUN_DIR], check=True)
