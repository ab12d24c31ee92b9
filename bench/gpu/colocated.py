"""Issue 29, end to end: ``python -m trainer`` colocated on one GPU with the operators'
objective flags, a cold launch and a relaunch on its compile cache, one step profiled by
kernel class (trainer/kernel_profile.py through DFLASH_PROFILE_STEP).

    PYTHONUNBUFFERED=1 python3 bench/gpu/colocated.py run --out DIR --work /tmp/w [--deadline-s 300]
    python3 bench/gpu/colocated.py run --out /tmp/o --work /tmp/w --cpu       # the plumbing on CPU
    python3 bench/gpu/colocated.py table DIR [--ceilings RESULTS.json]        # the profile table, anywhere

The launches are bench/gpu/memory_campaign.py's (synthetic Qwen3-8B target and full-length
random samples from ``python -m trainer synthetic``; soft labels KL 0.15 at T 2, CAP 0.1,
uniform noise 0.05 → 0.01, block 32, 1,024 anchors, 5 layers, max length 8,192, --grad-accum
1, killed once their steps are logged): ``cold`` (``--token-budget auto``, an empty compile
cache: the first step's compile) and ``warm`` (the same relaunched on that cache: the
relaunch's compile and the steady tokens/s; its step 3 profiled). memory_campaign.py's
``summary`` gives the tokens/s and the reserved peaks against trainer/memory.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), HERE]

import memory_campaign as mc  # noqa: E402
import roofline as rl  # noqa: E402
from trainer import flops as fl  # noqa: E402
from trainer import kernel_profile as kp  # noqa: E402

PROFILE_STEP = 3
PHASES = [("cold", 4), ("warm", 4)]


def cmd_run(a) -> int:
    sc = dict(mc.SCALES["cpu" if a.cpu else "gpu"])
    t0 = time.time()
    final, work = os.path.abspath(a.out), os.path.abspath(a.work)
    out = os.path.join(work, "out")
    os.makedirs(out, exist_ok=True)
    os.makedirs(final, exist_ok=True)
    os.environ["DFLASH_COMPILE_CACHE"] = os.path.join(work, "compile-cache")  # empty: the first launch is cold
    for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # the trainer's own (trainer/runtime_env.py)
        os.environ.pop(k, None)
    with open(os.path.join(out, "meta.json"), "w") as fh:
        json.dump({"scale": "cpu" if a.cpu else "gpu", "phases": [p[0] for p in PHASES], "t0": t0,
                   "host": os.uname().nodename}, fh)
    smi = None
    if not a.cpu:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,memory.used", "--format=csv,noheader,nounits",
                                "-lms", "500"], stdout=open(os.path.join(out, "smi.csv"), "w"),
                               stderr=subprocess.DEVNULL)
    try:
        data = os.path.join(work, "synthetic")
        mc.log("synthetic target and data")
        subprocess.run([sys.executable, "-m", "trainer", "synthetic", "--shape", sc["shape"], "--out", data,
                        "--samples", str(a.samples), "--max-len", str(sc["L"])], cwd=mc.ROOT, check=True)
        flags_ = mc.trainer_flags(sc, data)
        for name, steps in PHASES:
            left = a.deadline_s - (time.time() - t0)
            if left < 60:
                mc.log(f"{name}: not started, {left:.0f} s left")
                break
            os.environ["DFLASH_PROFILE_STEP"] = str(PROFILE_STEP) if name == "warm" else ""
            os.environ["DFLASH_PROFILE_DIR"] = out
            os.environ["DFLASH_COMPILE_REPORT"] = "1"
            mc.launch(name, [*flags_, "--token-budget", a.budget], steps, left - 20, work, out)
            mc.pack(out, final)
    finally:
        if smi is not None:
            smi.terminate()
        with open(os.path.join(out, "summary.txt"), "w") as fh:
            fh.write(mc.summary(out))
        mc.pack(out, final)
    print(open(os.path.join(out, "summary.txt")).read(), flush=True)
    return 0


def colocated_work(step: dict, shape=fl.QWEN3_8B, drafter_layers: int = 5, B: int = 32, anchors: int = 1024,
                   L: int = 8192, drafter_params: int = 1_048_626_432) -> dict:
    """FLOPs and bytes per class of one colocated optimizer step of ``step``'s tokens (full
    8,192-token sequences): the target forward through all its layers (soft labels ship the
    final state) and the drafter step."""
    tokens = int(step["tokens"])
    seqs = max(1, tokens // L)
    n_blocks = seqs * anchors
    w = rl.work_of(shape, drafter_layers, n_blocks, B, tokens, n_blocks * B * L // 2, drafter_params, True)
    lin = 2 * shape.layer_params * tokens * shape.n_layers
    attn = fl.target_forward_flops(shape, [L] * seqs) - lin
    qkv = shape.q_dim + 2 * shape.kv_dim
    w[kp.MATMUL_TARGET] = {"flop": lin}
    w[kp.ATTN_TARGET] = {"flop": attn}
    w[kp.ELEMENTWISE_TARGET] = {"bytes": (8 * shape.hidden + 2 * qkv + 3 * shape.intermediate) * 2 * tokens * shape.n_layers}
    w["_total_flop"] += lin + attn
    return w


def cmd_table(a) -> int:
    prof = json.load(open(os.path.join(a.dir, f"kernel_profile_step{PROFILE_STEP}.json")))
    ev = mc.read_events(os.path.join(a.dir, "warm-events.jsonl"))
    steps = [e for e in ev if e.get("kind") == "step"]
    step = next(e for e in steps if e["step"] == PROFILE_STEP)
    others = [e for e in steps[1:] if e["step"] != PROFILE_STEP]
    step_s = sorted(e["tokens"] / e["tokens_per_s"] for e in others)[len(others) // 2] if others else None
    ceilings = {"matmul_flop_s": 787e12, "copy_bytes_s": 4.24e12}
    if a.ceilings:
        ceilings = json.load(open(a.ceilings))["phases"]["ceilings"]
    t = rl.table(prof, colocated_work(step), ceilings, step_s)
    print(f"colocated step of {step['tokens']:,} tokens: profiled {prof['wall_s']:.2f} s, unprofiled steps "
          f"{step_s or 0:.2f} s, {step['tokens'] / (step_s or prof['wall_s']):,.0f} tokens/s\n")
    print(rl.markdown(t))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--work", required=True)
    r.add_argument("--budget", default="auto")
    r.add_argument("--samples", type=int, default=128)
    r.add_argument("--deadline-s", type=float, default=300)
    r.add_argument("--cpu", action="store_true")
    t = sub.add_parser("table")
    t.add_argument("dir")
    t.add_argument("--ceilings")
    a = p.parse_args()
    return cmd_run(a) if a.cmd == "run" else cmd_table(a)


if __name__ == "__main__":
    sys.exit(main())
