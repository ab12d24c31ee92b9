"""`python3 -m agent <verb> …`: the agent's fixed command line. Replies that a program
reads are printed with wrap_payload (JSON between sentinel lines); `follow` prints JSON lines.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from agent import protocol
from agent.options import Options
from agent.protocol import RunResult, RunStatus
from agent.rundir import RunDir, agent_live_or_none, agent_alive, finished, read_json, read_status, resolve


def _print(obj: dict) -> None:
    sys.stdout.write(protocol.wrap_payload(obj))
    sys.stdout.flush()


def _fail(message: str, code: int = protocol.EXIT_USAGE, **extra) -> int:
    _print({"ok": False, "error": message, **extra})
    print(f"agent: {message}", file=sys.stderr)
    return code


def _split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", help="run id (under <workspace>/runs/)")
    p.add_argument("--workspace", help=f"default ${protocol.ENV_WORKSPACE} or {protocol.DEFAULT_WORKSPACE}")
    p.add_argument("--run-dir", help="the run directory itself (instead of --run/--workspace)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 -m agent", description="dflash-ctl in-container agent")
    sub = parser.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("start", help="start (or re-attach to) a supervised run: start --run-dir DIR -- ARGV…")
    s.add_argument("--run-dir", required=True)
    s.add_argument("--run-id")
    s.add_argument("--cwd", help="working directory of the job (default: the current one)")
    Options.add_arguments(s)
    s.add_argument("--reattach", action="store_true", help="re-attach to the live job of an existing run dir")
    s.add_argument("--by", help="who re-attaches (recorded in status.json; default: agent start)")
    s.add_argument("--why", help="why it re-attaches (recorded in status.json)")
    s.add_argument("--auto", action="store_true",
                   help="an automatic re-attach (by ctl): refused when the run's --revive is 0")
    f = sub.add_parser("follow", help="print the stream from a seq, live, until the run ends")
    _run_args(f)
    f.add_argument("--from", dest="from_seq", type=int, default=0, help="print records with seq > FROM")
    f.add_argument("--once", action="store_true", help="print what exists now and exit 0")
    for verb in ("status", "stop"):
        x = sub.add_parser(verb)
        _run_args(x)
        if verb == "stop":
            x.add_argument("--grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL")
    ls = sub.add_parser("list", help="runs in the workspace and their states")
    ls.add_argument("--workspace")
    ls.add_argument("--prune", action="store_true",
                    help="also remove temp files of interrupted saves whose writer is gone (agent/leftovers.py)")
    sub.add_parser("gpus", help="one GPU sample")
    fp = sub.add_parser("fingerprint", help="python, torch + CUDA build, driver, packages and their hash")
    fp.add_argument("--python", help="the python to describe (default: python3 on PATH)")
    fp.add_argument("--write", help="also write the fingerprint to this file (atomically)")
    d = sub.add_parser("_daemon")
    d.add_argument("--run-dir", required=True)
    d.add_argument("--ready-fd", type=int)
    d.add_argument("--reattach", action="store_true")
    d.add_argument("--by")
    d.add_argument("--why")
    m = sub.add_parser("_monitor")
    m.add_argument("--run-dir", required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    head, tail = _split_argv(argv)
    args = build_parser().parse_args(head)
    try:
        protocol.check_run_arg(getattr(args, "run", None))
        return VERBS[args.verb](args, tail) or 0
    except protocol.BadRunId as exc:
        return _fail(str(exc))
    except protocol.CorruptFile as exc:  # a state file that is not its record: one line, no traceback
        return _fail(str(exc), protocol.EXIT_FAILURE, corrupt=exc.path)


def _result(rd: RunDir) -> dict | None:
    """result.json as a record; a corrupt one raises CorruptFile (main says it in one line)."""
    res = RunResult.load(rd.result)
    return res.to_json() if res else None


def _rd(args) -> RunDir:
    return resolve(getattr(args, "run", None), getattr(args, "workspace", None), getattr(args, "run_dir", None))


# --- verbs -----------------------------------------------------------------------------------
def cmd_start(args, job_argv: list[str]) -> int:
    from agent import daemon

    rd = RunDir(args.run_dir)
    try:
        existing = protocol.load_json_object(rd.spec)
    except protocol.CorruptFile as exc:
        return _fail(f"{exc}; refusing to start or re-attach a run whose spec cannot be read")
    if existing:
        st, corrupt = read_status(rd)
        if agent_alive(rd):
            _print({"ok": True, "run_id": existing.get("run_id"), "run_dir": rd.path,
                    "state": st.state.value if st.state else None, "already_supervised": True, "seq": st.seq})
            return 0
        if finished(rd):
            said = st.state.value if st.state else "result.json is there"
            return _fail(f"run {existing.get('run_id')} in {rd.path} already ended ({said}); its records are final: "
                         "start a new run in a new --run-dir")
        if corrupt:
            return _fail(f"{corrupt}; refusing to re-attach on a guess", protocol.EXIT_FAILURE)
        if args.auto:
            reply = daemon.revive_if_gone(rd, args.by or "agent start --auto", args.why)
            if reply is None:
                return _fail(f"automatic re-attach is off for run {existing['run_id']} (--revive 0); re-attach by "
                             f"hand: python3 -m agent start --run-dir {rd.path} --reattach", protocol.EXIT_FAILURE)
            return _reply(reply)
        reply = daemon.launch(rd, reattach=True, by=args.by or "agent start", why=args.why)
        return _reply(reply)
    if args.reattach:
        return _fail(f"nothing to re-attach to: {rd.spec} does not exist")
    if not job_argv:
        return _fail("no job command: put it after `--`, e.g. start --run-dir DIR -- python3 -m trainer …")
    os.makedirs(rd.path, exist_ok=True)
    spec = {
        "run_id": args.run_id or os.path.basename(rd.path), "argv": job_argv,
        "cwd": os.path.abspath(args.cwd or os.getcwd()), "created": time.time(),
        "protocol": protocol.PROTOCOL_VERSION,
        "options": Options.from_args(args).to_json(),
    }
    protocol.atomic_write_json(rd.spec, spec)
    return _reply(daemon.launch(rd, reattach=False))


def _reply(reply: dict) -> int:
    if reply.get("ok"):
        _print(reply)
        return 0
    return _fail(reply.get("error", "agent failed to start"), protocol.EXIT_FAILURE,
                 **{k: v for k, v in reply.items() if k not in ("ok", "error")})


def cmd_follow(args, _tail) -> int:
    from agent.stream import follow

    rd = _rd(args)
    if not os.path.isdir(rd.path):
        print(f"agent follow: no run directory {rd.path}", file=sys.stderr)
        return protocol.EXIT_USAGE
    try:
        return follow(rd.path, args.from_seq, sys.stdout.buffer, _supervised(rd), once=args.once,
                      writer_alive=lambda: agent_alive(rd))
    except (BrokenPipeError, KeyboardInterrupt):
        try:
            sys.stdout = None  # the reader went away: nothing more to say
        except Exception:  # noqa: BLE001
            pass
        return 0


# How long `follow` waits for the job's monitor to bring a dead agent back (--revive) before
# it says the agent is gone (exit 3).
REVIVAL_WAIT_S = 30.0


def _supervised(rd: RunDir):
    """For `follow`: is an agent writing the stream, or about to be? The job's monitor starts
    a new one --revive seconds after a death, so while the monitor lives the stream goes on."""
    revive = Options.from_spec(read_json(rd.spec) or {}).revive
    gone_since: float | None = None

    def alive() -> bool:
        nonlocal gone_since
        if agent_alive(rd):
            gone_since = None
            return True
        if revive <= 0 or not agent_live_or_none(rd.job_pid):
            return False
        gone_since = gone_since or time.monotonic()
        return time.monotonic() - gone_since < revive + REVIVAL_WAIT_S
    return alive


def cmd_status(args, _tail) -> int:
    rd = _rd(args)
    if not os.path.isdir(rd.path):
        return _fail(f"no run directory {rd.path}")
    st, corrupt = read_status(rd)
    out = {"ok": True, "run_dir": rd.path, "run_id": rd.run_id, "agent_alive": agent_alive(rd),
           "status": st.to_json() if os.path.exists(rd.status) else None,
           "result": _result(rd), "warnings": [corrupt] if corrupt else []}
    job = agent_live_or_none(rd.job_pid)
    out["job_alive"] = job
    return _print(out) or 0


def cmd_list(args, _tail) -> int:
    ws = args.workspace or os.environ.get(protocol.ENV_WORKSPACE) or protocol.DEFAULT_WORKSPACE
    base = os.path.join(ws, "runs")
    runs = []
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        rd = RunDir(os.path.join(base, name))
        if not os.path.exists(rd.spec):
            continue
        st, corrupt = read_status(rd)
        try:
            res = RunResult.load(rd.result)
        except protocol.CorruptFile as exc:
            res, corrupt = None, str(exc)
        runs.append({"run_id": rd.run_id, "run_dir": rd.path, "state": st.state.value if st.state else None,
                     "step": st.step, "updated": st.updated, "reason": res.reason if res else corrupt,
                     "agent_alive": agent_alive(rd), "corrupt": corrupt})
    reply = {"ok": True, "workspace": ws, "runs": runs}
    if args.prune:
        reply["pruned"] = _prune(ws, [RunDir(r["run_dir"]) for r in runs])
    return _print(reply) or 0


def _prune(ws: str, rds: list[RunDir]) -> list[dict]:
    """Every run directory, and every run's output root (--output-dir in its start.sh or job
    argv), swept of dead writers' temp files."""
    import shlex

    from agent import leftovers
    from agent.job import _flag_value

    roots = [(os.path.join(ws, "runs"), 4)]
    for rd in rds:
        argv = list((read_json(rd.spec) or {}).get("argv") or [])
        try:
            with open(os.path.join(rd.path, protocol.START_SCRIPT), encoding="utf-8") as fh:
                argv += shlex.split(fh.read(), comments=True)
        except (OSError, ValueError):
            pass
        out = _flag_value(argv, "--output-dir")
        if out:
            roots += leftovers.output_roots(out if os.path.isabs(out) else os.path.join(rd.path, out))
    return leftovers.sweep(roots)


def cmd_gpus(args, _tail) -> int:
    from agent import gpus

    return _print({"ok": True, **gpus.sample()}) or 0


def cmd_fingerprint(args, _tail) -> int:
    import shutil

    from agent import envfp, gpus

    python = args.python or shutil.which("python3") or sys.executable
    try:
        fp = dict(envfp.of_python(python), driver=gpus.driver_version())
    except envfp.FingerprintError as exc:
        return _fail(str(exc), protocol.EXIT_FAILURE)
    if args.write:
        protocol.atomic_write_json(args.write, fp)
    return _print({"ok": True, **fp}) or 0


def cmd_stop(args, _tail) -> int:
    rd = _rd(args)
    spec = read_json(rd.spec)
    if not spec:
        return _fail(f"no run at {rd.path}")
    st, _ = read_status(rd)
    if finished(rd):
        return _print({"ok": True, "already_ended": True, "state": st.state.value if st.state else None,
                       "result": _result(rd)}) or 0
    protocol.atomic_write_json(rd.stop_request, {"ts": time.time(), "grace": args.grace,
                                                 "by": f"agent stop (pid {os.getpid()})"})
    from agent.rundir import Lock
    from agent.supervisor import Supervisor

    deadline = time.monotonic() + args.grace + 60
    while time.monotonic() < deadline:
        res = _result(rd)
        st = RunStatus.load(rd.status)
        if res and st.terminal:
            return _print({"ok": True, "state": st.state.value, "by": "agent", "result": res}) or 0
        if not agent_alive(rd):
            # No agent (never was, or it died mid-stop): take its place for the stop; holding
            # the lock makes us the one writer of the stream.
            lock = Lock(rd.agent_lock)
            if lock.acquire(timeout=1.0):
                try:
                    Supervisor(rd, spec, reattach=True, lock=lock, by="agent stop",
                               why="a stop was requested and no agent was running").run()
                finally:
                    lock.release()
                st = RunStatus.load(rd.status)
                return _print({"ok": True, "state": st.state.value if st.state else None,
                               "by": "stop (no agent was running)", "result": _result(rd)}) or 0
        time.sleep(0.1)
    return _fail(f"the agent of {rd.path} did not finish stopping within {args.grace + 60:.0f} s",
                 protocol.EXIT_FAILURE)


def cmd_daemon(args, _tail) -> int:
    from agent import daemon

    return daemon.main(args.run_dir, args.ready_fd, args.reattach, args.by, args.why)


def cmd_monitor(args, tail) -> int:
    from agent import monitor

    return monitor.main(args.run_dir, tail)


VERBS = {"start": cmd_start, "follow": cmd_follow, "status": cmd_status, "list": cmd_list, "gpus": cmd_gpus,
         "fingerprint": cmd_fingerprint, "stop": cmd_stop, "_daemon": cmd_daemon, "_monitor": cmd_monitor}
