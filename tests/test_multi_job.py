"""One job across containers and nodes, end to end through the simulated nodes: `ctl launch`
with several ``--container NODE:CTID``, the real trainer on CPU/gloo under torchrun's static
rendezvous over the sim network (sim/net.py), each container's own agent.

- target rank in one container, drafter rank in another of the same node (sim2: 300 → 301),
  and across nodes (sim:200 → sim2:301): the loss trajectory equals the single-container
  colocated run of the same seed in 200 (tolerance of tests/test_trainer_topology.py);
- kill -9 of the drafter rank in 301 stops the target rank in 300 within the timeout; the job
  status names rank 1 in container sim2:301 as the root cause and 300's failure as a peer
  failure;
- cutting 300's link (job sim:200 → sim2:300) fails the job with a network failure at
  --dist-timeout, not a hang.

Container 201 is left out on purpose: tests/test_launch_sim.py's teardown deletes every run
in 201 that it did not see before, which would remove a concurrent job's run directory.

`ctl` runs as the operator runs it, in a subprocess (DFLASH_CTL_CONFIG: both nodes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _multi_sim import attach, sim2_node  # noqa: F401 (fixture)

pytestmark = [pytest.mark.sim, pytest.mark.slow]

CTL = [str(Path(sys.executable).with_name("ctl"))]
TINY = "/workspace/tiny-job"  # provisioned here by this module with this checkout's trainer
STEPS = 6

CONFIG = f"""
name = "multi"
[trainer]
target-model = "{TINY}/target"
data-dir = "{TINY}/data"
target-gpus = [0]
drafter-gpus = [0]
device = "cpu"
epochs = 2
max-steps = {STEPS}
grad-accum = 1
lr = 3e-3
warmup-ratio = 0.1
token-budget = 512
max-seq-len = 256
max-batch-size = 8
block-size = 8
max-anchors = 16
num-draft-layers = 1
save-interval = 1000
log-interval = 1
dist-timeout = 20
[wandb]
mode = "disabled"
[baseline]
regression-fraction = 0
"""


JOB_TABLE = """
[[job.containers]]
container = "sim2:301"
drafter-gpus = [0]
[[job.containers]]
container = "sim:200"
target-gpus = [0]
"""


def MEMBERS(sim_node, sim2_node):
    return ((sim_node, 200), (sim2_node, 300), (sim2_node, 301))


@pytest.fixture(scope="module")
def env(sim_node, sim2_node, tmp_path_factory):
    from controller import config as cfg

    tmp = tmp_path_factory.mktemp("multi")
    nodes = {}
    for n in (sim_node, sim2_node):
        e = n.node_config()
        nodes[n.name] = cfg.NodeConfig(host=e["host"], port=e["port"], user=e["user"], identity_file=e["identity_file"],
                                       known_hosts=e["known_hosts"],
                                       containers={k: cfg.ContainerConfig(**v) for k, v in e["containers"].items()})
    path = tmp / "config.toml"
    cfg.save(cfg.Config(default_node="sim", nodes=nodes), path)
    run_config = tmp / "multi.toml"
    run_config.write_text(CONFIG)
    # the same, with the job's containers in the file ([[job.containers]], any order)
    (tmp / "multi-job.toml").write_text(CONFIG + JOB_TABLE)
    e = dict(os.environ, DFLASH_CTL_CONFIG=str(path), DFLASH_CTL_SSH_CONFIG="none", COLUMNS="200")
    # The same tiny target and data in every container, made by this checkout's trainer.
    for n, ctid in MEMBERS(sim_node, sim2_node):
        p = ctl(e, "exec", "-n", n.name, "-c", ctid, "--", "rm", "-rf", TINY)
        assert p.returncode == 0, p.stderr
    from controller.container import Container
    from controller.session import open_runner

    conf = cfg.load(path)
    prints = set()
    for name, ctids in (("sim", (200,)), ("sim2", (300, 301))):
        with open_runner(name, conf.nodes[name]) as runner:
            for ctid in ctids:
                ct = Container(runner, name, conf.nodes[name], ctid)
                _provision(ct)
                prints.add(json.loads(ct.exec(["cat", f"{TINY}/data/meta.json"]).stdout)["fingerprint"])
    assert len(prints) == 1  # the same data everywhere (keyed randomness needs it)
    yield {"env": e, "config": str(run_config), "tmp": tmp}
    for n, ctid in MEMBERS(sim_node, sim2_node):
        ctl(e, "exec", "-n", n.name, "-c", ctid, "--", "rm", "-rf", TINY)


def _provision(ct) -> None:
    from controller.agentcall import AgentCaller

    res = AgentCaller(ct).run("trainer", ["tiny", "--out", TINY, "--seed", "0", "--samples", "96"], timeout=900)
    assert res.ok, res.tail("stderr", 10)


def ctl(env, *args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(CTL + [str(a) for a in args], env=env, capture_output=True, text=True, timeout=timeout)


def launch_job(env, *args, config=None) -> str:
    p = ctl(env["env"], "launch", "--config", config or env["config"], "--from-scratch", "--json", *args)
    assert p.returncode == 0, p.stderr + p.stdout
    return json.loads(p.stdout.strip().splitlines()[-1])["run_id"]


def job_status(env, run_id) -> dict:
    p = ctl(env["env"], "status", "--run", run_id, "--json")
    assert p.returncode in (0, 1), p.stderr  # 1: the job failed (controller/exitcodes.py)
    return json.loads(p.stdout)


def wait_job(env, run_id, done, timeout=300) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = job_status(env, run_id)
        if done(st) or time.monotonic() > deadline:
            return st
        time.sleep(1)


def terminal(st) -> bool:
    return all(((r.get("status") or {}).get("state") in ("completed", "failed", "stopped"))
               for r in st["containers"].values())


def steps_of(node, ctid, run_id) -> list[dict]:
    out = attach(node, ctid, "cat", f"/workspace/runs/{run_id}/events.jsonl").stdout
    return [e for e in map(json.loads, out.splitlines()) if e["kind"] == "step"]


def heartbeat(node, ctid, run_id, rank) -> dict:
    p = attach(node, ctid, "cat", f"/workspace/runs/{run_id}/heartbeat/rank-{rank}", check=False)
    return json.loads(p.stdout) if p.returncode == 0 and p.stdout.strip() else {}


def wait_for_step(node, ctid, run_id, rank, step, timeout=300) -> None:
    """Until rank ``rank``'s heartbeat in ``ctid`` reports ``step`` (the job is training)."""
    deadline = time.monotonic() + timeout
    while (heartbeat(node, ctid, run_id, rank).get("step") or 0) < step:
        assert time.monotonic() < deadline, f"the job never reached step {step}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def colocated(env, sim_node):
    """The reference: one colocated rank in container 200, same config and seed."""
    run_id = launch_job(env, "-c", "200")
    p = ctl(env["env"], "tail", "-c", "200", "--run", run_id, "--follow")
    assert p.returncode == 0, p.stderr[-3000:]
    return steps_of(sim_node, 200, run_id)


@pytest.mark.parametrize("target,drafter", [("sim2:300", "sim2:301"), ("sim:200", "sim2:301")],
                         ids=["one-node", "two-nodes"])
def test_target_and_drafter_in_two_containers_follow_the_colocated_trajectory(env, colocated, sim_node, sim2_node,
                                                                              target, drafter):
    if target == "sim:200":  # across nodes: the containers come from the run config's [[job.containers]]
        run_id = launch_job(env, config=str(env["tmp"] / "multi-job.toml"))
    else:  # given drafter-first on the command line: ctl puts targets first
        run_id = launch_job(env, "-c", drafter, "-c", target, "--target-gpus", f"{target}=0",
                            "--drafter-gpus", f"{drafter}=0")
    st = wait_job(env, run_id, terminal)
    assert st["job"]["state"] == "completed", json.dumps(st["job"], indent=1)
    nodes = {"sim": sim_node, "sim2": sim2_node}
    split = steps_of(nodes[drafter.split(":")[0]], int(drafter.split(":")[1]), run_id)
    assert [e["step"] for e in split] == list(range(1, STEPS + 1))
    assert {e["rank"] for e in split} == {1} and split[0]["role"] == "drafter"
    assert [e["tokens"] for e in split] == [e["tokens"] for e in colocated]
    for key in ("loss", "ce", "grad_norm"):
        assert [e[key] for e in split] == pytest.approx([e[key] for e in colocated], abs=1e-5), key
    assert heartbeat(nodes[target.split(":")[0]], int(target.split(":")[1]), run_id, 0)["role"] == "target"

    # tail merges both containers' streams in time order, each line labelled node:ctid (+ rank)
    p = ctl(env["env"], "tail", "--run", run_id)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert any(l.startswith(f"{target} rank 0 | ") for l in lines), p.stdout[-2000:]
    assert any(l.startswith(f"{drafter} rank 1 | step {STEPS}/{STEPS}") for l in lines), p.stdout[-2000:]
    raw = ctl(env["env"], "tail", "--run", run_id, "--json")
    recs = [json.loads(l) for l in raw.stdout.splitlines() if l.startswith("{")]
    assert {(r["node"], r["container"]) for r in recs} == {tuple(target.split(":")), tuple(drafter.split(":"))}
    ts = [r["ts"] for r in recs]
    assert ts == sorted(ts)


def test_kill_9_of_the_drafter_rank_in_301_stops_the_target_in_300(env, sim2_node):
    run_id = launch_job(env, "-c", "sim2:300", "-c", "sim2:301", "--target-gpus", "sim2:300=0",
                        "--drafter-gpus", "sim2:301=0", "--set", "max-steps=2000", "--set", "epochs=40")
    wait_for_step(sim2_node, 301, run_id, 1, 2)
    pid = heartbeat(sim2_node, 301, run_id, 1)["pid"]
    attach(sim2_node, 301, "kill", "-9", str(pid))
    killed = time.monotonic()
    st = wait_job(env, run_id, terminal, timeout=120)
    took = time.monotonic() - killed
    assert terminal(st), json.dumps(st["job"], indent=1)
    assert took < 60  # --dist-timeout 20 plus the agents' settle and status polling; seconds in practice
    c300, c301 = st["containers"]["sim2:300"], st["containers"]["sim2:301"]
    assert c301["status"]["state"] == "failed" and c300["status"]["state"] == "failed"
    cause301 = c301["result"]["root_cause"]
    assert cause301["rank"] == 1 and "killed by signal 9 (not by us)" in cause301["reason"], cause301
    cause300 = c300["result"]["root_cause"]
    assert cause300["kind"] == "peer_failure" and cause300["rank"] == 0, cause300
    root = st["job"]["root_cause"]
    assert (root["container"], root["rank"]) == ("sim2:301", 1), root
    text = ctl(env["env"], "status", "--run", run_id).stdout
    assert "root cause: rank 1 in container sim2:301" in text, text
    # nothing of the job is left running in either container
    for ctid in (300, 301):
        ps = attach(sim2_node, ctid, "ps", "-eo", "args").stdout
        assert run_id not in ps and "torch.distributed.run" not in ps, ps


def test_a_cut_link_between_nodes_is_a_network_failure_not_a_hang(env, sim_node, sim2_node):
    from sim import net

    run_id = launch_job(env, "-c", "sim:200", "-c", "sim2:300", "--target-gpus", "sim:200=0",
                        "--drafter-gpus", "sim2:300=0", "--set", "max-steps=2000", "--set", "epochs=40")
    wait_for_step(sim2_node, 300, run_id, 1, 2)
    addr = net.address_of("sim2", 300)
    net.set_link(addr, up=False)
    try:
        cut = time.monotonic()
        st = wait_job(env, run_id, terminal, timeout=150)
        took = time.monotonic() - cut
    finally:
        net.set_link(addr, up=True)
    assert terminal(st), json.dumps(st["job"], indent=1)
    assert took < 120
    kinds = {label: (c["result"] or {}).get("root_cause", {}).get("kind") for label, c in st["containers"].items()}
    assert "network_failure" in kinds.values(), kinds
    root = st["job"]["root_cause"]
    assert root["kind"] == "network_failure" and "network failure" in root["reason"], root


def test_kill_and_rollback_of_a_job_plans_for_every_container_first(env, sim2_node):
    """`ctl kill-and-rollback --run JOB` acts on every container of the job; a plan refused in
    any one of them changes nothing anywhere (the job goes on), and a dry run shows each
    container's plan, labelled."""
    run_id = launch_job(env, "-c", "sim2:300", "-c", "sim2:301", "--target-gpus", "sim2:300=0",
                        "--drafter-gpus", "sim2:301=0", "--set", "max-steps=2000", "--set", "epochs=40")
    try:
        wait_for_step(sim2_node, 301, run_id, 1, 1)
        p = ctl(env["env"], "kill-and-rollback", "--run", run_id, "--dry-run")
        out = p.stdout + p.stderr
        if p.returncode == 0:
            assert "sim2:300" in out and "sim2:301" in out, out
        else:
            assert "nothing changed anywhere" in out and ("sim2:300" in out or "sim2:301" in out), out
        st = job_status(env, run_id)
        assert set(st["job"]["states"].values()) == {"running"}, st["job"]  # nothing was stopped
        print(out)
    finally:
        subprocess.run([sys.executable, "-c", STOP_JOB, run_id, env["env"]["DFLASH_CTL_CONFIG"]], timeout=120)
    st = wait_job(env, run_id, terminal, timeout=120)
    assert terminal(st)


# Stops every container of a job through the agents (clean-up).
STOP_JOB = """
import sys
from controller import job as J
from controller.session import open_containers
members = J.load_record(sys.argv[2], sys.argv[1])
with open_containers(members, sys.argv[2]) as cts:
    for ct in cts:
        J.stop_member(ct, sys.argv[1], grace=5)
"""


def test_following_a_job_the_controller_stops_what_torch_would_leave_waiting(env, sim2_node):
    """A frozen drafter rank (SIGSTOP: alive, sockets open) fails its target peer in 300 only
    at --dist-timeout, and nothing in 301 notices (no exit, no stall for 300 s). `ctl tail
    --follow` of the job sees 300 fail and stops 301 itself, so the job ends now."""
    run_id = launch_job(env, "-c", "sim2:300", "-c", "sim2:301", "--target-gpus", "sim2:300=0",
                        "--drafter-gpus", "sim2:301=0", "--set", "max-steps=2000", "--set", "epochs=40")
    wait_for_step(sim2_node, 301, run_id, 1, 2)
    tail = subprocess.Popen(CTL + ["tail", "--run", run_id, "--follow"], env=env["env"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    attach(sim2_node, 301, "kill", "-STOP", str(heartbeat(sim2_node, 301, run_id, 1)["pid"]))
    try:
        out, err = tail.communicate(timeout=150)
    finally:
        if tail.poll() is None:
            tail.kill()
    assert tail.returncode == 1, err[-2000:]  # the job failed
    assert "sim2:301 ctl: another container of the job failed; stopping this one" in out, out[-3000:]
    st = job_status(env, run_id)
    assert terminal(st), st["job"]
    assert st["containers"]["sim2:300"]["result"]["root_cause"]["kind"] == "network_failure"
    assert st["containers"]["sim2:301"]["status"]["state"] in ("stopped", "failed")
    assert "FAILED" in err and "sim2:300" in err


def test_a_start_reply_lost_in_the_commit_stops_the_job_and_never_says_nothing_started(env, sim_node, sim2_node,
                                                                                       tmp_path):
    """The link to sim2 dies while 300's start is in flight: 200 has started; ctl's request
    to 300 went into a connection whose node end is frozen, then killed (a network cut), so no
    reply comes. The job is stopped wherever it ran, and the one line says the start may have
    happened and how to check — never "nothing was started"."""
    import psutil

    def runs_in_200() -> set[str]:
        return set(attach(sim_node, 200, "sh", "-c", "ls /workspace/runs 2>/dev/null", check=False).stdout.split())

    before = runs_in_200()
    pause = tmp_path / "pause"
    pause.mkdir()
    point = "launch.commit"
    proc = subprocess.Popen(CTL + ["launch", "--config", env["config"], "--from-scratch", "-c", "sim:200", "-c",
                                   "sim2:300", "--target-gpus", "sim:200=0", "--drafter-gpus", "sim2:300=0",
                                   "--set", "max-steps=2000", "--set", "epochs=40", "--set", "dist-timeout=600"],
                            env={**env["env"], "DFLASH_CTL_PAUSE_AT": point, "DFLASH_CTL_PAUSE_DIR": str(pause)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    frozen = []
    try:
        deadline = time.monotonic() + 300
        while not (pause / f"{point}.reached").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        # the node's end of ctl's connection to sim2 (and of any other): alive, silent
        frozen = psutil.Process(sim2_node.sshd.pid()).children(recursive=True)
        for child in frozen:
            child.suspend()
        (pause / f"{point}.go").write_text("")
        while not runs_in_200() - before:  # 200's start came back; 300's is sent next
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        time.sleep(2)
        for child in frozen:
            child.kill()  # the cut: ctl's connection ends with 300's request unanswered
        frozen = []
        out, err = proc.communicate(timeout=300)
    finally:
        for child in frozen:
            child.kill()
        if proc.poll() is None:
            proc.kill()
    [run_id] = runs_in_200() - before
    assert proc.returncode == 255 and "Traceback" not in err, (proc.returncode, out[-2000:], err[-3000:])
    assert "nothing was started" not in err, err
    assert f"job {run_id}: the start reply from sim2:300 was lost" in err and "it may have started" in err, err
    assert f"`ctl status --run {run_id}`" in err, err

    def ended():  # 200 started and was stopped: nothing of the job waits at the rendezvous
        p = attach(sim_node, 200, "cat", f"/workspace/runs/{run_id}/status.json", check=False)
        try:
            return json.loads(p.stdout).get("state") in ("stopped", "failed", "completed")
        except ValueError:
            return False
    deadline = time.monotonic() + 60
    while not ended():
        assert time.monotonic() < deadline, "the run in sim:200 is still live"
        time.sleep(0.5)
