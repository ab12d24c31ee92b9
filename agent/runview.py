"""Read-only views of a container's runs for `ctl status`, `ctl runs` and `ctl tail`, each
answered in one call (one round trip):

    python3 -m agent.runview status --workspace W [--run ID]   # the run (default: latest)
    python3 -m agent.runview stream --workspace W [--run ID] --from SEQ   # what exists now

``status`` re-attaches an agent to a run that has none (agent/daemon.py revive_if_gone),
resolves "the latest run" itself (so the operator's default costs no extra
listing round trip), returns the agent's status.json and result.json, whether the agent and
the job are alive, the run's launch record and the known-good baseline for its config
(updated first: a run that reached steady state since the last look becomes the baseline).
``stream`` is ``agent follow`` that stops at the current end instead of waiting for more;
it too defaults to the latest run, so `ctl tail` without --follow is one round trip.

Standard library only; apart from starting an agent for an unsupervised run, it reads what
the agent writes and never writes into a run.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace
from typing import Optional

from agent import knowngood, procs
from agent.daemon import revive_if_gone
from agent.protocol import (DEFAULT_WORKSPACE, ENV_WORKSPACE, EVENTS, EXIT_USAGE, SPEC, BadRunId, CorruptFile,
                            FailureKind, RunResult, RunStatus, ServedCheck, check_run_arg, load_json_object, read_json_lines, wrap_payload)
from agent.rundir import RunDir, agent_alive, agent_live_or_none, read_json, read_status


def runs(workspace: str) -> list[dict]:
    """Run directories that hold a spec, oldest first (by the agent's creation time)."""
    base = os.path.join(workspace, "runs")
    out = []
    for name in os.listdir(base) if os.path.isdir(base) else []:
        path = os.path.join(base, name, SPEC)
        if not os.path.exists(path):
            continue
        spec = read_json(path) or {}  # a corrupt spec still names a run (status says what is wrong)
        created = spec.get("created")
        out.append({"run_id": name, "run_dir": os.path.join(base, name),
                    "created": created if isinstance(created, (int, float)) else os.path.getmtime(path)})
    return sorted(out, key=lambda r: (r["created"], r["run_id"]))


HISTORY_POINTS = 200  # at most this many (step, loss, tokens/s) points, and τ points, travel to `ctl status`
HISTORY_BYTES = 16 << 20  # of events.jsonl read for them: a long run's recent part


def history(run_dir: str) -> dict:
    """Loss and tokens/s over the run from its step events, thinned to HISTORY_POINTS (every
    k-th step), and τ at each save from its eval events with the best so far, for `ctl
    status`'s inline charts."""
    path = os.path.join(run_dir, EVENTS)
    try:
        size = os.path.getsize(path)
    except OSError:
        return {"step": [], "loss": [], "tokens_per_s": [], "eval_step": [], "tau": [], "best": None, "served": []}
    offset = max(0, size - HISTORY_BYTES)
    seen, rows, evals, served = set(), [], {}, {}
    for _, r in read_json_lines(path, offset):  # the first line may be torn by the offset: skipped
        if r.get("kind") == "step" and r.get("step") not in seen:  # one row a step, whichever rank said it
            seen.add(r.get("step"))
            rows.append((r.get("step"), r.get("loss"), r.get("tokens_per_s")))
        elif r.get("kind") == "eval" and isinstance(r.get("tau"), (int, float)):  # τ at each save
            evals[r.get("step")] = (r.get("tau"), r.get("best_step"), r.get("best_tau"))
        elif r.get("kind") == "served_check":  # served τ beside τ at save (agent/servedcheck.py): the last per step
            rec = ServedCheck.from_json(r)
            if rec is not None:
                served[rec.step] = {k: v for k, v in rec.to_json().items() if k in SERVED_FIELDS}
    every = max(1, -(-len(rows) // HISTORY_POINTS))
    rows = rows[::every]
    taus = sorted((s, *v) for s, v in evals.items() if isinstance(s, int))[-HISTORY_POINTS:]
    return {"step": [r[0] for r in rows], "loss": [r[1] for r in rows], "tokens_per_s": [r[2] for r in rows],
            "eval_step": [t[0] for t in taus], "tau": [t[1] for t in taus],
            "best": {"step": taus[-1][2], "tau": taus[-1][3]} if taus and taus[-1][2] is not None else None,
            "served": [served[k] for k in sorted(served)][-SERVED_POINTS:]}


SERVED_POINTS = 20  # the last served checks `ctl status` lists
SERVED_FIELDS = ("step", "tau_served", "tau_at_save", "ok", "verdict", "causes", "device", "run_id")


_DIED_WITH_HOST = (FailureKind.CONTAINER_RESTART.value, FailureKind.NODE_REBOOT.value)


def host_restart_of(restart: Optional[dict], st: RunStatus, result: Optional[RunResult]) -> Optional[dict]:
    """The restart (or reboot) the run died with, {"kind", "at", "step"}, or None.

    ``restart`` (the marks' verdict) was taken before ``result``, and ``result`` was read
    before ``st``. The agent that ends such a run writes result.json, then status.json with
    ``host_restart``; every pair of those a reader can see names the restart: status.json
    already says it, or result.json's root cause is it, or neither file has ended the run yet
    and the marks say it. A run that ended on its own before the restart is not named."""
    if st.host_restart:
        return st.host_restart
    cause = (result.root_cause or {}) if result else {}
    if cause.get("kind") in _DIED_WITH_HOST:
        details = cause.get("details") or {}
        return {"kind": details.get("kind") or ("container" if cause["kind"] == _DIED_WITH_HOST[0] else "node"),
                "at": details.get("at"), "step": details.get("step", st.step)}
    if restart and result is None and not st.terminal:
        return dict(restart, step=st.step)
    return None


def status(workspace: str, run: Optional[str] = None) -> dict:
    all_runs = runs(workspace)
    if run is None:
        if not all_runs:
            return {"ok": False, "error": f"no runs in {workspace}/runs yet: start one with `ctl launch`"}
        run = all_runs[-1]["run_id"]
    rd = RunDir(os.path.join(workspace, "runs", run))
    if not os.path.exists(rd.spec):
        known = ", ".join(r["run_id"] for r in all_runs[-5:]) or "none"
        return {"ok": False, "error": f"no run {run!r} in {workspace}/runs (latest: {known}); `ctl runs` lists them"}
    # Read before anything is started: a container restart or node reboot under an
    # unfinished run is said even where no agent may be started (--revive 0). Taken first,
    # from the job's marks alone (job.pid is written at spawn, never after), and never skipped
    # for a run that looks finished: an agent re-attached by someone else (a follower) may be
    # ending the run right now, and the files it writes are read after this (host_restart_of).
    restart = procs.restart_since((read_json(rd.job_pid) or {}).get("boot"))
    try:
        spec = load_json_object(rd.spec) or {}
        result = RunResult.load(rd.result)
    except CorruptFile as exc:
        return {"ok": False, "corrupt": exc.path, "run_id": run,
                "error": f"run {run}: {exc}; nothing was started or changed"}
    st, corrupt = read_status(rd)
    # Nobody supervises a run whose agent died: the one who looks brings one back.
    # Never one that has ended (result.json is there) or whose status cannot be read.
    revived = None if corrupt else revive_if_gone(rd, "ctl status")
    if revived:
        st, corrupt = read_status(rd)
        result = RunResult.load(rd.result)
    try:
        known_good = knowngood.update(workspace)
    except OSError:
        known_good = knowngood.load(workspace)
    launch = read_json(knowngood.launch_record_path(workspace, run)) or {}
    config = launch.get("config")
    baseline = ((known_good.get("configs") or {}).get(config) or {}) if config else {}
    return {"ok": True, "run_id": run, "run_dir": rd.path, "latest": all_runs[-1]["run_id"] == run,
            "spec": {k: spec.get(k) for k in ("run_id", "created", "argv", "cwd", "options")},
            "status": st.to_json(), "result": result.to_json() if result else None,
            "warnings": [corrupt] if corrupt else [],
            "host_restart": host_restart_of(restart, st, result),
            "resume": {k: launch.get(k) for k in ("config", "config_file", "sets")},
            "agent_alive": agent_alive(rd), "job_alive": agent_live_or_none(rd.job_pid), "revived": revived,
            "config": config, "start": launch.get("start"), "gpus": launch.get("gpus"),
            "kind": launch.get("kind") or "train",
            "baseline": {"run_id": baseline.get("run_id"), "steady": baseline.get("steady")} if baseline else None,
            "known_good_run": (known_good.get("env") or {}).get("run_id"), "history": history(rd.path),
            "alerts": _alerts(rd.path)}


def _alerts(run_dir: str) -> dict:
    from agent.alertcmd import summary  # here: only a run's status pays for reading its alerts

    return summary(run_dir)


def _defaults() -> dict:
    return {"workspace": os.environ.get(ENV_WORKSPACE) or DEFAULT_WORKSPACE, "run": None, "from_seq": 0}


def _plain_args(argv: list[str]) -> Optional[dict]:
    """The command line as the controller sends it — the verb, then ``--workspace W``, ``--run R``
    and ``--from N`` as separate words — read without argparse, which (with the gettext, locale
    and shutil it loads for its help) was ≈ 7 ms of `ctl status`'s call; None for anything else,
    which argparse reads (help, errors) as before. tests/test_records.py checks both agree."""
    if not argv or argv[0] not in ("status", "stream") or len(argv) % 2 == 0:
        return None
    args = dict(_defaults(), verb=argv[0])
    for flag, value in zip(argv[1::2], argv[2::2]):
        key = {"--workspace": "workspace", "--run": "run", "--from": "from_seq"}.get(flag)
        if key is None or value.startswith("-") or (key == "from_seq" and not (value.isascii() and value.isdigit())):
            return None
        args[key] = int(value) if key == "from_seq" else value
    return args


def parse_args(argv: Optional[list[str]] = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    plain = _plain_args(argv)
    if plain is not None:
        return plain
    import argparse

    p = argparse.ArgumentParser(prog="python3 -m agent.runview")
    p.add_argument("verb", choices=("status", "stream"))
    p.add_argument("--workspace", default=_defaults()["workspace"])
    p.add_argument("--run")
    p.add_argument("--from", dest="from_seq", type=int, default=0)
    return vars(p.parse_args(argv))


def main(argv: Optional[list[str]] = None) -> int:
    args = SimpleNamespace(**parse_args(argv))
    try:
        check_run_arg(args.run)
    except BadRunId as exc:
        sys.stdout.write(wrap_payload({"ok": False, "error": str(exc)}))
        print(f"agent.runview {args.verb}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.verb == "status":
        reply = status(args.workspace, args.run)
        sys.stdout.write(wrap_payload(reply))
        return 0 if reply.get("ok") else 1
    from agent.stream import follow

    run = args.run
    if not run:
        all_runs = runs(args.workspace)
        if not all_runs:
            print(f"agent.runview stream: no runs in {args.workspace}/runs yet: start one with `ctl launch`",
                  file=sys.stderr)
            return 2
        run = all_runs[-1]["run_id"]
    rd = RunDir(os.path.join(args.workspace, "runs", run))
    if not os.path.isdir(rd.path):
        print(f"agent.runview stream: no run directory {rd.path}", file=sys.stderr)
        return 2
    try:
        return follow(rd.path, args.from_seq, sys.stdout.buffer, lambda: agent_alive(rd), once=True)
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
