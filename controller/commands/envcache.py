"""`ctl env cache`: a venv generation's compile cache, carried to a machine that has never compiled.

A run's first step on a fresh machine compiles for 34-89 s on an H200 (Inductor, Triton and,
with flash attention, flash-attn-4's kernels); a relaunch that finds them on disk takes 2-4 s
(docs/benchmarks.md). The cache belongs to one venv generation and one GPU
architecture (agent/compilecache.py), so a node whose container runs the same generation on
the same GPUs can start from another's:

    ctl env cache export --container 200 --out qwen3-8b-h200.cache.tar.gz
    ctl env cache import qwen3-8b-h200.cache.tar.gz --container 201 --node gpu-b

- ``list``: every generation's cache in the container, files and bytes per kind;
- ``export``: the current (or a named) generation's cache into a local archive, streamed;
- ``import``: an archive into the container's current generation, refused with nothing
  changed when it is another generation's, was built for other GPUs, or is damaged.
"""

from __future__ import annotations

import gzip
import json
import os
import secrets
import tarfile
import time
from pathlib import Path
from typing import Optional

import typer

from agent import compilecache
from controller import envgen_client as eg
from controller import interrupts
from controller.byteprogress import ByteProgress
from controller.commands import remote
from controller.commands.remote import (EXIT_CONFIG, EXIT_CONTAINER, EXIT_INTERRUPTED, ConfigOpt,
                                        NodeOpt, TrustOpt, container_option, container_session, guard_refused)

group = typer.Typer(help="A venv generation's compile cache: list it, export it from one container, import it "
                         "into another so a fresh machine's first step loads its kernels instead of compiling them.",
                    no_args_is_help=True)

OptContainer = container_option(..., "container id (Proxmox VMID), e.g. 200")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _gpus(gpus) -> str:
    return ", ".join(f"{g.get('name')} (sm {g.get('compute_cap')})" for g in gpus or []) or "no GPU"


@group.command("list")
def list_command(container: int = OptContainer, node: Optional[str] = NodeOpt, config: Optional[str] = ConfigOpt,
                 as_json: bool = typer.Option(False, "--json"), trust_new_host_key: bool = TrustOpt) -> None:
    """Every generation's compile cache in the container; * marks the venv's current generation."""
    with container_session(container, node, config, trust_new_host_key) as ct:
        body = guard_refused(lambda: eg.compile_cache(ct, "list"))
    if as_json:
        typer.echo(json.dumps(body, indent=1, sort_keys=True))
        return
    if not body["generations"]:
        typer.echo(f"no compile cache under {body['root']} in container {container}: a run's first step on a GPU "
                   f"makes one (or `ctl env cache import`)")
        return
    typer.echo(f"compile caches under {body['root']}:")
    for g in body["generations"]:
        kinds = ", ".join(f"{name} {k['files']} files {_mib(k['bytes'])}" for name, k in g["kinds"].items() if k["files"])
        came = g.get("imported_from")
        origin = f"  (imported from {came.get('from')}, built on {_gpus(came.get('gpus'))})" if came else ""
        typer.echo(f"{'*' if g['current'] else ' '} {g['generation']}  {g['files']} files {_mib(g['bytes'])}  "
                   f"{kinds or 'empty'}{origin}")


@group.command("export")
def export_command(container: int = OptContainer,
                   out: Path = typer.Option(..., "--out", "-o", help="the archive to write here (a new file)"),
                   generation: str = typer.Option("current", "--generation",
                                                  help="which generation's cache (default: the venv's current one)"),
                   node: Optional[str] = NodeOpt, config: Optional[str] = ConfigOpt,
                   force: bool = typer.Option(False, "--force", help="replace --out if it exists"),
                   trust_new_host_key: bool = TrustOpt) -> None:
    """Copy the container's compile cache into a local archive (gzip'd tar with a manifest:
    generation, compile stack, GPUs it was built on)."""
    out = out.expanduser().absolute()
    if out.is_dir():
        raise remote.fail(f"--out {out} is a directory: name the archive file, e.g. {out / 'cache.tar.gz'}", EXIT_CONFIG)
    if not out.parent.is_dir():
        raise remote.fail(f"--out {out}: the directory {out.parent} does not exist", EXIT_CONFIG)
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise remote.fail(f"--out {out}: cannot write in {out.parent}", EXIT_CONFIG)
    if out.exists() and not force:
        raise remote.fail(f"--out {out} exists; name a new file or pass --force", EXIT_CONFIG)
    if generation != "current" and not compilecache.generation_id_ok(generation):
        raise remote.fail(f"--generation {generation!r} is not a generation id (hex digits, as `ctl env cache list` "
                          f"shows them) nor 'current'", EXIT_CONFIG)
    part = out.parent / f".{out.name}.ctl-part-{secrets.token_hex(4)}"
    try:
        with container_session(container, node, config, trust_new_host_key) as ct:
            typer.echo(f"packing the compile cache of generation {generation} in container {container} …", err=True)
            started = time.monotonic()
            try:
                with open(part, "wb") as fh, ByteProgress("receiving", None) as advance:
                    body = guard_refused(lambda: eg.compile_cache_pack(ct, _CountingWriter(fh, advance), generation))
                    fh.flush()
                    os.fsync(fh.fileno())
            except KeyboardInterrupt:  # here, not in container_session: this one knows nothing was changed
                raise remote.fail(f"interrupted: nothing was written to {out} (the container's cache is untouched); "
                                  f"run the same command again", EXIT_INTERRUPTED) from None
        sent = body["manifest"]
        try:
            manifest = _local_manifest(part)  # what arrived is an archive this ctl can import
        except ValueError as exc:
            raise remote.fail(f"what container {container} sent is not a whole archive: {exc}; nothing was written "
                              f"to {out}", EXIT_CONTAINER) from None
        if manifest.get("files") != sent.get("files") or manifest.get("generation") != sent.get("generation"):
            raise remote.fail(f"what container {container} sent does not match what it packed; nothing was written "
                              f"to {out}", EXIT_CONTAINER)
        os.replace(part, out)
    except OSError as exc:  # this machine's side: a full disk, a directory that went away
        raise remote.fail(f"cannot write {out}: {exc}; nothing was written", EXIT_CONFIG) from None
    finally:
        part.unlink(missing_ok=True)
    typer.echo(f"{out}: generation {sent['generation']}, {sent['files']} files ({_mib(sent['bytes'])} unpacked, "
               f"{_mib(out.stat().st_size)} packed), built on {_gpus(sent.get('gpus'))}, "
               f"in {time.monotonic() - started:.1f} s")
    typer.echo(f"import it where the same torch and compilers run on the same GPUs: "
               f"ctl env cache import {out} --container ID [--node NODE]")


@group.command("import")
def import_command(archive: Path = typer.Argument(..., help="an archive made by `ctl env cache export`"),
                   container: int = OptContainer, node: Optional[str] = NodeOpt, config: Optional[str] = ConfigOpt,
                   any_gpu: bool = typer.Option(False, "--any-gpu",
                                                help="import even when the archive was built for another compute "
                                                     "capability (its GPU kernels will not be used)"),
                   trust_new_host_key: bool = TrustOpt) -> None:
    """Add an exported compile cache to the container's current generation (entries already
    there are kept). Refused, with nothing changed, for an archive compiled by another torch
    or compilers (another compile stack) or for another GPU architecture."""
    archive = archive.expanduser()
    if not archive.is_file():
        raise remote.fail(f"{archive} is not a file{' (a directory)' if archive.is_dir() else ''}: name an archive "
                          f"made by `ctl env cache export`", EXIT_CONFIG)
    try:
        manifest = _local_manifest(archive)
    except ValueError as exc:
        raise remote.fail(str(exc), EXIT_CONFIG) from None
    size = archive.stat().st_size
    with container_session(container, node, config, trust_new_host_key) as ct:
        typer.echo(f"importing {archive} (generation {manifest['generation']}, {manifest['files']} files, "
                   f"{_mib(size)}) into container {container} …", err=True)
        try:
            with open(archive, "rb") as fh, ByteProgress("sending", size) as advance:
                body = guard_refused(lambda: eg.compile_cache(ct, "unpack", "-", *(["--any-gpu"] if any_gpu else []),
                                                       stdin=_CountingReader(fh, advance)))
        except KeyboardInterrupt:
            # The container stages the whole archive before it moves one entry in: cut short, it
            # refuses it; only an interrupt after the last byte lets it finish, whole.
            raise remote.fail(f"interrupted: container {container}'s compile cache holds what it held, or all of "
                              f"this archive if it had been sent; `ctl env cache list` shows which, and the same "
                              f"command completes it", EXIT_INTERRUPTED) from None
    other = body.get("archive_generation")
    typer.echo(f"container {container}: generation {body['generation']}'s compile cache gained {body['added']} "
               f"entries ({body['present']} were there already), built on {_gpus(body.get('gpus'))}"
               + (f" by generation {other} (the same compile stack)" if other and other != body["generation"] else ""))
    for why in (body.get("gpu_mismatch"), body.get("gpu_note")):
        if why:
            typer.echo(f"warning: {why}", err=True)


def _local_manifest(path: Path) -> dict:
    """The archive's manifest, read here before anything is sent (the container checks it
    again, with the same agent code)."""
    try:
        with gzip.open(path, "rb") as gz, tarfile.open(fileobj=gz, mode="r|") as tar:
            return compilecache.read_manifest(tar, str(path))
    except compilecache.Refused as exc:
        raise ValueError(str(exc)) from None
    except (OSError, EOFError, tarfile.TarError) as exc:
        raise ValueError(f"{path} is not a compile-cache archive ({exc})") from None


class _CountingWriter:
    """A binary sink that reports each chunk's size (the transport writes stdout into it)."""

    def __init__(self, fh, advance):
        self.fh, self.advance = fh, advance

    def write(self, data: bytes) -> int:
        self.fh.write(data)
        self.advance(len(data))
        interrupts.pause_point("cache.export.receiving")  # tests: a Ctrl-C mid-transfer
        return len(data)

    def flush(self) -> None:
        self.fh.flush()


class _CountingReader:
    """A binary source that reports each chunk's size (the transport reads stdin from it)."""

    def __init__(self, fh, advance):
        self.fh, self.advance = fh, advance

    def read(self, n: int = -1) -> bytes:
        data = self.fh.read(n)
        self.advance(len(data))
        if data:
            interrupts.pause_point("cache.import.sending")  # tests: a Ctrl-C mid-transfer
        return data
