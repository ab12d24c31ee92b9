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
        assert rc["details"]["cgroup_oom_kills"] >= 1 and rc["details"]["signal"] == 9
        assert "cgroup oom_kill counter +" in res["reason"]
        assert no_run_pids(run_dir)
    finally:
        kill_all(run_dir)


def _start_in(cgroup_dir: str, run_dir: str, hide_cgroupfs: bool) -> None:
    """The agent and its job in ``cgroup_dir``; with ``hide_cgroupfs`` in a mount namespace
    where /sys/fs/cgroup is an empty tmpfs, as inside the simulated node's containers (and
    any container given no cgroup mount): no memory cgroup file can be read there."""
    script = 'echo $$ > "$1/cgroup.procs" && shift && ' + \
             ("mount -t tmpfs none /sys/fs/cgroup && " if hide_cgroupfs else "") + 'exec "$@"'
    argv = ["sh", "-c", script, "sh", cgroup_dir, PY, "-m", "agent", "start", "--run-dir", run_dir, "--", PY, "-c", HOG]
    if hide_cgroupfs:
        argv = ["unshare", "--mount", "--propagation", "private"] + argv
    proc = subprocess.run(argv, capture_output=True, text=True, env=env(), cwd=REPO, timeout=60)
    assert extract_payload(proc.stdout)["ok"], proc.stdout + proc.stderr


def test_an_oom_kill_the_container_cannot_see_in_its_cgroup_is_named_possibly_the_hosts(cgroup, tmp_path):
    """The kernel's OOM killer SIGKILLed a job whose container shows no memory cgroup file
    (a host-wide OOM, or a limit above the container): it was reported "killed by signal 9
    (not by us)". The kernel's own oom_kill counter (/proc/vmstat, not virtualized in a
    container) rose while it ran: the reason says "possibly the host's OOM killer", with it."""
    run_dir = str(tmp_path / "ws" / "runs" / "oom-20261201-114702-0001")
    try:
        _start_in(cgroup, run_dir, hide_cgroupfs=True)
        res = wait_terminal(run_dir, timeout=60)
        rc = res["root_cause"]
        assert rc["kind"] == "host_oom" and rc["details"]["signal"] == 9, res
        assert rc["details"]["host_oom_kills"] >= 1 and rc["details"]["cgroup_oom_kills"] is None, rc
        assert "killed by signal 9: possibly the host's OOM killer" in res["reason"], res["reason"]
        assert "kernel's oom_kill counter rose by " in res["reason"], res["reason"]
        assert no_run_pids(run_dir)
    finally:
        kill_all(run_dir)


def test_an_oom_kill_in_the_containers_own_cgroup_says_its_limit_was_reached(cgroup, tmp_path):
    run_dir = str(tmp_path / "ws" / "runs" / "oom-20261201-114702-0002")
    try:
        _start_in(cgroup, run_dir, hide_cgroupfs=False)
        res = wait_terminal(run_dir, timeout=60)
        rc = res["root_cause"]
        assert rc["kind"] == "host_oom" and rc["details"]["cgroup_oom_kills"] >= 1, res
        assert "its memory cgroup's limit (200 MiB) was reached" in res["reason"], res["reason"]
    finally:
        kill_all(run_dir)
