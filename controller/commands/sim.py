"""`ctl sim up|status|down`: the simulated Proxmox node (sim/) for tests and the demo.

`up` also writes the node's entry into the controller config (and makes it the default node
when none is set), so `ctl exec`/`ctl env` reach it with no further setup."""

from __future__ import annotations

from typing import Optional

import typer
from rich.console import Console

from controller import config as cfg

console = Console(stderr=True, highlight=False, soft_wrap=True)

group = typer.Typer(help="The simulated Proxmox node: real sshd + real LXC + a pct emulation.",
                    no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(group, name="sim")


def _node(name: str, ctids: Optional[str], pve: Optional[str] = None):
    from sim.node import SimNode

    ids = None
    if ctids:
        try:
            ids = tuple(int(x) for x in ctids.split(","))
        except ValueError:
            _fail(f"--ctids {ctids!r}: give two container ids, e.g. --ctids 300,301")
    try:
        return SimNode(name, ctids=ids, pve=pve)
    except ValueError as exc:
        _fail(str(exc))


def _fail(message: str) -> None:
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(1)


def _progress(line: str) -> None:
    console.print(f"[dim]·[/dim] {line}")


def write_node_entry(name: str, entry: dict, config_file: Optional[str] = None) -> str:
    """Put the sim node into the controller config; default_node only if none is set."""
    # A --config file that does not exist yet is created (load() refuses a missing explicit file).
    conf = cfg.load(config_file) if cfg.config_path(config_file).exists() else cfg.Config()
    containers = {k: cfg.ContainerConfig(**v) for k, v in entry["containers"].items()}
    conf.nodes[name] = cfg.NodeConfig(host=entry["host"], port=entry["port"], user=entry["user"],
                                      identity_file=entry["identity_file"], known_hosts=entry["known_hosts"],
                                      containers=containers)
    if not conf.default_node:
        conf.default_node = name
    return str(cfg.save(conf, config_file))


@group.command("up")
def up(
    name: str = typer.Option("sim", "--name", help="node name; also the key in the controller config"),
    ctids: Optional[str] = typer.Option(None, "--ctids", help="two container ids 'SNAP,DIR' (default 200,201 for sim)"),
    config_file: Optional[str] = typer.Option(None, "--config", help="controller config file to update"),
    tiny: bool = typer.Option(True, "--tiny/--no-tiny", help="provision /workspace/tiny/{target,data} in each "
                                                             "container (`python -m trainer tiny`, once)"),
    pve: Optional[str] = typer.Option(None, "--pve", metavar="VERSION",
                                      help="the Proxmox VE release whose pct to emulate: 7.4, 8.1, 8.2 or 9.1 "
                                           "(default: as before for this node, else 9.1); docs/sim.md lists "
                                           "what differs"),
) -> None:
    """Bring the node up (idempotent). The first run on a machine builds the rootfs cache."""
    from sim.proc import SimError

    node = _node(name, ctids, pve)
    try:
        info = node.up(progress=_progress)
        path = write_node_entry(name, node.node_config(), config_file)
    except (SimError, cfg.ConfigError) as exc:
        _fail(str(exc))
    console.print(f"[green]sim node {name} up[/green] (Proxmox VE {node.pve}) in {info['seconds']} s"
                  f"{' (cold: built the rootfs cache)' if info['cold'] else ''}; "
                  f"containers {', '.join(info['containers'])}; config: {path}")
    if tiny:  # as a real node already holds its model and data (controller/provision.py)
        from controller.container import ContainerError
        from controller.provision import provision_node
        from controller.transport import TransportError

        try:
            provision_node(name, config_file, say=_progress)
        except (ContainerError, TransportError, cfg.ConfigError) as exc:
            _fail(f"provisioning the tiny target and data: {exc}")


@group.command("status")
def status(
    name: str = typer.Option("sim", "--name"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """sshd, storage and per-container state."""
    import json

    from sim.proc import SimError

    node = _node(name, None)
    try:
        st = node.status()
    except SimError as exc:
        _fail(str(exc))
    if json_out:
        typer.echo(json.dumps(st, indent=1, sort_keys=True))
        return
    sshd = st["sshd"]
    typer.echo(f"node {st['name']} ({st['state_dir']}), emulating Proxmox VE {st['pve']}")
    typer.echo(f"  sshd: {'running' if sshd['running'] else 'stopped'}"
               + (f" on 127.0.0.1:{sshd['port']} (pid {sshd['pid']})" if sshd["running"] else ""))
    typer.echo(f"  btrfs storage: {'mounted' if st['storage']['btrfs_mounted'] else 'not mounted'}")
    for ctid, c in st["containers"].items():
        snaps = f", snapshots: {', '.join(c['snapshots'])}" if c["snapshots"] else ""
        addr = f", {c['address']} on the sim network" if c.get("address") else ""
        typer.echo(f"  CT {ctid}: {c['state']} ({c['storage']}{snaps}){addr}")
    if not (sshd["running"] and all(c["state"] == "running" for c in st["containers"].values())):
        raise typer.Exit(3)


@group.command("gpu")
def gpu(
    container: int = typer.Option(..., "--container", "-c", help="container id on the sim node"),
    state: str = typer.Option(..., "--state", help="none | ok | no-devices | no-cgroup | mismatch (sim/gpu.py)"),
    gpus: int = typer.Option(1, "--gpus", min=1, max=8, help="GPUs the node passes through"),
    free_mib: int = typer.Option(143000, "--free-mib", min=0, help="free memory each GPU reports"),
    name: str = typer.Option("sim", "--name"),
) -> None:
    """Make a container see its GPUs as LXC gives them, or lose them the ways it does (the
    sim has no GPU: nvidia-smi is emulated; device nodes and cgroup rules are real). Restarts
    the container."""
    from sim.proc import SimError

    node = _node(name, None)
    try:
        node.set_gpu(container, state, gpus=gpus, free_mib=free_mib, progress=_progress)
    except (SimError, ValueError) as exc:
        _fail(str(exc))
    console.print(f"container {container} on sim node {name}: GPU state {state}")


@group.command("down")
def down(
    name: str = typer.Option("sim", "--name"),
    purge: bool = typer.Option(False, "--purge", help="also delete containers, snapshots and keys (cache stays)"),
) -> None:
    """Stop containers and sshd, unmount storage, detach the loop device."""
    from sim.proc import SimError

    node = _node(name, None)
    try:
        node.down(purge=purge, progress=_progress)
    except SimError as exc:
        _fail(str(exc))
    console.print(f"sim node {name} down" + (" and purged" if purge else ""))
