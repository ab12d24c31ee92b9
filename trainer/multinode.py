"""One job across several containers (torchrun "nodes"): layout, launch arguments, topology.

A job names its containers in node-rank order. Each container runs ``python -m trainer``
with its *local* GPU lists (``--target-gpus``/``--drafter-gpus``, ids of that container's
GPUs) and the job-wide flags::

    --nnodes 2 --node-rank K --rdzv-endpoint HOST:PORT --rdzv-id RUN --job-layout 1+0,0+1

``--job-layout`` gives, per container in node-rank order, its target and drafter rank counts
(``T+D``; ``N`` alone is N colocated ranks). torchrun numbers ranks container by container
(node rank 0's ranks first; within a container local rank order), and inside a container the
trainer puts its target ranks before its drafter ranks, so the global order is the one
trainer/topology.py expects — target ranks 0..T-1, then drafter ranks T..T+D-1 — exactly when
every container with target ranks comes before every container with drafter ranks. The
controller orders containers that way; :func:`layout_problems` refuses any other layout.

Ranks → containers, e.g. ``--job-layout 2+0,0+1,0+1`` (containers a, b, c)::

    rank 0  target   a, local rank 0 → a's --target-gpus[0]
    rank 1  target   a, local rank 1 → a's --target-gpus[1]
    rank 2  drafter  b, local rank 0 → b's --drafter-gpus[0]
    rank 3  drafter  c, local rank 0 → c's --drafter-gpus[0]

Rendezvous is torchrun's own **static** form (``--rdzv-backend static``; node rank 0's agent
hosts the TCPStore at ``--rdzv-endpoint``): its node ranks are the ones we give, so the
target-first order holds. (The c10d backend numbers nodes in arrival order.) Every
collective and point-to-point op gets ``--dist-timeout`` seconds (gloo/NCCL timeout), so a
cut link fails the job instead of hanging it. No restarts inside torchrun: a rank that dies
fails its container's job, its peers elsewhere fail on the broken connection, and each
container's agent reports which it was (agent/classify.py: peer vs network failure).
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from typing import Any, Mapping

_ENTRY = re.compile(r"^(?:(\d+)\+(\d+)|(\d+))$")


def parse_layout(text: str | None) -> list[tuple[int, int, bool]]:
    """'1+0,0+1' → [(1, 0, False), (0, 1, False)]; '2' → [(2, 2, True)] (colocated)."""
    out = []
    for item in [t for t in str(text or "").replace(" ", "").split(",") if t]:
        m = _ENTRY.match(item)
        if not m:
            raise ValueError(f"--job-layout entry {item!r}: expected T+D (target+drafter ranks) or N (colocated)")
        if m.group(3) is not None:
            out.append((int(m.group(3)), int(m.group(3)), True))
        else:
            out.append((int(m.group(1)), int(m.group(2)), False))
    return out


def format_layout(layout: list[tuple[int, int, bool]]) -> str:
    return ",".join(str(t) if colo else f"{t}+{d}" for t, d, colo in layout)


def is_job(values: Mapping[str, Any]) -> bool:
    return int(values.get("nnodes") or 1) > 1


def layout_problems(values: Mapping[str, Any]) -> list[str]:
    """Why these job flags cannot make one job; [] when fine (or when this is no job)."""
    nnodes = int(values.get("nnodes") or 1)
    if nnodes < 1:
        return [f"--nnodes {nnodes} must be at least 1"]
    if nnodes == 1:
        return []
    problems = []
    rank = values.get("node_rank")
    if rank is None or not 0 <= int(rank) < nnodes:
        problems.append(f"--node-rank {rank} must be 0..{nnodes - 1} for --nnodes {nnodes}")
    endpoint = values.get("rdzv_endpoint")
    if not endpoint or not re.match(r"^[A-Za-z0-9.\-\[\]:]+:\d+$", str(endpoint)):
        problems.append(f"--rdzv-endpoint {endpoint!r}: give HOST:PORT of node rank 0's container "
                        "(the controller picks it for a job)")
    try:
        layout = parse_layout(values.get("job_layout"))
    except ValueError as exc:
        return problems + [str(exc)]
    if len(layout) != nnodes:
        return problems + [f"--job-layout {values.get('job_layout')!r} has {len(layout)} entries for --nnodes {nnodes}: "
                           "give one T+D (or N) per container, in node-rank order"]
    colo = {c for _, _, c in layout}
    if len(colo) > 1:
        problems.append(f"--job-layout {values.get('job_layout')}: mixes colocated (N) and split (T+D) containers; "
                        "use one mode for the whole job")
    if any(t + d == 0 for t, d, _ in layout):
        problems.append(f"--job-layout {values.get('job_layout')}: a container has no ranks; leave it out of the job")
    seen_drafter = False
    for i, (t, d, c) in enumerate(layout):
        if not c and t and seen_drafter:
            problems.append(f"--job-layout {values.get('job_layout')}: container {i} has target ranks after a container "
                            "with drafter ranks; order containers target first (global rank order: target ranks, "
                            "then drafter ranks)")
            break
        seen_drafter = seen_drafter or (d > 0 and not c)
    if not problems and rank is not None and 0 <= int(rank) < nnodes:
        t, d, c = layout[int(rank)]
        lt, ld = len(values.get("target_gpus") or ()), len(values.get("drafter_gpus") or ())
        if c and not (lt == ld == t and tuple(values.get("target_gpus") or ()) == tuple(values.get("drafter_gpus") or ())):
            problems.append(f"--job-layout entry {t} for node rank {rank} means {t} colocated ranks: give equal "
                            f"--target-gpus and --drafter-gpus of {t} GPU(s) in this container")
        elif not c and (lt, ld) != (t, d):
            problems.append(f"--job-layout entry {t}+{d} for node rank {rank} does not match this container's "
                            f"--target-gpus ({lt}) and --drafter-gpus ({ld})")
    return problems


def totals(values: Mapping[str, Any]) -> tuple[int, int, bool]:
    """(target ranks, drafter ranks, colocated) of the whole job."""
    layout = parse_layout(values.get("job_layout"))
    colocated = all(c for _, _, c in layout)
    return sum(t for t, _, _ in layout), sum(d for _, d, _ in layout), colocated


def world_size(values: Mapping[str, Any]) -> int:
    t, d, colocated = totals(values)
    return t if colocated else t + d


def local_nproc(values: Mapping[str, Any]) -> int:
    t, d = tuple(values.get("target_gpus") or ()), tuple(values.get("drafter_gpus") or ())
    return len(t) if t == d else len(t) + len(d)


def rank_base(values: Mapping[str, Any]) -> int:
    """This container's first global rank: the ranks of the containers before it."""
    layout = parse_layout(values.get("job_layout"))
    return sum(t if c else t + d for t, d, c in layout[:int(values.get("node_rank") or 0)])


def torchrun_args(values: Mapping[str, Any]) -> list[str]:
    """torch.distributed.run's arguments for this container of the job."""
    return ["--nnodes", str(values["nnodes"]), "--node-rank", str(values["node_rank"]),
            "--rdzv-backend", "static", "--rdzv-endpoint", str(values["rdzv_endpoint"]),
            "--rdzv-id", str(values.get("rdzv_id") or "dflash"), "--max-restarts", "0",
            # every worker line prefixed "[local<N>]:" so the controller can name its global
            # rank (controller/jobview.py)
            "--role", "local", "--tee", "3",
            f"--nproc-per-node={local_nproc(values)}"]


def interface_towards(host: str) -> str | None:
    """The local interface whose address routes to ``host`` (the rendezvous container).

    gloo (and NCCL's bootstrap) otherwise bind to the address of this container's hostname,
    which on a node without DNS for its containers does not resolve to the job network
    (seen on the sim: workers waited on an unroutable address until the timeout)."""
    import fcntl
    import socket
    import struct

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP: picks the route, sends nothing
            local = s.getsockname()[0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                except OSError:
                    continue
                if socket.inet_ntoa(raw[20:24]) == local:
                    return name
    except OSError:
        return None
    return None


def init(args, device_type: str):
    """This process's place in the job (a topology.Topology) and the process group, with
    the --dist-timeout on every op."""
    import torch
    import torch.distributed as dist

    from trainer.topology import Topology

    values = vars(args)
    n_target, n_drafter, colocated = totals(values)
    rank = int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    lt = tuple(args.target_gpus or ())
    ld = tuple(args.drafter_gpus or ())
    if colocated:
        gpu = lt[local]
    else:
        gpu = lt[local] if local < len(lt) else ld[local - len(lt)]
    # Rank slots stand in for the global GPU lists (only their lengths and equality matter
    # to Topology); this rank's own GPU is its container's.
    slots_t = tuple(range(n_target))
    slots_d = slots_t if colocated else tuple(range(n_target, n_target + n_drafter))
    topo = Topology(rank, world_size(values), slots_t, slots_d, device_type, local_gpu=gpu)
    if device_type == "cuda":
        torch.cuda.set_device(topo.device)
    ifname = interface_towards(str(args.rdzv_endpoint).rsplit(":", 1)[0].strip("[]"))
    if ifname:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", ifname)
    timeout = timedelta(seconds=args.dist_timeout)
    backend = "nccl" if device_type == "cuda" else "gloo"
    kw = {"device_id": topo.device} if device_type == "cuda" else {}
    dist.init_process_group(backend, rank=rank, world_size=topo.world, timeout=timeout, **kw)
    topo.drafter_group = dist.new_group(topo.drafter_ranks, timeout=timeout)
    return topo
