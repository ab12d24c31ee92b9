"""End to end inside LXC container 200 of the simulated node: a job started through
`ctl exec` (SSH → pct exec → agent start) keeps running, and its stream keeps growing,
after the SSH connection that started it — and one that was following it — is dropped."""

from __future__ import annotations

import json
import os
import posixpath
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from _agent_util import wait_for

from agent.protocol import END, extract_payload
from controller import config as cfg
from controller.agentcall import AgentCaller
from controller.container import Container
from controller.ssh import SSHRunner

pytestmark = pytest.mark.sim

REPO = Path(__file__).resolve().parent.parent
CTL = [sys.executable, "-c", "from controller.cli import main; main()"]
CT = 200
FAKE = REPO / "tests" / "jobs" / "fake_trainer.py"
RUN_ID = f"agent-e2e-{uuid.uuid4().hex[:8]}"
RUN_DIR = f"/workspace/runs/{RUN_ID}"
JOB_DIR = f"/workspace/agent-e2e/{RUN_ID}"
# Lists the live processes in the container that carry the run's marker.
SCAN = ("import os,sys\nd=sys.argv[1].encode()\nn=[]\n"
        "for p in os.listdir('/proc'):\n"
        "  if not p.isdigit() or int(p)==os.getpid(): continue\n"
        "  try:\n"
        "    st=open(f'/proc/{p}/stat','rb').read(); e=open(f'/proc/{p}/environ','rb').read(); c=open(f'/proc/{p}/cmdline','rb').read()\n"
        "  except OSError: continue\n"
        "  if st[st.rfind(b')')+2:][:1] in b'ZX': continue\n"
        "  if b'DFLASH_RUN_DIR='+d+b'\\0' in e or d in c: n.append(int(p))\n"
        "print(' '.join(map(str,n)))\n")


@pytest.fixture(scope="module")
def ct(sim_node, ctl_config):
    name, node = cfg.load(ctl_config).node("sim")
    with SSHRunner.for_node(name, node) as runner:
        container = Container(runner, name, node, CT)
        yield container
        # nothing of this test may outlive it in the shared container
        pids = container.exec(["python3", "-c", SCAN, RUN_DIR]).stdout.split()
        if pids:
            container.exec(["kill", "-9", *pids])
        container.exec(["rm", "-rf", RUN_DIR, JOB_DIR])


def _ctl_exec(*argv: str) -> subprocess.Popen:
    env = dict(os.environ, DFLASH_CTL_SSH_CONFIG="none")
    return subprocess.Popen([*CTL, "exec", "--container", str(CT), "--", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, cwd=str(REPO))


def _status(ct: Container) -> dict:
    return AgentCaller(ct).call("agent", ["status", "--run-dir", RUN_DIR], check=True)


def _wait(predicate, timeout, what):
    return wait_for(predicate, timeout, interval=0.5, what=what)


def test_job_started_through_ctl_exec_outlives_dropped_ssh_connections_and_its_stream_keeps_growing(ct):
    bundle = AgentCaller(ct).ensure_bundle()
    ct.exec(["mkdir", "-p", JOB_DIR], check=True)
    job = posixpath.join(JOB_DIR, "fake_trainer.py")
    ct.write_file(job, FAKE.read_bytes())
    agent = ["env", f"PYTHONPATH={bundle}", ct.config.python, "-m", "agent"]

    # 1. start through `ctl exec`, and cut that SSH connection hard as soon as the reply is in
    t0 = time.monotonic()
    starter = _ctl_exec(*agent, "start", "--run-dir", RUN_DIR, "--gpu-interval", "2", "--",
                        "python3", job, "--ranks", "2", "--step-time", "0.1", "--lines-per-step", "2",
                        "--grandchildren")
    out = b""
    while END.encode() not in out:
        chunk = starter.stdout.readline()
        assert chunk, f"ctl exec ended without a reply: {starter.stderr.read().decode()}"
        out += chunk
    starter.kill()  # SIGKILL: the SSH client vanishes without closing anything
    starter.wait(timeout=30)
    reply = extract_payload(out.decode())
    assert reply["ok"] and reply["run_id"] == RUN_ID
    assert time.monotonic() - t0 < 60  # start returns promptly; it does not wait for the job

    # 2. follow through `ctl exec`, and drop that connection mid-stream too
    follower = _ctl_exec(*agent, "follow", "--run-dir", RUN_DIR, "--from", "0")
    seen = []
    while len(seen) < 40:
        line = follower.stdout.readline()
        assert line, "follow ended early"
        seen.append(json.loads(line))
    follower.kill()
    follower.wait(timeout=30)
    assert [r["seq"] for r in seen] == list(range(1, 41))

    # 3. the job runs on and the stream keeps growing with no SSH session attached
    first = _wait(lambda: (s := _status(ct))["status"] and s["status"].get("ranks") and s, 60, "ranks")
    time.sleep(3)
    later = _status(ct)
    assert later["agent_alive"] and later["job_alive"]
    assert later["status"]["state"] == "running"
    assert later["status"]["seq"] > first["status"]["seq"]
    assert later["status"]["step"] > first["status"]["step"]

    # 4. a reconnecting follower continues from its last seq: no gap, no duplicate
    again = ct.exec([*agent, "follow", "--run-dir", RUN_DIR, "--from", str(seen[-1]["seq"]), "--once"], check=True)
    recs = [json.loads(l) for l in again.stdout.splitlines()]
    assert [r["seq"] for r in recs] == list(range(41, 41 + len(recs)))
    assert len(recs) > 40
    assert any(r["kind"] == "gpu" and r["payload"]["state"] == "no GPU" for r in seen + recs)

    # 5. stop: nothing of the run is left in the container
    stopped = AgentCaller(ct).call("agent", ["stop", "--run-dir", RUN_DIR, "--grace", "10"], check=True)
    assert stopped["state"] == "stopped" and stopped["result"]["stop"]["survivors"] == []
    deadline = time.monotonic() + 20
    while True:
        left = ct.exec(["python3", "-c", SCAN, RUN_DIR]).stdout.split()
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert left == []
