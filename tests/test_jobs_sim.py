"""Jobs of every kind through `ctl` on the simulated node: a
prepare job and a training run launched, tailed, stopped and resumed in container 200, one
agent supervising both; a training launch on the prepared data gets the data-drift verdict
against the known-good run of its config.

- prepare reads a FIFO fed from inside the container, so it is mid-run for as long as the
  test wants (no timing): `ctl status` shows its progress, `ctl tail` its status line; a
  training launch onto the directory it writes is refused (a path it shares), and the GPU
  slot it does not hold is no obstacle; `ctl stop` → state stopped, nothing partial left;
  the same config launched again completes with every sample once.
- training: a run on the tiny data becomes known good; a launch on the prepared (longer,
  more loss tokens) data is refused with the drift named; with --accept-drift it starts, is
  stopped after a checkpoint and resumed with --resume-from to the end.
- regenerate: its [regenerate] serve starts `transformers serve` of a tiny chat target made
  in the container (tests/_regen_target.py) behind that file's Proxy, which holds requests
  after the 6th until a gate file exists (mid-run, no timing); `ctl tail` shows the server
  healthy and the progress, `ctl stop` → stopped; the relaunch asks only the rest and ends
  with every id once and done + failed + skipped = input.

Every run here is this module's (names ``jobs-…``) and is removed at the end.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from _multi_sim import attach
from tests._agent_util import wait_for

pytestmark = [pytest.mark.sim, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
CTL = [sys.executable, "-c", "from controller.cli import main; main()"]  # this worktree's code (cwd first on sys.path)
CT = 200
BASE = "/workspace/jobs-sim"
FIFO = f"{BASE}/rows.fifo"
OUT = f"{BASE}/long"
N_ROWS, LENGTH, LOSS = 120, 200, 190  # longer than the tiny data, 95 % loss tokens


def ctl(env, *args, timeout=600):
    import subprocess

    return subprocess.run(CTL + [str(a) for a in args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def env(ctl_config, sim_node, tmp_path_factory):
    from controller import config as cfg
    from controller.container import Container
    from controller.provision import provision_tiny
    from controller.session import open_runner

    e = dict(os.environ, DFLASH_CTL_CONFIG=str(ctl_config), DFLASH_CTL_SSH_CONFIG="none", COLUMNS="200")
    name, conf = cfg.load(str(ctl_config)).node()
    with open_runner(name, conf) as runner:
        provision_tiny(Container(runner, name, conf, CT))
    d = tmp_path_factory.mktemp("jobs")
    (d / "prep.toml").write_text(f'name = "jobs-prep"\nkind = "prepare"\n[prepare]\ninput = ["{FIFO}"]\n'
                                 f'out = "{OUT}"\nprogress-every = 0\n')
    (d / "train.toml").write_text((REPO / "examples" / "tiny.toml").read_text()
                                  .replace('name = "tiny"', 'name = "jobs-train"')
                                  .replace("steady-steps = 5", "steady-steps = 3")
                                  .replace("throughput-tolerance = 0.5", "throughput-tolerance = 1.0"))
    e["JOBS_DIR"] = str(d)
    rows = "".join(json.dumps({"input_ids": [(i * 31 + j) % 500 + 1 for j in range(LENGTH)],
                               "loss_mask": [0] * (LENGTH - LOSS) + [1] * LOSS}) + "\n" for i in range(N_ROWS))
    _write(sim_node, f"{BASE}/rows.jsonl", rows)
    yield e
    attach(sim_node, CT, "sh", "-c", f"cat {BASE}/feeder.pid 2>/dev/null | xargs -r kill; "
           "rm -rf /workspace/runs/jobs-* /workspace/.dflash-ctl/launches/jobs-* " + BASE, check=False)


def _write(node, path: str, text: str) -> None:
    import subprocess

    proc = subprocess.run(["lxc-attach", "-P", str(node.paths.lxcpath), "-n", str(CT), "--clear-env", "--", "sh", "-c",
                           f"rm -rf {BASE} && mkdir -p {BASE} && cat > {path} && mkfifo {FIFO}"],
                          input=text, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def _feed(node, hold: bool) -> None:
    """Rows into the FIFO from inside the container; ``hold`` keeps it open afterwards (the job
    waits for more: mid-run for as long as the test wants)."""
    tail = "; exec sleep 600" if hold else ""
    # the FIFO is opened inside the child (it blocks there until prepare opens it), whose
    # inherited output is /dev/null: lxc-attach waits for nothing of it
    attach(node, CT, "sh", "-c", f"setsid sh -c 'exec > {FIFO}; cat {BASE}/rows.jsonl{tail}' "
           f"< /dev/null > /dev/null 2>&1 & echo $! > {BASE}/feeder.pid")


def _run_id(proc) -> str:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return re.search(r"(?:job|run) (jobs-\S+) started", proc.stdout).group(1)


def test_prepare_job_launched_tailed_stopped_and_resumed(env, sim_node):
    prep = f"{env['JOBS_DIR']}/prep.toml"
    _feed(sim_node, hold=True)
    run = _run_id(ctl(env, "launch", "--container", CT, "--config", prep))
    def progress():
        out = ctl(env, "status", "--container", CT, "--run", run).stdout
        return out if "progress samples" in out else None

    status = wait_for(progress, timeout=120, what="the prepare job's progress")
    assert "state    running" in status and "(prepare job)" in status and "samples/s" in status, status
    tail = ctl(env, "tail", "--container", CT, "--run", run)
    assert tail.returncode == 0 and "-- samples" in tail.stdout, tail.stdout + tail.stderr

    # A training run onto what the live prepare job writes is refused, naming it; the rank
    # slot the training run wants is not the data job's (it holds none).
    clash = ctl(env, "launch", "--container", CT, "--config", f"{env['JOBS_DIR']}/train.toml", "--from-scratch",
                "--data-dir", OUT)
    assert clash.returncode == 3, clash.stdout + clash.stderr
    assert f"run {run} (prepare, running) writes {OUT}" in clash.stderr
    assert "rank slot" not in clash.stderr

    stopped = ctl(env, "stop", "--container", CT, "--run", run, "--grace", "20")
    assert stopped.returncode == 0 and "state    stopped" in stopped.stdout, stopped.stdout + stopped.stderr
    left = attach(sim_node, CT, "sh", "-c", f"ls -a {BASE}").stdout.split()
    assert "long" not in left and not [n for n in left if "partial" in n], left

    # The same config again: a rerun, to the end; every sample exactly once. The first feeder
    # goes first: a writer still holding the FIFO open would keep the rerun from its end.
    attach(sim_node, CT, "sh", "-c", f"kill $(cat {BASE}/feeder.pid)")
    _feed(sim_node, hold=False)
    again = _run_id(ctl(env, "launch", "--container", CT, "--config", prep, "--follow"))
    meta = json.loads(attach(sim_node, CT, "cat", f"{OUT}/meta.json").stdout)
    assert meta["samples"] == N_ROWS and meta["tokens"] == N_ROWS * LENGTH
    done = ctl(env, "status", "--container", CT, "--run", again).stdout
    assert "result   completed" in done and f"samples {N_ROWS}," in done


def test_training_on_the_prepared_data_gets_the_drift_verdict_then_stops_and_resumes(env, sim_node):
    train = f"{env['JOBS_DIR']}/train.toml"
    good = ctl(env, "launch", "--container", CT, "--config", train, "--from-scratch", "--set", "max-steps=10",
               "--follow")
    assert good.returncode == 0, good.stdout[-3000:] + good.stderr
    refused = ctl(env, "launch", "--container", CT, "--config", train, "--from-scratch", "--data-dir", OUT)
    assert refused.returncode == 3, refused.stdout + refused.stderr
    text = refused.stdout + refused.stderr
    assert "drift against the known-good baseline" in text and "data mean length" in text, text
    assert "data loss tokens" in text or "loss-token" in text or "loss tokens" in text

    run = _run_id(ctl(env, "launch", "--container", CT, "--config", train, "--from-scratch", "--data-dir", OUT,
                      "--accept-drift", "--set", "max-steps=400", "--set", "save-interval=4"))
    wait_for(lambda: "ckpt     step" in ctl(env, "status", "--container", CT, "--run", run).stdout,
             timeout=300, what="a checkpoint")
    stopped = ctl(env, "stop", "--container", CT, "--run", run, "--grace", "60")
    assert "state    stopped" in stopped.stdout, stopped.stdout + stopped.stderr
    ckpt = re.search(r"ckpt     step (\d+): (\S+)", stopped.stdout)
    step = int(ckpt.group(1))
    resumed = ctl(env, "launch", "--container", CT, "--config", train, "--resume-from", ckpt.group(2),
                  "--data-dir", OUT, "--accept-drift", "--set", f"max-steps={step + 4}", "--set", "save-interval=4",
                  "--follow")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr
    assert "ckpt     " + os.path.dirname(ckpt.group(2)).rstrip("/") in resumed.stdout or \
        "ckpt     " + ckpt.group(2) in resumed.stdout, resumed.stdout  # the preflight read the checkpoint
    end = ctl(env, "status", "--container", CT, "--run", _run_id(resumed)).stdout
    assert "result   completed" in end, end


REGEN = f"{BASE}/regen"
N_CONV, HOLD_AFTER = 24, 6
SERVE_PORT, GATE_PORT = 18732, 18731  # the container's own loopback (its network is empty)
# The job's --serve: `transformers serve` of the tiny chat target behind tests/_regen_target.py's
# Proxy, which holds every request after the HOLD_AFTER-th until the gate file exists — the
# job is mid-run for as long as the test wants. One process group: regenerate stops both.
GATE_MAIN = """import os, signal, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _regen_target import Proxy
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
proxy = Proxy(sys.argv[1], hold_after=int(sys.argv[4]), port=int(sys.argv[2]))
while not os.path.exists(sys.argv[3]):
    time.sleep(0.1)
proxy.gate.set()
signal.pause()
"""


def _put(ct, path: str, text: str) -> None:
    """A file into the container through the product's own exec (stdin), written atomically."""
    import shlex

    q = shlex.quote(path)
    ct.exec(["sh", "-c", f"mkdir -p $(dirname {q}) && cat > {q}.tmp && mv {q}.tmp {q}"], stdin=text.encode(),
            check=True)


@pytest.fixture(scope="module")
def regen_config(env, ctl_config):
    """The tiny chat target made inside container 200 by tests/_regen_target.py (its trainer.synth.tiny
    from the agent bundle), the gate, the input, and the job's config."""
    from controller import config as cfg
    from controller.agentcall import AgentCaller
    from controller.container import Container
    from controller.session import open_runner

    name, conf = cfg.load(str(ctl_config)).node()
    with open_runner(name, conf) as runner:
        ct = Container(runner, name, conf, CT)
        _put(ct, f"{REGEN}/_regen_target.py", (REPO / "tests" / "_regen_target.py").read_text())
        _put(ct, f"{REGEN}/gate.py", GATE_MAIN)
        rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"question {i}"},
                                             {"role": "assistant", "content": "DATASET ANSWER"}]} for i in range(N_CONV)]
        _put(ct, f"{REGEN}/in.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        caller = AgentCaller(ct)
        made = ct.exec([caller.python, "-c", f"import sys; sys.path.insert(0, {REGEN!r}); "
                        f"from _regen_target import make_chat_target; make_chat_target({REGEN + '/target'!r})"],
                       env=caller.env(), timeout=300)
        assert made.ok, made.stderr[-2000:]
    serve = (f"sh -c '/root/venv/bin/transformers serve {REGEN}/target --host 127.0.0.1 --port {SERVE_PORT} "
             f"--device cpu --dtype float32 & exec /root/venv/bin/python {REGEN}/gate.py "
             f"http://127.0.0.1:{SERVE_PORT} {GATE_PORT} {REGEN}/open {HOLD_AFTER}'")
    path = Path(env["JOBS_DIR"]) / "regen.toml"
    path.write_text(f'name = "jobs-regen"\nkind = "regenerate"\n[regenerate]\ninput = "{REGEN}/in.jsonl"\n'
                    f'out = "{REGEN}/out"\nendpoint = ["http://127.0.0.1:{GATE_PORT}"]\nmax-tokens = 4\n'
                    f'temperature = 0\nconcurrency = 2\nflush-rows = 1\nprogress-s = 0.2\n'
                    f'serve = {json.dumps(serve)}\n')
    return str(path)


def test_regenerate_job_with_its_server_launched_tailed_stopped_and_resumed(env, regen_config):
    run = _run_id(ctl(env, "launch", "--container", CT, "--config", regen_config))

    def held():  # both workers wait at the gate: HOLD_AFTER answered, none after
        out = ctl(env, "status", "--container", CT, "--run", run).stdout
        return out if f"done {HOLD_AFTER}/{N_CONV}" in out else None

    status = wait_for(held, timeout=240, what="the regenerate job held mid-run")
    assert "state    running" in status and "(regenerate job)" in status, status
    tail = ctl(env, "tail", "--container", CT, "--run", run)
    assert tail.returncode == 0 and "the server is healthy" in tail.stdout, tail.stdout + tail.stderr
    assert f"done {HOLD_AFTER}" in tail.stdout or f"{HOLD_AFTER}/{N_CONV}" in tail.stdout, tail.stdout

    stopped = ctl(env, "stop", "--container", CT, "--run", run, "--grace", "20")
    assert stopped.returncode == 0 and "state    stopped" in stopped.stdout, stopped.stdout + stopped.stderr
    ctl(env, "exec", "--container", CT, "--", "touch", f"{REGEN}/open")  # the endpoint answers again

    again = ctl(env, "launch", "--container", CT, "--config", regen_config, "--follow")
    done = ctl(env, "status", "--container", CT, "--run", _run_id(again)).stdout
    assert "result   completed" in done and f"done {N_CONV}/{N_CONV}" in done, again.stdout[-3000:] + done
    out = ctl(env, "exec", "--container", CT, "--", "cat", f"{REGEN}/out/regenerated.jsonl")
    ids = [json.loads(line)["id"] for line in out.stdout.splitlines() if line.startswith("{")]
    assert sorted(ids) == sorted(f"c{i}" for i in range(N_CONV)), ids  # every id exactly once
    manifest = ctl(env, "exec", "--container", CT, "--", "cat", f"{REGEN}/out/regenerate.json").stdout
    summary = json.loads(manifest[manifest.index("{"):])
    s = summary["summary"]
    assert s["adds_up"] and s["done"] + s["failed"] + s["skipped"] == s["total"] == N_CONV, s
    assert s["requests"] == N_CONV - HOLD_AFTER, s  # resumed: the rows done before the stop were not asked again
