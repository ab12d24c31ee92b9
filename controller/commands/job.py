"""The job forms of `ctl tail`, `ctl status` and `ctl kill-and-rollback` (controller/job.py):
several ``--container NODE:CTID`` make one job. Called from controller/commands/run.py; a job's
launch goes through controller/commands/launch.py like every launch."""

from __future__ import annotations

import json
from typing import Optional

from controller import config as cfg
from controller import job
from controller.commands.plain import (EXIT_FAILED, EXIT_NOT_DONE, EXIT_REFUSED,
                                       echo, fail)
from controller.jobview import ContainerStream, last_launch_path
from controller.session import open_containers


def is_job(containers: list[str]) -> bool:
    return len(containers) > 1 or any(":" in c for c in containers)


def from_config(section) -> tuple[list[str], str, str]:
    """The run config's [[job.containers]] as `ctl launch` arguments (containers, roles)."""
    containers = [c.container for c in section.containers]

    def roles(attr: str) -> str:
        return ";".join(f"{c.container}={','.join(map(str, getattr(c, attr)))}"
                        for c in section.containers if getattr(c, attr))

    return containers, roles("target_gpus"), roles("drafter_gpus")


def default_node(ctl_config: Optional[str], node: Optional[str]) -> Optional[str]:
    if node:
        return node
    try:
        return cfg.load(ctl_config).default_node
    except cfg.ConfigError:
        return None


def tail(members: list[job.Member], run_id: str, *, ctl_config: Optional[str], follow: bool, raw: bool, since: int,
         trust_new_host_key: bool = False) -> int:
    from controller.agentcall import AgentCaller
    from controller import jobview

    def stop(m: job.Member) -> None:
        with open_containers([m], ctl_config) as (ct,):
            job.stop_member(ct, run_id)

    with open_containers(members, ctl_config, trust_new_host_key, per_member=True) as cts:
        callers = [AgentCaller(ct) for ct in cts]
        sources = [ContainerStream(ct, c) for ct, c in zip(cts, callers)]
        jobview.merged(members, sources, run_id, echo, follow=follow, raw=raw, stop=stop, since=since)
        if not follow:
            return 0
        replies = jobview.statuses(members, callers, run_id)
    verdict = job.job_verdict(replies)
    root = verdict["root_cause"]
    if verdict["state"] == "failed":
        where = f"rank {root.get('rank')} in " if root and root.get("rank") is not None else ""
        echo(f"ctl: job {run_id} FAILED: {where}container {root['container'] if root else '?'}: "
                   f"{root.get('reason') if root else 'unknown'}", err=True)
        return EXIT_FAILED
    if verdict["state"] == "completed":
        echo(f"ctl: job {run_id} completed in every container", err=raw)
        return 0
    echo(f"ctl: job {run_id} is {verdict['state']}: {verdict['states']}", err=True)
    return EXIT_NOT_DONE


def status(members: list[job.Member], run_id: str, *, ctl_config: Optional[str], json_out: bool,
           trust_new_host_key: bool = False) -> int:
    from controller.agentcall import AgentCaller
    from controller import jobview

    with open_containers(members, ctl_config, trust_new_host_key) as cts:
        replies = jobview.statuses(members, [AgentCaller(ct) for ct in cts], run_id)
    if json_out:
        echo(json.dumps({"run_id": run_id, "job": job.job_verdict(replies),
                               "containers": {m.label: r for m, r in replies}}, sort_keys=True, indent=1))
    else:
        for line in job.render_job_status(run_id, replies):
            echo(line)
    return EXIT_FAILED if job.job_verdict(replies)["state"] == "failed" else 0


def find(run: Optional[str], containers: Optional[list[str]], node: Optional[str],
         ctl_config: Optional[str]) -> Optional[tuple[list[job.Member], str]]:
    """The job a tail/status names: by --run (its local record), or the last launch's."""
    run_id = run
    if run_id is None and not containers:
        try:
            run_id = json.loads(last_launch_path(ctl_config).read_text()).get("run_id")
        except (OSError, ValueError):
            return None
    if not run_id:
        return None
    members = job.load_record(ctl_config, run_id)
    if members is None:
        return None
    if containers and not is_job(containers):
        return None  # one container of the job asked for by plain id: the single view
    return members, run_id


def kill_and_rollback(members: list[job.Member], run_id: str, *, to: str, grace: float, dry_run: bool, yes: bool,
                      ctl_config: Optional[str], trust_new_host_key: bool = False) -> int:
    """`ctl kill-and-rollback` of a job: every container's plan first (all or nothing is
    refused), one confirmation, then each container in turn. The first graceful stop stops
    the whole job (the trainer's stop decision is all-reduced over every rank, so all ranks
    checkpoint after the same step); the later ones find their run already stopped."""
    import sys

    from controller import envgen_client as eg
    from controller import rollback as rb

    import contextlib

    with open_containers(members, ctl_config, trust_new_host_key) as cts, contextlib.ExitStack() as claims:
        if not dry_run:  # every container's claim first, as in a single container (controller/rollback.py)
            for m, ct in zip(members, cts):
                try:
                    claims.enter_context(rb.claimed(ct, grace))
                except rb.RollbackRefused as exc:
                    raise fail(f"refused in {m.label}, nothing changed anywhere: {exc}", EXIT_REFUSED) from None
        plans = []
        for m, ct in zip(members, cts):
            try:
                plans.append(rb.make_plan(ct, run_id, to, grace))
            except (rb.RollbackRefused, eg.EnvGenRefused) as exc:
                raise fail(f"refused in {m.label}, nothing changed anywhere: {exc}", EXIT_REFUSED) from None
        for m, plan in zip(members, plans):
            for line in plan.lines():
                echo(f"{m.label} {line}")
        if dry_run:
            echo("dry run: nothing was changed")
            return 0
        if not yes:
            if not sys.stdin.isatty():
                raise fail("this stops the job and changes every container's environment: confirm with --yes "
                           "(no terminal to ask on)", EXIT_NOT_DONE)
            import typer  # the prompt: only a job's kill-and-rollback asks

            if not typer.confirm(f"proceed in {len(members)} containers?", default=False):
                raise fail("aborted; nothing was changed", EXIT_NOT_DONE)
        for m, ct, plan in zip(members, cts, plans):
            try:
                report = rb.execute(ct, plan, say=lambda line, p=m.label: echo(f"{p} {line}"))
            except (rb.RollbackRefused, eg.EnvGenRefused) as exc:
                raise fail(f"refused in {m.label}: {exc}", EXIT_REFUSED) from None
            for line in report.lines():
                echo(f"{m.label} {line}")
    return 0
