"""How fast does an alert reach its receiver, and what does watching cost the agent?
(bench/alerts/README.md: question, method, answer.)

1. Latency: N runs of the fake trainer (2 ranks, 0.1 s steps) under the agent, each with a
   webhook channel to a real HTTP receiver on 127.0.0.1. In each, step 3's loss is NaN (event
   time: the step event's own ts), then rank 1 is killed with SIGKILL at step >= 8 (event
   time: just before os.kill). Arrival: when the receiver answered 200. Median and max per kind.
2. CPU: the agent's utime+stime (/proc) over a window while it supervises the same job
   (1 rank, 1 step/s, 10 lines/step) — the agent of this tree against the agent of
   BASE (a commit without alerts, extracted with `git archive`), alternating, PAIRS times.
   The difference, times 3600 / window, is the added CPU per hour of a run.

Usage: python bench/alerts/measure.py [--events 20] [--window 45] [--pairs 2] [--base 2761340] [--json out.json]
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

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from agent.procs import cpu_seconds  # noqa: E402
from agent.protocol import extract_payload  # noqa: E402
from tests._alert_receiver import Receiver  # noqa: E402

PY = sys.executable
FAKE = os.path.join(REPO, "tests", "jobs", "fake_trainer.py")


def call(args, tree=REPO, stdin=None):
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([PY, "-m", *args], capture_output=True, text=True, env=env, cwd=tree, timeout=120,
                         input=stdin)
    return out


def wait(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while not (v := pred()):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)
    return v


def heartbeats(run_dir):
    d = os.path.join(run_dir, "heartbeat")
    out = {}
    for name in os.listdir(d) if os.path.isdir(d) else []:
        try:
            with open(os.path.join(d, name)) as fh:
                hb = json.load(fh)
            out[hb["rank"]] = hb
        except (OSError, ValueError, KeyError):
            pass
    return out


def nan_ts(run_dir):
    with open(os.path.join(run_dir, "events.jsonl")) as fh:
        for line in fh:
            ev = json.loads(line)
            if ev.get("kind") == "step" and ev.get("loss") != ev.get("loss"):
                return ev["ts"]
    return None


def latency(events: int, tmp: str) -> dict:
    rx = Receiver()
    out = {"failed": [], "loss_nonfinite": []}
    for i in range(events):
        run_dir = os.path.join(tmp, "ws", "runs", f"lat{i}")
        call(["agent", "start", "--run-dir", run_dir, "--", PY, FAKE, "--ranks", "2", "--step-time", "0.1",
              "--nan-at", "3"])
        req = {"config": {"channels": {"hook": {"type": "webhook", "url_env": "BENCH_HOOK"}}},
               "secrets": {"BENCH_HOOK": rx.url}}
        call(["agent.alertcmd", "configure", "--run-dir", run_dir], stdin=json.dumps(req))
        hbs = wait(lambda: (h := heartbeats(run_dir)) and len(h) == 2 and min(x["step"] for x in h.values()) >= 8
                   and h, 60, "ranks at step 8")
        t_kill = time.time()
        os.kill(hbs[1]["pid"], signal.SIGKILL)
        for kind, t_event in (("failed", t_kill), ("loss_nonfinite", nan_ts(run_dir))):
            wait(lambda: any(a["run"] == f"lat{i}" and a["kind"] == kind for a in rx.arrivals), 60, kind)
            idx = next(j for j, a in enumerate(rx.arrivals) if a["run"] == f"lat{i}" and a["kind"] == kind)
            out[kind].append(rx.arrived_at[idx] - t_event)
        wait(lambda: os.path.exists(os.path.join(run_dir, "result.json")), 60, "the run's end")
    rx.down()
    return {k: {"n": len(v), "median_s": round(statistics.median(v), 2), "max_s": round(max(v), 2),
                "all_s": [round(x, 2) for x in v]} for k, v in out.items()}


def agent_cpu(tree: str, run_dir: str, window: float) -> float:
    reply = extract_payload(call(["agent", "start", "--run-dir", run_dir, "--", PY, FAKE, "--ranks", "1",
                                  "--step-time", "1.0", "--lines-per-step", "10"], tree=tree).stdout)
    pid = reply["agent_pid"]
    time.sleep(5)  # past the start
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(window)
    c1, t1 = cpu_seconds(pid), time.monotonic()
    call(["agent", "stop", "--run-dir", run_dir, "--grace", "5"], tree=tree)
    return (c1 - c0) / (t1 - t0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--events", type=int, default=20)
    p.add_argument("--window", type=float, default=45.0)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--base", default="2761340")
    p.add_argument("--json")
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-alerts-")
    result = {"events": args.events, "latency": latency(args.events, tmp)}
    print(json.dumps(result["latency"], indent=1), flush=True)
    base = os.path.join(tmp, "base")
    os.makedirs(base)
    subprocess.run(f"git -C {REPO} archive {args.base} agent | tar -x -C {base}", shell=True, check=True)
    cpu = {"this": [], "base": []}
    for i in range(args.pairs):
        for name, tree in (("base", base), ("this", REPO)):
            cpu[name].append(agent_cpu(tree, os.path.join(tmp, "ws", "runs", f"cpu-{name}-{i}"), args.window))
    this, before = statistics.median(cpu["this"]), statistics.median(cpu["base"])
    result["cpu"] = {"window_s": args.window, "pairs": args.pairs, "base": args.base,
                     "this_cpu_fraction": [round(x, 5) for x in cpu["this"]],
                     "base_cpu_fraction": [round(x, 5) for x in cpu["base"]],
                     "added_cpu_s_per_hour": round((this - before) * 3600, 1),
                     "this_cpu_s_per_hour": round(this * 3600, 1), "base_cpu_s_per_hour": round(before * 3600, 1)}
    print(json.dumps(result["cpu"], indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
