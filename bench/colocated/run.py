"""How fast does ``python -m trainer`` train, target and drafter colocated on one GPU, with the
operators' objective flags; what does its first step compile, cold and relaunched; and where
does one optimizer step's time go (one step profiled by kernel class, trainer/gpu/kernel_profile.py
through DFLASH_PROFILE_STEP)?

    PYTHONUNBUFFERED=1 python3 bench/colocated/run.py run --out DIR --work /tmp/w [--deadline-s 300]
    python3 bench/colocated/run.py run --out /tmp/o --work /tmp/w --cpu       # the plumbing on CPU
    python3 bench/colocated/run.py table DIR [--ceilings RESULTS.json] [--what-if CLASS=RATE]  # the profile table
    PYTHONUNBUFFERED=1 python3 bench/colocated/run.py run --scale gpu27 --phases cold --out DIR --work /tmp/w
        # the seed's Qwen3.6-27B shape (hybrid target: flash-linear-attention must be importable)

The launches are bench/memory_model/campaign.py's (synthetic Qwen3-8B target and full-length
random samples from ``python -m trainer synthetic``; soft labels KL 0.15 at T 2, CAP 0.1,
uniform noise 0.05 → 0.01, block 32, 1,024 anchors, 5 layers, max length 8,192, --grad-accum
1, killed once their steps are logged): ``cold`` (``--token-budget auto``, an empty compile
cache: the first step's compile) and ``warm`` (the same relaunched on that cache: the
relaunch's compile and the steady tokens/s; its step 3 profiled). ``--scale gpu27`` runs the
same with the 64-layer Qwen3.6-27B text target (``synthetic --shape qwen3.6-27b``) and its
drafter (vocabulary 248,320, 4 sliding-window layers + 1 full); ``--phases cold`` profiles
the cold launch's step 3 instead (one launch, no relaunch). ``shipped`` is a fresh machine
given another's cache (``ctl env cache export/import``): the generation's cache is packed by
agent/compilecache.py, the whole cache root deleted, the archive unpacked into the empty
root, and the same launch run (``--phases cold,shipped``).

DIR/metrics.json holds each launch's steady tokens/s (the median over its steps after the
first) and first-step compile, for bench/compare.py (bench/colocated/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from bench import _layout  # noqa: E402
_layout.ensure()  # the trainer's module names, also in a base tree from before they moved

from bench.drafter_step import roofline as rl  # noqa: E402
from bench.memory_model import campaign as mc  # noqa: E402
from trainer.plan import flops as fl  # noqa: E402
from trainer.gpu import kernel_profile as kp  # noqa: E402
from trainer import runtime_env  # noqa: E402

PROFILE_STEP = 3
PHASES = [("cold", 4), ("warm", 4), ("shipped", 4)]


def cmd_run(a) -> int:
    scale = "cpu" if a.cpu else a.scale
    sc = dict(mc.SCALES[scale])
    sc["extra"] = shlex.split(a.trainer_flags)
    phases = [p for p in PHASES if p[0] in a.phases.split(",")]
    profiled = "warm" if any(p[0] == "warm" for p in phases) else phases[0][0]
    t0 = time.time()
    final = os.path.abspath(a.out)
    work = os.path.abspath(a.work) if a.work else tempfile.mkdtemp(prefix="colocated-")
    out = os.path.join(work, "out")
    os.makedirs(out, exist_ok=True)
    os.makedirs(final, exist_ok=True)
    os.environ["DFLASH_COMPILE_CACHE"] = os.path.join(work, "compile-cache")  # empty: the first launch is cold
    # the trainer's own caches (trainer/runtime_env.py), flash-attn-4's included: what a launch gets
    for k in (runtime_env.ENV_INDUCTOR, runtime_env.ENV_TRITON, runtime_env.ENV_FLASH_CACHE_ON,
              runtime_env.ENV_FLASH_CACHE_DIR):
        os.environ.pop(k, None)
    with open(os.path.join(out, "meta.json"), "w") as fh:
        json.dump({"scale": scale, "phases": [p[0] for p in phases], "profiled": profiled, "t0": t0,
                   "extra": sc["extra"]}, fh)
    smi = None
    if not a.cpu:
        with open(os.path.join(out, "gpu.csv"), "w") as fh:  # which GPU: the table's ceilings (gpu_of)
            subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total,power.limit,driver_version",
                            "--format=csv"], stdout=fh, stderr=subprocess.DEVNULL)
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,memory.used", "--format=csv,noheader,nounits",
                                "-lms", "500"], stdout=open(os.path.join(out, "smi.csv"), "w"),
                               stderr=subprocess.DEVNULL)
    holder = hold_all_but(a.free_mib) if a.free_mib and not a.cpu else None
    try:
        data = os.path.join(work, "synthetic")
        made = [sc["shape"], str(a.samples), str(sc["L"])]
        stamp = os.path.join(data, "made-by.json")
        if os.path.exists(stamp) and json.load(open(stamp)) == made:  # a second precision over the same --work
            mc.log(f"synthetic target and data: reusing {data}")
        else:
            mc.log("synthetic target and data")
            subprocess.run([sys.executable, "-m", "trainer", "synthetic", "--shape", sc["shape"], "--out", data,
                            "--samples", str(a.samples), "--max-len", str(sc["L"])], cwd=mc.ROOT, check=True)
            with open(stamp, "w") as fh:
                json.dump(made, fh)
        flags_ = mc.trainer_flags(sc, data)
        for name, steps in phases:
            left = a.deadline_s - (time.time() - t0)
            if left < 60:
                mc.log(f"{name}: not started, {left:.0f} s left")
                break
            os.environ["DFLASH_PROFILE_STEP"] = str(PROFILE_STEP) if name == profiled and not a.no_profile else ""
            os.environ["DFLASH_PROFILE_DIR"] = out
            os.environ["DFLASH_COMPILE_REPORT"] = "1"
            if name == "shipped":
                mc.log(ship_cache(os.environ["DFLASH_COMPILE_CACHE"], work))
            budget = "512" if a.cpu and a.budget == "auto" else a.budget  # auto sizes to a GPU's memory
            shutil.rmtree(os.path.join(work, name), ignore_errors=True)  # a launch's events are its own
            mc.launch(name, [*flags_, "--token-budget", budget], steps, left - 20, work, out)
            mc.pack(out, final)
    finally:
        if holder is not None:
            holder.kill()
        if smi is not None:
            smi.terminate()
        with open(os.path.join(out, "summary.txt"), "w") as fh:
            fh.write(mc.summary(out))
        with open(os.path.join(final, "metrics.json"), "w") as fh:
            json.dump(metrics(out, [p[0] for p in phases]), fh, indent=1)
        mc.pack(out, final)
    print(open(os.path.join(out, "summary.txt")).read(), flush=True)
    if not a.work:  # a scratch folder of its own: what is kept is packed into --out already
        shutil.rmtree(work, ignore_errors=True)
    return 0


HOLD = """import sys, time, torch
free = torch.cuda.mem_get_info()[0]
keep = int(sys.argv[1]) * 2**20
x = torch.empty(max(0, free - keep), dtype=torch.uint8, device="cuda")
print(f"holding {x.numel() / 2**20:,.0f} MiB: {torch.cuda.mem_get_info()[0] / 2**20:,.0f} MiB left free", flush=True)
time.sleep(1e9)
"""


def hold_all_but(free_mib: int) -> subprocess.Popen:
    """A process holding this GPU's memory but ``free_mib``: a larger card made to look like a
    smaller one to the launches (an H200 as an 80 GB H100: what fits there, not how fast)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(free_mib)], stdout=subprocess.PIPE, text=True)
    mc.log(proc.stdout.readline().strip())
    return proc


def ship_cache(root: str, work: str) -> str:
    """What `ctl env cache export` then `import` on another machine leave: this generation's
    cache packed, every cache under ``root`` deleted (Inductor's, Triton's, flash-attn-4's),
    the archive unpacked into the empty root."""
    from agent import compilecache as cc

    gen = runtime_env.env_generation()
    archive = os.path.join(work, "shipped-cache.tar.gz")
    t = time.time()
    try:
        packed = cc.op_pack(root, sys.prefix, gen, archive)
    except cc.Refused as exc:  # a CPU run (--cpu) compiles nothing
        return f"nothing shipped: {exc}"
    pack_s = time.time() - t
    shutil.rmtree(root)
    t = time.time()
    got = cc.op_unpack(root, sys.prefix, archive)
    return (f"shipped the compile cache of generation {gen}: {packed['manifest']['files']} files, "
            f"{packed['manifest']['bytes'] / 2**20:.1f} MiB ({packed['bytes'] / 2**20:.1f} MiB packed in {pack_s:.1f} s), "
            f"{got['added']} entries unpacked into an empty {root} in {time.time() - t:.1f} s")


def metrics(out: str, phases: list[str]) -> dict:
    """Each launch's steady tokens/s (median over its steps after the first, which holds the
    compiles) and its first step's compile seconds: name -> {value, better} (bench/compare.py)."""
    import statistics

    m = {}
    for name in phases:
        steps = [e for e in mc.read_events(os.path.join(out, f"{name}-events.jsonl")) if e.get("kind") == "step"]
        if len(steps) > 1:
            m[f"{name}.tokens_s"] = {"value": statistics.median(e["tokens_per_s"] for e in steps[1:]),
                                     "better": "higher"}
        if steps and steps[0].get("compile_s") is not None:
            m[f"{name}.first_step_compile_s"] = {"value": steps[0]["compile_s"], "better": "lower"}
        if steps and steps[0].get("loss") is not None:
            m[f"{name}.loss_first_step"] = {"value": steps[0]["loss"], "better": "same"}
    return m


def teacher_rows(seqs: int, L: int, anchors: int, B: int) -> int:
    """Rows of teacher logits the step's head computes, for anchors drawn as the trainer draws
    them (trainer/loss.py's sample_anchors) over full sequences with every position in the loss:
    the launches' synthetic samples."""
    import numpy as np
    import torch

    from trainer.gpu.fast_drafter import teacher_rows_computed
    from trainer.loss import sample_anchors

    a, keep = sample_anchors(np.ones((seqs, L), np.int64), np.full(seqs, L), anchors, list(range(seqs)))
    return teacher_rows_computed(torch.from_numpy(a), torch.from_numpy(keep), L, B)


def colocated_work(step: dict, shape=fl.QWEN3_8B, drafter_layers: int = 5, B: int = 32, anchors: int = 1024,
                   L: int = 8192, drafter_params: int = 1_048_626_432) -> dict:
    """FLOPs and bytes per class of one colocated optimizer step of ``step``'s tokens (full
    8,192-token sequences): the target forward through all its layers (soft labels ship the
    final state) and the drafter step, its head counting the teacher rows it computes."""
    tokens = int(step["tokens"])
    seqs = max(1, tokens // L)
    n_blocks = seqs * anchors
    w = rl.work_of(shape, drafter_layers, n_blocks, B, tokens, n_blocks * B * L // 2, drafter_params, True,
                   teacher_rows=teacher_rows(seqs, L, anchors, B))
    lin = 2 * shape.layer_params * tokens * shape.n_layers
    attn = fl.target_forward_flops(shape, [L] * seqs) - lin
    qkv = shape.q_dim + 2 * shape.kv_dim
    w[kp.MATMUL_TARGET] = {"flop": lin}
    w[kp.ATTN_TARGET] = {"flop": attn}
    w[kp.ELEMENTWISE_TARGET] = {"bytes": (8 * shape.hidden + 2 * qkv + 3 * shape.intermediate) * 2 * tokens * shape.n_layers}
    w["_total_flop"] += lin + attn
    return w


# the drafter of the Qwen3.6-27B shape: the trainable parameters its H200 run printed
DRAFTER_27B_PARAMS = 1_730_213_120


def colocated_work_27b(step: dict, drafter_layers: int = 5, B: int = 32, anchors: int = 1024, L: int = 8192) -> dict:
    """The same for the Qwen3.6-27B shape: the hybrid target's forward (trainer/gpu/fast_hybrid.py's
    count: projections + MLP as matmuls; gated attention's scores/values and the Gated DeltaNet
    recurrence's state products as its attention) and the drafter built from it (32/8 × 128
    heads, MLP 17,408, vocabulary 248,320; its sliding-window layers see at most 2,048 context
    keys: 2,048 − 2,048²/(2L) on average for anchors uniform over the sequence)."""
    from trainer import family
    from trainer.gpu import fast_hybrid as fh
    from trainer.model import DrafterConfig

    cfg = family.QWEN3_6_27B_TEXT
    dcfg = DrafterConfig.from_target(cfg, drafter_layers, B)
    tokens = int(step["tokens"])
    seqs = max(1, tokens // L)
    n_blocks = seqs * anchors
    shape = fl.ModelShape(cfg["num_hidden_layers"], dcfg.hidden_size, dcfg.num_attention_heads, dcfg.num_key_value_heads,
                          dcfg.head_dim, dcfg.intermediate_size, dcfg.vocab_size)
    n_slide = list(dcfg.layer_types).count(family.SLIDING)
    W = int(dcfg.sliding_window or L)
    full, slide = n_blocks * B * L // 2, n_blocks * B * (W - W * W // (2 * L))
    pairs = (full * (drafter_layers - n_slide) + slide * n_slide) // drafter_layers
    w = rl.work_of(shape, drafter_layers, n_blocks, B, tokens, pairs, DRAFTER_27B_PARAMS, True,
                   teacher_rows=teacher_rows(seqs, L, anchors, B))
    dims = fh.HybridDims.from_text_config(cfg)
    types = family.target_layer_types(cfg)
    total = fh.forward_flops(cfg, L, seqs)
    q_dim = dims.heads * dims.head_dim
    attn_per_token = sum(4 * q_dim * (L + 1) / 2 if t == family.FULL else
                         3 * 2 * dims.lin_v_heads * dims.lin_k_dim * dims.lin_v_dim for t in types)
    attn = attn_per_token * tokens
    H, I = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    qkv = dims.lin_k_heads * dims.lin_k_dim * 2 + dims.lin_v_heads * dims.lin_v_dim  # the linear layers' (3 of 4)
    w[kp.MATMUL_TARGET] = {"flop": total - attn}
    w[kp.ATTN_TARGET] = {"flop": attn}
    w[kp.ELEMENTWISE_TARGET] = {"bytes": (8 * H + 2 * qkv + 3 * I) * 2 * tokens * len(types)}
    w["_total_flop"] += total
    return w


def gpu_of(d: str) -> str:
    """The GPU a colocated run ran on: nvidia-smi's name in gpu.csv, in the run's folder (``run``
    writes it) or beside it."""
    for path in (os.path.join(d, "gpu.csv"), os.path.join(os.path.dirname(os.path.abspath(d)), "gpu.csv")):
        if os.path.exists(path):
            lines = open(path).read().splitlines()
            if len(lines) > 1 and "," in lines[1]:
                return lines[1].split(",")[1].strip()
    raise SystemExit(f"{d}: no gpu.csv here or beside it to tell which GPU ran the call; give --ceilings RESULTS.json")


def cmd_table(a) -> int:
    prof = json.load(open(os.path.join(a.dir, f"kernel_profile_step{PROFILE_STEP}.json")))
    meta = json.load(open(os.path.join(a.dir, "meta.json")))
    ev = mc.read_events(os.path.join(a.dir, f"{meta.get('profiled', 'warm')}-events.jsonl"))
    steps = [e for e in ev if e.get("kind") == "step"]
    step = next(e for e in steps if e["step"] == PROFILE_STEP)
    others = [e for e in steps[1:] if e["step"] != PROFILE_STEP]
    step_s = sorted(e["tokens"] / e["tokens_per_s"] for e in others)[len(others) // 2] if others else None
    ceilings = rl.ceilings_of(json.load(open(a.ceilings))) if a.ceilings else rl.ceilings_for(gpu_of(a.dir))
    fn = colocated_work_27b if meta.get("scale") == "gpu27" else colocated_work
    work = fn(step)
    t = rl.table(prof, work, ceilings, step_s)
    print(f"colocated step of {step['tokens']:,} tokens: profiled {prof['wall_s']:.2f} s, unprofiled steps "
          f"{step_s or 0:.2f} s, {step['tokens'] / (step_s or prof['wall_s']):,.0f} tokens/s\n")
    print(rl.markdown(t))
    if a.what_if:
        w = rl.what_if(t, rl.parse_what_if(a.what_if))
        print(rl.what_if_markdown(w) + f", {step['tokens'] / w['step_s']:,.0f} tokens/s.")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--work", default=None,
                   help="scratch: synthetic target and data, compile cache, launches (default: a new temporary folder)")
    r.add_argument("--budget", default="auto")
    r.add_argument("--samples", type=int, default=128)
    r.add_argument("--deadline-s", type=float, default=300)
    r.add_argument("--cpu", action="store_true")
    r.add_argument("--no-profile", action="store_true",
                   help="profile no step (a comparison's tokens/s: every step as a launch runs it)")
    r.add_argument("--scale", default="gpu", choices=["gpu", "gpu27"], help="the target: Qwen3-8B or Qwen3.6-27B")
    r.add_argument("--free-mib", type=int, default=0,
                   help="leave only this much of the GPU's memory free for the launches (another process holds the "
                        "rest): a larger card standing in for a smaller one's memory")
    r.add_argument("--trainer-flags", default="", metavar="FLAGS",
                   help="more flags for every launch, one string (e.g. '--target-precision fp8'); the memory prediction "
                        "in summary.txt takes them too")
    r.add_argument("--phases", default="cold,warm", help="launches, of: cold,warm,shipped (the last one's step 3 profiled; shipped: "
                        "a fresh machine given the cold launch's cache)")
    t = sub.add_parser("table")
    t.add_argument("dir")
    t.add_argument("--ceilings", help="a results.json whose ceilings phase to table against (default: those on "
                                      "record for the GPU in the call's gpu.csv)")
    t.add_argument("--what-if", action="append", default=[], metavar="CLASS=RATE",
                   help="tokens/s were CLASS to run at RATE (FLOP/s or bytes/s; 0: none), repeatable (roofline.py's)")
    a = p.parse_args()
    return cmd_run(a) if a.cmd == "run" else cmd_table(a)


if __name__ == "__main__":
    sys.exit(main())
