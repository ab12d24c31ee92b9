"""The trainer's side of a job across containers (trainer/multinode.py), without containers:
two trainer processes started as two torchrun "nodes" on 127.0.0.1 — node 0 with the target
rank, node 1 with the drafter rank — follow the colocated single-process trajectory (the
tolerance of tests/test_trainer_topology.py), and layouts that would break the global rank
order (target ranks first) are refused with the flag to change."""

import json
import os
import socket
import subprocess
import sys

import pytest

from _trainer_tiny import base_args, replace, step_events, tiny_setup
from trainer import flags
from trainer.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_node_job(tmp_path, node_argvs: list[list[str]], layout: str) -> None:
    """Node i runs ``python -m trainer node_argvs[i]`` as node rank i of one torchrun job
    (run directory tmp_path/run-i), both on this machine; both must exit 0."""
    endpoint = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    procs = []
    for node_rank, argv in enumerate(node_argvs):
        argv = argv + ["--run-dir", str(tmp_path / f"run-{node_rank}"), "--nnodes", str(len(node_argvs)),
                       "--node-rank", str(node_rank), "--rdzv-endpoint", endpoint, "--rdzv-id", "test",
                       "--job-layout", layout, "--dist-timeout", "60"]
        procs.append(subprocess.Popen([sys.executable, "-m", "trainer", *argv], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), "\n".join(o[-2000:] for o in outs)


def job_problems(tgpus, dgpus, **job):
    values = {**flags.defaults(), "target_model": "t", "data_dir": "d", "output_dir": "o", "from_scratch": True,
              "target_gpus": flags.parse_gpus(tgpus), "drafter_gpus": flags.parse_gpus(dgpus), **job}
    return flags.check(values)


def test_job_layouts_that_break_target_first_rank_order_are_refused():
    ok = dict(nnodes=2, node_rank=0, rdzv_endpoint="10.77.0.200:29500", job_layout="1+0,0+1")
    assert job_problems("0", "", **ok) == []
    assert job_problems("", "0", **dict(ok, node_rank=1)) == []
    bad = job_problems("", "0", **dict(ok, job_layout="0+1,1+0"))
    assert any("target ranks after a container with drafter ranks" in p for p in bad), bad
    assert any("does not match this container's" in p for p in job_problems("0,1", "", **ok))
    assert any("--rdzv-endpoint" in p for p in job_problems("0", "", **dict(ok, rdzv_endpoint=None)))
    assert any("entries for --nnodes 3" in p for p in job_problems("0", "", **dict(ok, nnodes=3)))
    assert any("mixes colocated" in p for p in job_problems("0", "0", **dict(ok, job_layout="1,0+1")))
    # one container alone still needs both roles
    assert any("--drafter-gpus is empty" in p for p in job_problems("0", ""))


def test_target_and_drafter_on_two_torchrun_nodes_follow_the_colocated_trajectory(tmp_path):
    target, data = tiny_setup(str(tmp_path))
    extra = ("--from-scratch", "--max-steps", str(STEPS), "--use-soft-labels", "--noise-start", "0.05",
             "--noise-end", "0.01", "--epochs", "4")
    colo = str(tmp_path / "colocated")
    assert main(base_args(target, data, colo, *extra)) == 0

    out = str(tmp_path / "job-out")
    run_two_node_job(tmp_path, [replace(replace(base_args(target, data, out, *extra), "--target-gpus", t),
                                        "--drafter-gpus", d) for t, d in (("0", ""), ("", "0"))], "1+0,0+1")

    a, b = step_events(colo), step_events(str(tmp_path / "run-1"))
    assert [e["step"] for e in b] == list(range(1, STEPS + 1))
    assert {e["rank"] for e in b} == {1} and b[0]["role"] == "drafter"
    assert [e["tokens"] for e in a] == [e["tokens"] for e in b]
    for key in ("loss", "ce", "kl", "grad_norm"):
        assert [e[key] for e in a] == pytest.approx([e[key] for e in b], abs=1e-5), key
    hb0 = json.load(open(tmp_path / "run-0" / "heartbeat" / "rank-0"))
    hb1 = json.load(open(tmp_path / "run-1" / "heartbeat" / "rank-1"))
    assert (hb0["role"], hb1["role"]) == ("target", "drafter")


def test_colocated_ranks_on_two_torchrun_nodes_follow_the_single_process_trajectory(tmp_path):
    """--job-layout 1,1: one colocated rank (target + drafter, DDP across the nodes) per node
    == one process with twice the accumulation."""
    target, data = tiny_setup(str(tmp_path))
    extra = ("--from-scratch", "--max-steps", str(STEPS), "--epochs", "4")
    single = str(tmp_path / "single")
    assert main(replace(base_args(target, data, single, *extra), "--grad-accum", "2")) == 0

    out = str(tmp_path / "job-out")
    # --target-gpus 0 --drafter-gpus 0 on each node: colocated
    run_two_node_job(tmp_path, [base_args(target, data, out, *extra)] * 2, "1,1")
    a, b = step_events(single), step_events(str(tmp_path / "run-0"))
    assert [e["step"] for e in b] == list(range(1, STEPS + 1)) and b[0]["role"] == "both"
    assert [e["tokens"] for e in a] == [e["tokens"] for e in b]
    for key in ("loss", "ce", "grad_norm"):
        assert [e[key] for e in a] == pytest.approx([e[key] for e in b], abs=1e-5), key
