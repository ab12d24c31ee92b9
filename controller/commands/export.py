"""`ctl export`: a run's drafter from the container to the operator's machine, ready to serve.

    ctl export --container 200 [--run RUN] [--step N | --best] --to DIR [--dtype bf16|fp32]

``--best``: the checkpoint with the highest τ measured at save (``--eval-prompts``), which
retention keeps; either way the result line says which step it took and its τ.

One SSH connection. DIR is checked here first (absent or empty). In the container,
``python -m trainer export --checkpoint RUN_DIR [--step N] --out TMP --json`` runs from this
version's bundle (trainer/serve/export.py: it finds the run's newest complete checkpoint through
its checkpoint events) and answers a manifest (size and sha256 per file). TMP is streamed
back as ``tar -cf -`` over the same connection — not ``pct pull``, whose options differ across
Proxmox versions — into a temp directory beside DIR, every file checked against the
manifest, then renamed to DIR. The container's TMP is removed whatever happens. Refusals
(no complete checkpoint, unknown step, DIR not empty, a checksum mismatch) are one line and
leave DIR as it was. For a job, the container of the first drafter rank (the one that saves).

Exit codes: 0 exported, 1 failed in the container or in transfer, 2 bad input (DIR not empty,
no such run or checkpoint), 255 the node could not be reached.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import secrets
import shutil
import tarfile
import tempfile
import threading
from pathlib import Path
from typing import Callable, Optional

import typer

from controller import byteprogress
from controller.commands.remote import (EXIT_CONFIG, EXIT_CONTAINER, EXIT_INTERRUPTED, TrustOpt, container_session, fail,
                                        container_option, run_option)

EXPORTS_DIR = ".dflash-ctl/exports"  # under the workspace; one temp dir per export, always removed


class ExportFailed(Exception):
    """The export or its transfer failed; the message is one line, ``code`` the exit code."""

    def __init__(self, message: str, code: int = EXIT_CONTAINER):
        super().__init__(message)
        self.code = code


def check_destination(dest: Path) -> bool:
    """Refuse a --to that cannot take the export. True when it already holds files that may be
    a complete earlier export (a retry after a Ctrl-C late in the last one): :func:`fetch`
    compares them with the container's manifest and reports the export complete if they match."""
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        if dest.is_dir() and (dest / "config.json").is_file() and all(p.is_file() for p in dest.iterdir()):
            return True
        raise ExportFailed(f"--to {dest} is not empty; name a new or empty directory", EXIT_CONFIG)
    parent = dest.parent
    if not parent.is_dir():
        raise ExportFailed(f"--to {dest}: its parent {parent} does not exist; create it first", EXIT_CONFIG)
    if not os.access(parent, os.W_OK):
        raise ExportFailed(f"--to {dest}: {parent} is not writable", EXIT_CONFIG)
    # os.access answers yes to root for /proc, /sys or a read-only mount: the export's
    # temporary directory beside DEST is made and removed here, before anything runs in the
    # container, so such a --to is refused in one line rather than after the export.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{dest.name}.ctl-probe-", dir=parent))
    except OSError as exc:
        raise ExportFailed(f"--to {dest}: cannot create anything in {parent} ({exc.strerror or exc}); "
                           "name a directory on a writable filesystem", EXIT_CONFIG) from None
    return False


def holds_export(dest: Path, manifest: dict) -> bool:
    """``dest`` holds exactly the manifest's files, each of its size and sha256."""
    want = {f["path"]: f for f in manifest["files"]}
    if sorted(p.name for p in dest.iterdir()) != sorted(want):
        return False
    for name, f in want.items():
        path = dest / name
        if path.stat().st_size != f["size"]:
            return False
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        if h.hexdigest() != f["sha256"]:
            return False
    return True


class TarReceiver:
    """A raw stdout sink that extracts a tar stream as it arrives into ``directory``: only
    regular files the manifest names, flat, each hashed while written. Runs the extraction in
    a thread fed through a pipe; on a bad member it keeps draining, so the sender never
    blocks, and reports the first problem at :meth:`close`."""

    def __init__(self, directory: Path, expected: dict[str, dict], progress: Callable[[int], None]):
        self.directory = directory
        self.expected = expected
        self.progress = progress
        self.got: dict[str, dict] = {}
        self.error: Optional[str] = None
        r, w = os.pipe()
        self._w = w
        self._r = os.fdopen(r, "rb")
        self._thread = threading.Thread(target=self._extract, daemon=True)
        self._thread.start()

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            n = os.write(self._w, view)
            view = view[n:]
        self.progress(len(data))
        return len(data)

    def flush(self) -> None:
        pass

    def _extract(self) -> None:
        try:
            with tarfile.open(fileobj=self._r, mode="r|") as tf:
                for member in tf:
                    name = member.name[2:] if member.name.startswith("./") else member.name
                    if member.isdir() and name in ("", "."):
                        continue
                    if not member.isfile() or "/" in name or name not in self.expected:
                        raise ExportFailed(f"the container sent {member.name!r}, which the export's manifest does "
                                           "not name as a file; nothing was kept")
                    h = hashlib.sha256()
                    src = tf.extractfile(member)
                    fd = os.open(self.directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                    with os.fdopen(fd, "wb") as out:
                        for chunk in iter(lambda: src.read(1 << 20), b""):
                            h.update(chunk)
                            out.write(chunk)
                        out.flush()
                        os.fsync(out.fileno())
                    self.got[name] = {"size": member.size, "sha256": h.hexdigest()}
        except (ExportFailed, tarfile.TarError, OSError) as exc:
            self.error = str(exc) if isinstance(exc, ExportFailed) else f"the stream from the container broke ({exc})"
        finally:
            while self._r.read(1 << 16):  # drain: the SSH reader must never block on a full pipe
                pass
            self._r.close()

    def close(self) -> None:
        os.close(self._w)
        self._thread.join()


def verify(got: dict[str, dict], manifest: dict) -> None:
    want = {f["path"]: f for f in manifest["files"]}
    missing = sorted(set(want) - set(got))
    if missing:
        raise ExportFailed(f"the transfer ended without {', '.join(missing)} (connection lost?); nothing was kept")
    for name, f in want.items():
        if got[name]["size"] != f["size"] or got[name]["sha256"] != f["sha256"]:
            raise ExportFailed(f"{name}: received {got[name]['size']} bytes with sha256 {got[name]['sha256'][:12]}, "
                               f"the container has {f['size']} bytes with sha256 {f['sha256'][:12]}; nothing was kept")


def fetch(ct, caller, run_dir: str, step: Optional[int], dtype: str, dest: Path, say: Callable[[str], None],
          progress_factory, earlier: bool = False, best: bool = False) -> dict:
    """Export in the container, stream, verify, place at ``dest``. Returns the manifest
    (``already``: True when ``dest`` held this very export before: ``earlier`` from
    :func:`check_destination`)."""
    from agent.protocol import PayloadError, extract_payload
    from controller import interrupts

    remote = posixpath.join(ct.config.workspace, EXPORTS_DIR, f"{posixpath.basename(run_dir)}-{secrets.token_hex(4)}")
    args = ["export", "--checkpoint", run_dir, "--out", remote, "--dtype", dtype, "--json"]
    if step is not None:
        args += ["--step", str(step)]
    if best:
        args.append("--best")
    local = Path(dest.parent) / f".{dest.name}.ctl-export-{secrets.token_hex(4)}"
    try:
        result = caller.run("trainer", args, on_stderr=lambda line: say(f"  {line}") if line.strip() else None)
        try:
            manifest = extract_payload(result.stdout)
        except PayloadError:
            raise ExportFailed(f"the export in {ct} gave no readable answer (exit code {result.returncode}): "
                               f"{result.tail('stderr', 3)}") from None
        if not manifest.get("ok"):
            code = EXIT_CONFIG if result.returncode == 2 else EXIT_CONTAINER
            raise ExportFailed(f"{ct}: {manifest.get('error')}", code)
        if earlier:
            if not holds_export(dest, manifest):
                raise ExportFailed(f"--to {dest} is not empty and does not hold this export (step "
                                   f"{manifest.get('step')}, {dtype}); name a new or empty directory", EXIT_CONFIG)
            return dict(manifest, already=True)
        interrupts.pause_point("export.transfer")
        try:
            local.mkdir(mode=0o755)
        except OSError as exc:  # the destination's filesystem changed since it was checked
            raise ExportFailed(f"--to {dest}: cannot create {local} ({exc.strerror or exc}); nothing was kept",
                               EXIT_CONFIG) from None
        with progress_factory(manifest["bytes"]) as advance:
            receiver = TarReceiver(local, {f["path"]: f for f in manifest["files"]}, advance)
            try:
                sent = ct.exec(["tar", "-C", remote, "-cf", "-", "."], stdout_sink=receiver, capture=False)
            finally:
                receiver.close()
        if sent.failed:
            raise ExportFailed(f"tar in {ct} failed (exit code {sent.returncode}): {sent.tail('stderr', 3)}")
        if receiver.error:
            raise ExportFailed(receiver.error)
        verify(receiver.got, manifest)
        for path in local.iterdir():
            path.chmod(0o644)
        local.chmod(0o755)
        if dest.exists():
            dest.rmdir()  # empty: checked before anything ran
        # From the rename on, --to holds the complete, verified export: a Ctrl-C now waits
        # until that is reported (controller/interrupts.py).
        interrupts.hold()
        local.rename(dest)
        interrupts.pause_point("export.placed")
        return manifest
    finally:
        if local.exists():
            shutil.rmtree(local, ignore_errors=True)
        try:
            ct.exec(["rm", "-rf", "--", remote])
        except Exception:  # noqa: BLE001 — a lost connection must not hide the real error
            say(f"ctl: warning: could not remove {remote} in {ct}; remove it by hand")


def export_command(
    container: Optional[int] = container_option(None, "container id (default: the last launch's); for a job, any "
                                                      "of its containers or none with --run"),
    run: Optional[str] = run_option("run id (default: the latest run in the container)"),
    step: Optional[int] = typer.Option(None, "--step", metavar="N", min=0,
                                       help="export the checkpoint of step N (default: the run's newest complete one)"),
    best: bool = typer.Option(False, "--best", help="the checkpoint with the highest τ measured at save "
                                                    "(--eval-prompts), not the newest"),
    to: str = typer.Option(..., "--to", metavar="DIR", help="where the drafter directory goes on this machine; "
                                                            "must be absent or empty"),
    dtype: str = typer.Option("bf16", "--dtype", help="weight dtype: bf16 (what the serving stacks run) or fp32"),
    node: Optional[str] = typer.Option(None, "--node", "-n", help="node name from the controller config"),
    ctl_config: Optional[str] = typer.Option(None, "--ctl-config", help="controller config (default: "
                                             "$DFLASH_CTL_CONFIG, else ~/.config/dflash-ctl/config.toml)"),
    trust_new_host_key: bool = TrustOpt,
    json_out: bool = typer.Option(False, "--json", help="print the manifest (files, sizes, sha256) as JSON"),
) -> None:
    """Copy a run's trained drafter out of the container, ready to serve: config.json for
    SGLang/vLLM/transformers/MLX, bf16 safetensors, its own modeling file, a model card
    (docs/export.md). Checksums verified; nothing is left at --to unless all of it arrived."""
    import json

    from controller import interrupts
    from controller.agentcall import AgentCaller
    from controller.commands import job as job_cmd
    from controller.commands.watch import resolve_run, container_or_last_launch

    from trainer.drafter_dir import dtype_problem

    if dtype_problem(dtype):  # a quantized export is refused with its reason, before any connection
        raise fail(dtype_problem(dtype), EXIT_CONFIG)
    if not to.strip():  # an unset $DEST: Path("") would be the current directory
        raise fail(f"--to {to!r}: the destination is empty; name a new or empty directory", EXIT_CONFIG)
    dest = Path(to).expanduser().absolute()
    try:
        earlier = check_destination(dest)
    except ExportFailed as exc:
        raise fail(str(exc), exc.code) from None
    say = lambda line: typer.echo(line, err=True)  # noqa: E731  (stdout: the result only)

    found = job_cmd.find(run, None if container is None else [str(container)], node, ctl_config)
    if found:  # a job: the checkpoints are where the first drafter rank runs
        members, run_id = found
        saver = next(m for m in members if m.drafter_gpus)
        ctid, node = int(saver.ctid), saver.node
        say(f"job {run_id}: exporting from {saver.label} (the first drafter rank's container)")
    else:
        ctid, node = container_or_last_launch(container, node, ctl_config)
    with interrupts.guarded():  # the report too: a Ctrl-C after the rename waits for it
        with container_session(ctid, node, ctl_config, trust_new_host_key) as ct:
            caller = AgentCaller(ct, say)
            if not found:
                run_id = run or resolve_run(ct, caller, None)["run_id"]
            run_dir = posixpath.join(ct.config.workspace, "runs", run_id)
            say(f"exporting run {run_id} from {ct}")
            try:
                manifest = fetch(ct, caller, run_dir, step, dtype, dest, say, byteprogress.receiving, earlier=earlier,
                                 best=best)
            except ExportFailed as exc:
                raise fail(str(exc), exc.code) from None
            except KeyboardInterrupt:
                raise fail(f"interrupted before the export was complete: nothing was kept at {dest}; run the same "
                           "command again", EXIT_INTERRUPTED) from None
        if interrupts.interrupted():
            say(f"ctl: interrupted after the export was complete: {dest} holds all of it, verified")
        if json_out:
            typer.echo(json.dumps({"run_id": run_id, "container": ct.ctid, "node": ct.node_name, "to": str(dest),
                                   "already": bool(manifest.get("already")),
                                   "tau": manifest.get("tau"), "best": best,
                                   **{k: manifest[k] for k in ("step", "checkpoint", "dtype", "files", "bytes")}},
                                  sort_keys=True))
        else:
            from trainer.serve.export import tau_words

            typer.echo(f"{dest}: step {manifest['step']} of run {run_id}{tau_words({**manifest, 'best': best})} "
                       f"({manifest['checkpoint']} in {ct}), "
                       f"{len(manifest['files'])} files, {manifest['bytes'] / 2**20:.1f} MiB, sha256 verified"
                       + (" (it was already there, complete)" if manifest.get("already") else ""))
        say(served_check_hint(dest))


def served_check_hint(dest: Path) -> str:
    """The served-τ gate, offered after every export (stderr: stdout stays the result)."""
    from trainer.serve.served import PROG

    return (f"check that it serves with its trained τ: {PROG} {dest} --target TARGET_DIR --data DATA_DIR "
            "(vLLM; docs/export.md)")


def register(app: typer.Typer) -> None:
    app.command("export")(export_command)
