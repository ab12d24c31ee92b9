"""A training loop on GPU with the fast paths, colocated on one GPU or split over two
(target on --target-gpu, drafter on --drafter-gpu, tapped states shipped by NCCL p2p).
Random weights and random tokens of real shapes; no download.

It writes the trainer → agent contract (events.jsonl step/error events, heartbeat/rank-N
with role and GPU) into $DFLASH_RUN_DIR (the agent sets it) or --run-dir, so it can run
under ``python3 -m agent start`` and be watched like the trainer.

Split: the drafter posts the receive of batch i+1 before training on batch i (double
buffer), so the target's forward of the next batch overlaps the drafter's step. The
drafter's wait for the target is measured on the GPU: CUDA events recorded before and after
the stream waits on the receive (no host sync inside the step loop; events are read at log
time).

--ballast-at-step K --ballast-short-mib M: after step K, occupy GPU memory so that the next
worst-case step lacks about M MiB (the story's "an upgrade ate ~200 MB per GPU"): a real
CUDA OOM during training, reported in events.jsonl with rank, GPU and message.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench import _layout  # noqa: E402
_layout.ensure()  # the trainer's module names, also in a base tree from before they moved

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from trainer.plan import flops as fl  # noqa: E402
from trainer.plan import memory as mm  # noqa: E402
from trainer.gpu.probe import shape_of, tapped_ids  # noqa: E402

GIB = 1024 ** 3


def telemetry(run_dir, rank, role, gpu):
    from trainer.telemetry import Events, Heartbeat

    os.makedirs(run_dir, exist_ok=True)
    return Events(run_dir, rank, role, gpu), Heartbeat(run_dir, rank, role, gpu)


def batch(shape, b, L, n_anchors, step, dev):
    g = torch.Generator(device=dev).manual_seed(1000 + step)
    ids = torch.randint(0, shape.vocab - 2, (b, L), device=dev, generator=g)
    anchors = torch.stack([torch.randperm(L - 1, device=dev, generator=g)[:n_anchors] for _ in range(b)]).sort(-1).values
    return ids, anchors


def build_drafter(shape, a, dev):
    from trainer.model import Drafter, DrafterConfig

    d = Drafter(DrafterConfig.for_shape(shape, a.num_draft_layers, a.block_size)).to(dev)
    embed = torch.randn(shape.vocab, shape.hidden, device=dev, dtype=torch.bfloat16) * 0.02
    head = torch.randn(shape.vocab, shape.hidden, device=dev, dtype=torch.bfloat16) * 0.02
    decay = [p for p in d.parameters() if p.dim() >= 2]
    rest = [p for p in d.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-4, fused=True)
    return d, embed, head, opt


def drafter_update(d, embed, head, opt, ids, taps, anchors, a, shape):
    from trainer.gpu import fast_drafter as fd

    b, L = ids.shape
    lm = torch.ones_like(ids)
    lengths = torch.full((b,), L, device=ids.device)
    keep = torch.ones(anchors.shape, dtype=torch.bool, device=ids.device)
    out = fd.step_backward(d, embed, head, ids, taps, lm, lengths, anchors, keep, block_size=a.block_size,
                           mask_token_id=shape.vocab - 1, gamma=7.0, chunk_anchors=max(1, a.chunk_positions // a.block_size),
                           head_chunk_rows=a.head_chunk_rows)
    gn = torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out, gn


def occupy(dev, short_mib, a, dshape):
    """Ballast so the next worst-case step misses about short_mib MiB."""
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info(dev)[0]
    peak = torch.cuda.max_memory_allocated(dev)
    now = torch.cuda.memory_allocated(dev)
    # the step needs (peak - now) more than what is held between steps
    size = int(free - (peak - now) + short_mib * 2 ** 20)
    return torch.empty(max(0, size), dtype=torch.uint8, device=dev), size


def run_rank(rank, a, world):
    shape = shape_of(a.model)
    dshape = shape_of(a.drafter_model) if a.drafter_model else shape
    split = world == 2
    role = ("target" if rank == 0 else "drafter") if split else "both"
    gpu = (a.target_gpu if rank == 0 else a.drafter_gpu) if split else a.target_gpu
    dev = torch.device("cuda", gpu)
    torch.cuda.set_device(dev)
    run_dir = a.run_dir or os.environ.get("DFLASH_RUN_DIR") or tempfile.mkdtemp(prefix="dflash-run-")
    ev, hb = telemetry(run_dir, rank, role, gpu)
    hb.beat(0, "loading")
    ballast = None
    try:
        if split:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29533")
            dist.init_process_group("nccl", rank=rank, world_size=2, device_id=dev)
        L = a.max_seq_len
        b = a.token_budget // L
        N = min(a.max_anchors, L - 1)
        taps_ids = tapped_ids(shape.n_layers, a.num_draft_layers)
        width = len(taps_ids) * shape.hidden
        ft = d = None
        if role in ("target", "both"):
            from trainer.gpu.fast_target import FastTarget

            ft = FastTarget.random(shape, taps_ids, device=dev)
        if role in ("drafter", "both"):
            d, embed, head, opt = build_drafter(dshape, a, dev)
            if dshape.hidden != shape.hidden:
                raise SystemExit("drafter width must equal the target's")
        if rank == 0:
            ev.emit("phase", phase="training")
        hb.beat(0)
        ev_pairs = []  # (step, start, end, wait_start, wait_end) CUDA events
        t_last = time.time()
        if role == "target":
            work = []
            for step in range(a.steps):
                ids, anchors = batch(shape, b, L, N, step, dev)
                taps, _ = ft.forward(ids)
                for w in work:  # at most one batch in flight: reuse of buffers is safe after this
                    w.wait()
                work = [dist.isend(ids, 1), dist.isend(anchors, 1), dist.isend(taps, 1)]
                hb.beat(step + 1)
            for w in work:
                w.wait()
            torch.cuda.synchronize(dev)
        else:
            bufs = [None, None]

            def post(i):
                ids = torch.empty((b, L), dtype=torch.long, device=dev)
                anc = torch.empty((b, N), dtype=torch.long, device=dev)
                taps = torch.empty((b, L, width), dtype=torch.bfloat16, device=dev)
                return (ids, anc, taps), [dist.irecv(ids, 0), dist.irecv(anc, 0), dist.irecv(taps, 0)]

            if split:
                bufs[0] = post(0)
            for step in range(a.steps):
                e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                e[0].record()
                if split:
                    (ids, anchors, taps), work = bufs[step % 2]
                    for w in work:
                        w.wait()
                    e[1].record()
                    if step + 1 < a.steps:
                        bufs[(step + 1) % 2] = post(step + 1)
                else:
                    ids, anchors = batch(shape, b, L, N, step, dev)
                    taps, _ = ft.forward(ids)
                    e[1].record()
                out, gn = drafter_update(d, embed, head, opt, ids, taps, anchors, a, dshape)
                e[2].record()
                ev_pairs.append((step, e))
                if split:
                    bufs[step % 2] = None
                hb.beat(step + 1)
                if (step + 1) % a.log_interval == 0 or step + 1 == a.steps:
                    torch.cuda.synchronize(dev)
                    now = time.time()
                    recent = ev_pairs[-a.log_interval:]
                    span = sum(x[1][0].elapsed_time(x[1][2]) for x in recent) / 1e3
                    pre = sum(x[1][0].elapsed_time(x[1][1]) for x in recent) / 1e3
                    n = len(recent)
                    f = fl.drafter_step_flops(dshape, n_layers=a.num_draft_layers, block_size=a.block_size,
                                              n_blocks=b * N, ctx_tokens=b * L,
                                              visible_ctx_pairs=int(anchors.sum()) * a.block_size)["total"]
                    metrics = {"step": step + 1, "total_steps": a.steps, "loss": float(out["loss"]),
                               "grad_norm": float(gn), "tokens": b * L, "tokens_per_s": n * b * L / span,
                               "drafted_per_s": n * b * N * a.block_size / span, "wait_s": pre / n if split else 0.0,
                               "target_s" if not split else "recv_s": pre / n, "step_s": span / n,
                               "drafter_mfu": fl.mfu(f, (span - pre) / n) if split else None,
                               "mem_peak_mib": torch.cuda.max_memory_allocated(dev) / 2 ** 20,
                               "wall_s_per_step": (now - t_last) / n}
                    t_last = now
                    ev.emit("step", **metrics)
                    print(json.dumps(metrics), flush=True)
                if a.ballast_at_step and step + 1 == a.ballast_at_step and ballast is None:
                    ballast, size = occupy(dev, a.ballast_short_mib, a, dshape)
                    print(f"ballast: occupied {size / 2 ** 20:.0f} MiB on GPU {gpu} after step {step + 1}", flush=True)
                    ev.emit("log", message=f"ballast {size / 2 ** 20:.0f} MiB on GPU {gpu}")
        hb.beat(a.steps, "done")
        if rank == 0 or role == "drafter":
            ev.emit("phase", phase="done")
        if split:
            dist.barrier()
            dist.destroy_process_group()
        return 0
    except Exception as exc:
        oom = isinstance(exc, torch.cuda.OutOfMemoryError)
        ev.emit("error", error="cuda_oom" if oom else "exception",
                message=f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
                traceback=traceback.format_exc())
        hb.beat(-1, "failed")
        traceback.print_exc()
        print(f"[rank{rank}]: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
              file=sys.stderr, flush=True)
        return 1


def _spawned(rank, a, world, q):
    q.put((rank, run_rank(rank, a, world)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--drafter-model")
    ap.add_argument("--target-gpu", type=int, default=0)
    ap.add_argument("--drafter-gpu", type=int, default=0)
    ap.add_argument("--token-budget", type=int, default=49152)
    ap.add_argument("--max-seq-len", type=int, default=8192)
    ap.add_argument("--max-anchors", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--num-draft-layers", type=int, default=5)
    ap.add_argument("--chunk-positions", type=int, default=16384)
    ap.add_argument("--head-chunk-rows", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--log-interval", type=int, default=1)
    ap.add_argument("--run-dir")
    ap.add_argument("--ballast-at-step", type=int, default=0)
    ap.add_argument("--ballast-short-mib", type=float, default=200.0)
    a = ap.parse_args()
    if a.target_gpu == a.drafter_gpu:
        sys.exit(run_rank(0, a, 1))
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    procs = [ctx.Process(target=_spawned, args=(r, a, 2, q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    rcs = {}
    while not q.empty():
        r, rc = q.get()
        rcs[r] = rc
    sys.exit(max([rcs.get(r, 1) for r in range(2)] + [p.exitcode or 0 for p in procs]))


if __name__ == "__main__":
    main()
