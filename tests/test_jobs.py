"""Jobs of every kind under one agent (trainer/kinds.py): the run
config of a data kind, validated from the kind's own parser; its start script; a real
`python -m trainer prepare` started by the launch's commit step under the real agent,
its progress in status.json and in `ctl status`'s words, stopped mid-run (nothing partial
left, state stopped) and launched again to completion; paths a live job shares refused.

The same on the simulated node through `ctl`: tests/test_jobs_sim.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading

import pytest

from agent import preflight
from agent.protocol import extract_payload
from controller import configfile, jobconfig, runconfig
from trainer import kinds
from controller.config import ContainerConfig
from controller.render import render_job_script
from controller.status import render_status
from tests._agent_util import REPO, agent, payload, wait_for, wait_terminal


def _config(tmp_path, text: str, name: str = "prep.toml"):
    path = tmp_path / name
    path.write_text(text)
    return configfile.load(path)


def _refused(tmp_path, text: str) -> str:
    with pytest.raises(runconfig.RunConfigError) as exc:
        _config(tmp_path, text)
    return str(exc.value)


def test_prepare_config_is_validated_from_prepares_own_parser(tmp_path):
    cfg = _config(tmp_path, 'name = "chat"\nkind = "prepare"\n[prepare]\ninput = "/w/chat.jsonl"\n'
                            'out = "{workspace}/data/{run_id}"\n')
    values = cfg.resolve(run_id="r1", run_dir="/w/runs/r1", workspace="/w")
    assert cfg.argv(values) == ["prepare", "--input", "/w/chat.jsonl", "--out", "/w/data/r1"]
    assert cfg.paths(values) == {"reads": ["/w/chat.jsonl"], "writes": ["/w/data/r1"]}
    # The parser's own options, defaults and help are the table's (one source of truth).
    from trainer.chat.prepare import build_parser

    fields = jobconfig.model_for("prepare").model_fields["prepare"].annotation.model_fields
    from controller.jobconfig import option_name, options_of

    not_in_config = {d.replace("_", "-") for d, _ in kinds.get("prepare").not_in_config}  # --preflight: the launch's
    assert {f.alias for f in fields.values()} == {option_name(a)[2:] for a in options_of(build_parser())} - not_in_config
    assert {"input", "out", "target", "thinking", "strict"} <= {f.alias for f in fields.values()}
    assert fields["shard_tokens"].default == build_parser().get_default("shard_tokens")
    assert "[prepare] thinking = 'maybe': Input should be 'on' or 'off'" in _refused(
        tmp_path, 'kind = "prepare"\n[prepare]\ninput = "a"\nout = "/o"\nthinking = "maybe"\n')

    assert "[prepare] input: missing" in _refused(tmp_path, 'kind = "prepare"\n[prepare]\nout = "/o"\n')
    assert "[prepare] shard-tokens = 'many'" in _refused(
        tmp_path, 'kind = "prepare"\n[prepare]\ninput = "a"\nout = "/o"\nshard-tokens = "many"\n')
    line = _refused(tmp_path, 'kind = "prepare"\n[prepare]\ninput = "a"\nout = "/o"\nlr = 1\n')
    assert "[prepare] lr: unknown setting for a prepare job; known: input, out" in line
    # regenerate's table, from its parser; its own converters judge the values
    regen = 'kind = "regenerate"\n[regenerate]\ninput = "a"\nout = "/o"\nendpoint = "http://127.0.0.1:1"\n'
    cfg = _config(tmp_path, regen + "concurrency = 4\n", "r.toml")
    assert cfg.argv(cfg.resolve(run_id="r", run_dir="/r", workspace="/w"))[:1] == ["regenerate"]
    assert "[regenerate]: argument --concurrency: 0 is out of range: give a whole number from 1 to 4096" in _refused(
        tmp_path, regen + "concurrency = 0\n")
    assert "[regenerate] run-dir: not a run-config setting" in _refused(tmp_path, regen + 'run-dir = "/x"\n')
    assert "[trainer]: a prepare job has no trainer flags" in _refused(
        tmp_path, 'kind = "prepare"\n[trainer]\nlr = 1\n[prepare]\ninput = "a"\nout = "/o"\n')
    assert "kind = 'frob': not a job kind; use one of train, prepare, regenerate" in _refused(tmp_path, 'kind = "frob"\n')
    # --set reaches the kind's table; a training override is refused with the table to use.
    path = tmp_path / "p.toml"
    path.write_text('kind = "prepare"\n[prepare]\ninput = "a"\nout = "/o"\n')
    cfg = configfile.load(path, sets=["out=/elsewhere", "supervision.kill-grace=3"])
    assert cfg.values()["out"] == "/elsewhere" and cfg.supervision.kill_grace == 3
    with pytest.raises(runconfig.RunConfigError, match=r"--data-dir: a training option.*\[prepare\]"):
        configfile.load(path, overrides={"data_dir": "/d"})
    # A training config still is one, with or without the explicit kind.
    train = tmp_path / "t.toml"
    train.write_text((open(os.path.join(REPO, "examples", "tiny.toml")).read()).replace('name =', 'kind = "train"\nname =', 1))
    assert isinstance(configfile.load(train), runconfig.RunConfig)


def test_a_served_check_config_is_validated_from_the_jobs_own_parser(tmp_path):
    # kind = "served-check" in a run config: what agent/servedcheck.py starts for a run, launched
    # by hand (`ctl launch --config check.toml`): its table comes from served_job's parser
    from controller.jobconfig import option_name, options_of
    from trainer.serve.served_job import build_parser

    head = 'name = "check"\nkind = "served-check"\n[served-check]\ncheckpoint = "{workspace}/runs/r0"\n'
    cfg = _config(tmp_path, head + 'best = true\nthreads = 2\nvllm-python = "/opt/vllm/bin/python"\n', "c.toml")
    values = cfg.resolve(run_id="c1", run_dir="/w/runs/c1", workspace="/w")
    assert cfg.argv(values) == ["served-check-job", "--checkpoint", "/w/runs/r0", "--best", "--threads", "2",
                                "--vllm-python", "/opt/vllm/bin/python"]
    fields = jobconfig.model_for("served-check").model_fields["served-check"].annotation.model_fields
    assert {f.alias for f in fields.values()} == {option_name(a)[2:] for a in options_of(build_parser())} - {"preflight"}
    assert "[served-check] checkpoint: missing" in _refused(tmp_path, 'kind = "served-check"\n[served-check]\nbest = true\n')
    assert "[served-check]: argument --gpu:" in _refused(tmp_path, head + "gpu = -1\n")
    assert "[served-check]: argument --tolerance:" in _refused(tmp_path, head + "tolerance = 2\n")
    assert "[served-check] lr: unknown setting for a served-check job" in _refused(tmp_path, head + "lr = 1\n")
    assert "[served-check] preflight: not a run-config setting" in _refused(tmp_path, head + "preflight = true\n")


def _samples(n: int, length: int = 12) -> str:
    rows = [{"input_ids": [(i * 7 + j) % 500 + 1 for j in range(length)],
             "loss_mask": [0] * (length // 2) + [1] * (length - length // 2)} for i in range(n)]
    return "".join(json.dumps(r) + "\n" for r in rows)


def _launch(workspace: str, run_id: str, argv: list[str], record: dict, secret=(None, ())) -> dict:
    """What `ctl launch`'s commit does in the container, here on this machine: start.sh
    rendered by controller/render.py, the agent started by agent.preflight commit; ``secret``
    as controller/datalaunch.py job_secret gives it."""
    from controller.launch import start_argv
    from controller.render import DEFAULT_SECRET_KEYS

    class Ct:  # the one thing start_argv reads of a container
        config = ContainerConfig(venv=os.path.dirname(os.path.dirname(sys.executable)), workspace=workspace)

    run_dir = os.path.join(workspace, "runs", run_id)
    secrets_file = os.path.join(workspace, "secrets", f"{run_id}.env")
    script = render_job_script(argv, container=Ct.config, bundle=REPO, run_id=run_id, run_dir=run_dir,
                               secrets_file=secrets_file, secret_keys=DEFAULT_SECRET_KEYS + secret[1])
    req = {"workspace": workspace, "run_id": run_id, "run_dir": run_dir, "script": script,
           "secrets_file": secrets_file if secret[0] else None, "secret": secret[0],
           "record": {"run_id": run_id, "ts": 0, **record},
           "start_argv": start_argv(Ct, run_dir, run_id, {"startup_timeout": 60})}
    proc = agent_module("agent.preflight", "commit", stdin=json.dumps(req))
    reply = extract_payload(proc.stdout)
    assert reply.get("ok"), reply
    return reply


def agent_module(module: str, *args: str, stdin: str = "") -> "subprocess.CompletedProcess":
    import subprocess

    from tests._agent_util import env

    return subprocess.run([sys.executable, "-m", module, *args], input=stdin, capture_output=True, text=True,
                          env=env(), cwd=REPO, timeout=120)


def test_prepare_job_under_the_agent_stopped_mid_run_then_relaunched(tmp_path):
    workspace = str(tmp_path / "ws")
    os.makedirs(workspace)
    out = os.path.join(workspace, "data", "chat")
    fifo = str(tmp_path / "rows.fifo")
    os.mkfifo(fifo)
    paths = {"reads": [fifo], "writes": [out]}
    argv = ["prepare", "--input", fifo, "--out", out]
    _launch(workspace, "prep-20261201-114702-0001", argv, {"kind": "prepare", "config": "chat", "paths": paths, "gpus": {}})
    run_dir = os.path.join(workspace, "runs", "prep-20261201-114702-0001")

    # The input arrives slowly (a FIFO held open): the job is mid-run, its progress known.
    writer_ready = threading.Event()

    def feed():
        with open(fifo, "w") as fh:
            fh.write(_samples(300))
            fh.flush()
            writer_ready.set()
            wait_for(lambda: os.path.exists(os.path.join(run_dir, "result.json")), timeout=60, what="the stop")

    threading.Thread(target=feed, daemon=True).start()
    assert writer_ready.wait(30)
    st = wait_for(lambda: (json.load(open(os.path.join(run_dir, "status.json"))).get("progress") or None)
                  if os.path.exists(os.path.join(run_dir, "status.json")) else None, what="a progress record")
    assert st["samples"] == 0 and st["tokens"] == 0  # the job's first progress, at its start

    # Another job writing the same output, or training on it, is refused while this one lives.
    clash = preflight.check_data_job({"workspace": workspace, "run_id": "prep-20261201-114702-0002", "kind": "prepare",
                                      "paths": {"reads": [], "writes": [out]}})
    assert not clash["ok"] and "run prep-20261201-114702-0001 (prepare, running) writes " + out in clash["errors"][0]
    assert preflight.path_conflicts(workspace, {"reads": [out + "/"], "writes": [str(tmp_path / "o")]})
    assert not preflight.path_conflicts(workspace, {"reads": ["/elsewhere"], "writes": [str(tmp_path / "o")]})

    stopped = payload("stop", "--workspace", workspace, "--run", "prep-20261201-114702-0001", "--grace", "20")
    assert stopped.get("ok"), stopped
    final = wait_terminal(run_dir)
    assert final["state"] == "stopped"
    assert json.load(open(os.path.join(run_dir, "job.exit.json")))["exit_code"] == 75  # stopped, resumable
    parent = os.path.dirname(out)
    assert not os.path.exists(out)
    assert [n for n in os.listdir(parent) if "partial" in n] == [] if os.path.isdir(parent) else True

    # Launched again (the same config: a rerun), on the whole input: complete, nothing twice.
    rows = tmp_path / "rows.jsonl"
    rows.write_text(_samples(300))
    argv2 = ["prepare", "--input", str(rows), "--out", out]
    _launch(workspace, "prep-20261201-114702-0002", argv2, {"kind": "prepare", "config": "chat", "paths": paths, "gpus": {}})
    run_dir2 = os.path.join(workspace, "runs", "prep-20261201-114702-0002")
    assert wait_terminal(run_dir2)["state"] == "completed"
    meta = json.load(open(os.path.join(out, "meta.json")))
    assert meta["samples"] == 300 and meta["tokens"] == 300 * 12
    reply = extract_payload(agent_module("agent.runview", "status", "--workspace", workspace, "--run", "prep-20261201-114702-0002").stdout)
    assert reply["kind"] == "prepare"
    lines = render_status(reply, "200", "sim")
    progress = next(l for l in lines if l.startswith("progress"))
    assert "samples 300, tokens 3,600" in progress and "samples/s" in progress
    assert "(prepare job)" in progress and any(l.startswith("result   completed") for l in lines)


def test_prepare_job_that_fails_names_the_bad_row(tmp_path):
    workspace = str(tmp_path / "ws")
    os.makedirs(workspace)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(_samples(3) + "{not json\n")
    out = os.path.join(workspace, "data", "x")
    _launch(workspace, "prep-bad", ["prepare", "--input", str(rows), "--out", out],
            {"kind": "prepare", "config": "x", "gpus": {}})
    run_dir = os.path.join(workspace, "runs", "prep-bad")
    assert wait_terminal(run_dir)["state"] == "failed"
    reply = extract_payload(agent_module("agent.runview", "status", "--workspace", workspace).stdout)
    failed = next(l for l in render_status(reply, "200", "sim") if l.startswith("FAILED"))
    assert f"{rows}:4: not valid JSON" in failed
    assert not os.path.exists(out)


@contextlib.contextmanager
def _served_target(tmp_path, **proxy_options):
    """`transformers serve` of a tiny chat target behind a real proxy (tests/_regen_target.py); yields the proxy."""
    import subprocess

    from tests._regen_target import Proxy, free_port, make_chat_target, serve_argv, wait_healthy
    from tests.test_regenerate import ENV

    target = make_chat_target(str(tmp_path / "target"))
    port = free_port()
    server = subprocess.Popen(serve_argv(target, port), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proxy = None
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, server)
        proxy = Proxy(url, **proxy_options)
        yield proxy
    finally:
        if proxy is not None:
            proxy.gate.set()
            proxy.close()
        server.terminate()
        server.wait(30)


def _regen_job(tmp_path, proxy, rows: int, settings: str):
    """A workspace, an input of ``rows`` conversations, and a regenerate job's config against ``proxy``."""
    from tests.test_regenerate import conversations, write_input

    workspace = str(tmp_path / "ws")
    os.makedirs(workspace)
    inp = write_input(tmp_path / "in.jsonl", conversations(rows))
    out = os.path.join(workspace, "regen")
    cfg = _config(tmp_path, f'name = "regen"\nkind = "regenerate"\n[regenerate]\ninput = "{inp}"\nout = "{out}"\n'
                            f'endpoint = ["{proxy.url}"]\nmax-tokens = 4\ntemperature = 0\n{settings}', "regen.toml")
    return workspace, inp, out, cfg


def test_regenerate_job_under_the_agent_stopped_mid_run_then_relaunched_every_id_once(tmp_path):
    """A regenerate job (its options from regenerate's own parser) against `transformers
    serve` of a tiny target, held mid-run by a real proxy, stopped through the agent, and the
    same config launched again: every id exactly once, and the accounting in `ctl status`."""
    from tests.test_regenerate import expected_ids, output_rows

    with _served_target(tmp_path, hold_after=6) as proxy:
        workspace, inp, out, cfg = _regen_job(tmp_path, proxy, 16, "concurrency = 2\nflush-rows = 1\n")

        def launch(run_id: str) -> str:
            run_dir = os.path.join(workspace, "runs", run_id)
            values = cfg.resolve(run_id=run_id, run_dir=run_dir, workspace=workspace)
            _launch(workspace, run_id, cfg.argv(values), {"kind": "regenerate", "config": "regen",
                                                          "paths": cfg.paths(values), "gpus": {}})
            return run_dir

        first = launch("regen-20261201-114702-0001")
        assert proxy.held.acquire(timeout=120) and proxy.held.acquire(timeout=60)  # mid-run, both workers held
        stopped = payload("stop", "--workspace", workspace, "--run", "regen-20261201-114702-0001", "--grace", "10")
        assert stopped.get("ok") and wait_terminal(first)["state"] == "stopped"
        before = output_rows(out)
        assert 0 < len(before) < 16
        proxy.gate.set()  # the endpoint answers again

        second = launch("regen-2")
        assert wait_terminal(second, timeout=180)["state"] == "completed"
        ids = [r["id"] for r in output_rows(out)]
        assert len(ids) == len(set(ids)) == 16 and sorted(map(str, ids)) == sorted(map(str, expected_ids(inp)))
        reply = extract_payload(agent_module("agent.runview", "status", "--workspace", workspace).stdout)
        progress = next(l for l in render_status(reply, "200", "sim") if l.startswith("progress"))
        assert "done 16/16 (100 %)" in progress and "(regenerate job)" in progress, progress


def test_regenerate_job_sends_the_api_key_named_by_api_key_env_and_writes_it_nowhere_else(tmp_path):
    """`api-key-env` in a regenerate job's config: the launch reads the variable on the
    operator's machine into the run's root-only secret file; start.sh passes that variable to
    the job, which sends the key to a server that wants it. The key is in no other file."""
    from controller.datalaunch import job_secret
    from tests.test_regenerate import output_rows

    key = "s3cret-7f3a-key"
    # a request without "Authorization: Bearer KEY" gets a 401
    with _served_target(tmp_path, api_key=key) as proxy:
        workspace, _, out, cfg = _regen_job(tmp_path, proxy, 4, 'api-key-env = "REGEN_TEST_KEY"\n')
        with pytest.raises(runconfig.RunConfigError) as unset:
            job_secret(cfg, {})
        assert str(unset.value).startswith("[regenerate] api-key-env = 'REGEN_TEST_KEY': that environment variable "
                                           "is unset or empty on this machine")
        secret = job_secret(cfg, {"REGEN_TEST_KEY": key + "\n"})
        assert secret == (f"REGEN_TEST_KEY={key}\n", ("REGEN_TEST_KEY",))
        run_dir = os.path.join(workspace, "runs", "regen-20261201-114702-0001")
        values = cfg.resolve(run_id="regen-20261201-114702-0001", run_dir=run_dir, workspace=workspace)
        assert "REGEN_TEST_KEY" in cfg.argv(values) and key not in " ".join(cfg.argv(values))
        _launch(workspace, "regen-20261201-114702-0001", cfg.argv(values), {"kind": "regenerate", "config": "regen",
                                                         "paths": cfg.paths(values), "gpus": {}}, secret)
        assert wait_terminal(run_dir, timeout=180)["state"] == "completed"
        assert len(output_rows(out)) == 4
        files = [str(tmp_path / "regen.toml")] + [os.path.join(d, f) for d, _, fs in os.walk(workspace) for f in fs]
        holders = [os.path.relpath(p, workspace) for p in files if key.encode() in open(p, "rb").read()]
        # the 0600 secret file only: not the run config, start.sh, the record, events or logs
        assert holders == [os.path.join("secrets", "regen-20261201-114702-0001.env")]
        assert os.stat(os.path.join(workspace, "secrets", "regen-20261201-114702-0001.env")).st_mode & 0o077 == 0


def test_a_regenerate_job_with_failed_rows_ends_in_its_own_words_not_a_training_ranks(tmp_path):
    """A regenerate job whose rows failed ended as "rank 0 (pid …) exited with code 1",
    training's wording. The job now says its failure as an error event (rows failed, of how
    many, where they are listed, the first error) and the agent names the run's failure with it."""
    with _served_target(tmp_path, fail=lambda n, body: 400 if "question 1" in json.dumps(body) else None) as proxy:
        workspace, inp, out, cfg = _regen_job(tmp_path, proxy, 4, "max-attempts = 1\n")
        run_id = "regen-20261201-114702-0003"
        run_dir = os.path.join(workspace, "runs", run_id)
        values = cfg.resolve(run_id=run_id, run_dir=run_dir, workspace=workspace)
        _launch(workspace, run_id, cfg.argv(values), {"kind": "regenerate", "config": "regen",
                                                       "paths": cfg.paths(values), "gpus": {}})
        res = wait_terminal(run_dir, timeout=180)
    assert res["state"] == "failed" and res["root_cause"]["kind"] == "rows_failed", res
    assert res["reason"].startswith(f"regenerate: 1 of 4 rows failed (listed in {out}/failures.jsonl; launch the "
                                    "same config again to retry them); first: "), res["reason"]
    assert "HTTP 400" in res["reason"] and "rank 0" not in res["reason"], res["reason"]
    reply = extract_payload(agent_module("agent.runview", "status", "--workspace", workspace, "--run", run_id).stdout)
    lines = render_status(reply, "200", "sim")
    assert any(line.startswith("FAILED   rows_failed: regenerate: 1 of 4 rows failed") for line in lines), lines
