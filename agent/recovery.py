"""In-container checks and records for `ctl kill-and-rollback`.

- ``survivors --run ID``: every live process that belongs to the run (below its recorded job
  and agent PIDs, or carrying ``DFLASH_RUN_ID=ID`` in its environment). Asked *after* the
  agent's stop, independently of it: a rollback must never start while a trainer process
  still holds files of the venv or GPU memory.
- ``gpus``: one NVML sample (agent.gpus), for "its GPU memory is released".
- ``history-append`` / ``history``: the container's recovery history,
  ``<workspace>/.dflash-ctl/history.jsonl``. One JSON line per kill or rollback, appended
  with O_APPEND under an flock and fsynced, so concurrent writers never interleave and a
  reader never sees half a record (a torn last line from a crash is skipped on read).

Why a history file and not the run's stream: the stream's contract is that its last record
of a finished run is the terminal status (agent/stream.py, protocol FIRST_SEQ comment), and
a rollback happens after that. The stop itself is in the stream (the agent's
agent.stop_requested / agent.stop events).

Standard library only; run with the container's system python3 like agent.envgen.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import time
from typing import Optional

from agent import protocol
from agent.protocol import read_json_doc, wrap_payload

HISTORY = ".dflash-ctl/history.jsonl"


def history_path(workspace: str) -> str:
    return os.path.join(workspace, HISTORY)


def append_history(workspace: str, record: dict) -> dict:
    record = dict(record)
    record.setdefault("ts", time.time())
    line = (json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n").encode()
    path = history_path(workspace)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        view = memoryview(line)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    return record


CLAIM = ".dflash-ctl/rollback.claim"  # one kill-and-rollback at a time in a container


def claim(workspace: str, holder: str, ttl_s: float) -> dict:
    """Take the container's kill-and-rollback claim, or say who holds it. Two at once would
    each stop the run and each write a kill and a rollback record; the second is refused
    instead. A claim past its ``expires`` (its ctl died without releasing) is taken over.

    Check and take happen under an flock of a sibling lock file, and the claim appears with
    its content (written to a temp file, renamed): an O_EXCL create followed by a write let a
    second taker read the still-empty file as torn, call it stale and take it too."""
    import secrets

    path = os.path.join(workspace, CLAIM)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lock_fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        now = time.time()
        held = read_json_doc(path)
        if held is not None and float(held.get("expires") or 0) > now:
            return {"claimed": False, "holder": held}
        mine = {"holder": holder, "ts": now, "expires": now + ttl_s, "token": secrets.token_hex(8)}
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(mine, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        return {"claimed": True, "token": mine["token"]}
    finally:
        os.close(lock_fd)


def release(workspace: str, token: str) -> bool:
    """Drop the claim if it is still the one ``token`` took."""
    path = os.path.join(workspace, CLAIM)
    lock_fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        held = read_json_doc(path)
        if held is None or held.get("token") != token:
            return False
        os.unlink(path)
        return True
    finally:
        os.close(lock_fd)


def history_problem(rec) -> Optional[str]:
    """Why a history line is not a record ({"event": str, "ts": number, "run": str|None, …})."""
    if not isinstance(rec, dict):
        return f"not a JSON object but {type(rec).__name__}"
    ts = rec.get("ts")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        return f"'ts' is {json.dumps(ts)[:40]}, not a number"
    if not isinstance(rec.get("event"), str):
        return f"'event' is {json.dumps(rec.get('event'))[:40]}, not a string"
    if rec.get("run") is not None and not isinstance(rec.get("run"), str):
        return f"'run' is {json.dumps(rec.get('run'))[:40]}, not a string"
    return None


def read_history(workspace: str, run: Optional[str] = None, limit: int = 0) -> tuple[list[dict], list[str]]:
    """(the records, one line per line of history.jsonl that is not a record: its number
    and why). A torn last line (a crash mid-append) is neither: it is skipped."""
    path = history_path(workspace)
    out, problems = [], []
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return [], []
    with fh:
        for number, raw in enumerate(fh, 1):
            if not raw.endswith(b"\n"):
                break
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                problems.append(f"{path} line {number}: not JSON: {raw[:60].decode('utf-8', 'replace').strip()!r}")
                continue
            problem = history_problem(rec)
            if problem:
                problems.append(f"{path} line {number}: {problem}")
            elif run is None or rec.get("run") == run:
                out.append(rec)
    return (out[-limit:] if limit else out), problems


def _pid_of(path: str) -> Optional[int]:
    try:
        with open(path) as fh:
            doc = json.load(fh)
        return int(doc.get("pid")) if isinstance(doc, dict) and doc.get("pid") else None
    except (OSError, ValueError, TypeError):
        return None


def survivors(workspace: str, run: str) -> list[dict]:
    from agent import procs  # the agent's own process helpers (PID table, env marker)

    run_dir = os.path.join(workspace, "runs", run)
    roots = [p for p in (_pid_of(os.path.join(run_dir, protocol.JOB_PID)),
                         _pid_of(os.path.join(run_dir, protocol.AGENT_PID))) if p]
    pids = procs.descendants(roots, marker={protocol.ENV_RUN_ID: run}) | {
        p for p in roots if (st := procs.stat(p)) is not None and st["state"] not in ("Z", "X")}
    return [{"pid": pid, "cmdline": " ".join(procs.cmdline(pid))[:300]} for pid in sorted(pids)]


_read = read_json_doc  # agent/protocol.py


def _runs(workspace: str) -> list[tuple[str, bool]]:
    """(name, live) of every run directory in the workspace."""
    root = os.path.join(workspace, "runs")
    try:
        names = [n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n))]
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        try:
            st = protocol.RunStatus.load(os.path.join(root, name, protocol.STATUS))
        except ValueError:  # a state this agent does not know
            st = protocol.RunStatus()
        out.append((name, st.state is not None and not st.terminal))
    return out


def live_runs(workspace: str) -> list[str]:
    return sorted(name for name, live in _runs(workspace) if live)


def latest_run(workspace: str) -> Optional[str]:
    """The run to act on when none is named: a live one if any, else the newest."""
    root = os.path.join(workspace, "runs")
    runs = _runs(workspace)
    if not runs:
        return None
    return max(runs, key=lambda r: (r[1], os.path.getmtime(os.path.join(root, r[0]))))[0]


def run_info(workspace: str, run: str) -> dict:
    """State, spec, launch record and last checkpoint of one run (what the report needs)."""
    run_dir = os.path.join(workspace, "runs", run)
    from agent.rundir import RunDir, read_status

    info: dict = {"run": run, "run_dir": run_dir, "exists": os.path.isdir(run_dir)}
    status, corrupt = read_status(RunDir(run_dir))
    try:
        result = protocol.RunResult.load(os.path.join(run_dir, protocol.RESULT))
    except protocol.CorruptFile as exc:
        result, corrupt = None, str(exc)
    info["corrupt"] = corrupt
    info["status"] = status.to_json() if status.state else None
    info["result"] = result.to_json() if result else None
    info["spec"] = _read(os.path.join(run_dir, protocol.SPEC))
    info["launch"] = _read(os.path.join(workspace, ".dflash-ctl", "launches", f"{run}.json"))
    last = None
    for _, rec in protocol.read_json_lines(os.path.join(run_dir, protocol.EVENTS)):
        if rec.get("kind") == "checkpoint" and rec.get("path"):
            last = {"step": rec.get("step"), "path": rec["path"]}
    if last is not None:
        path = last["path"] if os.path.isabs(last["path"]) else os.path.join(run_dir, last["path"])
        last["exists"] = os.path.exists(path)
    info["checkpoint"] = last
    info["started_from"] = started_from(os.path.join(run_dir, protocol.START_SCRIPT))
    return info


def started_from(start_script: str) -> Optional[dict]:
    """The start decision in the run's start.sh (one trainer flag per line, shell-quoted):
    {"kind": "resume"|"init", "path"} or None for --from-scratch. A failed run with no
    checkpoint of its own is resumed from where it started."""
    import shlex

    try:
        with open(start_script, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        for flag, kind in (("--resume-from", "resume"), ("--init-from", "init")):
            if flag in tokens and tokens.index(flag) + 1 < len(tokens):
                path = tokens[tokens.index(flag) + 1]
                return {"kind": kind, "path": path, "exists": os.path.exists(path)}
            for tok in tokens:
                if tok.startswith(flag + "="):
                    path = tok.split("=", 1)[1]
                    return {"kind": kind, "path": path, "exists": os.path.exists(path)}
    return None


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m agent.recovery")
    p.add_argument("--workspace", default=os.environ.get(protocol.ENV_WORKSPACE) or protocol.DEFAULT_WORKSPACE)
    sub = p.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("survivors")
    s.add_argument("--run", required=True)
    sub.add_parser("gpus")
    sub.add_parser("known-good", help="the known-good env record, folded up to date (agent.knowngood)")
    s = sub.add_parser("run-info")
    s.add_argument("--run", help="default: the live run, else the newest")
    sub.add_parser("history-append", help="one JSON record on stdin")
    s = sub.add_parser("claim", help="take the container's kill-and-rollback claim")
    s.add_argument("--holder", required=True)
    s.add_argument("--ttl", type=float, required=True)
    s = sub.add_parser("release", help="drop the claim taken with --token")
    s.add_argument("--token", required=True)
    s = sub.add_parser("history")
    s.add_argument("--run")
    s.add_argument("--limit", type=int, default=0)
    args = p.parse_args(argv)
    try:
        protocol.check_run_arg(getattr(args, "run", None))
    except protocol.BadRunId as exc:
        sys.stdout.write(wrap_payload({"ok": False, "error": str(exc)}))
        print(f"agent.recovery {args.verb}: {exc}", file=sys.stderr)
        return protocol.EXIT_USAGE
    if args.verb == "survivors":
        body = {"run": args.run, "survivors": survivors(args.workspace, args.run)}
    elif args.verb == "run-info":
        run = args.run or latest_run(args.workspace)
        body = run_info(args.workspace, run) if run else {"run": None, "exists": False}
        body["live_runs"] = live_runs(args.workspace)
    elif args.verb == "known-good":
        from agent import knowngood

        body = {"env": knowngood.update(args.workspace).get("env")}
    elif args.verb == "gpus":
        from agent import gpus

        body = gpus.sample()
    elif args.verb == "claim":
        body = claim(args.workspace, args.holder, args.ttl)
    elif args.verb == "release":
        body = {"released": release(args.workspace, args.token)}
    elif args.verb == "history-append":
        body = {"record": append_history(args.workspace, json.load(sys.stdin))}
    else:
        records, problems = read_history(args.workspace, args.run, args.limit)
        body = {"records": records, "problems": problems}
    body["ok"] = True
    sys.stdout.write(wrap_payload(body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
