"""A container restart mid-run on the simulated node, through ctl as the
operator runs it: `pct stop 200; pct start 200` on the node while a run trains and a
`ctl tail --follow` follows it. The first `ctl status` after the restart says the container
restarted, the step the run died at and the resume line — never "running — agent alive" —
and the follower prints the same and exits EXIT_CONTAINER_RESTARTED (5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _multi_sim import attach
from agent.protocol import EXIT_CONTAINER_RESTARTED
from tests._agent_util import wait_for

pytestmark = [pytest.mark.sim]

REPO = Path(__file__).resolve().parent.parent
CTL = [str(Path(sys.executable).with_name("ctl"))]
CT = 200
NAME = "restart"
SMALL = ["--set", "token-budget=256", "--set", "max-seq-len=128", "--set", "max-batch-size=2", "--set",
         "max-anchors=4", "--set", "save-interval=2", "--set", "log-interval=1", "--set", "epochs=50",
         "--set", "max-steps=100000"]


@pytest.fixture(scope="module")
def env(ctl_config, sim_node, tmp_path_factory):
    from controller import config as cfg
    from controller.container import Container
    from controller.provision import provision_tiny
    from controller.session import open_runner

    config = tmp_path_factory.mktemp("restart") / f"{NAME}.toml"
    config.write_text((REPO / "examples" / "tiny.toml").read_text().replace('name = "tiny"', f'name = "{NAME}"'))
    e = dict(os.environ, DFLASH_CTL_CONFIG=str(ctl_config), DFLASH_CTL_SSH_CONFIG="none", COLUMNS="200",
             RESTART_CONFIG=str(config), PYTHONPATH=str(REPO))  # this checkout's ctl and bundle
    name, conf = cfg.load(str(ctl_config)).node()
    with open_runner(name, conf) as runner:
        provision_tiny(Container(runner, name, conf, CT))
    yield e
    attach(sim_node, CT, "sh", "-c", f"rm -rf /workspace/runs/{NAME}-* /workspace/.dflash-ctl/launches/{NAME}-*",
           check=False)


def ctl(env, *args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(CTL + [str(a) for a in args], env=env, capture_output=True, text=True, timeout=timeout)


def _status_json(node, run_id: str) -> dict:
    p = attach(node, CT, "cat", f"/workspace/runs/{run_id}/status.json", check=False)
    try:
        return json.loads(p.stdout)
    except ValueError:
        return {}


def test_a_container_restart_mid_run_is_named_by_the_first_status_and_ends_the_follower_with_5(sim_node, env):
    from controller import config as cfg
    from controller.session import open_runner

    p = ctl(env, "launch", "--container", CT, "--config", env["RESTART_CONFIG"], "--from-scratch", "--json", *SMALL)
    assert p.returncode == 0, p.stdout + p.stderr
    run_id = json.loads(p.stdout.strip().splitlines()[-1])["run_id"]
    follower = subprocess.Popen(CTL + ["tail", "--container", str(CT), "--run", run_id, "--follow"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: ((_status_json(sim_node, run_id).get("checkpoint") or {}).get("step") or 0) >= 2, 300,
                 interval=0.5, what="a run with a checkpoint")
        name, conf = cfg.load(env["DFLASH_CTL_CONFIG"]).node()
        with open_runner(name, conf) as runner:
            for argv in (["pct", "stop", str(CT)], ["pct", "start", str(CT)]):
                res = runner.run(argv)
                assert res.ok, res.tail("stderr")
        step = _status_json(sim_node, run_id)["step"]
        status = ctl(env, "status", "--container", CT, "--run", run_id)
        lines = status.stdout.splitlines()
        assert lines[1].startswith(f"FAILED   container {CT} restarted at "), status.stdout + status.stderr
        assert f"; the run died at step {step}; resume with `ctl launch --node {name} --container {CT} --config " \
               f"{env['RESTART_CONFIG']} --resume-from /workspace/runs/{run_id}/output/step_" in lines[1], lines
        assert "alive" not in status.stdout and ": ok," not in status.stdout, status.stdout
        assert status.returncode == EXIT_CONTAINER_RESTARTED
        out, err = follower.communicate(timeout=180)
    finally:
        follower.kill()
    assert follower.returncode == EXIT_CONTAINER_RESTARTED, out[-2000:] + err[-2000:]
    assert f"container {CT} restarted at " in err and f"the run died at step {step}; resume with `ctl launch" in err
    res = json.loads(attach(sim_node, CT, "cat", f"/workspace/runs/{run_id}/result.json").stdout)
    assert res["state"] == "failed" and res["root_cause"]["kind"] == "container_restart"


def test_a_container_left_stopped_ends_the_follower_after_its_wait_with_one_line_not_a_reconnect_loop(sim_node, env):
    """`pct stop 200` by hand under a `ctl tail --follow`: the follower says once that it waits
    for the container, and after `--wait-stopped` ends with 5 and what to do (it used to
    reconnect for 80 minutes, a line a try). Once the container runs again, the run reads as
    the restart killed it, and `ctl tail --since` past its last record still exits 1: a failed
    run's tail, wherever it starts."""
    from controller import config as cfg
    from controller.session import open_runner

    p = ctl(env, "launch", "--container", CT, "--config", env["RESTART_CONFIG"], "--from-scratch", "--json", *SMALL)
    assert p.returncode == 0, p.stdout + p.stderr
    run_id = json.loads(p.stdout.strip().splitlines()[-1])["run_id"]
    follower = subprocess.Popen(CTL + ["tail", "--container", str(CT), "--run", run_id, "--follow",
                                       "--wait-stopped", "4"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    name, conf = cfg.load(env["DFLASH_CTL_CONFIG"]).node()
    stopped = False
    try:
        wait_for(lambda: (_status_json(sim_node, run_id).get("step") or 0) >= 1, 300, interval=0.5,
                 what="a run that trains")
        with open_runner(name, conf) as runner:
            res = runner.run(["pct", "stop", str(CT)])
            assert res.ok, res.tail("stderr")
            stopped = True
        out, err = follower.communicate(timeout=180)
    finally:
        follower.kill()
        if stopped:
            with open_runner(name, conf) as runner:
                res = runner.run(["pct", "start", str(CT)])
                assert res.ok, res.tail("stderr")
    assert follower.returncode == EXIT_CONTAINER_RESTARTED, out[-2000:] + err[-2000:]
    assert err.count("waiting up to 4 s for it to run again") == 1, err
    assert "reconnecting (#" not in err, err
    assert f"ctl: run {run_id}: container {CT} has not run again in 4 s: the run died with it" in err, err
    assert f"pct start {CT}" in err and f"`ctl status --container {CT} --run {run_id}` says how to resume" in err, err
    assert "Traceback" not in err

    status = ctl(env, "status", "--container", CT, "--run", run_id)
    assert status.stdout.splitlines()[1].startswith(f"FAILED   container {CT} restarted at "), status.stdout
    seqs = attach(sim_node, CT, "wc", "-l", f"/workspace/runs/{run_id}/stream.jsonl").stdout.split()[0]
    for since in ("0", seqs):
        tail = ctl(env, "tail", "--container", CT, "--run", run_id, "--since", since)
        assert tail.returncode == 1, (since, tail.stdout[-1000:], tail.stderr, attach(
            sim_node, CT, "tail", "-n", "3", f"/workspace/runs/{run_id}/stream.jsonl").stdout)
