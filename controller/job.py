"""One training job across several containers, on one node or several (docs/design.md: "Scale
beyond one node").

    ctl launch --config run.toml --from-scratch \\
        --container sim:200 --container sim2:300 \\
        --target-gpus sim:200=0 --drafter-gpus sim2:300=0

Each container gets an ordinary launch (controller/launch.py: preflight, drift, start script,
its own agent) with one run id for all, its local GPU lists and the job flags of
trainer/multinode.py: ``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``, ``--rdzv-id``,
``--job-layout``. Node ranks are given in target-first order (containers with only target
ranks, then mixed, then drafter-only), so torchrun's rank numbering is the trainer's
(target ranks, then drafter ranks). The rendezvous endpoint is node rank 0's container:
its address on the job network and a port free there (``python3 -m agent.netinfo``).

Every preflight runs before any container starts; a refusal anywhere starts nothing. If a
later container's start fails, the ones already started are stopped.

Failure across containers: a dead rank closes its sockets, so its peers elsewhere fail
within seconds (agent: "peer failure"); a cut link fails them at ``--dist-timeout``
(agent: "network failure"). ``ctl status``/``ctl tail`` of a job pick the root cause:
the earliest failure that is neither, in the container where it happened; while following a
job, a container that failed makes the controller stop the others that are still running
(they would otherwise wait for their timeout).

The job's shape is kept beside the controller config (``jobs/<run-id>.json``) so `ctl tail`
and `ctl status` find every container of it from the run id.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

from agent.protocol import FailureKind, RunResult, RunState, RunStatus
from controller import config as cfg
from controller import interrupts
from controller import vmid
from controller.container import Container

JOBS_DIR = "jobs"
PEER_KINDS = ("peer_failure", "network_failure")


class JobError(Exception):
    """The job cannot be formed or started; the message names the container and the fix."""


class JobStartLost(Exception):
    """A container's start reply was lost (a dropped link, a Ctrl-C that reached ssh): its run
    may have started. Every run of the job that did or may have started was then stopped; the
    message names them and how to check."""


@dataclass(frozen=True)
class Member:
    node: str
    ctid: str
    target_gpus: tuple[int, ...] = ()
    drafter_gpus: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.node}:{self.ctid}"

    @property
    def colocated(self) -> bool:
        return bool(self.target_gpus) and self.target_gpus == self.drafter_gpus

    def layout_entry(self) -> str:
        if self.colocated:
            return str(len(self.target_gpus))
        return f"{len(self.target_gpus)}+{len(self.drafter_gpus)}"


# --- forming a job ------------------------------------------------------------------------------

def parse_container(text: str, default_node: Optional[str]) -> tuple[str, str]:
    node, _, ctid = text.rpartition(":")
    node = node or default_node or ""
    if not node:
        raise JobError(f"--container {text!r}: a job names each container as NODE:CTID, e.g. sim:200")
    why = vmid.problem(ctid)
    if why:
        raise JobError(f"--container {text}: {why}")
    return node, ctid


def parse_roles(text: Optional[str], option: str, default_node: Optional[str]) -> dict[str, tuple[int, ...]]:
    """'sim:200=0,1;sim2:300=0' → {'sim:200': (0, 1), 'sim2:300': (0,)}."""
    from trainer import flags  # here: `ctl status` and `ctl tail` import this module, not the flags

    out: dict[str, tuple[int, ...]] = {}
    for item in [t.strip() for t in (text or "").replace(" ", ";").split(";") if t.strip()]:
        where, eq, ids = item.partition("=")
        if not eq:
            raise JobError(f"{option} {item!r}: in a job give NODE:CTID=IDS per container, e.g. "
                           f"{option} sim:200=0,1;sim2:300=0")
        node, ctid = parse_container(where, default_node)
        try:
            out[f"{node}:{ctid}"] = flags.parse_gpus(ids)
        except ValueError as exc:
            raise JobError(f"{option} {item!r}: {exc}") from None
    return out


def plan(containers: list[str], target_gpus: Optional[str], drafter_gpus: Optional[str],
         default_node: Optional[str]) -> list[Member]:
    """Members in node-rank order (target-first), or JobError."""
    targets = parse_roles(target_gpus, "--target-gpus", default_node)
    drafters = parse_roles(drafter_gpus, "--drafter-gpus", default_node)
    members, seen = [], set()
    named = [parse_container(text, default_node) for text in containers]  # every id is checked first
    for node, ctid in named:
        label = f"{node}:{ctid}"
        if label in seen:
            raise JobError(f"--container {label} is named twice")
        seen.add(label)
        m = Member(node, ctid, targets.pop(label, ()), drafters.pop(label, ()))
        if not m.target_gpus and not m.drafter_gpus:
            raise JobError(f"container {label} has no GPU role: give --target-gpus {label}=IDS and/or "
                           f"--drafter-gpus {label}=IDS")
        members.append(m)
    stray = sorted(set(targets) | set(drafters))
    if stray:
        raise JobError(f"--target-gpus/--drafter-gpus name {', '.join(stray)}, which is not a --container of the job")
    return order(members)


def order(members: list[Member]) -> list[Member]:
    """Target-only containers, then mixed, then drafter-only (stable): torchrun numbers ranks
    container by container, and the trainer needs target ranks first (trainer/topology.py)."""
    if len({m.colocated for m in members}) > 1:
        raise JobError("a job is either colocated (equal --target-gpus and --drafter-gpus in every container) or "
                       "split (disjoint roles); these containers mix both: "
                       + ", ".join(f"{m.label} ({'colocated' if m.colocated else 'split'})" for m in members))
    if members[0].colocated:
        return list(members)

    def rank(m: Member) -> int:
        return 0 if not m.drafter_gpus else (2 if not m.target_gpus else 1)

    ordered = sorted(members, key=rank)
    if sum(1 for m in ordered if rank(m) == 1) > 1:
        raise JobError("at most one container may hold both target and drafter ranks (split mode): "
                       "global rank order is all target ranks, then all drafter ranks; move roles so that "
                       "only one container is mixed")
    return ordered


def layout(members: list[Member]) -> str:
    return ",".join(m.layout_entry() for m in members)


def job_values(member: Member, node_rank: int, members: list[Member], endpoint: str, run_id: str,
               dist_timeout: Optional[int]) -> dict:
    values = {"target_gpus": member.target_gpus, "drafter_gpus": member.drafter_gpus, "nnodes": len(members),
              "node_rank": node_rank, "rdzv_endpoint": endpoint, "rdzv_id": run_id, "job_layout": layout(members)}
    if dist_timeout:
        values["dist_timeout"] = int(dist_timeout)
    return values


# --- launch ---------------------------------------------------------------------------------------

@dataclass
class JobResult:
    run_id: str
    endpoint: Optional[str]  # None for a single container
    members: list[Member]
    starts: list[dict] = field(default_factory=list)
    round_trips: int = 0
    timings: dict = field(default_factory=dict)


def rendezvous_endpoint(ct: Container, say: Callable[[str], None]) -> str:
    from controller.agentcall import AgentCaller

    reply = AgentCaller(ct, say).call("agent.netinfo", [], what="the network of the job's first container")
    addrs = [a["address"] for a in reply.get("addresses") or []]
    if not addrs:
        raise JobError(f"{ct} has no network address besides loopback: the job's containers must reach each "
                       "other (on the sim: `ctl sim up` attaches them to its bridge)")
    return f"{addrs[0]}:{reply['free_port']}"


def pin_auto_budget(launchers: list, say: Callable[[str], None]) -> None:
    """``--token-budget auto`` decided once, here: every rank of the run trains with the
    smallest of the containers' answers (each from its GPUs' free memory), written into each
    start script as a number so no rank decides again."""
    answers = [ln.auto_budget for ln in launchers if ln.auto_budget is not None]
    if not answers:
        return
    budget = min(answers)
    for ln in launchers:
        ln.values["token_budget"] = budget
    if len(launchers) > 1:
        say(f"memory   --token-budget auto → {budget} for every rank (the smallest of the containers' answers)")


def setup_alerts(launcher, single: bool) -> None:
    """The run's alert settings into its container (controller/alertsetup.py); a failure there
    is a warning line — the run has started, and `ctl watch` delivers its alerts anyway."""
    from controller.alertsetup import configure_run

    cfg = launcher.config
    launch = {"config_file": cfg._source_file, "config": cfg.name, "sets": list(cfg._command_line_sets),
              "kind": "train"} if single else None
    try:
        configure_run(launcher.caller, launcher.ct, launcher.run_id, launcher.run_dir, getattr(cfg, "notify", None),
                      launch, launcher.say)
    except Exception as exc:  # noqa: BLE001 - said; never a failed launch for it
        launcher.say(f"alerts   warning: could not set up this run's alerts ({str(exc).splitlines()[0][:200]}); "
                     "`ctl watch` delivers them")


def launch(cts: list[Container], members: list[Member], run_config, start: dict, *, say: Callable[[str], None] = print,
           accept_drift: bool = False, wandb_key: Optional[str] = None, dist_timeout: Optional[int] = None,
           endpoint: Optional[str] = None, agent_options: Optional[dict] = None,
           run_id: Optional[str] = None, share_gpus: bool = False) -> JobResult:
    """Preflight and assess every container, then start each; nothing starts unless all pass.

    The one launch path: a single-container launch is a job of one member, which keeps the
    run config's own roles and needs no rendezvous. ``share_gpus``: start although a live run
    holds some of the GPUs (the preflight refuses it otherwise)."""
    from controller.launch import Assessment, Launcher, new_run_id
    from trainer import flags

    t0 = time.monotonic()
    run_id = run_id or new_run_id(run_config.name)
    single = len(members) == 1
    if not single:
        endpoint = endpoint or rendezvous_endpoint(cts[0], say)
        say(f"job {run_id}: {len(members)} containers, layout {layout(members)} (target+drafter ranks per "
            f"container), rendezvous {endpoint} in {members[0].label}")
    launchers = []
    for i, (ct, m) in enumerate(zip(cts, members)):
        prefix = "" if single else f"[{m.label}] "
        launcher = Launcher(ct, run_config, start, accept_drift=accept_drift, say=lambda line, p=prefix: say(p + line),
                            wandb_key=wandb_key, run_id=run_id, agent_options=dict(agent_options or {}),
                            share_gpus=share_gpus)
        if not single:
            # The container's own roles and its place in the job (trainer/multinode.py).
            launcher.values.update(job_values(m, i, members, endpoint, run_id, dist_timeout))
            problems = flags.check(launcher.values)
            if problems:
                raise JobError(f"container {m.label}: " + "; ".join(problems))
        launchers.append(launcher)
    # Every container is assessed before any starts, and every refusal is shown at once.
    interrupts.pause_point("launch.preflight")
    preflights, verdicts = [], []
    for launcher in launchers:
        pf = launcher.preflight()
        verdict = launcher.assess(pf)
        for line in verdict.lines:
            launcher.say(line)
        preflights.append(pf)
        verdicts.append(verdict)
    if single:
        verdicts[0].raise_if_refused(str(launchers[0].ct))
    else:
        refused = Assessment([line for v in verdicts for line in v.lines],
                             [f"{m.label}: {r}" for m, v in zip(members, verdicts) for r in v.refusals],
                             [f for v in verdicts for f in v.blocking])
        refused.raise_if_refused(f"job {run_id}")
    pin_auto_budget(launchers, say if not single else launchers[0].say)
    result = JobResult(run_id, endpoint, members)
    started: list[tuple[Container, Member]] = []
    # From here a Ctrl-C waits until the command has printed the run id (controller/interrupts.py).
    interrupts.hold()
    interrupts.pause_point("launch.commit")
    in_flight: Optional[tuple[Container, Member]] = None
    try:
        for launcher, pf, ct, m in zip(launchers, preflights, cts, members):
            in_flight = (ct, m)
            reply = launcher.commit(pf)
            result.starts.append(reply.get("start") or {})
            started.append(in_flight)
            in_flight = None
    except BaseException as exc:
        lost = in_flight is not None and _reply_lost(exc)
        if single:
            raise  # one run waits on nobody: the command names it and how to check, follow, stop it
        # A commit whose reply was lost may have started its run, which alone would wait at the
        # rendezvous for its peers until the timeout: it is stopped with those that did start.
        unreached = []
        for ct, m in started + ([in_flight] if lost else []):
            say(f"[{m.label}] stopping: another container of the job did not start")
            try:
                stop_member(ct, run_id, grace=5)
            except Exception as stop_exc:  # noqa: BLE001 - named in the message; the start's error goes on
                # (a start that never arrived is a refused stop's reply, not an exception)
                unreached.append(f"{m.label} ({str(stop_exc).splitlines()[0][:160]})")
        if lost:
            left = (f"; could not stop it in {', '.join(unreached)}: stop it with `ctl kill-and-rollback --run {run_id}` "
                    "once the node answers") if unreached else ""
            raise JobStartLost(f"job {run_id}: the start reply from {in_flight[1].label} was lost "
                               f"({str(exc).splitlines()[0][:200]}); it may have started, so the job was stopped "
                               f"wherever it ran{left}; check with `ctl status --run {run_id}`") from exc
        raise
    for launcher in launchers:
        setup_alerts(launcher, single)
    result.round_trips = sum(l.round_trips for l in launchers)
    result.timings = {"total_s": time.monotonic() - t0}
    return result


def _reply_lost(exc: BaseException) -> bool:
    """The commit was sent and no readable reply came back: its run may have started."""
    from controller.launch import LaunchRefused
    from controller.transport import TransportError

    return isinstance(exc, TransportError) or (isinstance(exc, LaunchRefused) and not exc.certain)


def stop_member(ct: Container, run_id: str, grace: float = 10.0) -> dict:
    from controller.agentcall import AgentCaller

    return AgentCaller(ct).call("agent", ["stop", "--workspace", ct.config.workspace, "--run", run_id,
                                          "--grace", grace], what="agent stop")


# --- the local job record -------------------------------------------------------------------------

def record_path(ctl_config: Optional[str], run_id: str) -> Path:
    return cfg.config_path(ctl_config).parent / JOBS_DIR / f"{run_id}.json"


def save_record(ctl_config: Optional[str], result: JobResult) -> Path:
    from agent.protocol import atomic_write_json

    path = record_path(ctl_config, result.run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(str(path), {"run_id": result.run_id, "endpoint": result.endpoint, "ts": time.time(),
                                  "layout": layout(result.members),
                                  "members": [dict(asdict(m), node_rank=i) for i, m in enumerate(result.members)]})
    return path


def load_record(ctl_config: Optional[str], run_id: str) -> Optional[list[Member]]:
    try:
        doc = json.loads(record_path(ctl_config, run_id).read_text())
    except (OSError, ValueError):
        return None
    return [Member(m["node"], str(m["ctid"]), tuple(m.get("target_gpus") or ()), tuple(m.get("drafter_gpus") or ()))
            for m in doc.get("members") or []]


# --- status across containers ---------------------------------------------------------------------

def member_failure(reply: dict) -> Optional[dict]:
    res = RunResult.from_json(reply.get("result"))
    if res and res.root_cause:
        return res.root_cause
    st = RunStatus.from_json(reply.get("status"))
    if st.state == RunState.FAILED:
        return {"kind": FailureKind.JOB_EXIT.value, "reason": st.reason or st.last_error, "ts": st.updated}
    return None


def job_verdict(replies: list[tuple[Member, dict]]) -> dict:
    """The job's state and root cause from its containers' status replies.

    State: failed if any container failed; running while any runs; completed when all did.
    Root cause: the earliest failure that is not a peer/network consequence; else the
    earliest network failure, else the earliest peer failure."""
    known = [RunStatus.from_json(r.get("status")).state for _, r in replies]
    states = [s.value if s else "unknown" for s in known]
    failures = [(m, f) for m, r in replies if (f := member_failure(r))]
    if RunState.FAILED in known:
        state = "failed"
    elif known and all(s == RunState.COMPLETED for s in known):
        state = "completed"
    elif any(s is not None and not s.is_terminal() for s in known):
        state = "running"
    else:
        state = states[0] if len(set(states)) == 1 else "mixed"
    root = None
    if failures:
        def key(item):
            kind = item[1].get("kind")
            tier = 2 if kind == "peer_failure" else (1 if kind == "network_failure" else 0)
            return (tier, item[1].get("ts") or 0)
        m, f = min(failures, key=key)
        root = dict(f, container=m.label, node=m.node, ctid=m.ctid)
    return {"state": state, "root_cause": root, "states": {m.label: s for (m, _), s in zip(replies, states)}}


def render_job_status(run_id: str, replies: list[tuple[Member, dict]]) -> list[str]:
    from controller.status import render_status

    verdict = job_verdict(replies)
    lines = [f"job {run_id}: {verdict['state']} — " + ", ".join(f"{k} {v}" for k, v in verdict["states"].items())]
    root = verdict["root_cause"]
    if root:
        rank = f"rank {root.get('rank')} " if root.get("rank") is not None else ""
        lines.append(f"root cause: {rank}in container {root['container']}: {root.get('reason')}")
    for m, reply in replies:
        lines.append(f"--- {m.label} (target GPUs {list(m.target_gpus)}, drafter GPUs {list(m.drafter_gpus)})")
        lines += ["  " + line for line in render_status(reply, m.ctid, m.node)]
    return lines
