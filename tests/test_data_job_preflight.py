"""A data job is checked before anything starts: the launch's preflight in the container runs
the job's own start checks (`python -m trainer SUB … --preflight`, trainer/chat/preflight.py).
A wrong --target or a target without a chat template was found only after the job started (a
run directory per typo). Real agent.preflight processes on this machine, a real tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from agent.protocol import extract_payload
from tests._agent_util import REPO, env

RUN = "chat-20261201-114702-0001"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tests._regen_target import make_chat_target

    return make_chat_target(str(tmp_path_factory.mktemp("pf") / "target"))


def _check(workspace, argv: list[str], kind: str, reads: list[str], writes: list[str]) -> dict:
    req = {"workspace": str(workspace), "run_id": RUN, "config": "chat", "kind": kind, "argv": argv,
           "paths": {"reads": reads, "writes": writes}, "read_options": [f"[{kind}] input"] * len(reads)}
    proc = subprocess.run([sys.executable, "-m", "agent.preflight", "check"], input=json.dumps(req), text=True,
                          capture_output=True, env=env(), cwd=REPO, timeout=180)
    return extract_payload(proc.stdout)


def _chat(path) -> str:
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    return str(path)


def test_a_prepare_preflight_refuses_each_bad_input_before_anything_starts(tmp_path, target):
    ws = tmp_path / "ws"
    ws.mkdir()
    chat = _chat(tmp_path / "chat.jsonl")
    no_template = tmp_path / "no-template"
    no_template.mkdir()
    for name in os.listdir(target):  # the target without its chat template
        if name not in ("chat_template.jinja",):
            data = open(os.path.join(target, name), "rb").read()
            if name == "tokenizer_config.json":
                doc = json.loads(data)
                doc.pop("chat_template", None)
                data = json.dumps(doc).encode()
            (no_template / name).write_bytes(data)
    out = str(ws / "data" / "chat")
    cases = [
        (["--target", str(tmp_path / "typo")], "--target " + str(tmp_path / "typo") + ": not a directory"),
        (["--target", str(no_template)], f"--target {no_template}: no chat template"),
        (["--target", target], "--thinking: the chat template of"),  # it needs --thinking, as the job says
    ]
    for extra, said in cases:
        reply = _check(ws, ["prepare", "--input", chat, "--out", out, *extra], "prepare", [chat], [out])
        assert not reply["ok"] and any(said in e for e in reply["errors"]), (extra, reply["errors"])
    good = _check(ws, ["prepare", "--input", chat, "--out", out, "--target", target, "--thinking", "off"], "prepare",
                  [chat], [out])
    assert good["ok"], good["errors"]
    unreadable = tmp_path / "locked.jsonl"
    unreadable.write_text("{}\n")
    reply = _check(ws, ["prepare", "--input", str(tmp_path / "trail.json"), "--out", "/proc/nope/out"], "prepare",
                   [], ["/proc/nope/out"])
    assert any("--input" in e and "trail.json" in e for e in reply["errors"]), reply["errors"]
    assert any(e.startswith("--out /proc/nope/out: nothing can be created in /proc") for e in reply["errors"]), \
        reply["errors"]
    assert not os.path.exists(out) and not (ws / "runs").exists()


def test_a_regenerate_preflight_asks_its_endpoints_before_anything_starts(tmp_path):
    from tests._regen_target import free_port

    ws = tmp_path / "ws"
    ws.mkdir()
    chat = _chat(tmp_path / "chat.jsonl")
    dead = f"http://127.0.0.1:{free_port()}"
    out = str(ws / "regen")
    reply = _check(ws, ["regenerate", "--input", chat, "--out", out, "--endpoint", dead], "regenerate", [chat], [out])
    assert not reply["ok"] and any(f"--endpoint {dead}: unreachable" in e for e in reply["errors"]), reply
    assert not os.path.exists(out) and not (ws / "runs").exists()


def test_a_preflight_never_reads_a_pipe_the_job_will_read(tmp_path):
    """A FIFO as --input is the job's to read once: the preflight reading it took the job's
    first rows (the simulated node's prepare job then failed on a half line), or would block
    with no writer. It checks only that the pipe is readable."""
    ws = tmp_path / "ws"
    ws.mkdir()
    fifo = str(tmp_path / "rows.fifo")
    os.mkfifo(fifo)
    out = str(ws / "data" / "chat")
    reply = _check(ws, ["prepare", "--input", fifo, "--out", out], "prepare", [fifo], [out])
    assert reply["ok"], reply["errors"]
