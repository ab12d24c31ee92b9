"""`ctl launch`, `ctl tail`, `ctl status`, `ctl runs`: the operator's loop.

    ctl launch --container 200 --config run.toml --from-scratch [--follow]
    ctl tail   [--container 200] [--run ID] [--follow] [--since SEQ]
    ctl status [--container 200] [--run ID] [--json]
    ctl runs   [--container 200]

Every command is one SSH connection. Without --container the last launch's container is
used (remembered beside the controller config); without --run, the latest run there.
Exit codes: 0 ok (a followed run completed), 1 the run failed, 2 bad input, 3 launch
refused (preflight or drift; nothing was started), 4 the run stopped or its agent is gone,
255 the node could not be reached.
"""

from __future__ import annotations

import json
import posixpath
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from agent.protocol import RunStatus
from controller import config as cfg
from controller import runconfig
from controller.commands.remote import (EXIT_CONFIG, EXIT_FAILED, EXIT_NOT_DONE, EXIT_REFUSED, TrustOpt,
                                       container_session, fail)
from controller.container import Container
from controller.jobview import ContainerStream, last_launch_path, remember

def _help(flag: str) -> str:
    """The trainer's own words for a flag (trainer/flags.py), plus that it overrides the file."""
    from trainer.flags import BY_NAME

    return f"{BY_NAME[flag].help} (overrides the run config)"



NodeOpt = typer.Option(None, "--node", "-n", help="node name from the controller config (default: default_node)")
CtlConfigOpt = typer.Option(None, "--ctl-config", help="controller config (default: $DFLASH_CTL_CONFIG, else "
                                                       "~/.config/dflash-ctl/config.toml)")
ContainerOpt = typer.Option(None, "--container", "-c", help="container id (default: the last launch's)")
RunOpt = typer.Option(None, "--run", "-r", help="run id (default: the latest run in the container)")


def container_or_last_launch(container: Optional[int], node: Optional[str], ctl_config: Optional[str]) -> tuple[int, Optional[str]]:
    if container is not None:
        return container, node
    try:
        last = json.loads(last_launch_path(ctl_config).read_text())
        return int(last["container"]), node or last.get("node")
    except (OSError, ValueError, KeyError):
        raise fail("no --container given and no earlier launch to default to: pass --container ID", EXIT_CONFIG)


def _baseline_tok_s(status_reply: Optional[dict]):
    """The steady tokens/s of the config's known-good run (agent.runview status), for the live line."""
    return (((status_reply or {}).get("baseline") or {}).get("steady") or {}).get("tokens_per_s")


def _exit_for(state: Optional[str]) -> int:
    return {"completed": 0, "failed": EXIT_FAILED}.get(state or "", EXIT_NOT_DONE)


def _follow(ct: Container, caller, run_id: Optional[str], since: int, follow: bool, raw: bool,
            live_baseline: Optional[dict] = None) -> int:
    """``live_baseline``: the run's status reply when the output is a terminal that gets the
    live display (its baseline goes on the status line); None for plain lines."""
    import contextlib

    from controller.tail import Printer, tail

    live = None
    if live_baseline is not None:
        # A terminal: the log scrolls above one live status line (controller/livetail.py).
        from rich.console import Console

        from controller.livetail import LiveTail

        live = LiveTail(Console(highlight=False), baseline_tok_s=_baseline_tok_s(live_baseline))
    printer = Printer(live.write if live else (lambda line: typer.echo(line)), raw=raw,
                      on_step=live.on_step if live else None)

    def reconnecting(n: int, why: str) -> None:
        typer.echo(f"ctl: connection lost ({why.splitlines()[0][:120]}); reconnecting (#{n}) from seq "
                   f"{printer_last['seq']}", err=True)

    printer_last = {"seq": since}

    def on_record(rec: dict) -> None:
        printer_last["seq"] = rec["seq"]
        printer(rec)

    with live if live else contextlib.nullcontext():
        result = tail(ContainerStream(ct, caller), run_id, on_record, since=since, follow=follow,
                      on_reconnect=reconnecting)
    if printer.steps_seen and not raw and not printer.status_is_last and live is None:
        typer.echo(printer.status_line())
    if result.detached:
        typer.echo(f"ctl: detached at seq {result.last_seq}; the run goes on. Resume with "
                   f"`ctl tail --container {ct.ctid}{f' --run {run_id}' if run_id else ''} --since {result.last_seq} --follow`", err=True)
        return 0
    if result.gaps:
        typer.echo(f"ctl: warning: the stream skipped seq ranges {result.gaps}", err=True)
    if not follow:
        return 0
    state = result.state
    status = RunStatus.from_json(result.status)
    if state == "failed":
        typer.echo(f"ctl: run {run_id} FAILED: {status.reason or status.last_error}", err=True)
    elif state == "completed":
        # With --json, stdout carries only records: the verdict goes to stderr.
        typer.echo(f"ctl: run {run_id} completed" + (f"; last checkpoint {status.checkpoint.path}"
                                                     if status.checkpoint else ""), err=raw)
    else:
        typer.echo(f"ctl: the stream of run {run_id} ended while the run is {state or 'unknown'}: its agent is not "
                   "running; see `ctl status`", err=True)
    return _exit_for(state)


# --- commands ----------------------------------------------------------------------------------

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
    from controller.agentcall import AgentCaller
    from controller.launch import LaunchRefused
    from controller.render import RenderError

    from controller.commands import job as job_cmd

    # Several containers (or none, and the config's [[job.containers]]): one job (controller/job.py).
    is_job = job_cmd.is_job(container) or not container
    # Everything that can be checked here is, before any connection is opened.
    try:
        start = runconfig.start_decision(from_scratch, resume_from, init_from)
        run_config = runconfig.load(config, overrides={"target_model": target_model, "data_dir": data_dir,
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
    if not container[0].isdigit():
        raise fail(f"--container {container[0]!r}: give a container id, e.g. 200", EXIT_CONFIG)
    container = int(container[0])
    say = (lambda line: typer.echo(line, err=True)) if json_out else typer.echo
    with container_session(container, node, ctl_config, trust_new_host_key) as ct:
        try:
            result = _launch_one(ct, run_config, start, snapshot=snapshot, say=say, accept_drift=accept_drift,
                                 wandb_key=wandb_key, share_gpus=share_gpus)
        except (runconfig.RunConfigError, RenderError) as exc:
            raise fail(str(exc), EXIT_CONFIG) from None
        except LaunchRefused as exc:
            raise fail(f"launch refused — nothing was started:\n  {exc}", EXIT_REFUSED) from None
        remember(ctl_config, ct.node_name, ct.ctid, result.run_id)
        first = result.starts[0]
        if json_out:
            typer.echo(json.dumps({"run_id": result.run_id, "run_dir": f"{ct.config.workspace}/runs/{result.run_id}",
                                   "container": ct.ctid,
                                   "node": ct.node_name, "start": first, "round_trips": result.round_trips,
                                   "timings": result.timings}, sort_keys=True))
        else:
            typer.echo(f"run {result.run_id} started in {ct}: state {first.get('state')}, agent pid "
                       f"{first.get('agent_pid')}, job pid {first.get('job_pid')} ({result.round_trips} round trips, "
                       f"{result.timings['total_s']:.1f} s)")
            typer.echo(f"  follow: ctl tail --container {ct.ctid} --run {result.run_id} --follow")
        code = 0
        if follow:
            code = _follow(ct, AgentCaller(ct), result.run_id, 0, True, False)
    raise typer.Exit(code)


def _launch_one(ct: Container, run_config, start: dict, *, snapshot: bool, say, accept_drift: bool,
                wandb_key: Optional[str], share_gpus: bool = False):
    """A job of one member (controller/job.py: the one launch path), with kill-and-rollback's
    snapshot first when asked (controller/snapshots.py)."""
    from controller.job import Member, launch

    member = Member(ct.node_name, ct.ctid)
    if not snapshot:
        return launch([ct], [member], run_config, start, say=say, accept_drift=accept_drift, wandb_key=wandb_key,
                      share_gpus=share_gpus)
    from controller.launch import new_run_id
    from controller.snapshots import launch_snapshot, undo_launch_snapshot

    run_id = new_run_id(run_config.name)
    snap = launch_snapshot(ct, run_id, say)
    try:
        return launch([ct], [member], run_config, start, say=say, accept_drift=accept_drift,
                      wandb_key=wandb_key, run_id=run_id, share_gpus=share_gpus)
    except BaseException:
        # A refused or failed launch leaves the container as it found it: no stray
        # ctl-<run> snapshot of a run that never started.
        undo_launch_snapshot(ct, snap, say)
        raise


def resolve_run(ct: Container, caller, run: Optional[str]) -> dict:
    from controller.agentcall import AgentCallError

    args = ["status", "--workspace", ct.config.workspace] + (["--run", run] if run else [])
    try:
        reply = caller.call("agent.runview", args, what="run status")
    except AgentCallError as exc:
        raise fail(str(exc), EXIT_FAILED) from None
    if not reply.get("ok"):
        raise fail(f"container {ct.ctid}: {reply.get('error')}", EXIT_CONFIG)
    return reply


def tail_command(
    container: Optional[int] = ContainerOpt,
    run: Optional[str] = RunOpt,
    follow: bool = typer.Option(False, "--follow", "-f", help="keep following until the run ends (Ctrl-C detaches)"),
    since: int = typer.Option(0, "--since", metavar="SEQ", help="only records after this seq"),
    raw: bool = typer.Option(False, "--json", help="print the stream's records as JSON lines"),
    node: Optional[str] = NodeOpt,
    ctl_config: Optional[str] = CtlConfigOpt,
    trust_new_host_key: bool = TrustOpt,
) -> None:
    """A run's log lines and events, with a periodic one-line status; survives SSH drops.
    A job's containers are merged in time order, each line labelled with node, container, rank."""
    from controller.agentcall import AgentCaller
    from controller.commands import job as job_cmd

    found = job_cmd.find(run, None if container is None else [str(container)], node, ctl_config)
    if found:
        raise typer.Exit(job_cmd.tail(found[0], found[1], ctl_config=ctl_config, follow=follow, raw=raw, since=since,
                                      trust_new_host_key=trust_new_host_key))

    container, node = container_or_last_launch(container, node, ctl_config)
    with container_session(container, node, ctl_config, trust_new_host_key, one_shot=not follow) as ct:
        caller = AgentCaller(ct)
        live = follow and not raw and sys.stdout.isatty()
        # One status call, only where it is needed: the latest run's id for --follow, the
        # baseline for the live line. Without --follow the stream call finds the latest run.
        reply = resolve_run(ct, caller, run) if follow and (run is None or live) else None
        run_id = run or (reply["run_id"] if reply else None)
        code = _follow(ct, caller, run_id, since, follow, raw, live_baseline=reply if live else None)
    raise typer.Exit(code)


def status_command(
    container: Optional[int] = ContainerOpt,
    run: Optional[str] = RunOpt,
    json_out: bool = typer.Option(False, "--json", help="the full status document as JSON"),
    node: Optional[str] = NodeOpt,
    ctl_config: Optional[str] = CtlConfigOpt,
    trust_new_host_key: bool = TrustOpt,
) -> None:
    """State, phase, step/total, ETA, loss, tokens/s against the baseline, ranks and GPUs.
    For a job: every container's, and the job's root cause (rank, container, reason)."""
    from controller.agentcall import AgentCaller
    from controller.commands import job as job_cmd
    from controller.status import render_status

    found = job_cmd.find(run, None if container is None else [str(container)], node, ctl_config)
    if found:
        raise typer.Exit(job_cmd.status(found[0], found[1], ctl_config=ctl_config, json_out=json_out,
                                        trust_new_host_key=trust_new_host_key))

    container, node = container_or_last_launch(container, node, ctl_config)
    with container_session(container, node, ctl_config, trust_new_host_key, one_shot=True) as ct:
        reply = resolve_run(ct, AgentCaller(ct), run)
        if json_out:
            typer.echo(json.dumps(reply, sort_keys=True, indent=1))
        else:
            for line in render_status(reply, ct.ctid, ct.node_name):
                typer.echo(line)


def runs_command(
    container: Optional[int] = ContainerOpt,
    json_out: bool = typer.Option(False, "--json"),
    node: Optional[str] = NodeOpt,
    ctl_config: Optional[str] = CtlConfigOpt,
    trust_new_host_key: bool = TrustOpt,
) -> None:
    """The runs in a container, oldest first, with state, step and reason."""
    from controller.agentcall import AgentCaller
    from controller.status import render_runs

    container, node = container_or_last_launch(container, node, ctl_config)
    with container_session(container, node, ctl_config, trust_new_host_key, one_shot=True) as ct:
        reply = AgentCaller(ct).call("agent", ["list", "--workspace", ct.config.workspace], what="agent list")
        runs = reply.get("runs") or []
        # The agent lists by directory name; run ids start with the config name, so sort by
        # the time the agent recorded, which it keeps in status.json's "updated" only —
        # the id's embedded UTC stamp is the creation order for ids made by `ctl launch`.
        reply["runs"] = sorted(runs, key=lambda r: (_stamp(r["run_id"]), r["run_id"]))
        if json_out:
            typer.echo(json.dumps(reply, sort_keys=True, indent=1))
        else:
            for line in render_runs(reply, ct.ctid):
                typer.echo(line)


def _stamp(run_id: str) -> str:
    parts = run_id.rsplit("-", 3)
    return "-".join(parts[1:3]) if len(parts) == 4 else ""


def register(app: typer.Typer) -> None:
    app.command("launch")(launch_command)
    app.command("tail")(tail_command)
    app.command("status")(status_command)
    app.command("runs")(runs_command)
