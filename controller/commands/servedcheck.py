"""`ctl served-check`: serve a training run's checkpoint in the container's engine, now.

    ctl served-check --run RUN [--container C] [--best | --step N] [--gpu N] [--threads N] [--vllm-python PY]

In the container, agent/servedcheck.py runs the served-check job's own start checks (the
checkpoint, τ at save, the run's target and data, vLLM installed), refuses a ``--gpu`` a live run
holds and a second check of the same run while one is running, then starts the job (trainer/
serve/served_job.py) under its own agent. This command follows its stream to the end and prints
the record it left beside the run's τ: served τ, τ at save, the verdict and its first cause.

Exit codes: 0 the check passed, 1 it failed (or did not finish), 2 bad input (one line: unknown
run, no checkpoint yet, no τ at save, the GPU taken, no vLLM there), 255 the node could not be
reached.
"""

from __future__ import annotations

from typing import Optional

import typer

from controller.commands.remote import (EXIT_CONFIG, EXIT_CONTAINER, TrustOpt, container_option, container_session,
                                        fail, run_option)


def served_check_command(
    container: Optional[int] = container_option(None, "container id (default: the last launch's)"),
    run: Optional[str] = run_option("the training run whose checkpoint is checked (default: the latest run)"),
    step: Optional[int] = typer.Option(None, "--step", metavar="N", min=0,
                                       help="check the checkpoint of step N (default: the run's newest complete one)"),
    best: bool = typer.Option(False, "--best", help="check the checkpoint with the highest τ at save (best.json)"),
    gpu: Optional[int] = typer.Option(None, "--gpu", metavar="N", min=0,
                                      help="a GPU reserved for the check, never one a live run holds (default: CPU at "
                                           "nice 19, idle I/O, --threads threads)"),
    threads: int = typer.Option(1, "--threads", metavar="N", min=1, max=1024, help="on CPU: threads the check may use"),
    vllm_python: Optional[str] = typer.Option(None, "--vllm-python", metavar="PY",
                                              help="vLLM's interpreter in the container (default: the run's own "
                                                   "--vllm-python, else $DFLASH_VLLM_PYTHON, else .venv-vllm beside "
                                                   "the agent bundle)"),
    node: Optional[str] = typer.Option(None, "--node", "-n", help="node name from the controller config"),
    ctl_config: Optional[str] = typer.Option(None, "--ctl-config", help="controller config (default: "
                                             "$DFLASH_CTL_CONFIG, else ~/.config/dflash-ctl/config.toml)"),
    trust_new_host_key: bool = TrustOpt,
) -> None:
    """Serve a run's checkpoint in vLLM where the run runs, on the run's held-out prompts
    (--eval-prompts), and hold served τ to the τ it was measured at when it was saved: the
    output must be the target's greedy output, and served τ may fall at most the tolerance
    (2 %) below τ at save. The record goes beside τ in `ctl status`, the run's stream, its
    wandb and the checkpoint's meta.json (docs/jobs.md, "served-check")."""
    from controller.agentcall import AgentCaller, AgentCallError
    from controller.commands.watch import _follow, container_or_last_launch, resolve_run
    from controller.status import served_lines

    if best and step is not None:
        raise fail("--best and --step name different checkpoints; give one of them", EXIT_CONFIG)
    say = lambda line: typer.echo(line, err=True)  # noqa: E731
    ctid, node = container_or_last_launch(container, node, ctl_config)
    with container_session(ctid, node, ctl_config, trust_new_host_key) as ct:
        caller = AgentCaller(ct, say)
        run_id = run or resolve_run(ct, caller, None)["run_id"]
        args = ["start", "--workspace", ct.config.workspace, "--run", run_id, "--threads", str(threads)]
        args += ["--best"] if best else []
        args += ["--step", str(step)] if step is not None else []
        args += ["--gpu", str(gpu)] if gpu is not None else []
        args += ["--vllm-python", vllm_python] if vllm_python else []
        say(f"served check of run {run_id} in {ct}: the job's start checks first")
        try:
            reply = caller.call("agent.servedcheck", args, what="served check")
        except AgentCallError as exc:
            raise fail(str(exc), EXIT_CONTAINER) from None
        if not reply.get("ok"):
            raise fail(f"{ct}: {reply.get('error')}", EXIT_CONFIG)
        say(f"started served check {reply['run_id']}: step {reply['step']} ({reply.get('checkpoint')}), τ at save "
            f"{reply.get('tau_at_save'):.3f}; following it (Ctrl-C detaches; it goes on)")
        _follow(ct, caller, reply["run_id"], 0, True, False)
        served = (resolve_run(ct, caller, run_id).get("history") or {}).get("served") or []
    mine = [r for r in served if r.get("run_id") == reply["run_id"]]
    if not mine:
        raise fail(f"served check {reply['run_id']} ended without a record (`ctl tail --run {reply['run_id']}` has "
                   "its log)", 1)
    for line in served_lines(mine):
        typer.echo(line)
    if not mine[-1].get("ok"):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("served-check")(served_check_command)
