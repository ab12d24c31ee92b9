"""The one-shot commands as an operator runs them: `ctl exec`, `ctl env`, and
`ctl status` and `ctl tail` without --follow, each a new process, against the simulated node.

Most of such a command's time is ctl starting up (docs/benchmarks.md, "ctl start-up: where
the time goes"), so each must reach the node in one SSH session — no round trip first to ask
what the node's pct accepts — and import only what it uses: not paramiko (the operator's own
OpenSSH client carries one-shot commands) and not pydantic (the run config's models, which
only a launch needs). The sessions are counted on the node (its login shell logs each one,
sim/sshd.py), the pct calls in the sim's pct-calls.log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from controller import config as cfg
from controller.agentcall import AgentCaller
from controller.container import Container
from controller.ssh import SSHRunner

from tests._finished_run import finish_a_true_run

pytestmark = pytest.mark.sim

REPO = Path(__file__).resolve().parent.parent
CT = "200"
RUN_ID = f"oneshot-20261201-000000-{uuid.uuid4().hex[:4]}"  # the run-id grammar (agent/protocol.py)
RUN_DIR = f"/workspace/runs/{RUN_ID}"
# `ctl` as its entry point runs it, writing the names of the modules it imported when it exits.
CTL_LISTING_MODULES = [sys.executable, "-c", (
    "import atexit, json, os, sys\n"
    "atexit.register(lambda: open(os.environ['CTL_MODULES'], 'w').write(json.dumps(sorted(sys.modules))))\n"
    "from controller.cli import main\n"
    "main()\n")]
# Packages a one-shot command has no use for (paramiko's own imports among them).
NOT_FOR_ONE_SHOT = {"paramiko", "cryptography", "nacl", "bcrypt", "invoke", "tenacity", "pydantic", "jinja2"}
# ...and what the commands controller/front.py parses do without (typer's own imports).
NOT_FOR_THE_FRONT = {"typer", "click", "rich"}


def sessions(node) -> list[str]:
    path = Path(node.paths.log) / "ssh-sessions.log"
    return path.read_text().splitlines() if path.exists() else []


def pct_calls(node) -> list[list[str]]:
    path = Path(node.paths.log) / "pct-calls.log"
    return [json.loads(line)["argv"] for line in path.read_text().splitlines()] if path.exists() else []


def ctl(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    listing = tmp_path / f"modules-{uuid.uuid4().hex[:6]}.json"
    env = dict(os.environ, DFLASH_CTL_SSH_CONFIG="none", CTL_MODULES=str(listing))
    proc = subprocess.run([*CTL_LISTING_MODULES, *args], capture_output=True, text=True, env=env, cwd=str(REPO),
                          stdin=subprocess.DEVNULL, timeout=300)
    return proc, set(json.loads(listing.read_text()))


@pytest.fixture(scope="module")
def a_run(sim_node, ctl_config):
    """A finished run in container 200 (a `true` under the agent): what status and tail read.
    Starting it also installs this checkout's agent bundle there, as any earlier ctl call would."""
    name, node = cfg.load(ctl_config).node("sim")
    with SSHRunner.for_node(name, node) as runner:
        ct = Container(runner, name, node, CT)
        caller = AgentCaller(ct)
        finish_a_true_run(caller, RUN_DIR)
        yield RUN_ID
        ct.exec(["rm", "-rf", RUN_DIR], check=True)


def test_ctl_exec_is_one_ssh_session_that_runs_one_pct_exec(sim_node, ctl_config, tmp_path):
    before_sessions, before_calls = len(sessions(sim_node)), len(pct_calls(sim_node))
    proc, _ = ctl(tmp_path, "exec", "--container", CT, "--", "true")
    assert proc.returncode == 0, proc.stderr
    new = sessions(sim_node)[before_sessions:]
    assert len(new) == 1 and f" pct exec {CT} " in new[0], new
    assert [argv[:2] for argv in pct_calls(sim_node)[before_calls:]] == [["exec", CT]]


@pytest.mark.parametrize("command", [
    ("exec", "--container", CT, "--", "true"),
    ("env", "--container", CT),
    ("status", "--container", CT, "--run", RUN_ID),
    ("tail", "--container", CT, "--run", RUN_ID),
], ids=lambda c: c[0])
def test_one_shot_commands_import_neither_paramiko_nor_pydantic_and_open_one_session(
        command, a_run, sim_node, ctl_config, tmp_path):
    before = len(sessions(sim_node))
    proc, modules = ctl(tmp_path, *command)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if command[0] == "status":
        assert RUN_ID in proc.stdout and "completed" in proc.stdout, proc.stdout
    if command[0] == "tail":
        assert "== run completed" in proc.stdout, proc.stdout
    assert {m.split(".")[0] for m in modules} & NOT_FOR_ONE_SHOT == set()
    if command[0] != "env":  # `ctl env` is a typer group (controller/commands/envs.py)
        assert {m.split(".")[0] for m in modules} & NOT_FOR_THE_FRONT == set()
    assert len(sessions(sim_node)[before:]) == 1
