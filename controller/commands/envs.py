"""`ctl env`: the environment of a container.

- ``ctl env --container 200`` (no subcommand): the variables a process in the container
  actually gets, whatever the node's login exports (controller/commands/remote.py:env_command);
- ``list | show | diff``: the venv's generations (agent/envgen.py), each identified by its
  fingerprint (the exact package set, torch build included);
- ``install 'pkg==X' [--wheelhouse DIR]``: build a new generation beside the current one
  (offline with a wheelhouse in the container: pip --no-index --find-links) and switch to
  it atomically, keeping the old one;
- ``switch GEN``, ``resume`` (finish an interrupted operation), ``remove GEN`` (refused
  for the current generation and for one a known-good run used), ``adopt``;
- ``cache list | export | import``: a generation's compile cache, carried to another
  container (controller/commands/envcache.py).
"""

from __future__ import annotations

import json
import time
from typing import List, Optional

import typer

from controller import envgen_client as eg
from controller.commands import remote
from controller.commands import envcache
from controller.commands.remote import (EXIT_REFUSED, ConfigOpt, NodeOpt, TrustOpt, container_option, container_session,
                                        guard_refused)
from controller.rollback import pin_known_good, render_diff


group = typer.Typer(help="The environment of a container: its variables (no subcommand) and its venv generations.",
                    invoke_without_command=True)

OptContainer = container_option(..., "container id (Proxmox VMID), e.g. 200")


@group.callback()
def env_root(
    ctx: typer.Context,
    container: Optional[int] = container_option(None, "container id: print the environment a process there gets"),
    node: Optional[str] = NodeOpt,
    config: Optional[str] = ConfigOpt,
    trust_new_host_key: bool = TrustOpt,
) -> None:
    """Print the environment a process in the container actually gets (no subcommand), or
    manage the container's venv generations (list, show, diff, install, switch, remove)."""
    if ctx.invoked_subcommand is not None:
        return
    if container is None:
        typer.echo(ctx.get_help())
        raise remote.fail("name the container: ctl env --container ID (or a subcommand: list, show, diff, install)",
                          remote.EXIT_CONFIG)
    remote.env_command(container=container, node=node, config=config, trust_new_host_key=trust_new_host_key)


def _session(container, node, config, trust):
    return container_session(container, node, config, trust)


def _when(ts: Optional[float]) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts)) + "Z" if ts else "?"


def _torch(t: Optional[dict]) -> str:
    return f"torch {t.get('version')} ({t.get('build')})" if t else "no torch"


@group.command("list")
def list_command(container: int = OptContainer, node: Optional[str] = NodeOpt, config: Optional[str] = ConfigOpt,
                 as_json: bool = typer.Option(False, "--json"), trust_new_host_key: bool = TrustOpt) -> None:
    """The venv's generations, oldest first; * marks the one in use."""
    with _session(container, node, config, trust_new_host_key) as ct:
        body = guard_refused(lambda: eg.envgen(ct, "list"))
    if as_json:
        typer.echo(json.dumps(body, indent=1, sort_keys=True))
        return
    if not body["managed"]:
        typer.echo(f"{body['venv']} in container {container} is a plain venv: its first `ctl env install` "
                   f"(or `ctl env adopt`) makes it generation 1")
        return
    typer.echo(f"{body['venv']} → generation {body['current']} (store {body['store']})")
    for g in body["generations"]:
        mark = "*" if g["current"] else " "
        origin = "adopted" if g["adopted"] else f"from {g['parent']} + {' '.join(g['specs'])}"
        refs = f"  used by {', '.join(g['refs'])}" if g["refs"] else ""
        typer.echo(f"{mark} {g['id']}  {_when(g['created'])}  python {g['python']}  {_torch(g['torch'])}  "
                   f"{g['packages']} packages  {origin}{refs}")
    if body.get("pending"):
        typer.echo(f"an interrupted {body['pending'].get('op')} is pending: `ctl env resume --container {container}`")


@group.command("show")
def show_command(gen: str = typer.Argument("current", help="generation id (or unique prefix), or current"),
                 container: int = OptContainer, node: Optional[str] = NodeOpt, config: Optional[str] = ConfigOpt,
                 as_json: bool = typer.Option(False, "--json"), trust_new_host_key: bool = TrustOpt) -> None:
    """One generation: fingerprint, where it came from, every package."""
    with _session(container, node, config, trust_new_host_key) as ct:
        body = guard_refused(lambda: eg.envgen(ct, "show", gen))
    if as_json:
        typer.echo(json.dumps(body, indent=1, sort_keys=True))
        return
    fp = body.get("fingerprint", {})
    typer.echo(f"generation {body['id']}{' (current)' if body.get('current') else ''}: python {fp.get('python')}, "
               f"{_torch(fp.get('torch'))}")
    if body.get("parent"):
        typer.echo(f"built from {body['parent']} with {' '.join(body.get('specs') or [])}"
                   + (f" (wheelhouse {body['wheelhouse']})" if body.get("wheelhouse") else ""))
    for name, version in sorted(fp.get("packages", {}).items()):
        typer.echo(f"  {name}=={version}")


@group.command("diff")
def diff_command(a: str = typer.Argument(..., help="from this generation"),
                 b: str = typer.Argument("current", help="to this generation (default: current)"),
                 container: int = OptContainer, node: Optional[str] = NodeOpt, config: Optional[str] = ConfigOpt,
                 trust_new_host_key: bool = TrustOpt) -> None:
    """Packages up, down, added and removed from A to B, and the torch build."""
    with _session(container, node, config, trust_new_host_key) as ct:
        d = guard_refused(lambda: eg.envgen(ct, "diff", a, b))
    typer.echo(f"{d['from']} → {d['to']}")
    for line in render_diff(d):
        typer.echo(f"  {line}")


@group.command("install")
def install_command(specs: List[str] = typer.Argument(..., help="requirements, e.g. 'torch==2.9.1'"),
                    container: int = OptContainer, node: Optional[str] = NodeOpt, config: Optional[str] = ConfigOpt,
                    wheelhouse: Optional[str] = typer.Option(
                        None, "--wheelhouse", help="directory of wheels inside the container (offline: "
                                                  "pip --no-index --find-links)"),
                    force: bool = typer.Option(False, "--force", help="switch even while a run is live"),
                    trust_new_host_key: bool = TrustOpt) -> None:
    """Build a new generation with SPECS beside the current one and switch to it (atomic);
    the old generation is kept for `ctl kill-and-rollback`."""
    from agent.envgen import requirements_problem

    why = requirements_problem(specs)  # before connecting; envgen holds to it too
    if why:
        raise remote.fail(why, remote.EXIT_CONFIG)
    with _session(container, node, config, trust_new_host_key) as ct:
        if not force:
            _refuse_if_live(ct)
        typer.echo(f"building a new generation of {ct.config.venv} in container {container}: {' '.join(specs)} …")
        # "--": the requirements are positional there, whatever they look like
        body = guard_refused(lambda: eg.envgen(ct, "install", *(["--wheelhouse", wheelhouse] if wheelhouse else []),
                                        "--", *specs))
        # After the install: the first one adopts the venv, only then can the known-good
        # run's generation be found and pinned.
        pin_known_good(ct)
        seeded = _seed_compile_cache(ct, body) if body["from"] != body["to"] else None
    if body["from"] == body["to"]:
        typer.echo(f"nothing changed: generation {body['to']} already holds {' '.join(specs)}")
        return
    typer.echo(f"container {container}: generation {body['from']} → {body['to']} (the old one is kept)")
    for line in render_diff(body["diff"]):
        typer.echo(f"  {line}")
    if seeded:
        typer.echo(seeded)


def _seed_compile_cache(ct, body: dict) -> Optional[str]:
    """The new generation starts with the old one's compiled kernels when both compile the
    same (agent/compilecache.py seed): one line saying so, or why not; an install never fails
    for it."""
    from controller.container import ContainerError

    try:
        got = eg.compile_cache(ct, "seed", "--from", body["from"])
    except ContainerError as exc:
        return f"compile cache: not carried over ({exc}); the first step compiles"
    if got.get("seeded"):
        return (f"compile cache: {got['seeded']} entries of generation {body['from']} carried over (the same torch and "
                f"compilers): the next launch loads them instead of compiling")
    why = got.get("why") or ""
    if why.startswith("the compile stack changed"):
        return f"compile cache: starts empty, {why}: the first step compiles"
    return None


@group.command("switch")
def switch_command(gen: str = typer.Argument(...), container: int = OptContainer, node: Optional[str] = NodeOpt,
                   config: Optional[str] = ConfigOpt, force: bool = typer.Option(False, "--force"),
                   trust_new_host_key: bool = TrustOpt) -> None:
    """Make an existing generation current (no stop, no report: see kill-and-rollback)."""
    with _session(container, node, config, trust_new_host_key) as ct:
        if not force:
            _refuse_if_live(ct)
        body = guard_refused(lambda: eg.envgen(ct, "switch", gen))
    typer.echo(f"generation {body['from']} → {body['to']} (fingerprint verified: {body['verified']})")
    for line in render_diff(body["diff"]):
        typer.echo(f"  {line}")


@group.command("resume")
def resume_command(container: int = OptContainer, node: Optional[str] = NodeOpt, config: Optional[str] = ConfigOpt,
                   trust_new_host_key: bool = TrustOpt) -> None:
    """Complete an env operation that was interrupted (ssh dropped, ctl or the container process killed)."""
    with _session(container, node, config, trust_new_host_key) as ct:
        body = guard_refused(lambda: eg.envgen(ct, "resume"))
    done = body.get("resumed")
    typer.echo(f"completed the interrupted {done['resumed']}; current generation {body['current']}" if done
               else f"nothing was pending; current generation {body['current']}")


@group.command("adopt")
def adopt_command(container: int = OptContainer, node: Optional[str] = NodeOpt, config: Optional[str] = ConfigOpt,
                  trust_new_host_key: bool = TrustOpt) -> None:
    """Make the container's existing venv directory its first generation (done by install anyway)."""
    with _session(container, node, config, trust_new_host_key) as ct:
        body = guard_refused(lambda: eg.envgen(ct, "adopt"))
    typer.echo(("adopted" if body["adopted"] else "already managed:") + f" current generation {body['current']}")


@group.command("remove")
def remove_command(gen: str = typer.Argument(...), container: int = OptContainer, node: Optional[str] = NodeOpt,
                   config: Optional[str] = ConfigOpt, trust_new_host_key: bool = TrustOpt) -> None:
    """Delete a generation. Refused for the current one and for one a known-good run used."""
    with _session(container, node, config, trust_new_host_key) as ct:
        pin_known_good(ct)
        body = guard_refused(lambda: eg.envgen(ct, "remove", gen))
    typer.echo(f"removed generation {body['removed']}")


def _refuse_if_live(ct) -> None:
    from agent.protocol import RunStatus

    info = eg.recovery(ct, "run-info")
    status = RunStatus.from_json(info.get("status"))
    if info.get("run") and status.state and not status.terminal:
        raise remote.fail(f"run {info['run']} is {status.state.value} in container {ct.ctid}: changing its venv under it would "
                          f"mix package versions; stop it first (`ctl kill-and-rollback` or `ctl stop`), "
                          f"or pass --force", EXIT_REFUSED)


def register(app: typer.Typer) -> None:
    group.add_typer(envcache.group, name="cache")
    app.add_typer(group, name="env")
