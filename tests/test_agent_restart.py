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

    rd, out = tmp_path / "ws" / "runs" / "r1", tmp_path / "ws" / "out"
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
    view = ["-m", "agent.runview", "status", "--workspace", str(tmp_path / "ws"), "--run", "r1"]
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
