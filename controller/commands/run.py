"""`ctl tail`, `ctl status`, `ctl runs`: the operator's loop, with `ctl launch`
(controller/commands/launch.py), which ends in the same tail with --follow.

    ctl tail   [--container 200] [--run ID] [--follow] [--since SEQ]
    ctl status [--container 200] [--run ID] [--json]
    ctl runs   [--container 200]

Every command is one SSH connection. Without --container the last launch's container is
used (remembered beside the controller config); without --run, the latest run there.
Exit codes: controller/exitcodes.py (`ctl status` and `ctl tail` of a failed run exit 1).
"""

from __future__ import annotations

import json
from typing import Optional

import typer

from controller.commands import watch
from controller.commands.remote import (TrustOpt, container_option, container_session, fail, run_option,
                                        seconds_checked)
from controller.commands.watch import container_or_last_launch, resolve_run
from controller.tail import STOPPED_WAIT_S


NodeOpt = typer.Option(None, "--node", "-n", help="node name from the controller config (default: default_node)")
CtlConfigOpt = typer.Option(None, "--ctl-config", help="controller config (default: $DFLASH_CTL_CONFIG, else "
                                                       "~/.config/dflash-ctl/config.toml)")
ContainerOpt = container_option(None, "container id (default: the last launch's)")
RunOpt = run_option("run id (default: the latest run in the container)")


# --- commands (bodies: controller/commands/watch.py) --------------------------------------------

def tail_command(
    container: Optional[int] = ContainerOpt,
    run: Optional[str] = RunOpt,
    follow: bool = typer.Option(False, "--follow", "-f", help="keep following until the run ends (Ctrl-C detaches)"),
    since: int = typer.Option(0, "--since", metavar="SEQ", min=0, help="only records after this seq"),
    raw: bool = typer.Option(False, "--json", help="print the stream's records as JSON lines"),
    stopped_wait: float = typer.Option(STOPPED_WAIT_S, "--wait-stopped", metavar="SECONDS",
                                       callback=seconds_checked,
                                       help="with --follow: how long to wait for a stopped container to run again "
                                            "before saying the run died with it (exit code 5)"),
    node: Optional[str] = NodeOpt,
    ctl_config: Optional[str] = CtlConfigOpt,
    trust_new_host_key: bool = TrustOpt,
) -> None:
    """A run's log lines and events, with a periodic one-line status; survives SSH drops.
    A job's containers are merged in time order, each line labelled with node, container, rank."""
    raise typer.Exit(watch.tail_in(container, run, follow, since, raw, node, ctl_config, trust_new_host_key,
                                     stopped_wait=stopped_wait))


def status_command(
    container: Optional[int] = ContainerOpt,
    run: Optional[str] = RunOpt,
    json_out: bool = typer.Option(False, "--json", help="the full status document as JSON"),
    all_runs: bool = typer.Option(False, "--all", help="every live run on every configured node and container, "
                                                       "one line each: rate, step age, health, last alert"),
    node: Optional[str] = NodeOpt,
    ctl_config: Optional[str] = CtlConfigOpt,
    trust_new_host_key: bool = TrustOpt,
) -> None:
    """State, phase, step/total, ETA, loss, tokens/s against the baseline, ranks and GPUs, alerts.
    For a job: every container's, and the job's root cause (rank, container, reason)."""
    if all_runs:
        from controller import config as cfg
        from controller.watchall import status_all

        try:
            conf = cfg.load(ctl_config)
        except cfg.ConfigError as exc:
            raise fail(str(exc), 2) from None
        raise typer.Exit(status_all(conf, typer.echo, node=node, json_out=json_out,
                                    trust_new_host_key=trust_new_host_key))
    raise typer.Exit(watch.status_in(container, run, json_out, node, ctl_config, trust_new_host_key))


def watch_command(
    interval: float = typer.Option(5.0, "--interval", callback=seconds_checked, help="seconds between rounds"),
    rounds: Optional[int] = typer.Option(None, "--rounds", min=1, help="stop after this many rounds (default: "
                                                                       "until interrupted)"),
    node: Optional[str] = typer.Option(None, "--node", "-n", help="only this node (default: every configured node)"),
    ctl_config: Optional[str] = CtlConfigOpt,
    trust_new_host_key: bool = TrustOpt,
) -> None:
    """Follow every run on every configured node and container: the `ctl status --all` table,
    refreshed; and deliver, through the notify channels of this machine, every alert a container
    could not deliver (docs/alerts.md; a systemd user unit for it is there too)."""
    from controller import config as cfg
    from controller.watchall import watch as watch_all

    try:
        conf = cfg.load(ctl_config)
    except cfg.ConfigError as exc:
        raise fail(str(exc), 2) from None
    raise typer.Exit(watch_all(conf, typer.echo, node=node, interval=interval, rounds=rounds,
                               trust_new_host_key=trust_new_host_key))


def runs_command(
    container: Optional[int] = ContainerOpt,
    json_out: bool = typer.Option(False, "--json"),
    prune: bool = typer.Option(False, "--prune", help="also remove temp files that interrupted checkpoint saves "
                                                       "left (only of writers that are gone)"),
    node: Optional[str] = NodeOpt,
    ctl_config: Optional[str] = CtlConfigOpt,
    trust_new_host_key: bool = TrustOpt,
) -> None:
    """The runs in a container, oldest first, with state, step and reason."""
    from controller.agentcall import AgentCaller
    from controller.status import render_runs

    container, node = container_or_last_launch(container, node, ctl_config)
    with container_session(container, node, ctl_config, trust_new_host_key, one_shot=True) as ct:
        reply = AgentCaller(ct).call("agent", ["list", "--workspace", ct.config.workspace, *(["--prune"] if prune else [])],
                                     what="agent list")
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
            if prune:
                gone = reply.get("pruned") or []
                typer.echo(f"pruned   {len(gone)} temp file(s) of interrupted saves, "
                           f"{sum(g['bytes'] for g in gone) / 2**20:.1f} MiB" + "".join(f"\n         {g['path']}" for g in gone))


def _stamp(run_id: str) -> str:
    parts = run_id.rsplit("-", 3)
    return "-".join(parts[1:3]) if len(parts) == 4 else ""


def stop_command(
    container: Optional[int] = ContainerOpt,
    run: str = run_option("the run to stop (`ctl runs` lists them)", default=...),
    grace: float = typer.Option(30.0, "--grace", callback=seconds_checked,
                                help="seconds between SIGTERM and SIGKILL"),
    node: Optional[str] = NodeOpt,
    ctl_config: Optional[str] = CtlConfigOpt,
    trust_new_host_key: bool = TrustOpt,
) -> None:
    """Stop a run of any kind gracefully (SIGTERM: a training run checkpoints, a data job keeps
    what it finished), and nothing else: no rollback. Launching it again resumes it
    (train: --resume-from its checkpoint; prepare and regenerate: the same config)."""
    from controller.agentcall import AgentCallError
    from controller.job import stop_member
    from controller.status import render_status
    from controller.agentcall import AgentCaller

    container, node = container_or_last_launch(container, node, ctl_config)
    with container_session(container, node, ctl_config, trust_new_host_key) as ct:
        try:
            reply = stop_member(ct, run, grace=grace)
        except AgentCallError as exc:
            raise fail(f"cannot stop run {run} in {ct}: {exc}", 1) from None
        if not reply.get("ok", True):
            raise fail(f"cannot stop run {run} in {ct}: {reply.get('error')}", 1)
        status = resolve_run(ct, AgentCaller(ct), run)
        for line in render_status(status, ct.ctid, ct.node_name):
            typer.echo(line)


def register(app: typer.Typer) -> None:
    app.command("stop")(stop_command)
    app.command("tail")(tail_command)
    app.command("status")(status_command)
    app.command("watch")(watch_command)
    app.command("runs")(runs_command)
