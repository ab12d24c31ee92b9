"""Follow latency through the simulated node: from a line printed by a job in LXC container
200 to the same record arriving at the operator's side through SSH → pct exec → agent follow
(the product's path: controller.container.Container.exec on an open SSH connection).

The job prints "tick <time.time()>" every 0.25 s; host and container share one kernel clock,
so receipt time − printed time is the end-to-end latency. It is split into capture (the
agent's record ts − printed time: polling of the output file) and delivery (receipt − record
ts: follow polling, pct exec, SSH).

    .venv/bin/python bench/agent_overhead/follow_latency.py [--ticks 80] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from agent.protocol import extract_payload  # noqa: E402
from controller import config as cfg  # noqa: E402
from controller.agentcall import AgentCaller  # noqa: E402
from controller.container import Container  # noqa: E402
from controller.ssh import SSHRunner  # noqa: E402

JOB = "import sys,time\nfor i in range(int(sys.argv[1])):\n    print(f'tick {time.time():.6f}', flush=True)\n    time.sleep(0.25)\n"


def node_conf():
    from sim.node import SimNode

    sim = SimNode("sim")
    if not sim.is_up():
        raise SystemExit("the simulated node is not up: `ctl sim up` (or run the sim tests once)")
    e = sim.node_config()
    return "sim", cfg.NodeConfig(host=e["host"], port=e["port"], user=e["user"], identity_file=e["identity_file"],
                                 known_hosts=e["known_hosts"],
                                 containers={k: cfg.ContainerConfig(**v) for k, v in e["containers"].items()})


def one_run(ct: Container, bundle: str, ticks: int) -> list[tuple[float, float]]:
    run_dir = f"/workspace/runs/bench-latency-{uuid.uuid4().hex[:8]}"
    agent = ["env", f"PYTHONPATH={bundle}", ct.config.python, "-m", "agent"]
    try:
        res = ct.exec([*agent, "start", "--run-dir", run_dir, "--", "python3", "-c", JOB, str(ticks)], check=True)
        extract_payload(res.stdout)
        samples: list[tuple[float, float]] = []

        def on_line(line: str) -> None:
            now = time.time()
            try:
                rec = json.loads(line)
            except ValueError:
                return
            text = rec.get("payload", {}).get("line", "") if rec.get("kind") == "log" else ""
            if text.startswith("tick "):
                printed = float(text.split()[1])
                samples.append((rec["ts"] - printed, now - rec["ts"]))

        ct.exec([*agent, "follow", "--run-dir", run_dir, "--from", "0"], on_stdout=on_line, check=True)
        return samples
    finally:
        ct.exec(["rm", "-rf", run_dir])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ticks", type=int, default=80)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    name, node = node_conf()
    os.environ.setdefault("DFLASH_CTL_SSH_CONFIG", "none")
    with SSHRunner.for_node(name, node) as runner:
        ct = Container(runner, name, node, 200)
        bundle = AgentCaller(ct).ensure_bundle()
        per_run = []
        for i in range(args.runs):
            s = one_run(ct, bundle, args.ticks)
            total = [a + b for a, b in s]
            per_run.append({
                "n": len(s),
                "total_ms_median": round(statistics.median(total) * 1000, 1),
                "total_ms_p95": round(sorted(total)[int(0.95 * (len(total) - 1))] * 1000, 1),
                "capture_ms_median": round(statistics.median(a for a, _ in s) * 1000, 1),
                "delivery_ms_median": round(statistics.median(b for _, b in s) * 1000, 1),
            })
            print(f"run {i}: {per_run[-1]}", flush=True)
    out = {k: statistics.median(r[k] for r in per_run) for k in per_run[0] if k != "n"}
    out["lines_per_run"] = per_run[0]["n"]
    out["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out["load"] = round(os.getloadavg()[0], 1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
