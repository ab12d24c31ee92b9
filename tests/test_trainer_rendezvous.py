"""The trainer's own rendezvous in one container names no host that has to resolve, and its
launch event lists the ranks it starts (what the agent's start-up deadline names)."""

from __future__ import annotations

import re

from trainer import multinode, topology


def test_single_container_rendezvous_is_the_loopback_address_and_a_free_port():
    args = topology.torchrun_args(8, "run-1")
    endpoint = args[args.index("--rdzv-endpoint") + 1]
    assert re.fullmatch(r"127\.0\.0\.1:\d+", endpoint)
    assert args[args.index("--rdzv-backend") + 1] == "static" and "--standalone" not in args
    assert args[-1] == "--nproc-per-node=8" and args[args.index("--rdzv-id") + 1] == "run-1"
    assert 0 < topology.free_port() < 65536


def test_rank_plan_lists_the_seeds_layout_in_torchruns_rank_order():
    plan = topology.rank_plan((0, 1, 2, 3, 4), (5, 6, 7))
    assert [(r["rank"], r["role"], r["gpu"]) for r in plan] == \
        [(i, "target", i) for i in range(5)] + [(5, "drafter", 5), (6, "drafter", 6), (7, "drafter", 7)]
    assert topology.rank_plan((0, 1), (0, 1)) == [{"rank": 0, "role": "both", "gpu": 0},
                                                  {"rank": 1, "role": "both", "gpu": 1}]


def test_a_job_containers_ranks_start_after_the_containers_before_it():
    values = {"job_layout": "2+0,0+1,0+1", "node_rank": 2}
    assert multinode.rank_base(values) == 3
    assert topology.rank_plan((), (0,), multinode.rank_base(values)) == [{"rank": 3, "role": "drafter", "gpu": 0}]
