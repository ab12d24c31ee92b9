"""Benchmark: `ctl exec --container 200 -- true`, `ctl status` and `ctl tail` (no --follow)
against raw `ssh … pct exec 200 -- true`.

All are measured in the same run, as whole commands an operator would type (process start
included), median of N after one warm-up each; plus the SSH connections each `ctl exec`
opened (from $DFLASH_CTL_STATS) and, for reference, one command on an already open
connection inside one process. Figures go to docs/benchmarks.md under "ctl exec round trip".

    .venv/bin/python bench/exec_roundtrip.py [--config PATH] [--node sim] [--container 200] [-n 20]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from controller import config as cfg  # noqa: E402
from controller.container import Container  # noqa: E402
from controller.ssh import SSHRunner, resolve_target  # noqa: E402
from controller.sshconfig import ENV_SSH_CONFIG  # noqa: E402

from _docs import write_section  # bench/_docs.py (scripts run from bench/)

HEADING = "## ctl exec round trip"


def timed(argv: list[str], env: dict) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(argv)} failed ({proc.returncode}): {proc.stderr.decode()[-500:]}")
    return elapsed


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
        mem = f", {kb / 2**20:.0f} GiB"
    except (OSError, AttributeError):
        pass
    return f"{platform.node()}: {os.cpu_count()} cores ({cpu}){mem}, {platform.system()} {platform.release()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--node", default=None)
    ap.add_argument("--container", default="200")
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("--write", default=str(REPO / "docs" / "benchmarks.md"), help="'' to print only")
    args = ap.parse_args()

    conf = cfg.load(args.config)
    node_name, node = conf.node(args.node)
    target = resolve_target(node_name, node)
    env = dict(os.environ)
    if args.config:
        env[cfg.ENV_CONFIG] = str(Path(args.config).resolve())
    env.setdefault(ENV_SSH_CONFIG, "none")

    stats = tempfile.NamedTemporaryFile(prefix="ctl-stats-", suffix=".json", delete=False).name
    ctl_bin = str(REPO / ".venv" / "bin" / "ctl")
    ctl = [ctl_bin, "exec", "--container", args.container, *(["--node", node_name]), "--", "true"]
    # The latest run in the container: status and tail need one (a tiny run is enough).
    status = [ctl_bin, "status", "--container", args.container, "--node", node_name]
    tail = [ctl_bin, "tail", "--container", args.container, "--node", node_name]
    ssh = ["ssh", "-F", "/dev/null", "-T", "-p", str(target.port), "-o", "BatchMode=yes",
           "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={target.known_hosts}",
           *[a for k in target.key_filenames for a in ("-i", k)],
           f"{target.user}@{target.hostname}", shlex.join([node.pct, "exec", args.container, "--", "true"])]

    # What `ctl` pays before any connection: Python start-up and the controller's imports.
    startup = [sys.executable, "-c", "from controller.cli import _register; _register('exec'); import controller.ssh"]

    ctl_env = dict(env, DFLASH_CTL_STATS=stats)
    load_before = os.getloadavg()[0]
    timed(ctl, ctl_env)
    timed(ssh, env)
    timed(status, ctl_env)
    timed(tail, ctl_env)
    ctl_times, ssh_times, start_times, conns, status_times, tail_times = [], [], [], [], [], []
    for _ in range(args.n):  # interleaved, so drift on a shared machine hits all alike
        ctl_times.append(timed(ctl, ctl_env))
        conns.append(json.loads(Path(stats).read_text())["ssh_connections"])
        ssh_times.append(timed(ssh, env))
        status_times.append(timed(status, ctl_env))
        tail_times.append(timed(tail, ctl_env))
        start_times.append(timed(startup, dict(env, PYTHONPATH=str(REPO))))
    os.unlink(stats)

    before = SSHRunner.connections_opened
    with SSHRunner(target) as runner:
        ct = Container(runner, node_name, node, args.container)
        ct.exec(["true"], check=True)
        warm = []
        for _ in range(args.n):
            start = time.perf_counter()
            ct.exec(["true"], check=True)
            warm.append(time.perf_counter() - start)
    warm_conns = SSHRunner.connections_opened - before

    load_after = os.getloadavg()[0]
    ctl_med, ssh_med, warm_med, start_med, status_med, tail_med = (
        statistics.median(x) * 1000 for x in (ctl_times, ssh_times, warm, start_times, status_times, tail_times))
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = "\n".join([
        HEADING,
        "",
        f"`bench/exec_roundtrip.py`, {now}, node `{node_name}` ({target.hostname}:{target.port}), "
        f"container {args.container}, median of {args.n} (interleaved, one warm-up each).",
        f"Machine: {machine()}; 1-minute load average {load_before:.1f} before, {load_after:.1f} after "
        f"(the machine is shared with other test runs).",
        "",
        "| command | median | vs raw ssh | SSH connections per command |",
        "| --- | --- | --- | --- |",
        f"| raw `ssh … {node.pct} exec {args.container} -- true` | {ssh_med:.0f} ms | 1.00× | 1 |",
        f"| `ctl exec --container {args.container} -- true` (new process) | {ctl_med:.0f} ms | "
        f"{ctl_med / ssh_med:.2f}× | {statistics.median(conns):g} (max {max(conns)}) |",
        f"| `ctl status --container {args.container}` (new process) | {status_med:.0f} ms | "
        f"{status_med / ssh_med:.2f}× | 1 |",
        f"| `ctl tail --container {args.container}` (no --follow; new process) | {tail_med:.0f} ms | "
        f"{tail_med / ssh_med:.2f}× | 1 |",
        f"| `Container.exec(['true'])` on an open connection (in-process) | {warm_med:.0f} ms | "
        f"{warm_med / ssh_med:.2f}× | {warm_conns} for all {args.n + 1} |",
        f"| `ctl` start-up alone (Python + imports, no connection) | {start_med:.0f} ms | "
        f"{start_med / ssh_med:.2f}× | 0 |",
        "",
        "Each `ctl` command includes starting Python and importing what that command uses; it asks "
        "the node once what its pct accepts (`dpkg-query -W pve-container` on the same connection), "
        "runs the command through `pct exec --keep-env 0 -- env -i …` (the raw command does not "
        "scrub) and prints a marker line first so login-shell noise is dropped. `ctl status` and "
        "`ctl tail` add one agent call in the container (its python starting there).",
        "",
    ])
    print(section)
    if args.write:
        write_section(Path(args.write), HEADING, section)
        print(f"written to {args.write}")


if __name__ == "__main__":
    main()
