"""Issue 29, the first step's compile: what building the drafter's sliding-window block masks
costs on a fresh machine, create_block_mask(_compile=True) (the path before: a ~44 s
Inductor compile in the Qwen3.6-27B shape's cold launch) against trainer/flex_mask.py's
direct_block_mask (tiles from the anchors, nothing compiled).

    python3 bench/gpu/mask_compile.py                  # CUDA: the 27B drafter's shape (~1 min)
    python3 bench/gpu/mask_compile.py --device cpu     # the same code on CPU, small shapes, eager
    python3 bench/gpu/mask_compile.py --window 0       # the full-attention layers' mask instead

Each builder runs in its own subprocess with empty TORCHINDUCTOR_CACHE_DIR and
TRITON_CACHE_DIR (temporary directories), as on a fresh machine. A child builds the masks
of one step the way trainer/fast_drafter.py does (``_chunk_block_mask``: per sequence, per
chunk of memory.DRAFTER_CHUNK_ANCHORS anchors; DIRECT_MASKS picks the builder): the first
mask's time (compile included), then the whole step's masks several times, the median
(CUDA-synchronised). The shape is the seed's 27B colocated run (memory_campaign.SCALES
gpu27: 8,192 tokens per sequence, block 32, 1,024 anchors; ``--token-budget auto`` chose
40,960 tokens = 5 sequences; the drafter's window family.SLIDING_WINDOW). The parent
compares the two builders' first masks tensor for tensor and prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, HERE]

FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def shape(device: str, window: int | None) -> dict:
    import memory_campaign as mc
    from trainer import family
    from trainer import memory as mm

    w = family.SLIDING_WINDOW if window is None else (window or None)
    if device == "cpu":  # small enough for create_block_mask's eager Q × KV mask on two cores
        return dict(seqs=2, L=4096, block=32, anchors=64, chunk=64, window=w)
    sc = mc.SCALES["gpu27"]
    return dict(seqs=40960 // sc["L"], L=sc["L"], block=sc["block"], anchors=sc["anchors"],
                chunk=mm.DRAFTER_CHUNK_ANCHORS, window=w)


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def child(builder: str, device: str, sh: dict, reps: int, save: str) -> dict:
    """Time one builder in this (fresh-cache) process."""
    import torch

    from trainer import fast_drafter as fd

    dev = torch.device(device)
    fd.DIRECT_MASKS = builder == "direct"
    g = torch.Generator(device="cpu").manual_seed(0)
    L, B, n, c = sh["L"], sh["block"], sh["anchors"], sh["chunk"]
    anchors = torch.stack([torch.randperm(L - B, generator=g)[:n].sort().values for _ in range(sh["seqs"])]).to(dev)
    keep = torch.ones_like(anchors, dtype=torch.bool)
    chunks = [(s, j) for s in range(sh["seqs"]) for j in range(0, n, c)]

    def build(s, j):
        return fd._chunk_block_mask(anchors[s, j:j + c], keep[s, j:j + c], L, B, sh["window"])

    torch.ones(1, device=dev).sum().item()  # CUDA context up before the clock starts
    t0 = time.perf_counter()
    bm = build(*chunks[0])
    _sync(dev)
    first = time.perf_counter() - t0
    torch.save({k: getattr(bm, k).cpu() for k in FIELDS}, save)
    steady = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for s, j in chunks:
            build(s, j)
        _sync(dev)
        steady.append((time.perf_counter() - t0) / len(chunks))
    try:
        from torch._dynamo.utils import counters
        graphs = int(counters["stats"]["unique_graphs"])
    except Exception:  # the counter is torch-internal: report nothing rather than fail
        graphs = None
    return {"first_s": first, "steady_s": statistics.median(steady), "graphs": graphs, "masks_per_step": len(chunks)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--window", type=int, default=None, help="sliding window (default the 27B drafter's; 0: full attention)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions of one step's masks")
    p.add_argument("--builders", default="create,direct")
    p.add_argument("--child", choices=["create", "direct"], help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    sh = shape(a.device, a.window)
    if a.child:
        print(json.dumps(child(a.child, a.device, sh, a.reps, a.save)))
        return 0
    res: dict = {"device": a.device, "shape": sh}
    with tempfile.TemporaryDirectory(prefix="mask-compile-") as tmp:
        for b in a.builders.split(","):
            env = dict(os.environ)
            for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
                env[k] = os.path.join(tmp, b, k.lower())  # empty: this builder compiles from nothing
            env.pop("DFLASH_DIRECT_MASKS", None)  # the child sets the switch itself
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--device", a.device, "--child", b,
                                  "--reps", str(a.reps), "--save", os.path.join(tmp, b + ".pt"),
                                  *(["--window", str(a.window)] if a.window is not None else [])],
                                 capture_output=True, text=True, env=env)
            if out.returncode:
                sys.stderr.write(out.stderr[-4000:])
                res[f"{b}_error"] = out.stderr.strip().splitlines()[-1:] or [f"rc {out.returncode}"]
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            res.update({f"{b}_first_s": r["first_s"], f"{b}_steady_s": r["steady_s"], f"{b}_graphs": r["graphs"],
                        f"{b}_process_s": time.perf_counter() - t0})
            res["masks_per_step"] = r["masks_per_step"]
        saved = [os.path.join(tmp, b + ".pt") for b in ("create", "direct")]
        if all(os.path.exists(f) for f in saved):
            import torch

            x, y = (torch.load(f) for f in saved)
            res["equal"] = all(torch.equal(x[k], y[k]) for k in FIELDS)
    print(json.dumps(res), flush=True)
    return 0 if "create_error" not in res and "direct_error" not in res and res.get("equal", True) else 1


if __name__ == "__main__":
    sys.exit(main())
