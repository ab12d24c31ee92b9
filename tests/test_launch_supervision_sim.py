"""Supervision that never leaves a run alone, in the simulated node's containers,
through `ctl` as the operator runs it:

- the seed's layout, 5 target + 3 drafter ranks on CPU rank slots in one container, through
  `ctl launch … --follow` to completion; then, with `kill -9` of one drafter rank, the run
  stops within 10 s and `ctl status` names that rank and its slot first;
- a run whose ranks never start (its rendezvous container unreachable) fails at the start-up
  deadline, naming the ranks, the rendezvous address and their last lines;
- `kill -9` of the agent during a following `ctl tail`: supervision is back within seconds,
  the tail goes on, no record is lost or repeated, and a rank failure after it is classified;
- a second launch onto busy rank slots is refused (exit 3, one line, nothing started); with
  `--share-gpus` it starts.

Containers: 200 (and 201 for the two-container job). Every run here is this module's (config
name ``supervise``) and is removed at the end; nothing of it may be left running.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from _multi_sim import attach
from tests._agent_util import wait_for

pytestmark = [pytest.mark.sim, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
CTL = [str(Path(sys.executable).with_name("ctl"))]
CT = 200
WS = "/workspace"
NAME = "supervise"
SEED = ["--target-gpus", "0,1,2,3,4", "--drafter-gpus", "5,6,7"]  # the seed's layout, on rank slots
# On CPU 8 ranks share the machine's cores: keep the step tiny.
SMALL = ["--set", "token-budget=256", "--set", "max-seq-len=128", "--set", "max-batch-size=2", "--set",
         "max-anchors=4", "--set", "save-interval=100000", "--set", "log-interval=1"]


@pytest.fixture(scope="module")
def env(ctl_config, tmp_path_factory):
    config = tmp_path_factory.mktemp("supervise") / f"{NAME}.toml"
    config.write_text((REPO / "examples" / "tiny.toml").read_text().replace('name = "tiny"', f'name = "{NAME}"'))
    e = dict(os.environ, DFLASH_CTL_CONFIG=str(ctl_config), DFLASH_CTL_SSH_CONFIG="none", COLUMNS="200")
    e["SUPERVISE_CONFIG"] = str(config)
    return e


@pytest.fixture(scope="module")
def node(sim_node, env):
    """Container 200 (and 201) with /workspace/tiny; at the end every run of ours is stopped
    and removed from both."""
    from controller import config as cfg
    from controller.container import Container
    from controller.provision import provision_tiny
    from controller.session import open_runner

    name, conf = cfg.load(env["DFLASH_CTL_CONFIG"]).node()
    with open_runner(name, conf) as runner:
        for ct in (200, 201):
            provision_tiny(Container(runner, name, conf, ct))
    yield sim_node
    for ct in (200, 201):
        attach(sim_node, ct, "python3", "-c", CLEANUP, f"{WS}/runs/{NAME}-", check=False)


# Teardown inside a container: kill (by pid) every process of this module's runs — their
# marker in the environment, or their run directory on the command line (a revived agent
# carries no marker) — then remove the runs and their launch records.
CLEANUP = """
import glob, os, shutil, signal, sys
prefix = sys.argv[1].encode()
for p in os.listdir('/proc'):
    if not p.isdigit() or int(p) == os.getpid():
        continue
    try:
        env = open(f'/proc/{p}/environ', 'rb').read(); cmd = open(f'/proc/{p}/cmdline', 'rb').read()
    except OSError:
        continue
    if b'DFLASH_RUN_DIR=' + prefix in env or prefix in cmd:
        try:
            os.kill(int(p), signal.SIGKILL)
        except OSError:
            pass
for d in glob.glob(sys.argv[1] + '*'):
    shutil.rmtree(d, ignore_errors=True)
    run = os.path.basename(d)
    for f in glob.glob(f'/workspace/.dflash-ctl/launches/{run}.json'):
        os.unlink(f)
"""


def ctl(env, *args, timeout=900, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(CTL + [str(a) for a in args], env=env, capture_output=True, text=True, timeout=timeout,
                          **kw)


def launch(env, *args) -> str:
    p = ctl(env, "launch", "--container", CT, "--config", env["SUPERVISE_CONFIG"], "--from-scratch", "--json",
            *args)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])["run_id"]


def doc(node, run_id: str, name: str, ct: int = CT) -> dict:
    p = attach(node, ct, "cat", f"{WS}/runs/{run_id}/{name}", check=False)
    try:
        return json.loads(p.stdout)
    except ValueError:
        return {}


def wait(predicate, timeout: float, what: str):
    return wait_for(predicate, timeout, interval=0.2, what=what)


def runs(node, ct: int = CT) -> list[str]:
    out = attach(node, ct, "sh", "-c", f"ls -1 {WS}/runs 2>/dev/null || true").stdout.split()
    return sorted(r for r in out if r.startswith(f"{NAME}-"))


def stop(node, run_id: str, ct: int = CT) -> None:
    """The run's agent stops it (agent stop, with the bundle this checkout uploaded)."""
    bundles = attach(node, ct, "sh", "-c", f"ls -1dt {WS}/.dflash-ctl/bundles/*/ | head -1").stdout.strip()
    attach(node, ct, "env", f"PYTHONPATH={bundles}", "/root/venv/bin/python3", "-m", "agent", "stop", "--run", run_id,
           "--workspace", WS, "--grace", "10", timeout=120, check=False)


# --- the seed's layout ---------------------------------------------------------------------------

def test_the_seeds_layout_5_target_and_3_drafter_ranks_in_one_container_runs_to_completion(node, env):
    p = ctl(env, "launch", "--container", CT, "--config", env["SUPERVISE_CONFIG"], "--from-scratch", *SEED, *SMALL,
            "--set", "max-steps=3", "--follow")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert re.search(r"ctl: run \S+ completed", p.stdout + p.stderr)
    run_id = re.search(r"run (\S+) started in", p.stdout).group(1)
    st = doc(node, run_id, "status.json")
    assert st["state"] == "completed" and st["step"] == 3
    assert {r: (h["role"], h["gpu"], h["health"]) for r, h in st["ranks"].items()} == {
        **{str(i): ("target", i, "done") for i in range(5)}, **{str(i): ("drafter", i, "done") for i in (5, 6, 7)}}
    assert st["launch"]["rdzv_endpoint"].startswith("127.0.0.1:")  # never a name that has to resolve


def test_a_split_run_starts_in_a_container_where_no_name_resolves(node, env):
    # A 2-rank run once hung at start in a container without /etc/hosts (torchrun's
    # --standalone rendezvous on `localhost`, then on the hostname). The trainer's own
    # rendezvous now uses 127.0.0.1 and a port, and gloo the loopback interface.
    attach(node, CT, "mv", "/etc/hosts", "/etc/hosts.supervise-test")
    try:
        probe = attach(node, CT, "python3", "-c", "import socket; socket.gethostbyname('localhost')", check=False)
        assert probe.returncode != 0, "localhost still resolves: the test would prove nothing"
        p = ctl(env, "launch", "--container", CT, "--config", env["SUPERVISE_CONFIG"], "--from-scratch",
                "--target-gpus", "0", "--drafter-gpus", "1", *SMALL, "--set", "max-steps=2",
                "--set", "supervision.startup-timeout=120", "--follow", timeout=600)
    finally:
        attach(node, CT, "mv", "/etc/hosts.supervise-test", "/etc/hosts")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


def test_kill9_of_a_drafter_rank_stops_the_seeds_layout_within_10s_and_status_names_it_first(node, env):
    run_id = launch(env, *SEED, *SMALL, "--set", "epochs=50", "--set", "max-steps=100000")
    st = wait(lambda: (s := doc(node, run_id, "status.json")) and len(s.get("ranks") or {}) == 8
              and all((h.get("step") or 0) >= 1 for h in s["ranks"].values()) and s, 600, "8 ranks training")
    victim = st["ranks"]["6"]
    assert victim["role"] == "drafter" and victim["gpu"] == 6
    killed_at = time.time()
    attach(node, CT, "kill", "-9", str(victim["pid"]))
    res = wait(lambda: doc(node, run_id, "result.json"), 120, "the run to end")
    assert res["state"] == "failed"
    timeline = [(round(r["ts"] - killed_at, 2), r["payload"].get("kind"), r["payload"].get("reason") or "")
                for r in map(json.loads, attach(node, CT, "cat", f"{WS}/runs/{run_id}/stream.jsonl").stdout.splitlines())
                if r["kind"] == "event" and str(r["payload"].get("kind", "")).startswith("agent.")]
    assert res["ended"] - killed_at < 10, (f"stopped {res['ended'] - killed_at:.1f} s after the kill: {timeline} "
                                           f"{res['stop']}")
    assert res["root_cause"]["rank"] == 6 and res["root_cause"]["gpu"] == 6, res["root_cause"]
    assert res["stop"]["survivors"] == []
    out = ctl(env, "status", "--container", CT, "--run", run_id)
    lines = out.stdout.splitlines()
    assert lines[1].startswith("FAILED   ") and "rank 6 " in lines[1] and "rank slot 6" in lines[1], out.stdout


# --- a start that never happens --------------------------------------------------------------------

def test_a_run_whose_ranks_never_start_fails_at_the_deadline_naming_them_and_the_rendezvous(node, env):
    from sim import net

    # A job of two containers whose rendezvous container (201, node rank 0) cannot be reached:
    # neither side's ranks ever start (torchrun waits for the other node in the rendezvous).
    table = (f'\n[[job.containers]]\ncontainer = "sim:201"\ntarget-gpus = [0]\n'
             f'[[job.containers]]\ncontainer = "sim:200"\ndrafter-gpus = [0]\n')
    config = Path(env["SUPERVISE_CONFIG"]).with_name("never.toml")
    config.write_text(Path(env["SUPERVISE_CONFIG"]).read_text() + table)
    address = net.address_of("sim", 201)
    net.set_link(address, up=False)
    try:
        p = ctl(env, "launch", "--config", config, "--from-scratch", "--set", "supervision.startup-timeout=45",
                "--json")
        assert p.returncode == 0, p.stdout + p.stderr
        run_id = json.loads(p.stdout.strip().splitlines()[-1])["run_id"]
        res = wait(lambda: doc(node, run_id, "result.json"), 300, "the drafter container's run to fail")
    finally:
        net.set_link(address, up=True)
    cause = res["root_cause"]
    assert cause["kind"] == "startup_timeout" and cause["rank"] == 1, cause
    assert res["reason"].startswith("start-up deadline: rank 1 (drafter on rank slot 0) sent no heartbeat within "
                                    "45 s of the start (--startup-timeout); rendezvous "
                                    f"{address}:"), res["reason"]
    assert cause["evidence"], "the last lines of the container's output"
    out = ctl(env, "status", "--container", CT, "--run", run_id)
    assert "start-up deadline" in out.stdout and f"rendezvous {address}:" in out.stdout, out.stdout
    assert "         | " in out.stdout  # its last output lines, under the reason
    wait(lambda: doc(node, run_id, "result.json", ct=201), 120, "the rendezvous container's run to end too")


# --- a dead agent ------------------------------------------------------------------------------------

def test_kill9_of_the_agent_during_a_following_tail_supervision_comes_back_and_nothing_is_lost(node, env):
    run_id = launch(env, "--target-gpus", "0", "--drafter-gpus", "1", *SMALL, "--set", "epochs=50",
                    "--set", "max-steps=100000")
    tail = subprocess.Popen(CTL + ["tail", "--container", str(CT), "--run", run_id, "--follow", "--json"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(tail.stdout), daemon=True)
    reader.start()
    try:
        wait(lambda: len(lines) > 20, 300, "the tail to show records")
        before = doc(node, run_id, "status.json")
        attach(node, CT, "kill", "-9", str(before["agent_pid"]))
        killed_at = time.monotonic()
        back = wait(lambda: (s := doc(node, run_id, "status.json")).get("agent_pid") not in (None, before["agent_pid"])
                    and s.get("reattaches") and s, 60, "a new agent")
        assert time.monotonic() - killed_at < 30  # "within seconds" (a generous bound for a loaded machine)
        assert back["reattaches"][-1]["by"].startswith("the job's monitor")
        n = len(lines)
        wait(lambda: len(lines) > n + 10, 120, "the tail to go on after the new agent took over")
        drafter = wait(lambda: doc(node, run_id, "status.json")["ranks"].get("1"), 60, "drafter rank 1")
        attach(node, CT, "kill", "-9", str(drafter["pid"]))
        tail.wait(timeout=300)
    finally:
        tail.kill()
    reader.join(10)
    assert tail.returncode == 1, tail.stderr.read()  # the followed run failed
    seqs = [json.loads(line)["seq"] for line in lines]
    stream = attach(node, CT, "cat", f"{WS}/runs/{run_id}/stream.jsonl").stdout.splitlines()
    assert seqs == list(range(1, len(stream) + 1)), "a record lost or repeated"
    res = doc(node, run_id, "result.json")
    assert res["root_cause"]["rank"] == 1 and res["root_cause"]["kind"] in ("host_oom", "rank_exit"), res
    out = ctl(env, "status", "--container", CT, "--run", run_id).stdout
    assert "re-attached: last at" in out and "by the job's monitor" in out, out


# --- a busy GPU --------------------------------------------------------------------------------------

def test_a_second_launch_onto_busy_rank_slots_is_refused_and_with_share_gpus_it_starts(node, env):
    first = launch(env, "--target-gpus", "0", "--drafter-gpus", "0", *SMALL, "--set", "epochs=50",
                   "--set", "max-steps=100000")
    try:
        wait(lambda: doc(node, first, "status.json").get("state") == "running", 120, "the first run")
        before = runs(node)
        p = ctl(env, "launch", "--container", CT, "--config", env["SUPERVISE_CONFIG"], "--from-scratch",
                "--target-gpus", "0", "--drafter-gpus", "0", *SMALL)
        assert p.returncode == 3, p.stdout + p.stderr
        named = [line for line in p.stderr.splitlines() if f"run {first} is live" in line]
        assert len(named) == 1 and "rank slot 0" in named[0] and "--share-gpus" in named[0], p.stderr
        assert runs(node) == before  # nothing started, no run directory
        second = launch(env, "--target-gpus", "0", "--drafter-gpus", "0", *SMALL, "--set", "max-steps=2",
                        "--share-gpus")
        assert second not in before and doc(node, second, "spec.json")
        wait(lambda: doc(node, second, "result.json"), 300, "the shared run to end")
        assert doc(node, second, "result.json")["state"] == "completed"
    finally:
        stop(node, first)
