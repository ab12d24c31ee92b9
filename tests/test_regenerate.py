"""python -m trainer regenerate against a real `transformers serve` of a tiny chat target
(tests/_regen_target.py), with a real HTTP proxy in front where a test needs requests to
fail or to hang: every id exactly once across a SIGKILL, retries, recorded failures,
SIGTERM's resumable stop, bad input in one line, and the job starting its own server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests._regen_target import Proxy, free_port, make_chat_target, serve_argv, wait_healthy
from trainer.chat.rows import iter_rows
from trainer.regen.store import FAILURES, MANIFEST, OUTPUT, Store

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TRANSFORMERS_VERBOSITY": "error"}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_chat_target(str(tmp_path_factory.mktemp("regen") / "target"))


@pytest.fixture(scope="module")
def server(target):
    port = free_port()
    proc = subprocess.Popen(serve_argv(target, port), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def conversations(n: int) -> list[dict]:
    """n answerable rows: a system prompt on some, two user turns on every third, the
    dataset's own answers (to be replaced); some without an id (hashed) and some with."""
    rows = []
    for i in range(n):
        msgs = [{"role": "system", "content": "Be brief."}] if i % 2 == 0 else []
        msgs += [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "DATASET ANSWER"}]
        if i % 3 == 0:
            msgs += [{"role": "user", "content": f"follow-up {i}"}, {"role": "assistant", "content": "DATASET AGAIN"}]
        rows.append({"id": f"row-{i}", "messages": msgs} if i % 4 else {"messages": msgs})
    return rows


def write_input(path, rows, extra_lines: list[bytes] = ()) -> str:
    with open(path, "wb") as fh:
        for r in rows:
            fh.write(json.dumps(r).encode() + b"\n")
        for line in extra_lines:
            fh.write(line + b"\n")
    return str(path)


BAD = [
    b'{"messages": [{"role": "user", "content": "x"}, {"role": "assistant"',  # broken_json
    json.dumps({"id": "tool-row", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]}).encode(),
    json.dumps({"id": "row-1", "messages": [{"role": "user", "content": "same id again"}]}).encode(),  # duplicate_id
]


def regen_argv(inp, out, endpoint, *extra) -> list[str]:
    argv = [sys.executable, "-m", "trainer", "regenerate", "--input", str(inp), "--out", str(out),
            "--max-tokens", "4", "--temperature", "0", "--concurrency", "2", "--flush-rows", "1",
            "--retry-initial", "0.01", "--retry-max-wait", "0.05"]
    for e in ([endpoint] if isinstance(endpoint, str) else endpoint):
        argv += ["--endpoint", e]
    return argv + list(extra)


def regenerate(inp, out, endpoint, *extra, check=None, **kw):
    p = subprocess.run(regen_argv(inp, out, endpoint, *extra), cwd=ROOT, env=kw.pop("env", ENV), capture_output=True,
                       text=True, timeout=120, **kw)
    if check is not None:
        assert p.returncode == check, p.stdout + p.stderr
    return p


def output_rows(out) -> list[dict]:
    with open(os.path.join(out, OUTPUT), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def expected_ids(inp) -> list:
    ids = []
    for r in iter_rows(str(inp)):
        if r.problem in (None, "no_assistant_turn") and r.id not in ids and not any(m["role"] == "tool" for m in r.messages):
            ids.append(r.id)
    return ids


def events(out) -> list[dict]:
    with open(os.path.join(out, "events.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def summary_line(p) -> str:
    return next(line for line in p.stdout.splitlines() if " input rows; " in line)


def left_behind(marker: str, server_sid: int) -> list[str]:
    """Live processes of a job run with ``REGEN_TEST_MARK=marker``: those whose environment
    carries it (the job, its guard, the server) and those of the server's session (--serve
    starts it in its own). Both, since vLLM's engine core and workers rename themselves
    (setproctitle), which overwrites what /proc/PID/environ shows: only their session still
    says whose they are."""
    from agent import procs

    found = []
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        st = procs.stat(pid)
        if st is None or st["state"] in ("Z", "X") or pid == os.getpid():
            continue
        if st["sid"] == server_sid or procs.environ(pid).get("REGEN_TEST_MARK") == marker:
            found.append(f"{pid} {' '.join(procs.cmdline(pid))[:80]}")
    return found


def server_pid(stdout: str) -> int:
    return int(stdout.split("regenerate: started the server (pid ", 1)[1].split(")", 1)[0])


def sigkill_while_loading(argv: list[str], loading, wait_s: float = 120.0) -> list[str]:
    """Start a --serve job, SIGKILL it once ``loading(server_sid)`` is true (its server mid-start),
    and wait at most ``wait_s`` for nothing of it to be left. Returns what was left then, after
    SIGKILLing it so that no test leaves a server behind."""
    marker = os.urandom(8).hex()
    job = subprocess.Popen(argv, cwd=ROOT, env={**ENV, "REGEN_TEST_MARK": marker}, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
    first = job.stdout.readline()
    assert "started the server" in first, first
    sid = server_pid(first)
    try:
        while not loading(sid):
            assert job.poll() is None, "the job ended before its server was loading"
            time.sleep(0.1)
        job.send_signal(signal.SIGKILL)
        job.wait(30)
        deadline = time.monotonic() + wait_s
        while left_behind(marker, sid) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left_behind(marker, sid)
    finally:
        for line in left_behind(marker, sid):
            os.kill(int(line.split()[0]), signal.SIGKILL)
        job.stdout.close()



def test_each_row_is_answered_turn_by_turn_on_the_targets_own_history(tmp_path, server):
    rows = conversations(9) + [{"id": "prompt-only", "messages": [{"role": "user", "content": "just ask"}]}]
    inp = write_input(tmp_path / "in.jsonl", rows, BAD)
    proxy = Proxy(server)
    try:
        p = regenerate(inp, tmp_path / "out", proxy.url, "--thinking", "off", "--seed", "7", check=0)
    finally:
        proxy.close()
    out = output_rows(tmp_path / "out")
    assert sorted(map(str, (r["id"] for r in out))) == sorted(map(str, expected_ids(inp)))
    by_id = {r["id"]: r for r in out}
    src: dict = {}
    for r in iter_rows(inp):
        src.setdefault(r.id, r)  # the first of a duplicated id is the one answered
    for rid, row in by_id.items():
        want_users = [m["content"] for m in src[rid].messages if m["role"] == "user"]
        assert [m["content"] for m in row["messages"] if m["role"] == "user"] == want_users
        answers = [m for m in row["messages"] if m["role"] == "assistant"]
        assert len(answers) == len(want_users)
        assert all(a["content"] not in ("DATASET ANSWER", "DATASET AGAIN") for a in answers)
        assert row["regen"]["output_tokens"] == 4 * len(want_users)
        assert [m["role"] for m in row["messages"]].count("system") == (1 if src[rid].messages[0]["role"] == "system" else 0)
    # the second turn was asked with the target's first answer as history, not the dataset's
    two_turn = by_id["row-3"]
    second = next(b for b in proxy.bodies if b["messages"][-1]["content"] == "follow-up 3")
    assert second["messages"][:-1] == [{"role": m["role"], "content": m["content"]} for m in two_turn["messages"][:2]]
    assert all(b["chat_template_kwargs"] == {"enable_thinking": False} and b["seed"] == 7 and b["max_tokens"] == 4
               for b in proxy.bodies)
    assert len(proxy.bodies) == sum(len([m for m in r["messages"] if m["role"] == "user"]) for r in out)
    assert "done 10 + failed 0 + skipped 3 (broken_json 1, duplicate_id 1, tool_turns 1) = 13 input rows" in summary_line(p)
    prog = [e for e in events(tmp_path / "out") if e["kind"] == "progress"]
    final = prog[-1]
    assert final["final"] is True and (final["done"], final["failed"], final["skipped"], final["total"]) == (10, 0, 3, 13)
    assert final["requests"] == len(proxy.bodies) and final["eta_s"] == 0.0
    assert {"requests_per_s", "output_tokens_per_s", "eta_s", "skipped_by_cause"} <= set(final)
    manifest = json.load(open(tmp_path / "out" / MANIFEST))
    assert manifest["summary"]["adds_up"] is True
    # the agent's liveness signal, as the trainer's ranks write it: left cleanly
    hb = json.load(open(tmp_path / "out" / "heartbeat" / "rank-0"))
    assert (hb["state"], hb["step"], hb["role"]) == ("done", 10, "regenerate")


def sigkill_while_held(upstream: str, argv_for, hold_after: int = 6, timeout: float = 60) -> None:
    """Run ``argv_for(proxy_url)`` behind a Proxy that answers ``hold_after`` requests and holds
    the next ones, and SIGKILL it once both workers wait there: a run killed mid-way."""
    proxy = Proxy(upstream, hold_after=hold_after)
    proc = subprocess.Popen(argv_for(proxy.url), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        assert proxy.held.acquire(timeout=timeout) and proxy.held.acquire(timeout=timeout)  # both workers wait
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proxy.close()


def test_sigkill_mid_run_then_restart_writes_every_id_exactly_once(tmp_path, server):
    inp = write_input(tmp_path / "in.jsonl", conversations(16), BAD[:1])
    out = tmp_path / "out"
    sigkill_while_held(server, lambda url: regen_argv(inp, out, url))
    before = output_rows(out)
    assert 0 < len(before) < 16
    # a SIGKILL in the middle of a batch's write leaves a torn last line: cut off and redone
    torn = json.dumps({"id": "row-5", "messages": [{"role": "user", "content": "question 5"}]})[:30]
    with open(out / OUTPUT, "a") as fh:
        fh.write(torn)
    p = regenerate(inp, out, server, check=0)
    assert "cut a torn last line" in p.stdout
    ids = [r["id"] for r in output_rows(out)]
    assert len(ids) == len(set(ids)) == 16
    assert sorted(map(str, ids)) == sorted(map(str, expected_ids(inp)))
    assert f"done 16 + failed 0 + skipped 1 (broken_json 1) = 17 input rows" in summary_line(p)
    assert f"{len(before)} done before" in p.stdout


def test_a_flaky_endpoint_is_retried_and_permanent_errors_are_recorded(tmp_path, server):
    rows = conversations(10)
    rows[4]["messages"][1]["content"] = "REFUSE this one"  # the proxy answers 400 for these
    rows[7]["messages"][0]["content"] = "REFUSE this one too"

    attempts: dict[str, int] = {}

    def fail(n, body):
        if any("REFUSE" in m["content"] for m in body["messages"]):
            return 400
        key = json.dumps(body["messages"])
        attempts[key] = attempts.get(key, 0) + 1
        # every request fails its first three attempts: a 503, a dropped connection, a 429
        return {1: 503, 2: "drop", 3: 429}.get(attempts[key])

    inp = write_input(tmp_path / "in.jsonl", rows)
    proxy = Proxy(server, fail=fail)
    try:
        p = regenerate(inp, tmp_path / "out", proxy.url, "--max-attempts", "4", check=1)
    finally:
        proxy.close()
    assert set(attempts.values()) == {4}
    failures = [json.loads(line) for line in open(tmp_path / "out" / FAILURES)]
    assert sorted(f["id"] for f in failures) == sorted(["row-7", expected_ids(inp)[4]])
    assert all("HTTP 400" in f["error"] and "proxy says 400" in f["error"] and f["where"].endswith((":5", ":8"))
               for f in failures)
    assert len(output_rows(tmp_path / "out")) == 8
    assert "done 8 + failed 2 + skipped 0 = 10 input rows" in summary_line(p)
    assert "2 rows failed" in p.stderr and "failures.jsonl" in p.stderr
    # run again straight at the server: the failed rows are tried again, the done ones not
    p = regenerate(inp, tmp_path / "out", server, check=0)
    assert "8 done before, 2 failed before" in p.stdout
    assert "done 10 + failed 0 + skipped 0 = 10 input rows" in summary_line(p)
    ids = [r["id"] for r in output_rows(tmp_path / "out")]
    assert len(ids) == len(set(ids)) == 10
    assert open(tmp_path / "out" / FAILURES).read() == ""


def test_sigterm_stops_after_flushing_and_a_rerun_resumes(tmp_path, server):
    inp = write_input(tmp_path / "in.jsonl", conversations(12))
    out = tmp_path / "out"
    proxy = Proxy(server, hold_after=4)
    argv = regen_argv(inp, out, proxy.url, "--flush-rows", "100")  # nothing flushed by row count
    proc = subprocess.Popen(argv, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proxy.held.acquire(timeout=60) and proxy.held.acquire(timeout=60)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proxy.close()
    assert proc.returncode == 75, stdout + stderr
    assert "run the same command again to resume" in stdout
    done_at_stop = output_rows(out)
    assert done_at_stop  # what was answered before the stop was flushed
    final = [e for e in events(out) if e["kind"] == "progress"][-1]
    assert final["stopped"] is True and final["done"] == len(done_at_stop)
    assert json.load(open(out / "heartbeat" / "rank-0"))["state"] == "stopped"
    p = regenerate(inp, out, server, check=0)
    ids = [r["id"] for r in output_rows(out)]
    assert len(ids) == len(set(ids)) == 12


def test_an_unreachable_endpoint_is_one_line_naming_it_and_nothing_is_written(tmp_path, server):
    inp = write_input(tmp_path / "in.jsonl", conversations(2))
    dead = f"http://127.0.0.1:{free_port()}"
    p = regenerate(inp, tmp_path / "out", [server, dead], check=2)
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    assert f"--endpoint {dead}: unreachable" in p.stderr
    assert not (tmp_path / "out").exists()


def test_bad_input_is_one_line_and_a_restart_with_other_settings_is_refused(tmp_path, server):
    p = regenerate(tmp_path / "missing.jsonl", tmp_path / "out", server, check=2)
    assert p.stderr.count("\n") == 1 and "--input" in p.stderr and "missing.jsonl" in p.stderr
    p = regenerate(tmp_path / "missing.jsonl", tmp_path / "out", server, "--concurrency", "0", check=2)
    assert p.stderr.count("\n") == 1 and "--concurrency" in p.stderr
    inp = write_input(tmp_path / "in.jsonl", conversations(2))
    p = regenerate(inp, tmp_path / "out", server, "--model", "no-such-model", check=2)
    assert p.stderr.count("\n") == 1 and "--model no-such-model: not served by" in p.stderr
    regenerate(inp, tmp_path / "out", server, check=0)
    p = regenerate(inp, tmp_path / "out", server, "--thinking", "on", check=2)
    assert p.stderr.count("\n") == 1 and "--thinking 'on' differs from the run already in" in p.stderr


def test_the_job_starts_its_own_server_health_checks_it_and_stops_it(tmp_path, target):
    inp = write_input(tmp_path / "in.jsonl", conversations(3))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    import shlex

    p = regenerate(inp, tmp_path / "out", url, "--serve", shlex.join(serve_argv(target, port)), check=0)
    assert "the server is healthy after" in p.stdout and "stopped the server" in p.stdout
    assert len(output_rows(tmp_path / "out")) == 3
    assert os.path.getsize(tmp_path / "out" / "serve.log") > 0
    with pytest.raises(OSError):
        urllib.request.urlopen(url + "/health", timeout=2)
    phases = [e["phase"] for e in events(tmp_path / "out") if e["kind"] == "phase"]
    assert phases == ["serving", "regenerating", "done"]


def test_a_restart_cuts_only_a_torn_last_line(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    good = [json.dumps({"id": f"r{i}", "messages": []}) for i in range(3)]
    (out / OUTPUT).write_text("\n".join(good) + "\n" + good[0][:12])
    store = Store(str(out), {"--model": "m"})
    assert store.torn and store.done == {"r0", "r1", "r2"}
    assert (out / OUTPUT).read_text() == "\n".join(good) + "\n"
    store.close(None)
    (out / OUTPUT).write_text(good[0] + "\n{broken\n" + good[1] + "\n")
    with pytest.raises(ValueError, match=":2: not a line this job wrote"):
        Store(str(out), {"--model": "m"})


def test_a_terminal_gets_one_progress_line_rewritten_in_place(tmp_path, server):
    import pty

    inp = write_input(tmp_path / "in.jsonl", conversations(3))
    master, slave = pty.openpty()
    proc = subprocess.Popen(regen_argv(inp, tmp_path / "out", server), cwd=ROOT, env=ENV, stdout=slave,
                            stderr=subprocess.DEVNULL)
    os.close(slave)
    screen = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        screen += chunk
    os.close(master)
    assert proc.wait(60) == 0
    text = screen.decode()
    assert "\r\x1b[2Kregenerate:   0.0% done 0 failed 0 skipped 0 of 3 |" in text
    assert "done 3 + failed 0 + skipped 0 = 3 input rows" in text


def test_the_regenerated_rows_prepare_with_the_targets_own_template(tmp_path, server, target):
    inp = write_input(tmp_path / "in.jsonl", conversations(6))
    regenerate(inp, tmp_path / "out", server, "--thinking", "off", check=0)
    p = subprocess.run([sys.executable, "-m", "trainer", "prepare", "--input", str(tmp_path / "out" / OUTPUT),
                        "--out", str(tmp_path / "data"), "--target", target, "--thinking", "off", "--workers", "1"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    meta = json.load(open(tmp_path / "data" / "meta.json"))
    assert meta["samples"] == 6


def test_accounting_that_does_not_add_up_exits_non_zero(tmp_path, server):
    # rows appended to the input after it was counted: more rows are gone through than counted
    inp = write_input(tmp_path / "in.jsonl", conversations(12))
    proxy = Proxy(server, hold_after=2)
    proc = subprocess.Popen(regen_argv(inp, tmp_path / "out", proxy.url), cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proxy.held.acquire(timeout=60)  # counted, and the reader is a few rows in
        with open(inp, "a") as fh:
            fh.write(json.dumps({"id": "late-1", "messages": [{"role": "user", "content": "late"}]}) + "\n")
            fh.write(json.dumps({"id": "late-2", "messages": [{"role": "user", "content": "later"}]}) + "\n")
        proxy.gate.set()
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proxy.close()
    assert proc.returncode == 1, stdout + stderr
    assert "done 14 + failed 0 + skipped 0 ≠ 12 input rows" in stdout
    assert "the accounting does not add up" in stderr


def test_a_job_killed_while_its_server_loads_leaves_no_server(tmp_path):
    # a server that ignores SIGTERM while it loads, as vLLM's API server does while its engine
    # starts: PR_SET_PDEATHSIG's SIGTERM alone left it running; the job's guard SIGKILLs it
    inp = write_input(tmp_path / "in.jsonl", conversations(2))
    loading = (f"{sys.executable} -c \"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
               "print('loading', flush=True); time.sleep(600)\"")
    argv = regen_argv(inp, tmp_path / "out", f"http://127.0.0.1:{free_port()}", "--serve", loading,
                      "--serve-stop-grace", "1")
    # once it runs (and ignores SIGTERM)
    left = sigkill_while_loading(argv, lambda sid: "loading" in (tmp_path / "out" / "serve.log").read_text())
    assert left == []


def test_a_server_that_dies_while_starting_is_one_line_with_its_log(tmp_path):
    inp = write_input(tmp_path / "in.jsonl", conversations(2))
    serve = f"{sys.executable} -c \"print('CUDA out of memory while loading'); raise SystemExit(3)\""
    p = regenerate(inp, tmp_path / "out", f"http://127.0.0.1:{free_port()}", "--serve", serve, check=1)
    assert p.stderr.count("\n") == 1
    assert "the server exited 3 before" in p.stderr and "CUDA out of memory while loading" in p.stderr
    assert not (tmp_path / "out" / OUTPUT).exists()
    assert json.load(open(tmp_path / "out" / "heartbeat" / "rank-0"))["state"] == "failed"


def test_an_api_key_is_read_from_the_named_variable_and_sent(tmp_path, server):
    inp = write_input(tmp_path / "in.jsonl", conversations(2))
    proxy = Proxy(server, api_key="s3cret")
    try:
        p = regenerate(inp, tmp_path / "a", proxy.url, check=2)
        assert p.stderr.count("\n") == 1 and "HTTP 401" in p.stderr and "--api-key-env" in p.stderr
        p = regenerate(inp, tmp_path / "b", proxy.url, "--api-key-env", "REGEN_TEST_KEY", check=2)
        assert p.stderr.count("\n") == 1 and "--api-key-env REGEN_TEST_KEY: that environment variable is not set" in p.stderr
        regenerate(inp, tmp_path / "c", proxy.url, "--api-key-env", "REGEN_TEST_KEY", check=0,
                   env={**ENV, "REGEN_TEST_KEY": "s3cret"})
    finally:
        proxy.close()
    assert len(output_rows(tmp_path / "c")) == 2 and len(proxy.bodies) == 3


def test_regenerate_imports_no_torch():
    # the job runs beside a server holding the GPUs: it needs neither torch nor transformers
    code = ("import sys, trainer.regen.job as r; r.build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_conversations_are_spread_over_endpoints_and_a_failing_one_is_retried_on_the_next(tmp_path, server):
    inp = write_input(tmp_path / "in.jsonl", conversations(8))
    a, b = Proxy(server), Proxy(server)
    try:
        regenerate(inp, tmp_path / "ab", [a.url, b.url], check=0)
    finally:
        a.close()
        b.close()
    assert a.bodies and b.bodies

    def asked(proxy) -> set:
        return {body["messages"][-1]["content"] for body in proxy.bodies}
    for i in (0, 3, 6):  # the two-turn rows: both turns went to one endpoint (its prefix cache)
        holder, other = (a, b) if f"follow-up {i}" in asked(a) else (b, a)
        assert f"question {i}" in asked(holder) and f"question {i}" not in asked(other)
    good, bad = Proxy(server), Proxy(server, fail=lambda n, body: 503)
    try:
        p = regenerate(inp, tmp_path / "gb", [good.url, bad.url], "--max-attempts", "2", check=0)
    finally:
        good.close()
        bad.close()
    assert "done 8 + failed 0 + skipped 0 = 8 input rows" in summary_line(p)
    asked = sum(len([m for m in r["messages"] if m["role"] == "user"]) for r in output_rows(tmp_path / "gb"))
    assert bad.bodies and len(good.bodies) == asked  # every request the bad one refused was answered by the good one


def test_a_request_that_times_out_is_retried(tmp_path, server):
    inp = write_input(tmp_path / "in.jsonl", conversations(2))
    tries: dict[str, int] = {}

    def slow_first(n, body):
        key = json.dumps(body["messages"])
        tries[key] = tries.get(key, 0) + 1
        return "slow" if tries[key] == 1 else None

    proxy = Proxy(server, fail=slow_first)
    try:
        p = regenerate(inp, tmp_path / "out", proxy.url, "--request-timeout", "1", check=0)
    finally:
        proxy.close()
    assert "done 2 + failed 0 + skipped 0 = 2 input rows" in summary_line(p)
    assert len(tries) == 3 and min(tries.values()) >= 2  # every request's first attempt timed out


def test_three_regenerates_into_one_out_at_once_give_one_writer_and_every_id_once(tmp_path, server):
    """Two regenerate launches with the same --out both ran to "completed" (each id written
    twice); a job plus the same command typed by hand wrote 190 ids twice. The job now holds
    an exclusive lock beside its --out for its whole life (trainer/outlock.py, as prepare
    does): of three started together — whichever way they were started — one writes, and the
    others are refused in one line, exit 2, writing nothing."""
    inp = write_input(tmp_path / "in.jsonl", conversations(12))
    out = tmp_path / "out"
    proxy = Proxy(server, hold_after=2)  # the writer is held mid-way while the others start
    procs = [subprocess.Popen(regen_argv(inp, out, proxy.url), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        refused = []
        deadline = time.monotonic() + 60
        while len(refused) < 2 and time.monotonic() < deadline:
            refused = [p for p in procs if p.poll() is not None]
            time.sleep(0.1)
        assert len(refused) == 2, [p.poll() for p in procs]
        for p in refused:
            err = p.stderr.read()
            assert p.returncode == 2 and err.count("\n") == 1, err
            assert f"{out}: another regenerate is writing it now" in err and "choose another --out" in err, err
        proxy.gate.set()
        writer = next(p for p in procs if p not in refused)
        assert writer.wait(120) == 0, writer.stderr.read()
    finally:
        proxy.gate.set()
        proxy.close()
        for p in procs:
            p.kill()
    ids = [r["id"] for r in output_rows(out)]
    assert len(ids) == len(set(ids)) == 12


def test_a_jsonl_whose_first_line_is_an_array_has_every_later_row_answered(tmp_path, server):
    """Read as a JSON-array file, such an input answered 1 of 5 rows and exited 0 with the
    accounting adding up; line by line, line 1 is one skipped row and the other four are done."""
    inp = tmp_path / "in.jsonl"
    inp.write_text("[1, 2]\n" + "".join(json.dumps(r) + "\n" for r in conversations(4)))
    p = regenerate(inp, tmp_path / "out", server, check=0)
    assert "done 4 + failed 0 + skipped 1 (not_an_object 1) = 5 input rows" in summary_line(p), p.stdout
    trailing = tmp_path / "trailing.json"
    trailing.write_text(json.dumps(conversations(2), indent=1) + "\n" + json.dumps(conversations(1)[0]) + "\n")
    p = regenerate(trailing, tmp_path / "out2", server, check=2)
    assert p.stderr.count("\n") == 1 and f"{trailing}:" in p.stderr and "data after the JSON array" in p.stderr
    assert not (tmp_path / "out2").exists()
