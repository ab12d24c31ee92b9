"""`ctl launch`: preflight, drift check and start of a training run, in one container or
as a job across several (controller/job.py: the one launch path).

    ctl launch --container 200 --config run.toml --from-scratch [--follow]

A module of its own so that `ctl status` and `ctl tail` import neither the run config's
models (pydantic) nor the trainer's flags, which only a launch needs (docs/benchmarks.md).
With --follow it ends in the same tail as `ctl tail --follow` (controller/commands/run.py).
Exit codes as there: 3 when the launch is refused and nothing was started.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

import typer

from controller.commands.plain import errors_as_exits
from controller.commands.remote import (EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_REFUSED, EXIT_TRANSPORT, TrustOpt,
                                        container_checked, fail)
from controller.commands.run import CtlConfigOpt, NodeOpt
from controller.commands.watch import _follow
from controller.container import Container
from controller.jobview import remember


def _help(flag: str) -> str:
    """The trainer's own words for a flag (trainer/flags.py), plus that it overrides the file."""
    from trainer.flags import BY_NAME

    return f"{BY_NAME[flag].help} (overrides the run config)"


def launch_command(
    container: List[str] = typer.Option([], "--container", "-c",
                                        help="container id (Proxmox VMID), e.g. 200; repeat as NODE:CTID "
                                             "(e.g. -c sim:200 -c sim2:300) for one job across containers "
                                             "(default: the run config's [[job.containers]])"),
    config: Path = typer.Option(..., "--config", help="run config (TOML): trainer flags, GPU roles, paths, wandb"),
    from_scratch: bool = typer.Option(False, "--from-scratch", help="start a new drafter from random weights"),
    resume_from: Optional[str] = typer.Option(None, "--resume-from", metavar="CKPT",
                                              help="continue a run: weights, optimizer, schedule, data position"),
    init_from: Optional[str] = typer.Option(None, "--init-from", metavar="CKPT",
                                            help="weights only; fresh optimizer and schedule"),
    accept_drift: bool = typer.Option(False, "--accept-drift",
                                      help="launch although env or data drifted from the known-good run"),
    share_gpus: bool = typer.Option(False, "--share-gpus",
                                    help="start although a live run in the container holds some of these GPUs (or "
                                         "CPU rank slots); without it such a launch is refused (exit 3)"),
    follow: bool = typer.Option(False, "--follow", "-f", help="go on to tail the run until it ends"),
    node: Optional[str] = NodeOpt,
    target_model: Optional[str] = typer.Option(None, "--target-model", metavar="DIR", help=_help("--target-model")),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", metavar="DIR", help=_help("--data-dir")),
    output_dir: Optional[str] = typer.Option(None, "--output-dir", metavar="DIR", help=_help("--output-dir")),
    target_gpus: Optional[str] = typer.Option(None, "--target-gpus", metavar="IDS", help=_help("--target-gpus")),
    drafter_gpus: Optional[str] = typer.Option(None, "--drafter-gpus", metavar="IDS", help=_help("--drafter-gpus")),
    wandb_run_name: Optional[str] = typer.Option(None, "--wandb-run-name", metavar="NAME", help=_help("--wandb-run-name")),
    sets: List[str] = typer.Option([], "--set", metavar="KEY=VALUE",
                                   help="override any config setting, e.g. --set lr=3e-4 --set wandb.mode=disabled"),
    ctl_config: Optional[str] = CtlConfigOpt,
    trust_new_host_key: bool = TrustOpt,
    json_out: bool = typer.Option(False, "--json", help="print the launch result as JSON (not with --follow)"),
    snapshot: bool = typer.Option(False, "--snapshot",
                                  help="first take `pct snapshot <ctid> ctl-<run>` (snapshot-capable storage only; "
                                       "`ctl kill-and-rollback --to snapshot:ctl-<run>` restores it)"),
) -> None:
    """Preflight, drift check and start of a run: a training run in one container or as a job
    across several, or a data job (prepare, regenerate); one SSH connection per node."""
    # Here, not at the top: the run config's models (pydantic) are a third of what `ctl status`
    # or `ctl tail` would otherwise spend starting (docs/benchmarks.md).
    from controller import runconfig

    overrides = {"target_model": target_model, "data_dir": data_dir, "output_dir": output_dir,
                 "target_gpus": target_gpus, "drafter_gpus": drafter_gpus, "wandb_run_name": wandb_run_name}
    # Everything that can be checked here is, before any connection is opened.
    try:
        if _data_kind(config):
            plan = _data_plan(container, config, node=node, sets=sets, ctl_config=ctl_config, overrides=overrides,
                              start=(from_scratch, resume_from, init_from), snapshot=snapshot)
        else:
            plan = _train_plan(container, config, node=node, sets=sets, ctl_config=ctl_config, overrides=overrides,
                               start=(from_scratch, resume_from, init_from), snapshot=snapshot,
                               accept_drift=accept_drift, share_gpus=share_gpus)
    except runconfig.RunConfigError as exc:
        raise fail(str(exc), EXIT_CONFIG) from None
    raise typer.Exit(_launch(plan, ctl_config=ctl_config, trust_new_host_key=trust_new_host_key,
                             json_out=json_out, follow=follow))


@dataclass
class _Plan:
    """One launch as the front-end runs it: which containers, what starts there, and how the
    start is reported. Every kind (a run, a job across containers, a data job) goes through
    :func:`_launch`, so a refusal, a lost reply or a Ctrl-C reads the same for all."""

    members: list  # controller.job.Member, in rank order
    run_id: str
    what: str  # "launch" or "job": how a refusal names it
    start: Callable  # (containers, say) -> the launch's result
    report: Callable  # (containers, result) -> (lines, json object)
    follow_line: str
    stop_line: str
    on_started: Callable = lambda result: None


def _container_ids(container: List[str]) -> list[str]:
    for c in container:
        if ":" not in c:
            container_checked(c)
    return list(container)


def _member(container: str, node: Optional[str], ctl_config: Optional[str]):
    """The one container of a single launch, on the default node unless named."""
    from controller import config as cfg
    from controller.job import Member

    try:
        name = cfg.load(ctl_config).node(node)[0]
    except cfg.ConfigError as exc:
        raise fail(str(exc), EXIT_CONFIG) from None
    return Member(name, str(int(container_checked(container))))


def _train_plan(container, config, *, node, sets, ctl_config, overrides, start, snapshot, accept_drift,
                share_gpus) -> _Plan:
    from agent.protocol import new_run_id
    from controller import configfile, job, runconfig
    from controller.commands import job as job_cmd

    container = _container_ids(container)
    is_job = job_cmd.is_job(container) or not container
    decision = runconfig.start_decision(*start)
    run_config = configfile.load(config, overrides={**overrides, **({"target_gpus": None, "drafter_gpus": None}
                                                                    if is_job else {})}, sets=sets)
    wandb_key = run_config.wandb.read_key()
    run_id = new_run_id(run_config.name)
    if not container:
        if run_config.job is None:
            raise fail("--container is required (or a [[job.containers]] table in the run config)", EXIT_CONFIG)
        container, target_gpus, drafter_gpus = job_cmd.from_config(run_config.job)
    else:
        target_gpus, drafter_gpus = overrides["target_gpus"], overrides["drafter_gpus"]
    if not is_job:
        member = _member(container[0], node, ctl_config)

        def start_one(cts, say):
            return _launch_one(cts[0], run_config, decision, snapshot=snapshot, say=say, accept_drift=accept_drift,
                               wandb_key=wandb_key, share_gpus=share_gpus, run_id=run_id)

        def report_one(cts, result):
            ct, first = cts[0], result.starts[0]
            return ([f"run {result.run_id} started in {ct}: state {first.get('state')}, agent pid "
                     f"{first.get('agent_pid')}, job pid {first.get('job_pid')} ({result.round_trips} round "
                     f"trips, {result.timings['total_s']:.1f} s)"],
                    {"run_id": result.run_id, "run_dir": f"{ct.config.workspace}/runs/{result.run_id}",
                     "container": ct.ctid, "node": ct.node_name, "start": first,
                     "round_trips": result.round_trips, "timings": result.timings})

        return _Plan([member], run_id, "launch", start_one, report_one,
                     f"ctl tail --container {member.ctid} --run {run_id} --follow",
                     f"ctl kill-and-rollback --container {member.ctid} --run {run_id}")
    if snapshot:
        raise fail("--snapshot: a job across containers takes no snapshot; snapshot each container with "
                   "`pct snapshot` first, or launch one container", EXIT_CONFIG)
    try:
        members = job.plan(container, target_gpus, drafter_gpus, job_cmd.default_node(ctl_config, node))
    except job.JobError as exc:
        raise fail(str(exc), EXIT_CONFIG) from None

    def start_job(cts, say):
        return job.launch(cts, members, run_config, decision, say=say, accept_drift=accept_drift,
                          wandb_key=wandb_key, share_gpus=share_gpus, run_id=run_id)

    def report_job(cts, result):
        labels = [m.label for m in members]
        return ([f"job {result.run_id} started in {', '.join(labels)} (rendezvous {result.endpoint}, "
                 f"{result.timings['total_s']:.1f} s)"],
                {"run_id": result.run_id, "job": True, "containers": labels, "endpoint": result.endpoint,
                 "layout": job.layout(members), "starts": result.starts, "timings": result.timings})

    return _Plan(members, run_id, "job", start_job, report_job, f"ctl tail --run {run_id} --follow",
                 f"ctl kill-and-rollback --run {run_id}", on_started=lambda result: job.save_record(ctl_config, result))


def _data_kind(config: Path) -> Optional[str]:
    """The config's kind when it is a data kind (trainer/kinds.py), read without validating."""
    import tomllib

    try:
        kind = tomllib.loads(Path(config).read_text(encoding="utf-8")).get("kind", "train")
    except (OSError, ValueError):
        return None  # runconfig.load says what is wrong with it
    return None if kind == "train" else str(kind)


def _data_plan(container, config, *, node, sets, ctl_config, overrides, start, snapshot) -> _Plan:
    """A prepare or regenerate job (controller/datalaunch.py) in one container."""
    from agent.protocol import new_run_id
    from controller import configfile
    from controller.datalaunch import DataLauncher, job_secret

    run_config = configfile.load(config, overrides=overrides, sets=sets)
    secret = job_secret(run_config)  # read here, before any connection
    kind = run_config.job_kind
    given = [name for name, v in zip(("--from-scratch", "--resume-from", "--init-from"), start) if v]
    if given:
        raise fail(f"{given[0]}: a {kind.name} job has no start decision; launching its config again resumes it "
                   f"by {kind.resumes_by}", EXIT_CONFIG)
    if snapshot:
        raise fail(f"--snapshot: a {kind.name} job changes no environment; launch it without --snapshot", EXIT_CONFIG)
    if len(container) != 1:
        raise fail(f"--container: a {kind.name} job runs in one container; give its id, e.g. --container 200",
                   EXIT_CONFIG)
    member = _member(container[0], node, ctl_config)
    run_id = new_run_id(run_config.name)

    def start_data(cts, say):
        return DataLauncher(cts[0], run_config, say=say, secret=secret, run_id=run_id).run()

    def report_data(cts, result):
        ct, first = cts[0], result.start_reply
        return ([f"{kind.name} job {result.run_id} started in {ct}: state {first.get('state')}, agent pid "
                 f"{first.get('agent_pid')}, job pid {first.get('job_pid')} ({result.round_trips} round trips, "
                 f"{result.timings['total_s']:.1f} s)"],
                {"run_id": result.run_id, "run_dir": result.run_dir, "container": ct.ctid, "node": ct.node_name,
                 "kind": kind.name, "start": first, "round_trips": result.round_trips, "timings": result.timings})

    return _Plan([member], run_id, "launch", start_data, report_data,
                 f"ctl tail --container {member.ctid} --run {run_id} --follow",
                 f"ctl stop --container {member.ctid} --run {run_id}")


def _launch(plan: _Plan, *, ctl_config: Optional[str], trust_new_host_key: bool, json_out: bool,
            follow: bool) -> int:
    """The one front-end of every launch: open the containers, start, and say what happened —
    one refusal line, one lost-reply line, one Ctrl-C rule and one report for every kind."""
    from controller import interrupts
    from controller.commands import job as job_cmd
    from controller.job import JobError, JobStartLost
    from controller.launch import LaunchRefused
    from controller.render import RenderError
    from controller.runconfig import RunConfigError
    from controller.session import open_containers
    from controller.transport import TransportError

    say = (lambda line: typer.echo(line, err=True)) if json_out else typer.echo
    single = len(plan.members) == 1
    noun = "run" if single else "job"
    where = f" in container {plan.members[0].ctid} on node {plan.members[0].node}" if single else ""

    def maybe_started(why: object, code: int) -> SystemExit:
        """A start was sent and its reply lost: the run may have started regardless."""
        check = (f"ctl status --container {plan.members[0].ctid} --run {plan.run_id}" if single
                 else f"ctl status --run {plan.run_id}")
        return fail(f"{why}; {noun} {plan.run_id} may have started{where}: check with `{check}`; follow: "
                    f"`{plan.follow_line}`; stop: `{plan.stop_line}`",
                    EXIT_INTERRUPTED if interrupts.interrupted() else code)

    def started(cts) -> object:
        # Ctrl-C before the first commit starts nothing; from it on it is held until the run id
        # and how to follow and stop it are printed (controller/interrupts.py).
        with interrupts.guarded():
            try:
                result = plan.start(cts, say)
            except (JobError, RunConfigError, RenderError) as exc:
                raise fail(str(exc), EXIT_CONFIG) from None
            except JobStartLost as exc:
                raise fail(str(exc), EXIT_INTERRUPTED if interrupts.interrupted() else EXIT_TRANSPORT) from None
            except LaunchRefused as exc:
                if not exc.certain:
                    raise maybe_started(exc, EXIT_REFUSED) from None
                raise fail(f"{plan.what} refused — nothing was started:\n  {exc}", EXIT_REFUSED) from None
            except KeyboardInterrupt:
                raise nothing_started() from None
            except TransportError as exc:
                if interrupts.holding():
                    raise maybe_started(exc, EXIT_TRANSPORT) from None
                raise
            interrupts.pause_point("launch.started")
            plan.on_started(result)
            state["started"] = True
            remember(ctl_config, plan.members[0].node, plan.members[0].ctid, plan.run_id)
            lines, record = plan.report(cts, result)
            if json_out:
                typer.echo(json.dumps(record, sort_keys=True))
            else:
                for line in lines + interrupts.how_to_follow_and_stop(plan.follow_line, plan.stop_line):
                    typer.echo(line)
        if interrupts.interrupted():
            raise fail(interrupts.went_on(f"{noun} {plan.run_id}", plan.follow_line, plan.stop_line, where=where),
                       EXIT_INTERRUPTED)
        return result

    def nothing_started() -> SystemExit:
        return fail(f"interrupted before {noun} {plan.run_id} was created{where}: nothing was started",
                    EXIT_INTERRUPTED)

    state = {"started": False}
    try:
        with errors_as_exits(), open_containers(plan.members, ctl_config, trust_new_host_key) as cts:
            started(cts)
            if follow and single:  # over the same connection
                from controller.agentcall import AgentCaller

                return _follow(cts[0], AgentCaller(cts[0]), plan.run_id, 0, True, False)
    except KeyboardInterrupt:
        if state["started"]:
            raise fail(interrupts.went_on(f"{noun} {plan.run_id}", plan.follow_line, plan.stop_line, where=where),
                       EXIT_INTERRUPTED) from None
        raise nothing_started() from None
    if not follow:
        return 0
    return job_cmd.tail(plan.members, plan.run_id, ctl_config=ctl_config, follow=True, raw=False, since=0,
                        trust_new_host_key=trust_new_host_key)


def _launch_one(ct: Container, run_config, start: dict, *, snapshot: bool, say, accept_drift: bool,
                wandb_key: Optional[str], share_gpus: bool = False, run_id: Optional[str] = None):
    """A job of one member (controller/job.py: the one launch path), with kill-and-rollback's
    snapshot first when asked (controller/snapshots.py)."""
    from controller.job import Member, launch

    member = Member(ct.node_name, ct.ctid)
    if not snapshot:
        return launch([ct], [member], run_config, start, say=say, accept_drift=accept_drift, wandb_key=wandb_key,
                      share_gpus=share_gpus, run_id=run_id)
    from controller.launch import new_run_id
    from controller.snapshots import launch_snapshot, undo_launch_snapshot

    run_id = run_id or new_run_id(run_config.name)
    snap = launch_snapshot(ct, run_id, say)
    try:
        return launch([ct], [member], run_config, start, say=say, accept_drift=accept_drift,
                      wandb_key=wandb_key, run_id=run_id, share_gpus=share_gpus)
    except BaseException:
        # A refused or failed launch leaves the container as it found it: no stray
        # ctl-<run> snapshot of a run that never started.
        undo_launch_snapshot(ct, snap, say)
        raise


def register(app: typer.Typer) -> None:
    app.command("launch")(launch_command)
