"""The operators' 8-rank layout (5 target + 3 drafter ranks) on CPU with gloo, under the
agent: what can be run of the operators' layout without an 8-GPU machine.

The target is the tiny random Qwen3 (`python -m trainer tiny`); the objective flags are the
operators' (their launch command: gamma 10, soft labels with kl-weight 0.15 at T=2, CAP 0.1,
uniform noise 0.05→0.01, grad-accum 4, warmup 0.04, lr 6e-4); sizes are scaled to the tiny
model (block 8, 16 anchors, token budget 1,024, max length 256). Reports tokens/s, the
drafter ranks' wait for the target, and compares with 1 + 1 and colocated runs of the same
flags measured in the same run.

    .venv/bin/python bench/layouts/cpu.py [--steps 24] [--out /tmp/layout-cpu]
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable

OPERATOR_OBJECTIVE = ["--gamma", "10.0", "--use-soft-labels", "--kl-weight", "0.15", "--kl-temperature", "2.0",
                      "--cap-lambda", "0.1", "--noise-type", "uniform", "--noise-start", "0.05", "--noise-end", "0.01",
                      "--lr", "6e-4", "--warmup-ratio", "0.04", "--weight-decay", "0.01", "--grad-accum", "4",
                      "--grad-clip", "1.0"]
TINY_SIZES = ["--token-budget", "1024", "--max-seq-len", "256", "--max-batch-size", "8", "--block-size", "8",
              "--max-anchors", "16", "--num-draft-layers", "1", "--epochs", "100", "--save-interval", "100000"]
LAYOUTS = {"5+3": ("0,1,2,3,4", "5,6,7"), "1+1": ("0", "1"), "colocated": ("0", "0")}


def run_layout(name: str, tiny: Path, out: Path, steps: int) -> dict:
    run_dir = out / "runs" / name.replace("+", "p")
    target, drafter = LAYOUTS[name]
    argv = [PY, "-m", "trainer", "--target-model", str(tiny / "target"), "--data-dir", str(tiny / "data"),
            "--output-dir", str(run_dir / "output"), "--device", "cpu", "--target-gpus", target,
            "--drafter-gpus", drafter, "--from-scratch", "--max-steps", str(steps), "--seed", "0",
            *OPERATOR_OBJECTIVE, *TINY_SIZES]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    subprocess.run([PY, "-m", "agent", "start", "--run-dir", str(run_dir), "--", *argv], env=env, check=True,
                   capture_output=True)
    while True:
        status = json.loads((run_dir / "status.json").read_text()) if (run_dir / "status.json").exists() else {}
        if status.get("state") in ("completed", "failed", "stopped"):
            break
        time.sleep(1)
    wall = time.monotonic() - t0
    events = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines() if l.strip()]
    steps_ev = [e for e in events if e.get("kind") == "step"]
    steady = [e for e in steps_ev if e.get("step", 0) > 2]  # past start-up
    tok = [e["tokens_per_s"] for e in steady if e.get("tokens_per_s")]
    wait = [e["wait_s"] for e in steady if e.get("wait_s") is not None]
    return {"layout": name, "state": status.get("state"), "reason": status.get("reason"),
            "ranks": len(target.split(",")) + (0 if target == drafter else len(drafter.split(","))),
            "steps": max((e.get("step", 0) for e in steps_ev), default=0), "wall_s": round(wall, 1),
            "tokens_per_s_median": round(statistics.median(tok)) if tok else None,
            "drafter_wait_s_median": round(statistics.median(wait), 4) if wait else None,
            "final_loss": steps_ev[-1].get("loss") if steps_ev else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "layout-cpu"))
    ap.add_argument("--layouts", default="5+3,1+1,colocated")
    ap.add_argument("--repeat", type=int, default=1, help="runs per layout; the row is the run with the median tok/s")
    args = ap.parse_args()
    out = Path(args.out)
    tiny = out / "tiny"
    if not (tiny / "data" / "meta.json").exists():
        subprocess.run([PY, "-m", "trainer", "tiny", "--out", str(tiny)], check=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    rows = []
    for name in args.layouts.split(","):
        runs = []
        for i in range(args.repeat):
            runs.append(run_layout(name, tiny, out / f"rep{i}", args.steps))
            print(json.dumps(runs[-1]), flush=True)
        runs.sort(key=lambda r: r["tokens_per_s_median"] or 0)
        rows.append(dict(runs[len(runs) // 2], repeats=[r["tokens_per_s_median"] for r in runs]))
    print(f"\n{'layout':<10} {'ranks':>5} {'state':<10} {'steps':>5} {'wall s':>7} {'tok/s':>8} {'drafter wait s':>15}")
    for r in rows:
        print(f"{r['layout']:<10} {r['ranks']:>5} {r['state']:<10} {r['steps']:>5} {r['wall_s']:>7} "
              f"{r['tokens_per_s_median'] or '-':>8} {r['drafter_wait_s_median'] if r['drafter_wait_s_median'] is not None else '-':>15}")
    return 0 if all(r["state"] == "completed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
