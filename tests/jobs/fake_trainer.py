"""A stand-in for `torchrun … python -m trainer`: the files and lines the real trainer and
torchrun produce, none of the compute. Standard library only, light on CPU.

Launcher mode (--ranks N ≥ 1): like torchrun, starts N workers each in its own session
(start_new_session), polls them, and when one dies prints torchrun's
"failed (exitcode: -9) local_rank: 2 (pid: …)" line, SIGTERMs the rest and exits 1;
forwards SIGTERM. --ranks 0: this process is rank 0 itself.

Worker: writes heartbeat/rank-N ({rank, step, ts, pid, role, gpu}) every step, events.jsonl
(phase/step/checkpoint), "[rankN]: …" lines; on SIGTERM saves a checkpoint and exits 75.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

EXIT_STOPPED = 75
OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {tried}. GPU {gpu} has a total "
       "capacity of 79.15 GiB of which {free} is free. Including non-PyTorch memory, this process has "
       "77.55 GiB memory in use. Of the allocated memory 75.12 GiB is allocated by PyTorch, and 1.21 GiB "
       "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
       "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
       "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
NCCL = ("[Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1234, OpType=ALLREDUCE, "
        "NumelIn=1048576, NumelOut=1048576, Timeout(ms)=600000) ran for 600043 milliseconds before timing out.")


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=0)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=1000000)
    p.add_argument("--step-time", type=float, default=0.2)
    p.add_argument("--lines-per-step", type=int, default=1)
    p.add_argument("--tokens-per-s", type=float, default=20000.0)
    p.add_argument("--slow-after", type=int, default=-1)
    p.add_argument("--slow-tokens-per-s", type=float, default=5400.0)
    p.add_argument("--slow-rank", type=int, default=-1, help="only this rank slows down after --slow-after")
    p.add_argument("--every-rank-steps", action="store_true", help="every rank sends step events (own tokens/s)")
    p.add_argument("--nan-at", type=int, default=-1, help="the loss of this step is NaN (rank 0's event)")
    p.add_argument("--save-interval", type=int, default=0)
    p.add_argument("--oom-rank", type=int, default=-1)
    p.add_argument("--oom-at", type=int, default=3)
    p.add_argument("--oom-tried", default="2.00 GiB")
    p.add_argument("--oom-free", default="1.59 GiB")
    p.add_argument("--nccl-rank", type=int, default=-1)
    p.add_argument("--nccl-at", type=int, default=3)
    p.add_argument("--stall-rank", type=int, default=-1)
    p.add_argument("--stall-at", type=int, default=3)
    p.add_argument("--fail-until-resumed", action="store_true", help="OOM/NCCL faults only when not resuming")
    p.add_argument("--grandchildren", action="store_true", help="each worker leaves a setsid'd sleeper")
    p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--output-dir", default=None)
    p.add_argument("--from-scratch", action="store_true")
    p.add_argument("--resume-from", default=None)
    p.add_argument("--init-from", default=None)
    p.add_argument("--rdzv-endpoint", default=None,
                   help="launcher: announce the ranks and this rendezvous in a launch event, as the trainer does")
    p.add_argument("--never-start", default="", help="ranks (comma list) that wait for a rendezvous that never comes")
    return p.parse_args(argv)


def run_dir() -> str:
    return os.environ.get("DFLASH_RUN_DIR", ".")


def emit(ev: dict) -> None:
    ev.setdefault("ts", time.time())
    with open(os.path.join(run_dir(), "events.jsonl"), "a") as fh:
        fh.write(json.dumps(ev) + "\n")


def heartbeat(rank: int, step: int) -> None:
    d = os.path.join(run_dir(), "heartbeat")
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".rank-{rank}.tmp")
    with open(tmp, "w") as fh:
        json.dump({"rank": rank, "step": step, "ts": time.time(), "pid": os.getpid(), "role": "drafter",
                   "gpu": rank}, fh)
    os.replace(tmp, os.path.join(d, f"rank-{rank}"))


def save(args, rank: int, step: int) -> None:
    if rank != 0 or not args.output_dir:
        return
    d = os.path.join(args.output_dir, f"step_{step}")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "checkpoint.pt")
    with open(path, "w") as fh:
        fh.write(str(step))
    emit({"kind": "checkpoint", "rank": rank, "step": step, "path": path})


def leave_sleeper() -> None:
    """A grandchild in its own session that outlives its parent (torchrun workers, data
    loader helpers …): the kind of process killpg of the top group misses."""
    subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)"],
                     start_new_session=True, stdin=subprocess.DEVNULL)


def worker(args, rank: int) -> int:
    step = 0
    if args.resume_from:
        with open(args.resume_from) as fh:
            step = int(fh.read().strip() or 0)
    resumed = args.resume_from is not None
    stop = {"flag": False}

    def on_term(signum, frame):
        stop["flag"] = True

    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.ignore_term else on_term)
    if args.grandchildren:
        leave_sleeper()
    if str(rank) in args.never_start.split(","):
        print(f"[rank{rank}]: waiting for the rendezvous at {args.rdzv_endpoint}", flush=True)
        while not stop["flag"]:
            time.sleep(0.1)
        return EXIT_STOPPED
    emit({"kind": "phase", "rank": rank, "gpu": rank, "phase": "training", "resumed_from": args.resume_from})
    print(f"[rank{rank}]: starting at step {step} (resume={args.resume_from})", flush=True)
    faults = not (args.fail_until_resumed and resumed)
    while step < args.steps:
        if stop["flag"]:
            save(args, rank, step)
            print(f"[rank{rank}]: SIGTERM: saved step {step}, exiting {EXIT_STOPPED}", flush=True)
            return EXIT_STOPPED
        if step == args.stall_at and rank == args.stall_rank:
            while not stop["flag"]:
                time.sleep(0.1)
            continue
        if faults and step == args.oom_at and rank == args.oom_rank:
            print(f"[rank{rank}]: Traceback (most recent call last):", file=sys.stderr)
            print(f"[rank{rank}]:   File \"trainer/loop.py\", line 210, in train_step", file=sys.stderr)
            print(f"[rank{rank}]:     loss.backward()", file=sys.stderr)
            print(f"[rank{rank}]: " + OOM.format(tried=args.oom_tried, gpu=rank, free=args.oom_free),
                  file=sys.stderr, flush=True)
            return 1
        if faults and step == args.nccl_at and rank == args.nccl_rank:
            print(f"[rank{rank}]: " + NCCL.format(rank=rank), file=sys.stderr, flush=True)
            time.sleep(0.5)
            return 1
        step += 1
        for i in range(args.lines_per_step):
            print(f"[rank{rank}]: step {step} line {i}", flush=True)
        heartbeat(rank, step)
        slowed = 0 <= args.slow_after < step and args.slow_rank in (-1, rank)
        tps = args.slow_tokens_per_s if slowed else args.tokens_per_s
        if rank == 0 or args.every_rank_steps:
            loss = float("nan") if step == args.nan_at else round(5.0 / step, 4)
            emit({"kind": "step", "rank": rank, "gpu": rank, "step": step, "total_steps": args.steps,
                  "loss": loss, "tokens_per_s": tps})
        if args.save_interval and step % args.save_interval == 0:
            save(args, rank, step)
        time.sleep(args.step_time)
    emit({"kind": "phase", "rank": rank, "gpu": rank, "phase": "done"})
    return 0


def launcher(args, argv) -> int:
    if args.rdzv_endpoint:
        emit({"kind": "launch", "rank": None, "rdzv_endpoint": args.rdzv_endpoint, "nproc": args.ranks,
              "device": "cpu", "ranks": [{"rank": r, "role": "drafter", "gpu": r} for r in range(args.ranks)]})
    children = {}
    for r in range(args.ranks):
        children[r] = subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv, "--rank", str(r)],
                                       start_new_session=True, stdin=subprocess.DEVNULL)

    def forward(signum, frame):
        for c in children.values():
            try:
                c.send_signal(signum)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, forward)
    while True:
        codes = {r: c.poll() for r, c in children.items()}
        bad = [(r, c) for r, c in codes.items() if c not in (None, 0, EXIT_STOPPED)]
        if bad:
            r, code = bad[0]
            print(f"torch.distributed.elastic.multiprocessing.api: [ERROR] failed (exitcode: {code}) "
                  f"local_rank: {r} (pid: {children[r].pid}) of binary: {sys.executable}", file=sys.stderr, flush=True)
            forward(signal.SIGTERM, None)
            for c in children.values():
                try:
                    c.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    c.kill()
            return 1
        if all(c is not None for c in codes.values()):
            return EXIT_STOPPED if EXIT_STOPPED in codes.values() else 0
        time.sleep(0.1)


def main() -> int:
    argv = sys.argv[1:]
    args = parse(argv)
    if args.rank is not None:
        return worker(args, args.rank)
    if args.ranks == 0:
        return worker(args, 0)
    return launcher(args, argv)


if __name__ == "__main__":
    sys.exit(main())
