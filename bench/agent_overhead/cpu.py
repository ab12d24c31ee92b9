"""Agent overhead and stream throughput, with real processes (docs/benchmarks.md, "Agent").

1. CPU of the agent process while it supervises an idle job (a fake trainer with one rank
   writing a heartbeat and a step event once a second) — utime+stime from /proc/<pid>/stat
   over a window, as a percentage of one core.
2. The same while the job prints 10,000 lines/s; every line must reach the stream.
3. Stream throughput: a job prints 2,000,000 lines as fast as it can (a few seconds), so
   the agent is the bottleneck; lines/s = lines after the first read ÷ (capture time of the
   last line − capture time of the first), with a check that none was lost or repeated.

Usage: python bench/agent_overhead/cpu.py [--runs 3] [--window 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from agent.protocol import extract_payload  # noqa: E402
from agent.procs import cpu_seconds  # noqa: E402

PY = sys.executable
FAKE = os.path.join(REPO, "tests", "jobs", "fake_trainer.py")
PRINTER = os.path.join(REPO, "tests", "jobs", "printer.py")


def agent(*args):
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([PY, "-m", "agent", *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    return extract_payload(out.stdout)


def stream_lines(run_dir):
    n, lines = 0, []
    with open(os.path.join(run_dir, "stream.jsonl"), "rb") as fh:
        for raw in fh:
            rec = json.loads(raw)
            n += 1
            if rec["kind"] == "log":
                lines.append(rec["payload"]["line"])
    return n, lines


def log_ts(run_dir):
    """Capture times of the log records (the agent stamps a line when it reads it)."""
    out = []
    with open(os.path.join(run_dir, "stream.jsonl"), "rb") as fh:
        for raw in fh:
            rec = json.loads(raw)
            if rec["kind"] == "log":
                out.append(rec["ts"])
    return out


def wait_state(run_dir, states, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(os.path.join(run_dir, "status.json")) as fh:
                st = json.load(fh)
            if st.get("state") in states:
                return st
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{run_dir} not in {states}")


def cpu_window(pid, window):
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(window)
    c1, t1 = cpu_seconds(pid), time.monotonic()
    return 100.0 * (c1 - c0) / (t1 - t0)


def idle_run(base, window):
    run_dir = os.path.join(base, "idle")
    rep = agent("start", "--run-dir", run_dir, "--", PY, FAKE, "--ranks", "1", "--step-time", "1.0")
    wait_state(run_dir, ("running",), 30)
    time.sleep(2)  # past start-up
    pct = cpu_window(rep["agent_pid"], window)
    agent("stop", "--run-dir", run_dir, "--grace", "5")
    return pct


def busy_run(base, window, rate=10000):
    run_dir = os.path.join(base, "busy")
    count = int(rate * (window + 6))
    rep = agent("start", "--run-dir", run_dir, "--", PY, PRINTER, str(count), str(rate))
    wait_state(run_dir, ("running",), 30)
    time.sleep(2)
    pct = cpu_window(rep["agent_pid"], window)
    job_pct = None
    wait_state(run_dir, ("completed",), 300)
    _, lines = stream_lines(run_dir)
    ok = lines == [f"line {i}" for i in range(count)]
    return pct, ok, count


def throughput_run(base, count=2000000):
    run_dir = os.path.join(base, "tput")
    t0 = time.monotonic()
    agent("start", "--run-dir", run_dir, "--", PY, PRINTER, str(count), "1e9")
    wait_state(run_dir, ("completed",), 600)
    elapsed = time.monotonic() - t0
    _, lines = stream_lines(run_dir)
    ok = lines == [f"line {i}" for i in range(count)]
    ts = log_ts(run_dir)
    first_batch = ts.count(ts[0])  # lines captured in the agent's first read (one timestamp)
    ingest = (count - first_batch) / (ts[-1] - ts[0]) if ts[-1] > ts[0] else float("nan")
    # the job's own printing time, from its exit record, to separate producer from consumer
    with open(os.path.join(run_dir, "job.exit.json")) as fh:
        ex = json.load(fh)
    return ingest, ok, ex["ended"] - ex["started"], elapsed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--window", type=float, default=20.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    idle, busy, busy_ok, tput, tput_ok, job_s, total_s = [], [], [], [], [], [], []
    for i in range(args.runs):
        base = tempfile.mkdtemp(prefix="agent-bench-")
        try:
            idle.append(idle_run(base, args.window))
            pct, ok, count = busy_run(base, args.window)
            busy.append(pct)
            busy_ok.append(ok)
            rate, ok, js, ts = throughput_run(base)
            tput.append(rate)
            tput_ok.append(ok)
            job_s.append(js)
            total_s.append(ts)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        print(f"run {i}: idle {idle[-1]:.2f}%  10k lines/s {busy[-1]:.1f}% (all lines: {busy_ok[-1]})  "
              f"throughput {tput[-1]:,.0f} lines/s (all lines: {tput_ok[-1]}; job printed for {job_s[-1]:.1f} s, "
              f"stream complete after {total_s[-1]:.1f} s)", flush=True)
    out = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()}-core {platform.system()} {platform.release()}, Python {platform.python_version()}",
        "load_at_start": round(load, 1), "runs": args.runs, "window_s": args.window,
        "idle_cpu_pct_median": round(statistics.median(idle), 2), "idle_cpu_pct": [round(x, 2) for x in idle],
        "busy_cpu_pct_median": round(statistics.median(busy), 1), "busy_cpu_pct": [round(x, 1) for x in busy],
        "busy_all_lines": all(busy_ok),
        "throughput_lines_per_s_median": round(statistics.median(tput)),
        "throughput_lines_per_s": [round(x) for x in tput], "throughput_all_lines": all(tput_ok),
        "throughput_job_print_s": [round(x, 1) for x in job_s],
    }
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
