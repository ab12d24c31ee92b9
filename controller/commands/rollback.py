"""`ctl kill-and-rollback` and `ctl history`: stop a run cleanly, restore the environment
that worked (controller/rollback.py), and the container's record of every kill and rollback."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from typing import Optional

import typer

from controller import envgen_client as eg
from controller import rollback as rb
from controller.commands import remote
from controller.commands.remote import EXIT_NOT_DONE as EXIT_ABORTED
from controller.commands.remote import EXIT_REFUSED, ConfigOpt, ContainerOpt, NodeOpt, TrustOpt, container_session


def _checked_target(value: str) -> str:
    """``--to`` as controller/rollback.py parses it, before anything connects."""
    try:
        rb.parse_to(value)
    except rb.RollbackRefused as exc:
        raise remote.fail(str(exc), remote.EXIT_CONFIG) from None
    return value


def kill_and_rollback_command(
    container: Optional[int] = remote.container_option(None, "container id (Proxmox VMID), e.g. 200; not needed "
                                                             "for a job's --run (every container of the job is acted on)"),
    run: Optional[str] = remote.run_option("run id (default: the live run, else the newest)"),
    to: str = typer.Option("last-good", "--to", callback=_checked_target,
                           help="last-good | env:GENERATION | snapshot:NAME"),
    grace: float = typer.Option(60.0, "--grace", callback=remote.seconds_checked,
                                help="seconds between SIGTERM and SIGKILL (the trainer checkpoints in between)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the plan, change nothing"),
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask before stopping and rolling back"),
    node: Optional[str] = NodeOpt,
    config: Optional[str] = ConfigOpt,
    trust_new_host_key: bool = TrustOpt,
) -> None:
    """Stop a run gracefully, check nothing of it is left, restore the venv generation of the
    last known-good run (or a named generation, or a Proxmox snapshot), verify, and print
    what changed and the exact command to resume."""
    from controller.commands import job as job_cmd

    found = job_cmd.find(run, None if container is None else [str(container)], node, config) if run else None
    if found:  # a job across containers (controller/job.py): every container of it
        raise typer.Exit(job_cmd.kill_and_rollback(found[0], found[1], to=to, grace=grace, dry_run=dry_run, yes=yes,
                                                   ctl_config=config, trust_new_host_key=trust_new_host_key))
    if container is None:
        raise remote.fail("--container is required (or --run of a job launched across containers)", remote.EXIT_CONFIG)
    with container_session(container, node, config, trust_new_host_key) as ct:
        try:
            with (contextlib.nullcontext() if dry_run else rb.claimed(ct, grace)):
                _kill_and_rollback(ct, run, to, grace, dry_run, yes)
        except rb.RollbackRefused as exc:  # the claim: another one is under way
            raise remote.fail(f"refused, nothing changed: {exc}", EXIT_REFUSED) from None


def _kill_and_rollback(ct, run: Optional[str], to: str, grace: float, dry_run: bool, yes: bool) -> None:
    from controller.interrupts import pause_point

    pause_point("rollback.claimed")
    try:
        plan = rb.make_plan(ct, run, to, grace)
    except (rb.RollbackRefused, eg.EnvGenRefused) as exc:
        raise remote.fail(f"refused, nothing changed: {exc}", EXIT_REFUSED) from None
    for line in plan.lines():
        typer.echo(line)
    if dry_run:
        typer.echo("dry run: nothing was changed")
        return
    if not yes:
        if not sys.stdin.isatty():
            raise remote.fail("this stops the run and changes the container's environment: "
                              "confirm with --yes (no terminal to ask on)", EXIT_ABORTED)
        if not typer.confirm("proceed?", default=False):
            raise remote.fail("aborted; nothing was changed", EXIT_ABORTED)
    try:
        report = rb.execute(ct, plan, say=typer.echo)
    except (rb.RollbackRefused, eg.EnvGenRefused) as exc:
        raise remote.fail(f"refused: {exc}", EXIT_REFUSED) from None
    for line in report.lines():
        typer.echo(line)


def history_command(
    container: int = ContainerOpt,
    run: Optional[str] = remote.run_option("only this run's records"),
    limit: int = typer.Option(0, "--limit", help="only the last N records"),
    as_json: bool = typer.Option(False, "--json", help="one JSON record per line"),
    node: Optional[str] = NodeOpt,
    config: Optional[str] = ConfigOpt,
    trust_new_host_key: bool = TrustOpt,
) -> None:
    """Every kill and rollback in the container, oldest first (kept in its workspace)."""
    with container_session(container, node, config, trust_new_host_key) as ct:
        reply = eg.recovery(ct, "history", *(["--run", run] if run else []), "--limit", str(limit))
    records = reply["records"]
    for problem in reply.get("problems") or []:  # a line that is not a record: named, never a traceback
        typer.echo(f"ctl: warning: container {container}: {problem} (line skipped)", err=True)
    for rec in records:
        if as_json:
            typer.echo(json.dumps(rec, sort_keys=True))
            continue
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(rec.get("ts", 0))) + "Z"
        if rec.get("event") == "kill":
            typer.echo(f"{when}  kill      run {rec.get('run')}: {rec.get('how')}")
        elif rec.get("event") == "rollback":
            typer.echo(f"{when}  rollback  run {rec.get('run')} → {rec.get('to')}: venv {rec.get('from_env')} → "
                       f"{rec.get('to_env')} (verified {rec.get('verified')})")
            for line in rb.render_diff(rec.get("diff") or {}):
                typer.echo(f"{'':22}  {line}")
        else:
            typer.echo(f"{when}  {rec.get('event')}  {json.dumps(rec, sort_keys=True)}")
    if not records:
        typer.echo(f"no kills or rollbacks recorded in container {container}")


def register(app: typer.Typer) -> None:
    app.command("kill-and-rollback")(kill_and_rollback_command)
    app.command("history")(history_command)
