"""The bodies of `ctl tail` and `ctl status`, without typer: typer's commands
(controller/commands/run.py) call them, and so does controller/front.py, which parses their
plainest forms without importing typer (controller/commands/plain.py says why). Each
returns the command's exit code (controller/exitcodes.py: a failed run's `ctl status` and
`ctl tail` exit 1)."""

from __future__ import annotations

import json
import sys
from typing import Optional

from agent.protocol import RunStatus
from controller.commands.plain import EXIT_CONFIG, EXIT_FAILED, EXIT_NOT_DONE, container_session, echo, fail
from controller.container import Container
from controller.exitcodes import CtlExit
from controller.jobview import ContainerStream, last_launch_path
from controller.status import restart_message


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
            live_baseline: Optional[dict] = None, stopped_wait: Optional[float] = None) -> int:
    """``live_baseline``: the run's status reply when the output is a terminal that gets the
    live display (its baseline goes on the status line); None for plain lines."""
    import contextlib

    from controller.tail import STOPPED_WAIT_S, Printer, tail

    live = None
    if live_baseline is not None:
        # A terminal: the log scrolls above one live status line (controller/livetail.py).
        from rich.console import Console

        from controller.livetail import LiveTail

        live = LiveTail(Console(highlight=False), baseline_tok_s=_baseline_tok_s(live_baseline))
    printer = Printer(live.write if live else (lambda line: echo(line)), raw=raw,
                      on_step=live.on_step if live else None)

    def reconnecting(n: int, why: str) -> None:
        echo(f"ctl: connection lost ({why.splitlines()[0][:120]}); reconnecting (#{n}) from seq "
                   f"{printer_last['seq']}", err=True)

    printer_last = {"seq": since, "state": None}
    stopped_wait = STOPPED_WAIT_S if stopped_wait is None else stopped_wait

    def stopped(why: str) -> None:
        echo(f"ctl: {why.splitlines()[0]}; waiting up to {stopped_wait:.0f} s for it to run again (Ctrl-C detaches)",
             err=True)

    def on_record(rec: dict) -> None:
        printer_last["seq"] = rec["seq"]
        if rec.get("kind") == "status" and isinstance(rec.get("payload"), dict):
            printer_last["state"] = rec["payload"].get("state")
        printer(rec)

    with live if live else contextlib.nullcontext():
        result = tail(ContainerStream(ct, caller), run_id, on_record, since=since, follow=follow,
                      on_reconnect=reconnecting, stopped_wait=stopped_wait, on_stopped=stopped)
    if printer.steps_seen and not raw and not printer.status_is_last and live is None:
        echo(printer.status_line())
    if result.detached:
        echo(f"ctl: detached at seq {result.last_seq}; the run goes on. Resume with "
                   f"`ctl tail --container {ct.ctid}{f' --run {run_id}' if run_id else ''} --since {result.last_seq} --follow`", err=True)
        return 0
    if result.gaps:
        echo(f"ctl: warning: the stream skipped seq ranges {result.gaps}", err=True)
    if result.stopped:
        # Nothing runs in a stopped container: the run died with it, and the restart check
        # that names how to resume can only run once the container does.
        echo(f"ctl: run {run_id}: container {ct.ctid} has not run again in {stopped_wait:.0f} s: the run died with "
             f"it ({result.stopped.splitlines()[0]}); once it runs, `ctl status --container {ct.ctid} --run {run_id}` "
             "says how to resume", err=True)
        return CtlExit.CONTAINER_RESTARTED
    if not follow:  # what exists now: a stream that ends in the run's failure says so
        return EXIT_FAILED if printer_last["state"] == "failed" or result.run_failed else 0
    state = result.state
    status = RunStatus.from_json(result.status)
    reply = (result.status or {}).get("_reply")
    if reply is None and status.host_restart:  # the stream said it: ask once for the resume line's launch
        try:
            reply = ContainerStream(ct, caller).state(run_id).get("_reply")
        except Exception:  # noqa: BLE001 - the message goes out without the launch's config then
            reply = None
    died = restart_message(reply or {"status": result.status, "host_restart": status.host_restart},
                           ct.ctid, ct.node_name)
    if died:
        echo(f"ctl: run {run_id}: {died}", err=True)
        return CtlExit.CONTAINER_RESTARTED
    if state == "failed":
        echo(f"ctl: run {run_id} FAILED: {status.reason or status.last_error}", err=True)
    elif state == "completed":
        # With --json, stdout carries only records: the verdict goes to stderr.
        echo(f"ctl: run {run_id} completed" + (f"; last checkpoint {status.checkpoint.path}"
                                                     if status.checkpoint else ""), err=raw)
    else:
        echo(f"ctl: the stream of run {run_id} ended while the run is {state or 'unknown'}: its agent is not "
                   "running; see `ctl status`", err=True)
    return _exit_for(state)


# --- commands ----------------------------------------------------------------------------------

def resolve_run(ct: Container, caller, run: Optional[str]) -> dict:
    from controller.agentcall import AgentCallError

    args = ["status", "--workspace", ct.config.workspace] + (["--run", run] if run else [])
    try:
        reply = caller.call("agent.runview", args, what="run status")
    except AgentCallError as exc:
        raise fail(str(exc), EXIT_FAILED) from None
    if not reply.get("ok"):
        # a corrupt state file is the run's trouble, not the operator's input
        raise fail(f"container {ct.ctid}: {reply.get('error')}", EXIT_FAILED if reply.get("corrupt") else EXIT_CONFIG)
    for warning in reply.get("warnings") or []:
        echo(f"ctl: warning: container {ct.ctid}: {warning}", err=True)
    return reply


def _state_of(reply: dict) -> Optional[str]:
    try:
        state = RunStatus.from_json(reply.get("status")).state
    except (ValueError, TypeError):
        return None
    return state.value if state else None


def tail_in(container: Optional[int], run: Optional[str], follow: bool, since: int, raw: bool, node: Optional[str],
            ctl_config: Optional[str], trust_new_host_key: bool, stopped_wait: Optional[float] = None) -> int:
    """`ctl tail`."""
    from controller.agentcall import AgentCaller
    from controller.commands import job as job_cmd

    found = job_cmd.find(run, None if container is None else [str(container)], node, ctl_config)
    if found:
        return job_cmd.tail(found[0], found[1], ctl_config=ctl_config, follow=follow, raw=raw, since=since,
                            trust_new_host_key=trust_new_host_key)

    container, node = container_or_last_launch(container, node, ctl_config)
    with container_session(container, node, ctl_config, trust_new_host_key, one_shot=not follow) as ct:
        caller = AgentCaller(ct)
        live = follow and not raw and sys.stdout.isatty()
        # One status call, only where it is needed: the latest run's id for --follow, the
        # baseline for the live line. Without --follow the stream call finds the latest run.
        reply = resolve_run(ct, caller, run) if follow and (run is None or live) else None
        run_id = run or (reply["run_id"] if reply else None)
        code = _follow(ct, caller, run_id, since, follow, raw, live_baseline=reply if live else None,
                       stopped_wait=stopped_wait)
    return code


def status_in(container: Optional[int], run: Optional[str], json_out: bool, node: Optional[str],
              ctl_config: Optional[str], trust_new_host_key: bool) -> int:
    """`ctl status`."""
    from controller.agentcall import AgentCaller
    from controller.commands import job as job_cmd
    from controller.status import render_status

    found = job_cmd.find(run, None if container is None else [str(container)], node, ctl_config)
    if found:
        return job_cmd.status(found[0], found[1], ctl_config=ctl_config, json_out=json_out,
                              trust_new_host_key=trust_new_host_key)

    container, node = container_or_last_launch(container, node, ctl_config)
    with container_session(container, node, ctl_config, trust_new_host_key, one_shot=True) as ct:
        reply = resolve_run(ct, AgentCaller(ct), run)
        from controller import kernellog

        # a rank dead or a GPU lost: what the node's own kernel log says of that moment
        evidence = kernellog.for_run(ct, reply)
        if evidence is not None:
            reply["node_evidence"] = evidence.to_json()
        if json_out:
            echo(json.dumps(reply, sort_keys=True, indent=1))
        else:
            for line in render_status(reply, ct.ctid, ct.node_name):
                echo(line)
    # A script's `ctl status || alert` sees a failed run (controller/exitcodes.py).
    if reply.get("host_restart"):  # died with its container, whatever state its files still say
        return CtlExit.CONTAINER_RESTARTED
    return EXIT_FAILED if _state_of(reply) == "failed" else 0
