"""What does a served check running beside training cost the training's step rate (CPU)?

Alternates runs without and with a served check (python -m trainer served-check-job on CPU: nice 19,
idle I/O, 1 thread, vLLM CPU) running for the whole training window, on the same machine, and
compares the median training step rate (steps/s over each run's steps after the first
--skip). Writes summary.json beside this file. See README.md.

    python3 bench/served_check/run.py --runs 3 --steps 150
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))


def env() -> dict:
    return {**os.environ, "PYTHONPATH": REPO}


def train_args(target: str, data: str, out: str, steps: int, *extra: str) -> list[str]:
    from _trainer_tiny import base_args

    args = base_args(target, data, out, "--target-layer-ids", "1,2", "--from-scratch", "--max-steps", str(steps),
                     "--lr", "1e-2", "--block-size", "4", "--save-interval", str(steps), "--epochs", "1000", *extra)
    args[args.index("--max-seq-len") + 1], args[args.index("--token-budget") + 1] = "200", "800"
    return args


def step_rate(run_dir: str, skip: int) -> float:
    ts = []
    with open(os.path.join(run_dir, "events.jsonl")) as fh:
        for line in fh:
            e = json.loads(line)
            if e["kind"] == "step":
                ts.append((e["step"], e["ts"]))
    ts = [t for t in ts if t[0] > skip]
    return (ts[-1][0] - ts[0][0]) / (ts[-1][1] - ts[0][1])


def window_s(run_dir: str) -> float:
    with open(os.path.join(run_dir, "events.jsonl")) as fh:
        ts = [json.loads(line)["ts"] for line in fh if '"step"' in line]
    return ts[-1] - ts[0]


def checks_loop(checkpoint: str, stop: str) -> subprocess.Popen:
    """Served checks back to back until ``stop`` exists (each one nice 19 itself)."""
    code = ("import os, subprocess, sys\n"
            f"while not os.path.exists({stop!r}):\n"
            f"    subprocess.run([sys.executable, '-m', 'trainer', 'served-check-job', '--checkpoint', {checkpoint!r}],"
            " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n")
    return subprocess.Popen([sys.executable, "-c", code], env=env(), cwd=REPO, start_new_session=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--skip", type=int, default=10, help="steps left out at the start of each run (warm-up)")
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="bench-served-check-")
    py = [sys.executable, "-m", "trainer"]
    subprocess.run([*py, "tiny", "--out", root, "--samples", "120"], check=True, env=env(), cwd=REPO,
                   stdout=subprocess.DEVNULL)
    target, data = os.path.join(root, "target"), os.path.join(root, "data")
    base = os.path.join(root, "base")
    subprocess.run([*py, *train_args(target, data, base, 20, "--eval-prompts", "4")], check=True, env=env(),
                   cwd=REPO, stdout=subprocess.DEVNULL)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for i in range(args.runs):
        for arm in ("off", "on"):
            out, run_dir = os.path.join(root, f"{arm}{i}"), os.path.join(root, f"{arm}{i}-run")
            os.makedirs(run_dir)
            loop = None
            if arm == "on":
                stop = os.path.join(root, f"stop{i}")
                loop = checks_loop(base, stop)
                time.sleep(5)  # the check is past its imports and exporting when training starts
            try:
                subprocess.run([*py, *train_args(target, data, out, args.steps, "--run-dir", run_dir)], check=True,
                               env=env(), cwd=REPO, stdout=subprocess.DEVNULL)
            finally:
                if loop is not None:
                    open(stop, "w").close()
                    os.killpg(loop.pid, signal.SIGTERM)
                    loop.wait()
            rates[arm].append(step_rate(run_dir, args.skip))
            print(f"run {i} {arm}: {rates[arm][-1]:.2f} steps/s over {window_s(run_dir):.0f} s", flush=True)
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    summary = {"question": "training step rate with served checks (CPU: nice 19, SCHED_IDLE, idle I/O, 1 thread) "
                           "running back to back beside it",
               "machine": f"{os.cpu_count()} CPUs, shared", "date": time.strftime("%Y-%m-%d"), "commit": commit,
               "steps": args.steps, "skip": args.skip, "runs": args.runs, "steps_per_s": rates,
               "median_off": round(off, 3), "median_on": round(on, 3), "ratio_on_off": round(on / off, 3)}
    with open(os.path.join(HERE, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
        fh.write("\n")
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
