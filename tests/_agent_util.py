"""Helpers for the agent tests: run `python -m agent` for real, poll with deadlines, and
scan /proc for anything a run left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from agent.protocol import extract_payload

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
FAKE = os.path.join(REPO, "tests", "jobs", "fake_trainer.py")
PRINTER = os.path.join(REPO, "tests", "jobs", "printer.py")


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = REPO
    return e


def agent(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run([PY, "-m", "agent", *args], capture_output=True, text=True, env=env(),
                          cwd=REPO, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise AssertionError(f"agent {args} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def payload(*args: str, check: bool = True) -> dict:
    return extract_payload(agent(*args, check=check).stdout)


def start(run_dir: str, job: list[str], *opts: str) -> dict:
    return payload("start", "--run-dir", str(run_dir), *opts, "--", *job)


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def read_json(path) -> dict | None:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def status(run_dir) -> dict:
    return read_json(os.path.join(run_dir, "status.json")) or {}


def result(run_dir) -> dict | None:
    return read_json(os.path.join(run_dir, "result.json"))


def terminal(run_dir) -> dict | None:
    st = status(run_dir)
    if st.get("state") in ("completed", "failed", "stopped"):
        return st
    return None


def wait_terminal(run_dir, timeout: float = 60.0) -> dict:
    wait_for(lambda: terminal(run_dir) and result(run_dir), timeout, what=f"{run_dir} to end")
    return result(run_dir)


def records(run_dir) -> list[dict]:
    out = []
    with open(os.path.join(run_dir, "stream.jsonl"), "rb") as fh:
        for raw in fh:
            if raw.endswith(b"\n"):
                try:
                    out.append(json.loads(raw))
                except ValueError:
                    pass
    return out


def heartbeats(run_dir) -> dict[int, dict]:
    d = os.path.join(run_dir, "heartbeat")
    out = {}
    for name in os.listdir(d) if os.path.isdir(d) else []:
        if name.startswith("rank-"):
            hb = read_json(os.path.join(d, name))
            if hb:
                out[int(hb["rank"])] = hb
    return out


def run_pids(run_dir) -> set[int]:
    """Live (non-zombie) processes that belong to the run: its marker in the environment,
    or its directory on the command line (the agent and job monitor)."""
    run_dir = os.path.abspath(str(run_dir))
    found = set()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                st = fh.read()
            if st[st.rfind(b")") + 2:][:1] in (b"Z", b"X"):
                continue
            with open(f"/proc/{name}/environ", "rb") as fh:
                environ = fh.read()
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                cmd = fh.read()
        except OSError:
            continue
        if b"DFLASH_RUN_DIR=" + run_dir.encode() + b"\0" in environ or run_dir.encode() in cmd:
            found.add(int(name))
    return found


def kill_all(run_dir) -> None:
    """Teardown: nothing of a test's run may outlive it on this shared machine."""
    for _ in range(3):
        pids = run_pids(run_dir)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.2)


def agent_pid(run_dir) -> int:
    return int(read_json(os.path.join(run_dir, "agent.pid"))["pid"])


def no_run_pids(run_dir, timeout: float = 10.0) -> bool:
    """True once nothing of the run is alive (the agent itself leaves just after the result)."""
    try:
        wait_for(lambda: not run_pids(run_dir), timeout, what="the run's processes to go")
        return True
    except AssertionError:
        return False


@pytest.fixture
def run_dir(tmp_path):
    """A run directory under a workspace; nothing of its run outlives the test."""
    d = tmp_path / "ws" / "runs" / "r1-20261201-114702-0001"  # a run id of the grammar
    yield str(d)
    kill_all(str(d))
