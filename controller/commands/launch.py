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
from pathlib import Path
from typing import List, Optional

import typer

from controller.commands.remote import (EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_REFUSED, EXIT_TRANSPORT, TrustOpt,
                                        container_checked, container_session, fail)
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
    """Preflight, drift check and start of a training run in a container: one SSH connection."""
    # Here, not at the top: the run config's models (pydantic) are a third of what `ctl status`
    # or `ctl tail` would otherwise spend starting (docs/benchmarks.md).
    from controller import configfile, runconfig
    from controller.agentcall import AgentCaller
    from controller.launch import LaunchRefused
    from controller.render import RenderError

    from controller.commands import job as job_cmd

    if _data_kind(config):
        raise typer.Exit(_launch_data_job(container, config, node=node, sets=sets, follow=follow, json_out=json_out,
                                          ctl_config=ctl_config, trust_new_host_key=trust_new_host_key,
                                          start=(from_scratch, resume_from, init_from), snapshot=snapshot,
                                          overrides={"target_model": target_model, "data_dir": data_dir,
                                                     "output_dir": output_dir, "target_gpus": target_gpus,
                                                     "drafter_gpus": drafter_gpus, "wandb_run_name": wandb_run_name}))
    # Several containers (or none, and the config's [[job.containers]]): one job (controller/job.py).
    is_job = job_cmd.is_job(container) or not container
    # Everything that can be checked here is, before any connection is opened.
    try:
        start = runconfig.start_decision(from_scratch, resume_from, init_from)
        run_config = configfile.load(config, overrides={"target_model": target_model, "data_dir": data_dir,
                                               "output_dir": output_dir,
                                               "target_gpus": None if is_job else target_gpus,
                                               "drafter_gpus": None if is_job else drafter_gpus,
                                               "wandb_run_name": wandb_run_name},
                            sets=sets)
        wandb_key = run_config.wandb.read_key()
    except runconfig.RunConfigError as exc:
        raise fail(str(exc), EXIT_CONFIG) from None
    if not container:
        if run_config.job is None:
            raise fail("--container is required (or a [[job.containers]] table in the run config)", EXIT_CONFIG)
        container, target_gpus, drafter_gpus = job_cmd.from_config(run_config.job)
    if is_job:
        raise typer.Exit(job_cmd.launch(container, run_config, start, node=node, target_gpus=target_gpus,
                                        drafter_gpus=drafter_gpus, accept_drift=accept_drift, follow=follow,
                                        json_out=json_out, wandb_key=wandb_key, ctl_config=ctl_config,
                                        trust_new_host_key=trust_new_host_key, share_gpus=share_gpus))
    container = int(container_checked(container[0]))
    say = (lambda line: typer.echo(line, err=True)) if json_out else typer.echo
    from agent.protocol import new_run_id
    from controller import interrupts
    from controller.transport import TransportError

    run_id = new_run_id(run_config.name)
    with container_session(container, node, ctl_config, trust_new_host_key) as ct:
        follow_line = f"ctl tail --container {ct.ctid} --run {run_id} --follow"
        stop_line = f"ctl kill-and-rollback --container {ct.ctid} --run {run_id}"

        def maybe_started(why: object, code: int) -> SystemExit:
            """The commit was sent and its reply lost: the run may have started regardless."""
            return fail(f"{why}; run {run_id} may have started in {ct}: check with `ctl status --container {ct.ctid} "
                        f"--run {run_id}`; follow: `{follow_line}`; stop: `{stop_line}`",
                        EXIT_INTERRUPTED if interrupts.interrupted() else code)
        # Ctrl-C before the commit: nothing started; from the commit on: held until the run id
        # and how to follow and stop it are printed (controller/interrupts.py).
        with interrupts.guarded():
            try:
                result = _launch_one(ct, run_config, start, snapshot=snapshot, say=say, accept_drift=accept_drift,
                                     wandb_key=wandb_key, share_gpus=share_gpus, run_id=run_id)
            except (runconfig.RunConfigError, RenderError) as exc:
                raise fail(str(exc), EXIT_CONFIG) from None
            except LaunchRefused as exc:
                if not exc.certain:
                    raise maybe_started(exc, EXIT_REFUSED) from None
                raise fail(f"launch refused — nothing was started:\n  {exc}", EXIT_REFUSED) from None
            except KeyboardInterrupt:
                raise fail(f"interrupted before run {run_id} was created in {ct}: nothing was started",
                           EXIT_INTERRUPTED) from None
            except TransportError as exc:
                if not interrupts.holding():
                    raise
                raise maybe_started(exc, EXIT_TRANSPORT) from None
            interrupts.pause_point("launch.started")
            remember(ctl_config, ct.node_name, ct.ctid, result.run_id)
            first = result.starts[0]
            if json_out:
                typer.echo(json.dumps({"run_id": result.run_id,
                                       "run_dir": f"{ct.config.workspace}/runs/{result.run_id}",
                                       "container": ct.ctid,
                                       "node": ct.node_name, "start": first, "round_trips": result.round_trips,
                                       "timings": result.timings}, sort_keys=True))
            else:
                typer.echo(f"run {result.run_id} started in {ct}: state {first.get('state')}, agent pid "
                           f"{first.get('agent_pid')}, job pid {first.get('job_pid')} ({result.round_trips} round "
                           f"trips, {result.timings['total_s']:.1f} s)")
                for line in interrupts.how_to_follow_and_stop(follow_line, stop_line):
                    typer.echo(line)
        if interrupts.interrupted():
            raise fail(interrupts.went_on(f"run {run_id}", follow_line, stop_line, where=f" in {ct}"), EXIT_INTERRUPTED)
        code = 0
        if follow:
            code = _follow(ct, AgentCaller(ct), result.run_id, 0, True, False)
    raise typer.Exit(code)


def _data_kind(config: Path) -> Optional[str]:
    """The config's kind when it is a data kind (trainer/kinds.py), read without validating."""
    import tomllib

    try:
        kind = tomllib.loads(Path(config).read_text(encoding="utf-8")).get("kind", "train")
    except (OSError, ValueError):
        return None  # runconfig.load says what is wrong with it
    return None if kind == "train" else str(kind)


def _launch_data_job(container: List[str], config: Path, *, node, sets, follow, json_out, ctl_config,
                     trust_new_host_key, start, snapshot, overrides) -> int:
    """A prepare or regenerate job (controller/datalaunch.py) in one container."""
    from controller import configfile, runconfig
    from controller.agentcall import AgentCaller
    from controller.datalaunch import DataLauncher, job_secret
    from controller.launch import LaunchRefused
    from controller.render import RenderError

    try:
        run_config = configfile.load(config, overrides=overrides, sets=sets)
        secret = job_secret(run_config)  # read here, before any connection
    except runconfig.RunConfigError as exc:
        raise fail(str(exc), EXIT_CONFIG) from None
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
    container_checked(container[0])
    say = (lambda line: typer.echo(line, err=True)) if json_out else typer.echo
    with container_session(int(container[0]), node, ctl_config, trust_new_host_key) as ct:
        try:
            result = DataLauncher(ct, run_config, say=say, secret=secret).run()
        except RenderError as exc:
            raise fail(str(exc), EXIT_CONFIG) from None
        except LaunchRefused as exc:
            raise fail(f"launch refused — nothing was started:\n  {exc}", EXIT_REFUSED) from None
        remember(ctl_config, ct.node_name, ct.ctid, result.run_id)
        first = result.start_reply
        if json_out:
            typer.echo(json.dumps({"run_id": result.run_id, "run_dir": result.run_dir, "container": ct.ctid,
                                   "node": ct.node_name, "kind": kind.name, "start": first,
                                   "round_trips": result.round_trips, "timings": result.timings}, sort_keys=True))
        else:
            typer.echo(f"{kind.name} job {result.run_id} started in {ct}: state {first.get('state')}, agent pid "
                       f"{first.get('agent_pid')}, job pid {first.get('job_pid')} ({result.round_trips} round trips, "
                       f"{result.timings['total_s']:.1f} s)")
            typer.echo(f"  follow: ctl tail --container {ct.ctid} --run {result.run_id} --follow")
        if follow:
            return _follow(ct, AgentCaller(ct), result.run_id, 0, True, False)
    return 0


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
