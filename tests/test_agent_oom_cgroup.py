"""A real host OOM kill: the agent and its job run in a memory cgroup limited to 200 MiB, the
job allocates past it, the kernel's OOM killer SIGKILLs it, and the agent names the cause from
the cgroup's oom_kill counter (memory.events on cgroup v2, memory.oom_control on v1) — the
evidence that works inside a container without dmesg
(docs/research/proxmox-and-supervision.md §6)."""

from __future__ import annotations

import os
import subprocess
import time
import uuid

import pytest

from agent.protocol import extract_payload
from tests._agent_util import PY, REPO, env, kill_all, no_run_pids, wait_terminal

HOG = ("import time\nb = []\nprint('allocating', flush=True)\n"
       "for i in range(80):\n    b.append(bytearray(10 * 2**20))\n    time.sleep(0.05)\nprint('survived')\n")


def _v1_memory_cgroup() -> str | None:
    try:
        with open("/proc/self/cgroup") as fh:
            for line in fh:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if "memory" in controllers.split(","):
                    base = "/sys/fs/cgroup/memory" + path
                    return base if os.access(base, os.W_OK) else None
    except OSError:
        pass
    return None


@pytest.fixture
def cgroup():
    base = _v1_memory_cgroup()
    if os.geteuid() != 0 or base is None:
        pytest.skip("needs root and a writable cgroup v1 memory hierarchy")
    path = os.path.join(base, f"dflash-agent-oom-{uuid.uuid4().hex[:8]}")
    os.mkdir(path)
    with open(os.path.join(path, "memory.limit_in_bytes"), "w") as fh:
        fh.write(str(200 * 2**20))
    yield path
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.2)


def test_kernel_oom_kill_in_the_runs_cgroup_is_named_host_oom_from_the_counter(cgroup, tmp_path):
    run_dir = str(tmp_path / "ws" / "runs" / "oom")
    try:
        # enter the cgroup first, so the agent, its monitor and the job all live in it
        proc = subprocess.run(
            ["sh", "-c", 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"', "sh", cgroup,
             PY, "-m", "agent", "start", "--run-dir", run_dir, "--", PY, "-c", HOG],
            capture_output=True, text=True, env=env(), cwd=REPO, timeout=60)
        assert extract_payload(proc.stdout)["ok"]
        res = wait_terminal(run_dir, timeout=60)
        rc = res["root_cause"]
        assert rc["kind"] == "host_oom", res
        assert rc["details"]["oom_kills"] >= 1 and rc["details"]["signal"] == 9
        assert "cgroup oom_kill counter +" in res["reason"]
        assert no_run_pids(run_dir)
    finally:
        kill_all(run_dir)
