"""Who does what: one process per GPU, target ranks → drafter ranks.

Ranks (torch.distributed, started by torchrun's static rendezvous on 127.0.0.1)::

    split      (--target-gpus ≠ --drafter-gpus): ranks 0..T-1 run the frozen target on
               target_gpus[i]; ranks T..T+D-1 train the drafter on drafter_gpus[j], DDP
               among themselves; micro-batches go target → drafter by point-to-point.
    colocated  (--target-gpus == --drafter-gpus): n ranks, each runs the target forward and
               then trains on the same GPU; nothing is sent.

On CPU (--device cpu, or auto without CUDA) the GPU ids only name rank slots; gloo is used.

Grad accumulation and the data stream (documented contract)
-----------------------------------------------------------
``--grad-accum G`` counts micro-batches *per drafter rank*, as in plain DDP: one optimizer
step consumes G × D micro-batches of the global, deterministic micro-batch stream (all
epochs' ``make_batches`` lists concatenated). Within a step, local index j = 0..G·D-1 goes
to drafter rank j mod D (its (j div D)-th accumulation micro-batch); in split mode it is
produced by target rank m mod T, m the global stream index (so 5 target ranks feeding 12
micro-batches per step share the work evenly over steps). So one colocated process with G = 2 and 1 target + 2 drafter ranks with G = 1
consume exactly the same micro-batches per step, and the averaged gradient is the same (up
to float summation order). Between any (target, drafter) pair, messages flow in increasing
micro-batch order on both sides, so blocking send/recv cannot deadlock.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist


@dataclass
class Topology:
    rank: int
    world: int
    target_gpus: tuple[int, ...]
    drafter_gpus: tuple[int, ...]
    device_type: str  # "cuda" | "cpu"
    drafter_group: object = field(default=None, repr=False)
    # A rank of a job across containers (trainer/multinode.py): the GPU lists above are
    # global rank slots, and this rank's own GPU is its container's.
    local_gpu: int | None = None

    @property
    def colocated(self) -> bool:
        return tuple(self.target_gpus) == tuple(self.drafter_gpus)

    @property
    def n_target(self) -> int:
        return len(self.target_gpus)

    @property
    def n_drafter(self) -> int:
        return len(self.drafter_gpus)

    @property
    def target_ranks(self) -> list[int]:
        return list(range(self.n_target))

    @property
    def drafter_ranks(self) -> list[int]:
        off = 0 if self.colocated else self.n_target
        return list(range(off, off + self.n_drafter))

    @property
    def is_target(self) -> bool:
        return self.rank in self.target_ranks

    @property
    def is_drafter(self) -> bool:
        return self.rank in self.drafter_ranks

    @property
    def is_log_rank(self) -> bool:
        """The first drafter rank writes step/checkpoint events, checkpoints and wandb."""
        return self.rank == self.drafter_ranks[0]

    @property
    def role(self) -> str:
        return "both" if self.colocated else ("target" if self.is_target else "drafter")

    @property
    def gpu(self) -> int:
        if self.local_gpu is not None:
            return self.local_gpu
        if self.is_target:
            return self.target_gpus[self.rank]
        return self.drafter_gpus[self.rank - self.drafter_ranks[0]]

    @property
    def drafter_index(self) -> int:
        return self.rank - self.drafter_ranks[0]

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.gpu) if self.device_type == "cuda" else torch.device("cpu")

    def producer(self, m: int) -> int:
        """Target rank producing global micro-batch m (split mode; colocated ranks produce
        their own)."""
        return self.target_ranks[m % self.n_target]

    def consumer(self, j: int) -> int:
        """Rank training on local micro-batch j of a step."""
        return self.drafter_ranks[j % self.n_drafter]

    def consumed_here(self, per_step: int) -> list[int]:
        """The local micro-batch indices of a step this (drafter) rank trains on."""
        return [j for j in range(per_step) if self.consumer(j) == self.rank]


def world_size_for(target_gpus, drafter_gpus) -> int:
    return len(target_gpus) if tuple(target_gpus) == tuple(drafter_gpus) else len(target_gpus) + len(drafter_gpus)


def rank_plan(target_gpus, drafter_gpus, base: int = 0) -> list[dict]:
    """The ranks of one container as the agent's launch event lists them: {rank, role, gpu}
    in local-rank order (``base``: the container's first global rank, for a job)."""
    t, d = tuple(target_gpus), tuple(drafter_gpus)
    if t == d:
        return [{"rank": base + i, "role": "both", "gpu": g} for i, g in enumerate(t)]
    return ([{"rank": base + i, "role": "target", "gpu": g} for i, g in enumerate(t)]
            + [{"rank": base + len(t) + j, "role": "drafter", "gpu": g} for j, g in enumerate(d)])


# A single container's ranks meet on the loopback address, never on a name: a container
# without /etc/hosts resolves neither `localhost` nor its own hostname, and torchrun's
# --standalone (c10d on localhost, then the hostname for the workers' store) hung there for
# minutes. gloo picks its interface from the hostname too, so it is told `lo`.
LOOPBACK = "127.0.0.1"
LOOPBACK_IFNAME = "lo"


def free_port(host: str = LOOPBACK) -> int:
    """A port free on ``host`` now (the kernel's pick; torchrun binds it a moment later)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun_args(world: int, run_id: str, port: int | None = None) -> list[str]:
    """torch.distributed.run's arguments for the ranks of one container: the static
    rendezvous (one node, node rank 0) on the loopback address and a free port."""
    return ["--nnodes", "1", "--node-rank", "0", "--rdzv-backend", "static",
            "--rdzv-endpoint", f"{LOOPBACK}:{port or free_port()}", "--rdzv-id", run_id, "--max-restarts", "0",
            f"--nproc-per-node={world}"]


def init(target_gpus, drafter_gpus, device_type: str, timeout_s: float | None = None) -> Topology:
    """Join the process group torchrun set up (env://), or run alone when world size is 1.
    ``timeout_s`` (--dist-timeout): how long any op waits for a peer (torch's default if None)."""
    world = world_size_for(target_gpus, drafter_gpus)
    rank = int(os.environ.get("RANK", "0"))
    topo = Topology(rank, world, tuple(target_gpus), tuple(drafter_gpus), device_type)
    if device_type == "cuda":
        torch.cuda.set_device(topo.device)
    if world > 1:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_IFNAME)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_IFNAME)  # its bootstrap; data goes GPU to GPU
        backend = "nccl" if device_type == "cuda" else "gloo"
        kw = {"device_id": topo.device} if device_type == "cuda" else {}
        timeout = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
        dist.init_process_group(backend, rank=rank, world_size=world, **kw, **timeout)
        # every rank must create every group, in the same order
        topo.drafter_group = dist.new_group(topo.drafter_ranks, **timeout)
    return topo


def shutdown(topo: Topology) -> None:
    if topo.world > 1 and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_max(topo: Topology, value: float) -> float:
    """Every rank's value, maxed over the world (used for the stop decision: all ranks
    must agree on the step after which they stop)."""
    if topo.world == 1:
        return value
    t = torch.tensor([float(value)], device=topo.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def drafter_sum(topo: Topology, t: torch.Tensor) -> torch.Tensor:
    if topo.n_drafter > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=topo.drafter_group)
    return t


def average_gradients(topo: Topology, module) -> None:
    """Mean of the drafter ranks' gradients, in one flat all-reduce after the step's last
    backward. Both drafter steps use it: the chunked one runs its own backward passes outside
    a module forward, where DDP's hooks cannot see them, and one rule for both is simpler
    than DDP for one and this for the other."""
    if topo.n_drafter == 1:
        return
    params = list(module.parameters())
    for p in params:
        if p.grad is None:  # every rank must contribute the same layout
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=topo.drafter_group)
    flat /= topo.n_drafter
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n


def broadcast_parameters(topo: Topology, module) -> None:
    """Start every drafter rank from the first one's weights."""
    if topo.n_drafter == 1:
        return
    for p in module.parameters():
        dist.broadcast(p.data, src=topo.drafter_ranks[0], group=topo.drafter_group)


def barrier(topo: Topology) -> None:
    if topo.world > 1:
        dist.barrier()


# --------------------------------------------------------------------------- micro-batches


@dataclass
class MicroBatch:
    """What the drafter needs from the target for one micro-batch (all on one device)."""

    index: int  # position in the global micro-batch stream
    epoch: int
    sample_ids: torch.Tensor  # [b] int64
    input_ids: torch.Tensor  # [b, S] int64, right-padded with 0
    loss_mask: torch.Tensor  # [b, S] int64 0/1
    lengths: torch.Tensor  # [b] int64 (after truncation)
    anchors: torch.Tensor  # [b, N] int64, sorted, 0 where padded
    keep: torch.Tensor  # [b, N] bool
    taps: torch.Tensor  # [b, S, n·H] tapped target layer outputs
    final: torch.Tensor | None  # [b, S, H] target final (normed) hidden, soft labels only


_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def send_microbatch(mb: MicroBatch, dst: int) -> None:
    b, S = mb.input_ids.shape
    n = mb.anchors.shape[1]
    F = mb.taps.shape[-1]
    Hf = 0 if mb.final is None else mb.final.shape[-1]
    dev = mb.taps.device
    header = torch.tensor([mb.index, mb.epoch, b, S, n, F, Hf, _DTYPES.index(mb.taps.dtype)], dtype=torch.int64, device=dev)
    ints = torch.cat([mb.sample_ids.reshape(-1), mb.input_ids.reshape(-1), mb.loss_mask.reshape(-1),
                      mb.lengths.reshape(-1), mb.anchors.reshape(-1), mb.keep.long().reshape(-1)]).to(dev)
    dist.send(header, dst)
    dist.send(ints, dst)
    dist.send(mb.taps.contiguous(), dst)
    if mb.final is not None:
        dist.send(mb.final.contiguous(), dst)


def recv_microbatch(src: int, device: torch.device) -> MicroBatch:
    header = torch.empty(8, dtype=torch.int64, device=device)
    dist.recv(header, src)
    index, epoch, b, S, n, F, Hf, dt = header.tolist()
    sizes = [b, b * S, b * S, b, b * n, b * n]
    ints = torch.empty(sum(sizes), dtype=torch.int64, device=device)
    dist.recv(ints, src)
    sid, ids, lm, lens, anc, keep = ints.split(sizes)
    taps = torch.empty(b, S, F, dtype=_DTYPES[dt], device=device)
    dist.recv(taps, src)
    final = None
    if Hf:
        final = torch.empty(b, S, Hf, dtype=_DTYPES[dt], device=device)
        dist.recv(final, src)
    return MicroBatch(index, epoch, sid, ids.view(b, S), lm.view(b, S), lens, anc.view(b, n),
                      keep.view(b, n).bool(), taps, final)


def assemble(data, sample_ids, max_seq_len: int):
    """numpy (input_ids [b, S] int64, loss_mask [b, S] int64, lengths [b]) for a batch of
    sample ids: truncated to max_seq_len, right-padded with 0 (loss 0)."""
    samples = [data.sample(int(i)) for i in sample_ids]
    lengths = np.array([min(len(x), max_seq_len) for x, _ in samples], np.int64)
    S = max(2, int(lengths.max()))
    ids = np.zeros((len(samples), S), np.int64)
    lm = np.zeros((len(samples), S), np.int64)
    for i, (x, m) in enumerate(samples):
        n = lengths[i]
        ids[i, :n] = x[:n]
        lm[i, :n] = m[:n]
    return ids, lm, lengths
