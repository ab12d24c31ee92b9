"""A container restart under a run, on this machine: the "container" is a
pid namespace (`unshare --pid --fork --mount-proc`) whose init is killed with everything in
it, as `pct stop` does; the next look is from a new namespace, as after `pct start`. The run
is said to have died with its container at its last step, never healthy. (Through ctl on the
simulated node: tests/test_restart_sim.py.)"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time

import pytest

from agent import procs
from agent.protocol import extract_payload
from tests._agent_util import FAKE, PY, REPO, env, read_json, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="new pid namespaces need root")


def _in_new_container(script: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", script], env=env(), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _init_of(unshare_pid: int) -> int:
    """The host pid of the namespace's pid 1 (unshare's one child)."""
    def child():
        for pid in procs.all_pids():
            st = procs.stat(pid)
            if st and st["ppid"] == unshare_pid:
                return pid
    return wait_for(child, 10, what="the namespace's init")


def test_a_container_restart_under_a_run_is_named_with_its_last_step_and_the_run_failed(tmp_path):
    from controller.status import render_status

    rd, out = tmp_path / "ws" / "runs" / "r1-20261201-114702-0001", tmp_path / "ws" / "out"
    start = [PY, "-m", "agent", "start", "--run-dir", str(rd), "--revive", "0", "--", PY, FAKE, "--ranks", "0",
             "--step-time", "0.1", "--save-interval", "3", "--output-dir", str(out)]
    first = _in_new_container(f"{shlex.join(start)} >/dev/null && exec sleep 600")
    try:
        st = wait_for(lambda: (s := read_json(rd / "status.json")) and (s.get("checkpoint") or {}).get("step", 0) >= 3
                      and s, 60, what="a run with a checkpoint")
        os.kill(_init_of(first.pid), signal.SIGKILL)  # `pct stop`: init and everything in the container
        first.wait(20)
    finally:
        first.kill()
    step = read_json(rd / "status.json")["step"]
    assert step >= st["checkpoint"]["step"]
    view = ["-m", "agent.runview", "status", "--workspace", str(tmp_path / "ws"), "--run", "r1-20261201-114702-0001"]
    looked = _in_new_container(f"{shlex.join([PY, *view])}; sleep 1")  # `pct start`, then `ctl status`
    reply = extract_payload(looked.communicate(timeout=60)[0])
    # --revive 0: no agent may be started, yet the status never says the run is alive
    assert reply["revived"] is None and reply["status"]["state"] == "running"
    restart = reply["host_restart"]
    assert restart["kind"] == "container" and restart["step"] == step and abs(restart["at"] - time.time()) < 60
    lines = render_status(reply, "200", "sim")
    ckpt = reply["status"]["checkpoint"]["path"]
    assert lines[1].startswith("FAILED   container 200 restarted at "), lines
    assert lines[1].endswith(f"; the run died at step {step}; resume with `ctl launch --node sim --container 200 "
                             f"--config RUN_CONFIG.toml --resume-from {ckpt}`"), lines
    assert not any("alive" in line or ": ok," in line for line in lines), lines
    # The re-attach by hand ends the run, FAILED, saying why, at its last step.
    again = _in_new_container(f"{shlex.join([PY, '-m', 'agent', 'start', '--run-dir', str(rd), '--reattach'])}; sleep 1")
    again.communicate(timeout=60)
    res = read_json(rd / "result.json")
    assert res["state"] == "failed" and res["root_cause"]["kind"] == "container_restart", res
    assert res["reason"].startswith("the container restarted at ") and f"the run died at step {step};" in res["reason"]
    st = read_json(rd / "status.json")
    assert st["state"] == "failed" and st["step"] == step and st["host_restart"]["kind"] == "container"
    assert all(r["health"] == "dead" for r in st["ranks"].values()) and st["ranks"]


def test_a_node_reboot_is_told_apart_from_a_container_restart():
    now = procs.boot_marks()
    assert procs.restart_since(now) is None
    assert procs.restart_since(dict(now, node_boot=now["node_boot"] - 3600))["kind"] == "node"
    # LXC gives every container start its own boot id: a new one alone is a container restart
    assert procs.restart_since(dict(now, boot_id="another-boot"))["kind"] == "container"
    moved = procs.restart_since(dict(now, init_start=now["init_start"] - 100))
    assert moved["kind"] == "container" and moved["at"] is not None


RESTARTED_RUN = "r2-20261201-114702-0002"


def _run_restarted_under(ws, result_written: bool, status_terminal: bool):
    """The files of a run whose container restarted since its job started (its job.pid's marks
    are those of an earlier container: another init start time), at one moment of the agent
    that re-attaches and ends it: it writes result.json, then the terminal status.json."""
    from agent.protocol import RunResult, RunState, RunStatus, atomic_write_json

    rd = ws / "runs" / RESTARTED_RUN
    rd.mkdir(parents=True)
    now = procs.boot_marks()
    atomic_write_json(str(rd / "spec.json"), {"run_id": RESTARTED_RUN, "argv": ["true"], "options": {"revive": 0}})
    atomic_write_json(str(rd / "job.pid"), {"pid": 2, "starttime": 1, "boot_id": "", "marker": RESTARTED_RUN,
                                            "boot": dict(now, init_start=now["init_start"] - 100)})
    restart = {"kind": "container", "at": time.time() - 5, "step": 26}
    st = RunStatus(run_id=RESTARTED_RUN, state=RunState.RUNNING, step=26, phase="training", updated=time.time())
    if status_terminal:
        st.state, st.host_restart = RunState.FAILED, restart
    st.save(str(rd / "status.json"))
    if result_written:
        RunResult(run_id=RESTARTED_RUN, state=RunState.FAILED, ended=time.time(), reason="the container restarted",
                  root_cause={"kind": "container_restart", "reason": "the container restarted", "details": restart}
                  ).save(str(rd / "result.json"))


@pytest.mark.parametrize("result_written,status_terminal", [(False, False), (True, False), (True, True), (False, True)])
def test_a_restart_is_named_at_every_moment_of_the_agent_that_ends_the_run(tmp_path, result_written, status_terminal):
    """The first `ctl status` after `pct stop; pct start` said "running — AGENT NOT RUNNING"
    with a healthy rank when a follower's revived agent was ending the run at the same moment:
    the view read status.json (still running), then saw result.json (just written) and so took
    the run for finished and skipped the restart check. Each state the writer passes through —
    and the one a reader of result.json before status.json can combine — must name the restart
    (a run that ended before a restart is the next test)."""
    from agent.runview import status
    from controller.status import render_status

    _run_restarted_under(tmp_path, result_written, status_terminal)
    reply = status(str(tmp_path), RESTARTED_RUN)
    assert reply["host_restart"] and reply["host_restart"]["kind"] == "container", reply
    lines = render_status(reply, "200", "sim")
    assert lines[1].startswith("FAILED   container 200 restarted at "), lines
    assert not any("alive" in line or "AGENT NOT RUNNING" in line for line in lines), lines


def test_a_run_that_ended_before_its_container_restarted_is_not_said_to_have_died_with_it(tmp_path):
    from agent.protocol import RunResult, RunState, RunStatus
    from agent.runview import status

    _run_restarted_under(tmp_path, False, False)
    rd = tmp_path / "runs" / RESTARTED_RUN
    RunResult(run_id=RESTARTED_RUN, state=RunState.COMPLETED, ended=time.time(), reason="completed").save(
        str(rd / "result.json"))
    RunStatus(run_id=RESTARTED_RUN, state=RunState.COMPLETED, step=26).save(str(rd / "status.json"))
    assert status(str(tmp_path), RESTARTED_RUN)["host_restart"] is None
