"""`ctl kill-and-rollback`: stop a run cleanly, restore the environment that worked, say
what changed and how to resume.

The story (docs/design.md): a torch upgrade cu128 → cu130 ate ~200 MB per GPU, the run OOMed
and recovery meant killing everything and rolling torch back by hand. The order here is
the lesson of docs/research/proxmox-and-supervision.md §2 and §7.3:

1. stop: the agent's ``stop --grace S`` (SIGTERM → the trainer checkpoints and exits 75 →
   SIGKILL of every remaining descendant), then an independent scan for any process that
   still carries the run's marker, and on GPUs a check that the run's GPUs hold no process;
   a run that cannot be stopped refuses the rollback (nothing is touched);
2. roll back: switch the venv to an existing generation (agent/envgen.py: one rename), or
   ``pct rollback`` to a snapshot — which hard-stops the container with lxc-stop --kill, so
   it only ever happens after step 1 — then ``pct start`` and wait until it answers;
3. verify: the venv's fingerprint after equals the target's; report packages up / down /
   added / removed and the torch build, the checkpoint to resume from and the exact
   ``ctl launch … --resume-from …`` line;
4. record the kill and the rollback in the container's history (agent/recovery.py).

Planning reads only; ``--dry-run`` stops after the plan. Every refusal happens before the
first change and names what to do.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from agent.protocol import RunResult, RunStatus
from controller import envgen_client as eg
from controller.agentcall import AgentCaller
from controller import snapshots as snaps
from controller.container import Container, ContainerError
from controller.resume import resume_line

# Extra seconds, after the agent's stop returned, for SIGKILLed processes to be reaped.
SURVIVOR_WAIT_S = 10.0
GPU_RELEASE_WAIT_S = 30.0


class RollbackRefused(ContainerError):
    """Refused before anything was changed; the message says why and what to do."""


@dataclass
class Target:
    kind: str  # "env" | "snapshot"
    ref: str  # generation id | snapshot name
    why: str  # how it was chosen, for the report
    expected_id: Optional[str] = None  # venv fingerprint id expected after the rollback
    snapshot: Optional[snaps.Snapshot] = None

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.ref}"


@dataclass
class Plan:
    ctid: str
    run: Optional[str]
    run_state: Optional[str]
    run_live: bool
    grace: float
    target: Target
    before: dict  # fingerprint of the venv now (agent.envgen format)
    diff: Optional[dict]  # env rollbacks: known before acting
    checkpoint: Optional[dict]
    launch: Optional[dict]
    gpus: list[int] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"container {self.ctid}: kill-and-rollback plan"]
        if self.run is None:
            out.append("  1. stop: no run in this container; nothing to stop")
        elif self.run_live:
            out.append(f"  1. stop run {self.run} ({self.run_state}): SIGTERM, {self.grace:g} s for the trainer to "
                       f"checkpoint and exit, then SIGKILL of every remaining process of the run")
        else:
            out.append(f"  1. stop: run {self.run} already ended ({self.run_state}); check that none of its "
                       f"processes is left")
        t = self.target
        if t.kind == "env" and t.ref == self.before.get("id"):
            out.append(f"  2. the venv already runs generation {t.ref} ({t.why}): nothing to switch")
        elif t.kind == "env":
            out.append(f"  2. switch the venv to generation {t.ref} ({t.why}); the current one "
                       f"({self.before.get('id')}) is kept")
            if self.diff is not None:
                out += ["     " + line for line in render_diff(self.diff)]
        else:
            out.append(f"  2. pct rollback {self.ctid} {t.ref} ({t.why}): Proxmox hard-stops the container, "
                       f"every file of its root filesystem returns to the snapshot; then pct start")
        out.append("  3. verify the venv fingerprint and print how to resume")
        return out


# A generation as agent/genstore.py resolves it: current (or @), its id or a prefix of one, with
# or without the gen- of its directory name.
_GENERATION_REF = re.compile(r"current|@|(gen-)?[0-9a-f]{1,64}")


def parse_to(text: str) -> tuple[str, Optional[str]]:
    """``--to``'s target, checked before anything connects; RollbackRefused names what is wrong."""
    if text in ("last-good", "known-good"):
        return "last-good", None
    kind, sep, ref = text.partition(":")
    if sep and kind == "env" and _GENERATION_REF.fullmatch(ref):
        return kind, ref
    if sep and kind == "env":
        raise RollbackRefused(f"--to {text!r}: a generation is its id (hex, a unique prefix will do) or current; "
                              "`ctl env list` shows them")
    if sep and kind == "snapshot" and ref:
        why = snaps.name_problem(ref)
        if why:
            raise RollbackRefused(f"--to {text!r}: {why}")
        return kind, ref
    raise RollbackRefused(f"--to {text!r}: give last-good, env:GENERATION or snapshot:NAME")


def render_diff(diff: dict) -> list[str]:
    """Packages up / down / added / removed, torch build and python: one line each."""
    out = []
    tb = diff.get("torch_build")
    if tb:
        out.append(f"torch build {tb['from']} → {tb['to']}")
    if diff.get("python"):
        out.append(f"python {diff['python']['from']} → {diff['python']['to']}")
    for key, arrow in (("up", "↑"), ("down", "↓")):
        for p in diff.get(key, []):
            out.append(f"{arrow} {p['name']} {p['from']} → {p['to']}")
    for p in diff.get("added", []):
        out.append(f"+ {p['name']} {p['to']}")
    for p in diff.get("removed", []):
        out.append(f"- {p['name']} {p['from']}")
    return out or ["no package changes"]


def known_good(ct: Container) -> Optional[dict]:
    """The container's known-good env record (agent/knowngood.py), brought up to date first
    so a run that reached steady state since the last launch or status counts."""
    env = eg.recovery(ct, "known-good").get("env")
    return env if env and env.get("fingerprint") else None


def known_good_generation(ct: Container) -> tuple[dict, Optional[str]]:
    """(known-good record, the generation holding its exact package set or None)."""
    env = known_good(ct)
    if env is None:
        raise RollbackRefused(
            f"container {ct.ctid} has no known-good run yet (a run becomes known-good when it reaches steady "
            f"state), so there is no last-good environment; name the target: --to env:GENERATION "
            f"(`ctl env list --container {ct.ctid}`) or --to snapshot:NAME")
    packages = env["fingerprint"].get("packages") or {}  # agent/envfp.py: {name: version}
    hits = eg.envgen(ct, "match", stdin=json.dumps(packages).encode())["matches"]
    return env, (hits[0] if hits else None)


def pin_known_good(ct: Container) -> Optional[str]:
    """Pin the known-good run's generation so `ctl env remove` never deletes it."""
    try:
        env, gid = known_good_generation(ct)
    except RollbackRefused:
        return None
    if gid:
        eg.envgen(ct, "pin", "--ref", f"known-good-{env.get('run_id')}", "--gen", gid)
    return gid


def resolve_target(ct: Container, to: str) -> Target:
    kind, ref = parse_to(to)
    if kind == "last-good":
        env, gid = known_good_generation(ct)
        if gid is None:
            raise RollbackRefused(
                f"the known-good run {env.get('run_id')} of container {ct.ctid} used a package set that no "
                f"generation of {ct.config.venv} holds (the venv was changed outside `ctl env install`?); "
                f"nothing changed. See `ctl env list --container {ct.ctid}` and pick --to env:GENERATION")
        return Target("env", gid, f"the env of known-good run {env.get('run_id')}", expected_id=gid)
    if kind == "env":
        shown = eg.envgen(ct, "show", ref)  # refuses, naming the known ones, if it does not exist
        if not shown.get("managed", True):
            raise RollbackRefused(f"{ct.config.venv} in container {ct.ctid} is a plain venv, not generations: there "
                                  f"is no other environment to roll back to (`ctl env install` keeps the old one)")
        return Target("env", shown["id"], "named on the command line", expected_id=shown["id"])
    try:
        snap = snaps.find_snapshot(ct, ref)
    except snaps.SnapshotMissing as exc:
        raise RollbackRefused(str(exc)) from None
    return Target("snapshot", snap.name, f"taken {snap.taken or 'at an unknown time'}: {snap.description}",
                  expected_id=snap.venv_id, snapshot=snap)


def current_fingerprint(ct: Container) -> dict:
    """The venv as a new process gets it now. If its python does not even run (the kind of
    breakage a rollback is for), fall back to what was recorded for the current generation."""
    try:
        return eg.envgen(ct, "fingerprint")
    except ContainerError as exc:
        try:
            recorded = eg.envgen(ct, "show", "current").get("fingerprint") or {}
        except ContainerError:
            recorded = {}
        return dict(recorded, unrunnable=str(exc))


def _gpus_of(info: dict) -> list[int]:
    launch = info.get("launch") or {}
    gpus = launch.get("gpus") or {}
    ids: set[int] = set()
    if isinstance(gpus, dict):
        for v in gpus.values():
            ids.update(int(x) for x in (v or []))
    elif isinstance(gpus, list):
        ids.update(int(x) for x in gpus)
    return sorted(ids)


def make_plan(ct: Container, run: Optional[str], to: str, grace: float) -> Plan:
    info = eg.recovery(ct, "run-info", *(["--run", run] if run else []))
    if run and not info.get("exists"):
        raise RollbackRefused(f"run {run} does not exist in container {ct.ctid} "
                              f"({ct.config.workspace}/runs/{run}); see `ctl status --container {ct.ctid}`")
    live_runs = info.get("live_runs") or []
    if not run and len(live_runs) > 1:
        # Picking one would leave the other running on the GPUs the rollback is meant to free.
        raise RollbackRefused(f"{len(live_runs)} runs are live in container {ct.ctid} ({', '.join(live_runs)}): "
                              f"name the one to stop with --run; nothing changed")
    run = info.get("run")
    status = RunStatus.from_json(info.get("status"))
    state = status.state.value if run and status.state else None
    live = bool(run) and not status.terminal
    target = resolve_target(ct, to)
    before = current_fingerprint(ct)
    diff = None
    if target.kind == "env":
        diff = eg.envgen(ct, "diff", "current", target.ref)
    return Plan(ct.ctid, run, state, live, grace, target, before, diff, info.get("checkpoint"),
                info.get("launch"), _gpus_of(info))


# --- acting -------------------------------------------------------------------------------

# How long a claim outlives a ctl that died holding it, past the stop's grace.
CLAIM_SLACK_S = 900.0


@contextlib.contextmanager
def claimed(ct: Container, grace: float) -> Iterator[None]:
    """The container's kill-and-rollback claim (agent/recovery.py) for the whole command:
    two at once would both stop the run and both record a kill and a rollback; the second
    is refused, naming the first."""
    import getpass
    import os
    import socket

    holder = f"ctl pid {os.getpid()} of {getpass.getuser()}@{socket.gethostname()}"
    got = eg.recovery(ct, "claim", "--holder", holder, "--ttl", f"{grace + CLAIM_SLACK_S:g}")
    if not got.get("claimed"):
        held = got.get("holder") or {}
        since = time.strftime("%H:%M:%S", time.gmtime(held["ts"])) + "Z" if held.get("ts") else "an unknown time"
        raise RollbackRefused(f"another kill-and-rollback in container {ct.ctid} ({held.get('holder')}, since "
                              f"{since}) is under way; let it finish, then see "
                              f"`ctl history --container {ct.ctid}`")
    try:
        yield
    finally:
        try:
            eg.recovery(ct, "release", "--token", got["token"])
        except Exception:  # noqa: BLE001 - a snapshot rollback took the claim file with it, or the
            pass  # container is gone: the claim expires on its own

@dataclass
class Report:
    plan: Plan
    stop: dict = field(default_factory=dict)
    rollback: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)
    diff: Optional[dict] = None
    verified: bool = False
    checkpoint: Optional[dict] = None
    resume_line: Optional[str] = None
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        p, t = self.plan, self.plan.target
        out = []
        if p.run:
            s = self.stop
            out.append(f"stopped   run {p.run}: {s.get('how')}; processes left: none"
                       + (f"; GPUs {', '.join(map(str, p.gpus))} released" if s.get("gpus_checked") else ""))
        out.append(f"rolled back to {t.label} ({t.why})")
        mark = "OK" if self.verified else "MISMATCH"
        out.append(f"verified  venv fingerprint {self.after.get('id')} "
                   + (f"== target {t.expected_id}" if t.expected_id else "(snapshot recorded no venv id)")
                   + f"  [{mark}]")
        out.append("changed:")
        out += ["  " + line for line in render_diff(self.diff or {})]
        out += self.notes
        ck = self.checkpoint
        if ck and ck.get("exists", True):
            origin = f" ({ck['origin']})" if ck.get("origin") else ""
            out.append(f"resume from checkpoint {ck['path']}" + (f" (step {ck['step']})" if ck.get("step") is not None
                                                                 else "") + origin)
            out.append(f"  {self.resume_line}")
        elif ck:
            out.append(f"the last checkpoint {ck['path']} (step {ck.get('step')}) no longer exists"
                       + (" (it was inside the rolled-back root filesystem)" if t.kind == "snapshot" else ""))
            out.append(f"  start again: {self.resume_line}")
        elif p.run:
            out.append(f"no checkpoint of run {p.run} to resume from; start again: {self.resume_line}")
        else:
            out.append(f"start a run: {self.resume_line}")
        return out


def pick_checkpoint(info: dict, plan: Plan) -> Optional[dict]:
    """The run's own last checkpoint; else, for a run that was itself a resume and failed
    before writing one, the checkpoint it started from; else what the plan saw before a
    snapshot rollback took the run directory away (marked as gone)."""
    own = info.get("checkpoint")
    if own and own.get("exists", True):
        return own
    start = info.get("started_from") or {}
    if start.get("kind") == "resume" and start.get("exists"):
        return {"path": start["path"], "step": None, "exists": True, "origin": "the checkpoint the run started from"}
    if own:
        return own
    if plan.checkpoint:
        return dict(plan.checkpoint, exists=False)
    return None


def stop_run(ct: Container, plan: Plan, say: Callable[[str], None]) -> dict:
    """Graceful stop through the agent, then an independent check that nothing is left."""
    out: dict[str, Any] = {"how": "had already ended"}
    if plan.run_live:
        say(f"stopping run {plan.run} (SIGTERM, up to {plan.grace:g} s to checkpoint, then SIGKILL) …")
        try:
            # The system python: the venv is what is about to be rolled back (controller/agentcall.py).
            reply = AgentCaller(ct, python="system").call(
                "agent", ["stop", "--run", plan.run, "--workspace", ct.config.workspace, "--grace", f"{plan.grace:g}"],
                what="agent stop", check=True)
        except ContainerError as exc:
            reply = {"error": str(exc)}
        out["agent"] = reply
        result = RunResult.from_json(reply.get("result"))
        out["how"] = (f"ended {reply.get('state')}" + (f" ({result.reason})" if result and result.reason else "")
                      if "error" not in reply else f"agent stop failed: {reply['error']}")
    deadline = time.monotonic() + SURVIVOR_WAIT_S
    while True:
        left = eg.recovery(ct, "survivors", "--run", plan.run)["survivors"]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    if left:
        listing = "; ".join(f"pid {p['pid']}: {p['cmdline']}" for p in left[:8])
        raise RollbackRefused(
            f"run {plan.run} in container {ct.ctid} cannot be stopped: {len(left)} of its processes are still "
            f"alive after the stop ({out['how']}): {listing}. Nothing was rolled back; find what restarts them "
            f"(`ctl exec --container {ct.ctid} -- ps -ef`) and rerun.")
    out["survivors"] = []
    out.update(_gpus_released(ct, plan))
    return out


def _gpus_released(ct: Container, plan: Plan) -> dict:
    """NVML inside LXC lists host PIDs (docs/research/proxmox-and-supervision.md §1.3), so we
    cannot match them to the run; we ask that the run's GPUs list no compute process at all
    once the run is gone."""
    deadline = time.monotonic() + GPU_RELEASE_WAIT_S
    while True:
        sample = eg.recovery(ct, "gpus")
        if not sample.get("gpus"):
            return {"gpus_checked": False, "gpus_note": f"no GPUs visible ({sample.get('reason')})"}
        busy = [g for g in sample["gpus"] if (not plan.gpus or g.get("index") in plan.gpus) and g.get("processes")]
        if not busy:
            return {"gpus_checked": True, "gpus": [{k: g.get(k) for k in ("index", "memory_used_mib")}
                                                   for g in sample["gpus"]]}
        if time.monotonic() > deadline:
            what = ", ".join(f"GPU {g['index']} ({g.get('memory_used_mib')} MiB used, "
                             f"{len(g['processes'])} process(es))" for g in busy)
            raise RollbackRefused(f"run {plan.run} in container {ct.ctid} is stopped but its GPU memory is not "
                                  f"released: {what}. Nothing was rolled back; check the GPUs on the node "
                                  f"(nvidia-smi) and rerun.")
        time.sleep(1.0)


def execute(ct: Container, plan: Plan, say: Callable[[str], None] = print) -> Report:
    report = Report(plan)
    t = plan.target
    history: list[dict] = []
    if plan.run:
        report.stop = stop_run(ct, plan, say)
        history.append({"event": "kill", "container": ct.ctid, "run": plan.run, "grace": plan.grace,
                        "how": report.stop.get("how"), "survivors": 0,
                        "gpus": report.stop.get("gpus") or report.stop.get("gpus_note")})
        if t.kind == "env":  # a snapshot rollback would erase it: written after, below
            eg.append_history(ct, history[-1])
    if t.kind == "env":
        say(f"switching {ct.config.venv} to generation {t.ref} …")
        sw = eg.envgen(ct, "switch", t.ref)
        report.rollback = {"from": sw.get("from"), "to": sw.get("to")}
        report.after = sw["fingerprint_after"]
        report.diff = eg.envgen(ct, "compare", stdin=json.dumps(
            {"old": plan.before, "new": report.after}).encode())
    else:
        say(f"pct rollback {ct.ctid} {t.ref} (the container is hard-stopped, then started) …")
        took = snaps.rollback(ct, t.ref)
        # A fresh handle: the agent bundle this one uploaded may have been erased with the
        # rest of the root filesystem, and the handle remembers it as present.
        ct = Container(ct.runner, ct.node_name, ct.node, ct.ctid)
        report.rollback = {"snapshot": t.ref, "restart_s": round(took, 2)}
        report.after = eg.envgen(ct, "fingerprint")
        report.diff = eg.envgen(ct, "compare", stdin=json.dumps(
            {"old": plan.before, "new": report.after}).encode())
        report.notes.append(f"  every file of container {ct.ctid}'s root filesystem is as it was at snapshot {t.ref} "
                            f"(bind mounts are not part of a snapshot)")
    report.verified = report.after.get("id") == t.expected_id if t.expected_id else True
    info = eg.recovery(ct, "run-info", "--run", plan.run) if plan.run else {}
    report.checkpoint = pick_checkpoint(info, plan) if plan.run else None
    report.resume_line = resume_line(ct.ctid, ct.node_name, info.get("launch") or plan.launch, report.checkpoint)
    history.append({"event": "rollback", "container": ct.ctid, "run": plan.run, "to": t.label, "why": t.why,
                    "from_env": plan.before.get("id"), "to_env": report.after.get("id"),
                    "verified": report.verified, "diff": report.diff,
                    "checkpoint": report.checkpoint, "resume": report.resume_line})
    for rec in (history if t.kind == "snapshot" else history[-1:]):
        eg.append_history(ct, rec)
    if not report.verified:
        raise ContainerError(f"container {ct.ctid}: after the rollback to {t.label} the venv fingerprint is "
                             f"{report.after.get('id')}, not {t.expected_id}: inspect with "
                             f"`ctl env show --container {ct.ctid}`")
    return report
