"""Corrupt state files, with real agent processes on this machine: every
state file is read through its type, and a corrupt one is one line naming the file — never a
traceback, never a hang, never a finished run re-attached or rewritten."""

from __future__ import annotations

import json
import os
import subprocess
import threading

import pytest

from agent.protocol import extract_payload
from tests._agent_util import FAKE, PY, REPO, env, kill_all, records, start, wait_terminal

DONE, FAILED = "done-20261201-114702-0001", "failed-20261201-114702-0002"  # run ids of the grammar


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A completed and a failed run in one workspace, made once (each test copies them)."""
    ws = tmp_path_factory.mktemp("corrupt") / "ws"
    done, failed = str(ws / "runs" / DONE), str(ws / "runs" / FAILED)
    start(done, [PY, FAKE, "--ranks", "0", "--steps", "4", "--step-time", "0.05", "--save-interval", "2",
                 "--output-dir", str(ws / "out-done")])
    start(failed, [PY, "-c", "import sys; print('boom'); sys.exit(3)"])
    try:
        wait_terminal(done, 60)
        wait_terminal(failed, 60)
    finally:
        kill_all(done)
        kill_all(failed)
    return ws


@pytest.fixture
def ws(finished, tmp_path):
    import shutil

    copy = tmp_path / "ws"
    shutil.copytree(finished, copy, symlinks=True)
    return copy


def _run(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", *argv], capture_output=True, text=True, env=env(), cwd=REPO, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _view(ws, run: str) -> tuple[int, dict, str]:
    p = _run("agent.runview", "status", "--workspace", str(ws), "--run", run)
    assert "Traceback" not in p.stderr, p.stderr
    return p.returncode, extract_payload(p.stdout), p.stderr


@pytest.mark.parametrize("body, why", [
    ("garbage\n", "not JSON"),
    ('{"state": "failed", "root_cause": "oops"}', "'root_cause' is str \"oops\", not dict"),
    ("[]", "not a JSON object but list"),
    ("", "empty file"),
])
def test_a_corrupt_result_json_is_one_line_naming_the_file(ws, body, why):
    path = ws / "runs" / DONE / "result.json"
    path.write_text(body)
    rc, reply, _ = _view(ws, DONE)
    assert rc == 1 and not reply["ok"]
    assert reply["error"] == f"run {DONE}: {path} is corrupt: {why}" + reply["error"].split(why, 1)[1]
    assert str(path) in reply["error"] and "\n" not in reply["error"]
    listing = extract_payload(_run("agent", "list", "--workspace", str(ws)).stdout)
    row = {r["run_id"]: r for r in listing["runs"]}[DONE]
    assert row["corrupt"].startswith(f"{path} is corrupt")


def test_an_emptied_status_json_of_a_completed_run_never_starts_an_agent_and_keeps_its_step(ws):
    run = ws / "runs" / DONE
    before = (run / "stream.jsonl").read_bytes()
    (run / "status.json").write_text("")
    rc, reply, _ = _view(ws, DONE)
    assert rc == 0 and reply["revived"] is None
    assert reply["status"]["state"] == "completed" and reply["status"]["step"] == 4
    assert reply["status"]["checkpoint"]["step"] == 4
    assert reply["warnings"] == [f"{run}/status.json is corrupt: empty file; shown from the stream's last status "
                                 f"record (seq {reply['status']['seq']})"]
    start_again = _run("agent", "start", "--run-dir", str(run), "--reattach")
    assert start_again.returncode == 2 and "already ended" in start_again.stderr
    listing = extract_payload(_run("agent", "list", "--workspace", str(ws)).stdout)
    row = {r["run_id"]: r for r in listing["runs"]}[DONE]
    assert row["state"] == "completed" and row["step"] == 4
    assert (run / "stream.jsonl").read_bytes() == before  # nothing appended after "run completed"
    assert (run / "status.json").read_text() == ""  # and the record itself is not rewritten


@pytest.mark.parametrize("name, body", [("status.json", '{"state": "running", "step": "ninety"}'),
                                        ("status.json", '{"state": "zombie"}'), ("spec.json", "")])
def test_a_corrupt_status_or_spec_of_an_unfinished_looking_run_is_named_and_nothing_starts(ws, name, body):
    run = ws / "runs" / FAILED
    (run / "result.json").unlink()  # as if it had not ended: the one case a status call may revive
    (run / "stream.jsonl").write_text("")
    (run / name).write_text(body)
    rc, reply, _ = _view(ws, FAILED)
    if name == "spec.json":
        assert rc == 1 and reply["error"].startswith(f"run {FAILED}: {run}/spec.json is corrupt: empty file")
    else:
        assert rc == 0 and reply["revived"] is None and reply["warnings"][0].startswith(f"{run}/status.json is corrupt")
    assert not (run / "agent.lock").exists() or reply.get("agent_alive") is not True


def test_a_follower_of_a_failed_run_with_corrupt_status_and_spec_ends_with_the_stream(ws):
    """The stream's own terminal status ends the follow; the tail loop never asks forever."""
    from controller.jobview import CorruptRun
    from controller.tail import tail

    run = ws / "runs" / FAILED
    (run / "status.json").write_text("[1,2,3]")
    (run / "spec.json").write_text("")

    class Local:  # controller.jobview.ContainerStream's two calls, run here instead of in a container
        def follow(self, run_id, after, on_line, *, once):
            p = _run("agent", "follow", "--run-dir", str(run), "--from", str(after), timeout=30)
            for line in p.stdout.splitlines():
                on_line(line)
            return p.returncode

        def state(self, run_id):
            rc, reply, _ = _view(ws, run_id)
            if not reply["ok"]:
                raise CorruptRun(reply["error"])
            return reply["status"]

    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=tail(Local(), FAILED, lambda rec: None, sleep=lambda s: None)),
                         daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the follower hung"
    assert out["r"].state == "failed"
    rc, reply, _ = _view(ws, FAILED)
    assert rc == 1 and f"{run}/spec.json is corrupt: empty file" in reply["error"]


def test_history_with_bad_lines_names_each_line_and_keeps_the_good_records(ws):
    path = ws / ".dflash-ctl" / "history.jsonl"
    path.parent.mkdir(exist_ok=True)
    good = {"event": "kill", "run": DONE, "ts": 1.5, "how": "stopped"}
    path.write_text("\n".join([json.dumps(good), "[]", json.dumps({"event": "kill", "ts": "yesterday"}), "{torn",
                               json.dumps({"ts": 2, "event": 7})]) + "\n")
    p = _run("agent.recovery", "--workspace", str(ws), "history")
    assert p.returncode == 0 and "Traceback" not in p.stderr
    reply = extract_payload(p.stdout)
    assert reply["records"] == [good]
    assert reply["problems"] == [f"{path} line 2: not a JSON object but list",
                                 f"{path} line 3: 'ts' is \"yesterday\", not a number",
                                 f"{path} line 4: not JSON: '{{torn'",
                                 f"{path} line 5: 'event' is 7, not a string"]
