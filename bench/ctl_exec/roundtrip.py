"""Benchmark: `ctl exec --container 200 -- true`, `ctl status` and `ctl tail` (no --follow)
against a fresh raw `ssh … pct exec 200 -- true`.

All are measured in the same run, as whole commands an operator would type (process start
included), median of N after one warm-up each, interleaved, as the operator lives them:
the first `ctl exec` of a session (no shared connection yet: `ctl disconnect`
before each) and every later command within the keep time (riding the master the first one
left); plus the SSH connections each opened (from $DFLASH_CTL_STATS) and, to show where the
time goes: raw ssh sending
the very command `ctl exec` sends, raw `ssh … true` (connection and login shell, no pct),
the same with the curve25519 key exchange paramiko gets from the sim's sshd, ctl's start-up
alone (Python and the imports of `ctl exec`), and on one already open connection inside one
process `Container.exec(["true"])` and the agent
call `ctl status` makes (`agent.runview status`: the container's python starting, without
site as ctl starts it, and with site for comparison); and one
`ctl exec` split into its interpreter start, imports, ssh and exit. Figures go to
docs/benchmarks.md under "ctl exec round trip".

    .venv/bin/python bench/ctl_exec/roundtrip.py [--config PATH] [--node sim] [--container 200] [-n 20]

Run it with the simulated node to itself (no sim tests beside it) and with PYTHONPATH at the checkout
to measure: `ctl` is the venv's entry point, which imports whatever is first on sys.path.

The checkout's modules are byte-compiled first (compileall into their __pycache__, which git
ignores), as an installed ctl's are: where $PYTHONDONTWRITEBYTECODE is set (this VM's shells
set it) and no __pycache__ exists, every `ctl` would compile its modules from source again
(≈ 12–25 ms here); the row "the same, ctl's modules without bytecode" shows that case.
"""

from __future__ import annotations

import argparse
import atexit
import datetime as dt
import json
import os
import platform
import re
import shutil
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from agent.protocol import RunStatus  # noqa: E402
from controller import config as cfg  # noqa: E402
from controller.agentcall import AgentCaller  # noqa: E402
from controller.container import Container  # noqa: E402
from controller.pct import exec_argv  # noqa: E402
from controller.transport import marked_command  # noqa: E402
from controller.ssh import SSHRunner, resolve_target  # noqa: E402
from controller.sshconfig import ENV_SSH_CONFIG  # noqa: E402
from controller.sshmux import ENV_SOCKET_DIR  # noqa: E402


HEADING = "## ctl exec round trip"

# `ctl` as its entry point runs it, noting when it started, when it spawned ssh and when ssh
# ended (atexit: before the interpreter's own teardown), for the split of one `ctl exec`.
PHASES = r"""
import json, os, subprocess, time
marks = {"started": time.time()}
class _Timed(subprocess.Popen):
    def __init__(self, *a, **k):
        marks.setdefault("ssh_started", time.time())
        super().__init__(*a, **k)
    def wait(self, timeout=None):
        code = super().wait(timeout)
        marks.setdefault("ssh_ended", time.time())
        return code
subprocess.Popen = _Timed
import atexit
atexit.register(lambda: open(os.environ["CTL_PHASES"], "w").write(json.dumps(marks)))
from controller.cli import main
main()
"""


def phases(argv: list[str], env: dict) -> dict:
    """One `ctl` run split: interpreter start, until ssh starts, ssh, after ssh (seconds)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        start = time.time()
        proc = subprocess.run([sys.executable, "-c", PHASES, *argv], env=dict(env, CTL_PHASES=out.name),
                              stdin=subprocess.DEVNULL, capture_output=True)
        end = time.time()
        if proc.returncode != 0:
            raise SystemExit(f"ctl {shlex.join(argv)} failed: {proc.stderr.decode()[-500:]}")
        m = json.loads(Path(out.name).read_text())
    return {"start": m["started"] - start, "to_ssh": m["ssh_started"] - m["started"],
            "ssh": m["ssh_ended"] - m["ssh_started"], "exit": end - m["ssh_ended"]}


def timed(argv: list[str], env: dict, cwd: str | None = None) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, cwd=cwd)
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
    ap.add_argument("--write", default="", metavar="FILE", help="also write the markdown section to FILE")
    args = ap.parse_args()

    conf = cfg.load(args.config)
    node_name, node = conf.node(args.node)
    target = resolve_target(node_name, node)
    env = dict(os.environ)
    if args.config:
        env[cfg.ENV_CONFIG] = str(Path(args.config).resolve())
    env.setdefault(ENV_SSH_CONFIG, "none")

    # The shared connections of this run in a directory of their own, closed at the end.
    sockets = tempfile.mkdtemp(prefix="bench-ssh-", dir="/tmp")
    env[ENV_SOCKET_DIR] = sockets
    # A finished tiny run in the container: what status and tail read.
    run_id = f"bench-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"  # the shape ctl launch makes
    run_dir = f"/workspace/runs/{run_id}"
    with SSHRunner(target) as runner:
        caller = AgentCaller(Container(runner, node_name, node, args.container))
        caller.call("agent", ["start", "--run-dir", run_dir, "--", "true"], check=True)
        for _ in range(300):
            status = caller.call("agent", ["status", "--run-dir", run_dir], check=True)
            if RunStatus.from_json(status["status"] or {}).terminal:
                break
            time.sleep(0.2)

    stats = tempfile.NamedTemporaryFile(prefix="ctl-stats-", suffix=".json", delete=False).name
    ctl_bin = str(REPO / ".venv" / "bin" / "ctl")
    ctl = [ctl_bin, "exec", "--container", args.container, *(["--node", node_name]), "--", "true"]
    status = [ctl_bin, "status", "--container", args.container, "--node", node_name, "--run", run_id]
    tail = [ctl_bin, "tail", "--container", args.container, "--node", node_name, "--run", run_id]
    disconnect = [ctl_bin, "disconnect", "--node", node_name]
    # No master outlives the bench, whatever failed (a command's failure is a SystemExit).
    atexit.register(lambda: (subprocess.run(disconnect, env=env, capture_output=True),
                             shutil.rmtree(sockets, ignore_errors=True)))
    ssh_opts = ["ssh", "-F", "/dev/null", "-T", "-p", str(target.port), "-o", "BatchMode=yes",
                "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={target.known_hosts}",
                *[a for k in target.key_filenames for a in ("-i", k)]]
    ssh = [*ssh_opts, f"{target.user}@{target.hostname}", shlex.join([node.pct, "exec", args.container, "--", "true"])]
    ssh_true = [*ssh_opts, f"{target.user}@{target.hostname}", "true"]
    # The very command `ctl exec -- true` sends: prelude and marker, the on-node --keep-env
    # check, env -i; what `ctl exec` takes beyond it is ctl's Python.
    ssh_as_ctl = [*ssh_opts, f"{target.user}@{target.hostname}",
                  marked_command(exec_argv(node, args.container, ["true"]))[1]]
    ssh_true_curve = [*ssh_opts, "-o", "KexAlgorithms=curve25519-sha256", f"{target.user}@{target.hostname}", "true"]

    # What `ctl` pays before any connection: Python start-up and the imports of `ctl exec`
    # (controller/front.py's path: no typer); and the same where ctl's own modules have no
    # bytecode and none is written (a copy of them without __pycache__; the standard library
    # and the venv keep theirs), as every ctl here was before this bench compiled them.
    startup = [sys.executable, "-c", "import controller.cli, controller.front, controller.commands.plain, "
                                     "controller.openssh"]
    no_bytecode = tempfile.mkdtemp(prefix="bench-nopyc-", dir="/tmp")
    atexit.register(shutil.rmtree, no_bytecode, ignore_errors=True)
    for package in ("controller", "agent"):
        shutil.copytree(REPO / package, Path(no_bytecode) / package, ignore=shutil.ignore_patterns("__pycache__"))
    startup_env = dict(env, PYTHONPATH=str(REPO))
    startup_env_nopyc = dict(env, PYTHONPATH=no_bytecode, PYTHONDONTWRITEBYTECODE="1")

    def connections() -> int:
        return json.loads(Path(stats).read_text())["ssh_connections"]

    ctl_env = dict(env, DFLASH_CTL_STATS=stats)
    subprocess.run([sys.executable, "-m", "compileall", "-q", *(str(REPO / p) for p in ("controller", "agent"))],
                   check=True, capture_output=True)
    load_before = os.getloadavg()[0]

    timed(disconnect, env)
    timed(ctl, ctl_env)
    timed(ctl, ctl_env)
    timed(ssh, env)
    timed(status, ctl_env)
    timed(tail, ctl_env)
    timed(ssh_true, env)
    timed(ssh_true_curve, env)
    timed(ssh_as_ctl, env)
    ctl_times, first_times, ssh_times, start_times, status_times, tail_times = [], [], [], [], [], []
    true_times, curve_times, as_ctl_times, splits, nopyc_times = [], [], [], [], []
    conns, first_conns, status_conns, tail_conns = [], [], [], []
    for _ in range(args.n):  # interleaved, so drift on a shared machine hits all alike
        timed(disconnect, env)  # the first command of a session: no master
        first_times.append(timed(ctl, ctl_env))
        first_conns.append(connections())
        ssh_times.append(timed(ssh, env))
        ctl_times.append(timed(ctl, ctl_env))  # within the keep time: on the first one's master
        conns.append(connections())
        status_times.append(timed(status, ctl_env))
        status_conns.append(connections())
        tail_times.append(timed(tail, ctl_env))
        tail_conns.append(connections())
        start_times.append(timed(startup, startup_env))
        nopyc_times.append(timed(startup, startup_env_nopyc, cwd=no_bytecode))  # `-c`: the cwd is first
        true_times.append(timed(ssh_true, env))
        curve_times.append(timed(ssh_true_curve, env))
        as_ctl_times.append(timed(ssh_as_ctl, env))
        splits.append(phases(ctl[1:], env))
    os.unlink(stats)

    before = SSHRunner.connections_opened
    with SSHRunner(target) as runner:
        ct = Container(runner, node_name, node, args.container)
        caller = AgentCaller(ct)
        ct.exec(["true"], check=True)
        caller.call("agent.runview", ["status", "--workspace", ct.config.workspace])  # the bundle is there
        # The same call with site, as it was before the read-only views dropped it (-S).
        with_site = [caller.python, "-m", "agent.runview", "status", "--workspace", ct.config.workspace]
        warm, agent_warm, agent_site = [], [], []
        for _ in range(args.n):
            start = time.perf_counter()
            ct.exec(["true"], check=True)
            warm.append(time.perf_counter() - start)
            start = time.perf_counter()
            caller.call("agent.runview", ["status", "--workspace", ct.config.workspace])
            agent_warm.append(time.perf_counter() - start)
            start = time.perf_counter()
            ct.exec(with_site, env=caller.env(), check=True)
            agent_site.append(time.perf_counter() - start)
        ct.exec(["rm", "-rf", "--", run_dir], check=True)
    warm_conns = SSHRunner.connections_opened - before

    load_after = os.getloadavg()[0]
    (ctl_med, first_med, ssh_med, warm_med, start_med, status_med, tail_med, true_med, curve_med, agent_med,
     as_ctl_med, site_med, nopyc_med) = (statistics.median(x) * 1000 for x in (
        ctl_times, first_times, ssh_times, warm, start_times, status_times, tail_times, true_times, curve_times,
        agent_warm, as_ctl_times, agent_site, nopyc_times))
    split = {k: statistics.median(s[k] for s in splits) * 1000 for k in splits[0]}
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = "\n".join([
        HEADING,
        "",
        f"`bench/ctl_exec/roundtrip.py`, {now}, node `{node_name}` ({target.hostname}:{target.port}), "
        f"container {args.container}, median of {args.n} (interleaved, one warm-up each).",
        f"Machine: {machine()}; 1-minute load average {load_before:.1f} before, {load_after:.1f} after "
        f"(the machine is shared with other test runs).",
        "",
        "| command | median | vs raw ssh | SSH connections per command |",
        "| --- | --- | --- | --- |",
        f"| raw `ssh … {node.pct} exec {args.container} -- true` (a fresh connection, as typed) | {ssh_med:.0f} ms | "
        f"1.00× | 1 |",
        f"| `ctl exec --container {args.container} -- true`, the first of a session (no shared connection yet) | "
        f"{first_med:.0f} ms | {first_med / ssh_med:.2f}× | {statistics.median(first_conns):g} "
        f"(max {max(first_conns)}) |",
        f"| `ctl exec --container {args.container} -- true`, a later one (on the shared connection) | "
        f"{ctl_med:.0f} ms | {ctl_med / ssh_med:.2f}× | {statistics.median(conns):g} (max {max(conns)}) |",
        f"| `ctl status --container {args.container} --run ID` (on the shared connection) | {status_med:.0f} ms | "
        f"{status_med / ssh_med:.2f}× | {statistics.median(status_conns):g} (max {max(status_conns)}) |",
        f"| `ctl tail --container {args.container} --run ID` (no --follow; on the shared connection) | "
        f"{tail_med:.0f} ms | {tail_med / ssh_med:.2f}× | {statistics.median(tail_conns):g} "
        f"(max {max(tail_conns)}) |",
        f"| raw `ssh …` sending exactly what `ctl exec` sends (prelude, `--keep-env` check, `env -i`) | "
        f"{as_ctl_med:.0f} ms | {as_ctl_med / ssh_med:.2f}× | 1 |",
        f"| raw `ssh … true` (connection and login shell, no pct) | {true_med:.0f} ms | "
        f"{true_med / ssh_med:.2f}× | 1 |",
        f"| raw `ssh -o KexAlgorithms=curve25519-sha256 … true` (the key exchange paramiko gets here) | {curve_med:.0f} ms | "
        f"{curve_med / ssh_med:.2f}× | 1 |",
        f"| `ctl` start-up alone (Python + the imports of `ctl exec`, no connection) | {start_med:.0f} ms | "
        f"{start_med / ssh_med:.2f}× | 0 |",
        f"| the same, ctl's modules without bytecode (compiled from source each time) | {nopyc_med:.0f} ms | "
        f"{nopyc_med / ssh_med:.2f}× | 0 |",
        f"| `Container.exec(['true'])` on an open connection (in-process) | {warm_med:.0f} ms | "
        f"{warm_med / ssh_med:.2f}× | {warm_conns} for all |",
        f"| `agent.runview status` (the call `ctl status` makes) on the same open connection | {agent_med:.0f} ms | "
        f"{agent_med / ssh_med:.2f}× | (same) |",
        f"| the same call with site (no `-S`: controller/agentcall.py NO_SITE_CALLS) | {site_med:.0f} ms | "
        f"{site_med / ssh_med:.2f}× | (same) |",
        "",
        "Each `ctl` command includes starting Python and importing what that command uses (these three are "
        "parsed without typer: controller/front.py), and reaches "
        "the node through the operator's `ssh` binary (controller/openssh.py), one session; the first "
        "of a session opens the node's shared connection (controller/sshmux.py), later ones open a "
        "channel on it (`ctl disconnect` closed it before each first one); the node "
        "picks `pct exec --keep-env 0` or not in that session (dpkg's pve-container), the command runs "
        "under `env -i …` (the raw command does not scrub), and a marker line comes first so "
        "login-shell noise is dropped. `ctl status` and `ctl tail` make one agent call in the "
        "container (its python starting there).",
        "",
        f"One later `ctl exec --container {args.container} -- true` split (median of {args.n}, the same run; "
        "`ctl` run through a wrapper that notes when it started, spawned ssh and saw ssh end):",
        "",
        "| part | ms |",
        "| --- | --- |",
        f"| the Python interpreter starting | {split['start']:.0f} |",
        f"| imports and parsing the command line, until ssh starts | {split['to_ssh']:.0f} |",
        f"| the ssh command (a channel on the shared connection; a fresh one sending the same: {as_ctl_med:.0f}) | "
        f"{split['ssh']:.0f} |",
        f"| after ssh ended: the result, Python's exit | {split['exit']:.0f} |",
        "",
    ])
    print(section)
    if args.write:
        Path(args.write).write_text(section + "\n")
        print(f"written to {args.write}")


if __name__ == "__main__":
    main()
