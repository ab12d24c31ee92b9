"""Launches that collide, Ctrl-C at named moments, and two kill-and-rollbacks at once, on the
simulated node with `ctl` run as the operator runs it.

- Three `ctl launch` of one config at once, ten times: exactly one run each time, the other
  two refused (exit 3) naming it; the slot is free again once that run has ended (the next
  trial starts one).
- SIGINT at named moments (controller/interrupts.py's pause points: no timing races): before
  the commit nothing starts; from the commit on the run starts and its id, follow and stop
  lines are printed. The same for `ctl export`: interrupted before the rename nothing is
  kept and a retry works; after it, the export is reported complete and a retry says so.
- A kill-and-rollback that holds the container's claim refuses a second one, which changes
  and records nothing.

Each trial is a launch stopped at once (the trainer never gets past its imports), so the
whole module stays near two minutes. Container 201, runs named ``racetest-…``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from _ctl_subprocess import CTL, baseline_aside, baseline_back, no_torch_env
from controller import config as cfg
from controller.agentcall import AgentCaller
from controller.container import Container
from controller.ssh import SSHRunner

pytestmark = [pytest.mark.sim]

CT = 201
WS = "/workspace"
NAME = "racetest"
REPO = Path(__file__).resolve().parent.parent
TRIALS = 10
SAVED = f"/tmp/dflash-{NAME}-saved"  # the container's baseline while this module runs


def _launched(text: str) -> str:
    """The run a launch started, from its own lines ("run ID started", or the follow/stop
    lines of an interrupted one): other run ids appear in its report (the known-good run)."""
    m = re.search(rf"\brun ({NAME}-\S+) started", text) or re.search(rf"--run ({NAME}-[\w-]+)", text)
    assert m, text[-1500:]
    return m.group(1)


@pytest.fixture(scope="module")
def env(ctl_config, tmp_path_factory):
    return no_torch_env(ctl_config, tmp_path_factory.mktemp("race-no-torch"))


@pytest.fixture(scope="module")
def ct(sim_node, ctl_config):
    name, node = cfg.load(ctl_config).node("sim")
    with SSHRunner.for_node(name, node) as runner:
        container = Container(runner, name, node, CT)
        _stop_ours(container)
        container.exec(baseline_aside(WS, SAVED))
        yield container
        _stop_ours(container)
        container.exec(["sh", "-c", f"rm -rf {WS}/runs/{NAME}-* {WS}/.dflash-ctl/launches/{NAME}-*"])
        container.exec(baseline_back(WS, SAVED))


@pytest.fixture(scope="module")
def toml(tmp_path_factory) -> str:
    """examples/tiny.toml under our name, long enough that a run is live until stopped."""
    path = tmp_path_factory.mktemp("race") / f"{NAME}.toml"
    text = (REPO / "examples" / "tiny.toml").read_text().replace('name = "tiny"', f'name = "{NAME}"')
    path.write_text(text.replace("max-steps = 24", "max-steps = 100000").replace("epochs = 1", "epochs = 1000"))
    return str(path)


def _ours(ct: Container) -> list[str]:
    out = ct.exec(["sh", "-c", f"ls -1 {WS}/runs 2>/dev/null || true"]).stdout.split()
    return sorted(r for r in out if r.startswith(f"{NAME}-"))


def _stop(ct: Container, run_id: str) -> dict:
    return AgentCaller(ct).call("agent", ["stop", "--workspace", WS, "--run", run_id, "--grace", "1"],
                                what="agent stop")


def _stop_ours(ct: Container) -> None:
    for run_id in _ours(ct):
        reply = AgentCaller(ct).call("agent", ["status", "--workspace", WS, "--run", run_id], what="status")
        if (reply.get("status") or {}).get("state") not in ("completed", "failed", "stopped"):
            _stop(ct, run_id)


def _launch(env, toml, *extra, **kw) -> subprocess.Popen:
    return subprocess.Popen(CTL + ["launch", "-c", str(CT), "--config", toml, "--from-scratch", *extra],
                            env={**env, **kw.pop("extra_env", {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


# --- N launches at once → one run ------------------------------------------------------------

def test_three_launches_at_once_start_exactly_one_run_every_time(env, ct, toml):
    before = _ours(ct)
    for trial in range(TRIALS):
        procs = [_launch(env, toml, "--json") for _ in range(3)]
        outs = [(p.wait(timeout=300), *p.communicate()) for p in procs]
        codes = sorted(rc for rc, _, _ in outs)
        assert codes == [0, 3, 3], (trial, [(rc, err[-600:]) for rc, _, err in outs])
        winner = next(json.loads(out.strip().splitlines()[-1])["run_id"] for rc, out, _ in outs if rc == 0)
        for rc, out, err in outs:
            if rc == 3:
                assert "Traceback" not in err and out == ""
                assert f"run {winner} is live" in err and "rank slot 0" in err, err
        now = _ours(ct)
        assert now == sorted(before + [winner]), (trial, now)  # exactly one run directory more
        stopped = _stop(ct, winner)  # the run ends: its slot is free for the next trial
        assert stopped["state"] in ("stopped", "failed", "completed"), stopped
        before = now


# --- SIGINT during launch --------------------------------------------------------------------

def _interrupted_at(env, toml, point: str, tmp_path: Path, command=None) -> tuple[int, str, str]:
    pause = tmp_path / point
    pause.mkdir()
    extra_env = {"DFLASH_CTL_PAUSE_AT": point, "DFLASH_CTL_PAUSE_DIR": str(pause)}
    if command is None:
        proc = _launch(env, toml, extra_env=extra_env)
    else:
        proc = subprocess.Popen(CTL + command, env={**env, **extra_env}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    reached = pause / f"{point}.reached"
    while not reached.exists():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)  # the handler has run (or KeyboardInterrupt is raised) before we let it go on
    (pause / f"{point}.go").write_text("")
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def test_ctrl_c_before_the_commit_starts_nothing(env, ct, toml, tmp_path):
    before = _ours(ct)
    rc, out, err = _interrupted_at(env, toml, "launch.preflight", tmp_path)
    assert rc == 130 and "Traceback" not in err, err
    assert "interrupted before run" in err and "nothing was started" in err, err
    assert _ours(ct) == before


@pytest.mark.parametrize("point", ["launch.commit", "launch.started"])
def test_ctrl_c_from_the_commit_on_prints_the_run_and_how_to_follow_and_stop_it(env, ct, toml, tmp_path, point):
    before = _ours(ct)
    rc, out, err = _interrupted_at(env, toml, point, tmp_path)
    assert rc == 130 and "Traceback" not in err, err
    new = sorted(set(_ours(ct)) - set(before))
    assert len(new) == 1, (new, out, err)
    run_id = new[0]
    try:
        assert f"run {run_id} started in container {CT}" in out
        assert f"follow: ctl tail --container {CT} --run {run_id} --follow" in out
        assert f"stop:   ctl kill-and-rollback --container {CT} --run {run_id}" in out
        assert f"interrupted after run {run_id} started" in err and "it goes on" in err, err
    finally:
        _stop(ct, run_id)


def test_a_terminal_ctrl_c_that_also_reaches_ssh_still_names_the_run(env, ct, toml, tmp_path):
    """A Ctrl-C at a terminal goes to the whole foreground process group, ssh included: the
    commit's connection may die with it. The container finishes (or undoes) the commit on its
    own; ctl names the run id, with how to check, follow and stop it."""
    pause = tmp_path / "pg"
    pause.mkdir()
    before = _ours(ct)
    proc = subprocess.Popen(CTL + ["launch", "-c", str(CT), "--config", toml, "--from-scratch"],
                            env={**env, "DFLASH_CTL_PAUSE_AT": "launch.commit", "DFLASH_CTL_PAUSE_DIR": str(pause)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    while not (pause / "launch.commit.reached").exists():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.2)
    (pause / "launch.commit.go").write_text("")
    out, err = proc.communicate(timeout=300)
    new = sorted(set(_ours(ct)) - set(before))
    try:
        assert proc.returncode == 130 and "Traceback" not in err, (proc.returncode, err)
        run_id = _launched(out + err)
        assert new in ([], [run_id]), (new, run_id)  # never a run other than the one named
        assert f"--run {run_id}" in out + err
    finally:
        for run_id in new:
            _stop(ct, run_id)


# --- SIGINT during export --------------------------------------------------------------------

@pytest.fixture(scope="module")
def done_run(env, ct, toml) -> str:
    """A 2-step run with its checkpoint, finished."""
    proc = subprocess.run(CTL + ["launch", "-c", str(CT), "--config", toml, "--from-scratch", "--follow",
                                 "--set", "max-steps=2", "--set", "save-interval=2", "--set", "epochs=1"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return _launched(proc.stdout)


def test_ctrl_c_during_export_keeps_nothing_or_reports_it_complete(env, done_run, tmp_path):
    export = ["export", "-c", str(CT), "--run", done_run]
    dest = tmp_path / "drafter"
    # before the rename: nothing is kept at --to, and the same command works afterwards
    rc, out, err = _interrupted_at(env, None, "export.transfer", tmp_path, command=export + ["--to", str(dest)])
    assert rc == 130 and "Traceback" not in err, err
    assert "interrupted before the export was complete: nothing was kept" in err, err
    assert not dest.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    # after the rename: --to holds all of it, verified; reported complete, exit 0
    rc, out, err = _interrupted_at(env, None, "export.placed", tmp_path, command=export + ["--to", str(dest)])
    assert rc == 0 and "Traceback" not in err, err
    assert f"{dest}: step 2 of run {done_run}" in out and "sha256 verified" in out, out
    assert "interrupted after the export was complete" in err, err
    files = sorted(p.name for p in dest.iterdir())
    assert "config.json" in files and "model.safetensors" in files
    # a retry is not refused: the export is already there, complete
    again = subprocess.run(CTL + export + ["--to", str(dest)], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "(it was already there, complete)" in again.stdout
    # but a --to whose files differ from this export is still refused, and left as it was
    (dest / "config.json").write_text("{}")
    other = subprocess.run(CTL + export + ["--to", str(dest)], env=env, capture_output=True, text=True, timeout=300)
    assert other.returncode == 2 and "does not hold this export" in other.stderr, other.stderr
    assert (dest / "config.json").read_text() == "{}"


# --- two kill-and-rollbacks at once -----------------------------------------------------------

def test_a_second_kill_and_rollback_is_refused_while_one_holds_the_container(env, ct, toml, tmp_path):
    launched = _launch(env, toml, "--json")
    out, err = launched.communicate(timeout=300)
    assert launched.returncode == 0, err
    run_id = json.loads(out.strip().splitlines()[-1])["run_id"]
    history = lambda: AgentCaller(ct).call("agent.recovery", ["--workspace", WS, "history", "--run", run_id],  # noqa: E731
                                           what="history")["records"]
    try:
        pause = tmp_path / "kar"
        pause.mkdir()
        first = subprocess.Popen(CTL + ["kill-and-rollback", "-c", str(CT), "--run", run_id, "--yes"],
                                 env={**env, "DFLASH_CTL_PAUSE_AT": "rollback.claimed",
                                      "DFLASH_CTL_PAUSE_DIR": str(pause)},
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while not (pause / "rollback.claimed.reached").exists():
            assert first.poll() is None, first.communicate()
            time.sleep(0.02)
        second = subprocess.run(CTL + ["kill-and-rollback", "-c", str(CT), "--run", run_id, "--yes"], env=env,
                                capture_output=True, text=True, timeout=300)
        assert second.returncode == 3, second.stderr
        assert "another kill-and-rollback in container 201" in second.stderr and "under way" in second.stderr
        assert second.stdout == ""  # not even a plan
        status = AgentCaller(ct).call("agent", ["status", "--workspace", WS, "--run", run_id], what="status")
        assert status["status"]["state"] in ("starting", "running"), status  # the second stopped nothing
        assert history() == []
        (pause / "rollback.claimed.go").write_text("")
        first.communicate(timeout=300)
        # The shared sim's venv is plain (no generation to roll back to), so the first is
        # refused at its plan; its claim is released all the same: a third gets as far.
        third = subprocess.run(CTL + ["kill-and-rollback", "-c", str(CT), "--run", run_id, "--dry-run"], env=env,
                               capture_output=True, text=True, timeout=300)
        assert "another kill-and-rollback" not in third.stderr
        claim_left = ct.exec(["sh", "-c", f"test -e {WS}/.dflash-ctl/rollback.claim && echo held || true"]).stdout
        assert claim_left.strip() == ""
    finally:
        _stop(ct, run_id)


# --- exit codes: a failed run is not "ok" -----------------------------------------------------

def test_status_and_tail_of_a_failed_run_exit_1(env, ct, toml):
    """A real failure, fast: a start-up deadline no trainer can meet."""
    proc = subprocess.run(CTL + ["launch", "-c", str(CT), "--config", toml, "--from-scratch", "--follow",
                                 "--set", "supervision.startup-timeout=0.5"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-1500:] + proc.stderr[-1500:]
    run_id = _launched(proc.stdout)
    for args in (["status"], ["status", "--json"], ["tail"], ["tail", "--json"], ["tail", "--follow"]):
        got = subprocess.run(CTL + args + ["-c", str(CT), "--run", run_id], env=env, capture_output=True, text=True,
                             timeout=120)
        assert got.returncode == 1, (args, got.returncode, got.stderr)
    shown = subprocess.run(CTL + ["status", "-c", str(CT), "--run", run_id], env=env, capture_output=True, text=True)
    assert "FAILED" in shown.stdout and "startup_timeout" in shown.stdout, shown.stdout


# --- nonexistent container: bad input ---------------------------------------------------------

def test_a_container_that_does_not_exist_is_exit_2(env):
    for args in (["status", "-c", "999"], ["runs", "-c", "999"], ["tail", "-c", "999"]):
        proc = subprocess.run(CTL + args, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (args, proc.returncode, proc.stderr)
        assert "container 999 does not exist on node sim" in proc.stderr
