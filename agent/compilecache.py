"""The compile cache of a venv generation, and shipping it to a machine that has never compiled.

A run's first step compiles: Inductor's graphs, Triton's kernels and, with
``--attention-kernel flash``, flash-attn-4's CuTe kernels — 34-89 s of a fresh H200's first
step (docs/benchmarks.md), against 2-4 s on a relaunch that finds them on disk. The
trainer keeps them in one directory per env generation (trainer/runtime_env.py)::

    <workspace>/.dflash-ctl/compile-cache/gen-<id>/{inductor,triton,flash-attn-cute}/

Every entry there is named by a hash of what it compiled (graph, shapes, torch and Triton
versions, GPU target) and holds no absolute path, so the directory can be copied to another
container and its first step loads instead of compiling. What the entries depend on is the
*compile stack* (python, torch's build and COMPILE_PACKAGES below); generations with the same
stack (they differ in numpy, say) share entries. This module packs one generation's directory
into an archive and unpacks one into the current generation's cache (`ctl env cache
export/import`, controller/commands/envcache.py, between containers and nodes), and seeds a
new generation from its parent's when the stack did not change (`ctl env install`).

An archive is a gzip'd tar: ``MANIFEST.json`` first (the generation, its compile stack and
key, the GPUs it was built on, file and byte counts), then ``cache/<kind>/…``. An import is
refused, with nothing changed, when the archive's compile stack is not this venv's (its
kernels would never be looked up), when it was built for another compute capability than
this container's GPUs, when a member is anything but a plain file or directory under
``cache/<kind>/``, or when the disk cannot hold it. Entries are extracted into a temp
directory beside the cache and moved in one rename each (a seed links them), entries already
present kept, Triton's group files (which mark a kernel complete) last: a trainer reading the
cache meanwhile sees whole entries or none, and an import cut short leaves a smaller valid
cache that a rerun completes.

Standard library only; runs on the container's system python like agent.envgen.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import gzip
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import socket
import sys
import tarfile
import time
import zlib
from typing import IO, Iterator, Optional

from agent import genstore
from agent.genstore import EnvGenError, Refused
from agent.protocol import ENVGEN_EXIT_FAILED, ENVGEN_EXIT_REFUSED, atomic_write_json, read_json_doc, wrap_payload

WORKSPACE_CACHE = ".dflash-ctl/compile-cache"  # under the container's workspace (controller/render.py)
# (environment variable, sub-directory of gen-<id>): the caches the trainer points there
KINDS = (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"),
         ("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "flash-attn-cute"))
KIND_NAMES = tuple(sub for _, sub in KINDS)
ARCHIVE_FORMAT = 1
MANIFEST = "MANIFEST.json"
MEMBER_ROOT = "cache"
IMPORT_PREFIX = ".import-"
_LOCK = ".lock"
_GEN_ID = re.compile(r"^[0-9a-f]{6,64}$")  # agent/envfp.py's ids; also what keeps a name out of other paths
# Triton writes a kernel's files, then __grp__<name>.json naming them: a reader trusts a
# kernel only once its group file is there, so those move in last.
_GROUP_PREFIX = "__grp__"


# What compiled code depends on besides the interpreter and torch's build: the compilers and
# the packages whose kernels are compiled at run time (prefixes of PEP 503 names). A package
# outside these (numpy, safetensors, wandb) makes another generation but not one other
# compiled byte, so generations that differ only there share their cache entries.
COMPILE_PACKAGES = ("torch", "triton", "pytorch-triton", "flash-attn", "nvidia-cutlass-dsl", "apache-tvm-ffi",
                    "fla-core", "flash-linear-attention")


def compile_stack(fp: dict) -> dict:
    """The part of a fingerprint (agent/envfp.py) that compiled kernels depend on."""
    packages = fp.get("packages") or {}
    return {"python": fp.get("python"), "torch": fp.get("torch"),
            "packages": {name: packages[name] for name in sorted(packages)
                         if any(name == p or name.startswith(p + "-") for p in COMPILE_PACKAGES)}}


def compile_key(fp: dict) -> str:
    """12 hex digits naming a compile stack: equal keys, interchangeable cache entries."""
    return hashlib.sha256(json.dumps(compile_stack(fp), sort_keys=True).encode()).hexdigest()[:12]


def stack_difference(a: dict, b: dict) -> str:
    """What differs between two compile stacks, for a message ("torch 2.9.1 → 2.11.0, …")."""
    out = []
    if a.get("python") != b.get("python"):
        out.append(f"python {a.get('python')} → {b.get('python')}")
    ta, tb = a.get("torch") or {}, b.get("torch") or {}
    if (ta.get("version"), ta.get("build")) != (tb.get("version"), tb.get("build")):
        out.append(f"torch {ta.get('version')} ({ta.get('build')}) → {tb.get('version')} ({tb.get('build')})")
    pa, pb = a.get("packages") or {}, b.get("packages") or {}
    for name in sorted(set(pa) | set(pb)):
        if name != "torch" and pa.get(name) != pb.get(name):
            out.append(f"{name} {pa.get(name, 'absent')} → {pb.get(name, 'absent')}")
    return ", ".join(out) or "nothing"


def generation_id_ok(gen: str) -> bool:
    return bool(_GEN_ID.match(gen))


def root_of(workspace: str) -> str:
    return os.path.join(workspace, WORKSPACE_CACHE)


def generation_dir(root: str, gen: str) -> str:
    return os.path.join(root, "gen-" + gen)


def _skipped(name: str) -> bool:
    """Work files of a cache being written, not entries: locks, temp files (Inductor's
    ``.<pid>.<thread>.tmp``) and Triton's per-writer ``tmp.pid_<pid>_<n>/`` directories."""
    return name == "locks" or name.endswith((".lock", ".tmp")) or name.startswith((".tmp", "tmp.pid_", IMPORT_PREFIX))


def entries(gen_dir: str) -> Iterator[tuple[str, str, int]]:
    """(path relative to gen_dir, absolute path, bytes) of every cached file, sorted."""
    for kind in KIND_NAMES:
        top = os.path.join(gen_dir, kind)
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if not _skipped(d) and not os.path.islink(os.path.join(dirpath, d)))
            for name in sorted(filenames):
                path = os.path.join(dirpath, name)
                if _skipped(name) or os.path.islink(path) or not os.path.isfile(path):
                    continue
                yield os.path.relpath(path, gen_dir), path, os.path.getsize(path)


def summary(gen_dir: str, files: Optional[list] = None) -> dict:
    """{kind: {"files", "bytes"}} of one generation's cache (of ``files``, its entries() when
    the caller has them already)."""
    out = {kind: {"files": 0, "bytes": 0} for kind in KIND_NAMES}
    for rel, _, size in entries(gen_dir) if files is None else files:
        kind = rel.split(os.sep, 1)[0]
        out[kind]["files"] += 1
        out[kind]["bytes"] += size
    return out


class _Lock:
    """flock on the cache root: one pack or unpack at a time; released if the holder dies."""

    def __init__(self, root: str):
        self.root = root
        self.fd = -1

    def __enter__(self) -> "_Lock":
        os.makedirs(self.root, exist_ok=True)
        self.fd = os.open(os.path.join(self.root, _LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)


def _clear_leftovers(root: str) -> list[str]:
    """Staging directories of imports that were cut short (under the lock, so none is in use)."""
    gone = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if name.startswith(IMPORT_PREFIX):
            genstore.rmtree(os.path.join(root, name))
            gone.append(name)
    return gone


def venv_generation(venv: str) -> dict:
    """The venv's fingerprint (its id is the generation whose cache the trainer uses)."""
    return genstore.fingerprint(venv)


def generation_fingerprint(venv: str, gen: str) -> Optional[dict]:
    """The fingerprint of generation ``gen``: the venv's own when it is current, else what the
    generations store recorded when it was built (agent/genstore.py); None when unknown."""
    try:
        current = venv_generation(venv)
        if current["id"] == gen:
            return current
    except EnvGenError:
        pass
    fp = genstore.read_meta(genstore.Store(venv), gen).get("fingerprint")
    return fp if isinstance(fp, dict) and fp.get("id") == gen else None


def capability_problem(built_on: list[dict], here: list[dict]) -> Optional[str]:
    """Why kernels built on ``built_on`` GPUs would never be used on ``here`` GPUs, or None.
    Where either side's compute capability is unknown (no GPU) nothing is refused: a CPU
    container's Inductor entries are as portable as any."""
    built = {g.get("compute_cap") for g in built_on if g.get("compute_cap")}
    have = {g.get("compute_cap") for g in here if g.get("compute_cap")}
    if not built or not have or have <= built:
        return None
    return (f"the archive's kernels were compiled for compute capability {', '.join(sorted(built))} "
            f"({', '.join(sorted({g.get('name') or '?' for g in built_on}))}); this container's GPUs are "
            f"{', '.join(sorted(have))} ({', '.join(sorted({g.get('name') or '?' for g in here}))}): they would never "
            f"be loaded. Export the cache from a machine with these GPUs")


def model_note(built_on: list[dict], here: list[dict]) -> Optional[str]:
    """What is lost when the GPU models differ within one compute capability (an H200's cache
    on an H100): Inductor keys a graph by the GPU's name too (torch/_inductor/codecache.py,
    CacheBase.get_system), Triton and flash-attn-4 key a kernel by the architecture only."""
    built = {g.get("name") for g in built_on if g.get("name")}
    have = {g.get("name") for g in here if g.get("name")}
    if not built or not have or have <= built:
        return None
    return (f"built on {', '.join(sorted(built))}, imported where {', '.join(sorted(have))} run: Triton's and "
            f"flash-attn-4's kernels will load, Inductor's graphs (keyed by the GPU's name) compile again")


def _gpus() -> list[dict]:
    from agent import gpus

    return gpus.architectures()


def _file_sha256(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _tarinfo(name: str, size: int, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, mode, int(time.time())
    return info


# --- verbs -------------------------------------------------------------------------------

def op_list(root: str, venv: str) -> dict:
    current = None
    try:
        current = venv_generation(venv)["id"]
    except EnvGenError:
        pass  # no venv (yet): the caches are still listed
    gens = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, name)
        if not name.startswith("gen-") or not os.path.isdir(path):
            continue
        kinds = summary(path)
        gens.append({"generation": name[4:], "current": name[4:] == current, "kinds": kinds,
                     "files": sum(k["files"] for k in kinds.values()),
                     "bytes": sum(k["bytes"] for k in kinds.values()),
                     "imported_from": read_json_doc(os.path.join(path, "imported.json"))})
    return {"root": root, "current": current, "generations": gens}


def op_pack(root: str, venv: str, gen: Optional[str], out: str, *, stream: Optional[IO[bytes]] = None) -> dict:
    """Pack one generation's cache (default: the venv's current one) into the file ``out``,
    written to a temp name and renamed, or into ``stream`` (the controller reads it from
    stdout, so no archive is ever left in the container)."""
    fp = None
    if not gen or gen == "current":
        fp = venv_generation(venv)
        gen = fp["id"]
    if not generation_id_ok(gen):
        raise Refused(f"{gen!r} is not a generation id (hex digits, as `list` shows them)")
    src = generation_dir(root, gen)
    if not os.path.isdir(src):  # before the lock: a refused export leaves no trace
        raise Refused(f"the compile cache of generation {gen} ({src}) is empty: nothing has compiled there yet. A "
                      f"run's first step fills it (a CUDA run; CPU runs compile nothing)")
    with _Lock(root):
        _clear_leftovers(root)
        files = list(entries(src))
        if not files:
            raise Refused(f"the compile cache of generation {gen} ({src}) is empty: nothing has compiled there yet. A "
                          f"run's first step fills it (a CUDA run; CPU runs compile nothing)")
        if fp is None:
            fp = generation_fingerprint(venv, gen)
        manifest = {"format": ARCHIVE_FORMAT, "generation": gen, "created": time.time(), "host": socket.gethostname(),
                    "torch": (fp or {}).get("torch"), "gpus": _gpus(), "kinds": summary(src, files),
                    "compile_key": compile_key(fp) if fp else None, "compile_stack": compile_stack(fp) if fp else None,
                    "files": len(files), "bytes": sum(size for _, _, size in files)}
        if stream is not None:
            _write_archive(stream, manifest, files)
            return {"manifest": manifest}
        part = f"{out}.part-{secrets.token_hex(4)}"
        try:
            with open(part, "wb") as fh:
                _write_archive(fh, manifest, files)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(part, out)
        except BaseException:
            try:
                os.unlink(part)
            except FileNotFoundError:
                pass
            raise
    return {"archive": out, "bytes": os.path.getsize(out), "sha256": _file_sha256(out), "manifest": manifest}


def _write_archive(raw: IO[bytes], manifest: dict, files: list[tuple[str, str, int]]) -> None:
    # gzip around a streamed tar rather than tarfile's "w|gz": the same on every python the
    # container may have (a compression level for stream modes came in 3.12); level 1 because
    # the archive crosses a network once and compiling is what it saves.
    with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1) as gz, \
            tarfile.open(fileobj=gz, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        doc = json.dumps(manifest, sort_keys=True, indent=1).encode()
        tar.addfile(_tarinfo(MANIFEST, len(doc), 0o644), io.BytesIO(doc))
        for rel, path, size in files:
            with open(path, "rb") as fh:
                tar.addfile(_tarinfo(f"{MEMBER_ROOT}/{'/'.join(rel.split(os.sep))}", size, 0o644), fh)


def read_manifest(tar: tarfile.TarFile, archive: str) -> dict:
    """The archive's manifest, its first member (``tar`` read as a stream); Refused when it is
    not one this module wrote."""
    first = tar.next()
    if first is None or first.name != MANIFEST or not first.isfile():
        raise Refused(f"{archive} is not a compile-cache archive: its first member is not {MANIFEST} "
                      f"(make one with `ctl env cache export`)")
    try:
        manifest = json.loads(tar.extractfile(first).read())
    except ValueError as exc:
        raise Refused(f"{archive}: {MANIFEST} is not JSON ({exc})") from None
    if (not isinstance(manifest, dict) or manifest.get("format") != ARCHIVE_FORMAT or not manifest.get("generation")
            or not isinstance(manifest.get("bytes"), int)):
        raise Refused(f"{archive}: unknown archive format {manifest.get('format') if isinstance(manifest, dict) else '?'} "
                      f"(this agent reads format {ARCHIVE_FORMAT}); export it again with this ctl")
    return manifest


def member_problem(member: tarfile.TarInfo) -> Optional[str]:
    """Why a member may not be extracted into the cache, or None."""
    name = member.name
    parts = name.split("/")
    if name.startswith("/") or ".." in parts or "" in parts[:-1] or "\\" in name or "\0" in name:
        return f"{name!r} is not a plain relative path"
    if parts[0] != MEMBER_ROOT or len(parts) < 3 or parts[1] not in KIND_NAMES:
        return f"{name!r} is outside {MEMBER_ROOT}/<{'|'.join(KIND_NAMES)}>/"
    if not (member.isfile() or member.isdir()):
        return f"{name!r} is a link or a special file"
    return None


_UNREADABLE = (tarfile.TarError, EOFError, OSError, zlib.error)


def op_unpack(root: str, venv: str, archive: str, force_gpu: bool = False, here_gpus=None,
              stream: Optional[IO[bytes]] = None) -> dict:
    """Unpack the archive at ``archive`` (or read from ``stream``, named ``archive`` in
    messages) into the cache of the venv's current generation. Read once, front to back: the
    manifest is checked before anything is written, every member before it is staged, and
    nothing reaches the cache until the whole archive has been read."""
    try:
        raw = open(archive, "rb") if stream is None else stream
    except FileNotFoundError:
        raise Refused(f"{archive} does not exist") from None
    with raw, gzip.GzipFile(fileobj=raw, mode="rb") as gz:
        try:
            tar = tarfile.open(fileobj=gz, mode="r|")
            manifest = read_manifest(tar, archive)
        except Refused:
            raise
        except _UNREADABLE as exc:
            raise Refused(f"{archive} is not a gzip'd tar ({exc})") from None
        gen = manifest["generation"]
        if not isinstance(gen, str) or not generation_id_ok(gen):
            raise Refused(f"{archive}: its manifest names generation {gen!r}, not a generation id")
        fp = venv_generation(venv)
        same_stack = manifest.get("compile_key") is not None and manifest["compile_key"] == compile_key(fp)
        if fp["id"] != gen and not same_stack:
            theirs = manifest.get("compile_stack")
            what = (f"its compile stack differs: {stack_difference(theirs, compile_stack(fp))}" if theirs
                    else "the archive does not say what it was compiled with")
            raise Refused(f"the archive holds the compile cache of generation {gen}; this container's venv {venv} is "
                          f"generation {fp['id']} and {what}: the trainer would never look these entries up. Install "
                          f"the same versions (`ctl env install`) or export from a container running them")
        here = _gpus() if here_gpus is None else here_gpus
        mismatch = capability_problem(manifest.get("gpus") or [], here)
        if mismatch and not force_gpu:
            raise Refused(mismatch)
        declared = manifest["bytes"]
        with _Lock(root):
            _clear_leftovers(root)
            free = shutil.disk_usage(root).free
            if declared > free:
                raise Refused(f"the archive holds {declared / 2**20:.0f} MiB; {root} has {free / 2**20:.0f} MiB "
                              f"free: free space there first")
            staging = os.path.join(root, f"{IMPORT_PREFIX}{secrets.token_hex(4)}")
            os.makedirs(staging)
            try:
                _stage(tar, archive, staging, declared)
                dest = generation_dir(root, fp["id"])
                added, present = _merge(_files_under(staging), dest, os.replace)
                atomic_write_json(os.path.join(dest, "imported.json"),
                                  {"from": manifest.get("host"), "generation": gen, "created": manifest.get("created"),
                                   "gpus": manifest.get("gpus"), "imported": time.time(),
                                   "added": added, "present": present})
            finally:
                genstore.rmtree(staging)
    return {"generation": fp["id"], "archive_generation": gen, "added": added, "present": present, "root": root,
            "from": manifest.get("host"), "gpus": manifest.get("gpus"), "gpu_mismatch": mismatch,
            "gpu_note": None if mismatch else model_note(manifest.get("gpus") or [], here)}


def _stage(tar: tarfile.TarFile, archive: str, staging: str, declared: int) -> None:
    got = 0
    try:
        # next(), not iteration: a stream-mode TarFile's iterator starts again at the manifest
        while (member := tar.next()) is not None:
            why = member_problem(member)
            if why:
                raise Refused(f"{archive}: {why}; nothing was imported")
            if not member.isfile():
                continue
            got += member.size
            if got > declared:
                raise Refused(f"{archive} holds more than the {declared} bytes its manifest declares; nothing was "
                              f"imported")
            dest = os.path.join(staging, *member.name.split("/")[1:])
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with tar.extractfile(member) as src, open(dest, "wb") as fh:
                shutil.copyfileobj(src, fh, 1 << 20)
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise Refused(f"{archive} is damaged or cut short ({type(exc).__name__}: {exc}); nothing was imported") from None
    except OSError as exc:
        if exc.errno == errno.ENOSPC:  # the manifest's bytes fitted, the files' blocks did not
            raise Refused(f"the disk under {os.path.dirname(staging)} filled up while staging {archive}; nothing was "
                          f"imported: free space there first") from None
        raise EnvGenError(f"staging {archive} failed ({exc}); nothing was imported") from None


def _files_under(top: str) -> list[tuple[str, str]]:
    """(absolute path, path relative to top) of every file under ``top``."""
    out = []
    for dirpath, _, filenames in os.walk(top):
        for name in filenames:
            path = os.path.join(dirpath, name)
            out.append((path, os.path.relpath(path, top)))
    return out


def _merge(files: list[tuple[str, str]], dest: str, place) -> tuple[int, int]:
    """Put every file not already in ``dest`` in place with ``place(src, target)`` (a rename
    or a hard link: one step each, so a reader sees an entry whole or not at all), Triton's
    group files last. (added, already present)."""
    files = sorted(files, key=lambda f: (os.path.basename(f[1]).startswith(_GROUP_PREFIX), f[1]))
    added = present = 0
    for path, rel in files:
        target = os.path.join(dest, rel)
        if os.path.exists(target):
            present += 1
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        place(path, target)
        added += 1
        if added == 1:
            genstore.fault("cache-import:mid-merge")
    return added, present


def _link_or_copy(src: str, target: str) -> None:
    """A hard link (the entries are written once and replaced, never changed in place, so two
    generations can share one inode); a copy renamed into place where links are refused."""
    try:
        os.link(src, target)
    except OSError:
        tmp = f"{target}.{secrets.token_hex(4)}.tmp"
        shutil.copy2(src, tmp)
        os.replace(tmp, target)


def op_seed(root: str, venv: str, src_gen: str) -> dict:
    """Give the venv's current generation the cache entries of ``src_gen`` (the generation it
    was built from) when both compile the same: same python, torch build and compile
    packages (COMPILE_PACKAGES). `ctl env install` calls it, so an upgrade of numpy costs no
    recompile. Never refused: a different stack or nothing cached seeds nothing, and says why."""
    if not generation_id_ok(src_gen):
        raise Refused(f"{src_gen!r} is not a generation id")
    fp = venv_generation(venv)
    reply = {"generation": fp["id"], "from": src_gen, "seeded": 0}
    if src_gen == fp["id"]:
        return dict(reply, why="the same generation")
    src_fp = generation_fingerprint(venv, src_gen)
    if src_fp is None:
        return dict(reply, why=f"generation {src_gen}'s packages are not recorded")
    if compile_key(src_fp) != compile_key(fp):
        return dict(reply, why=f"the compile stack changed: {stack_difference(compile_stack(src_fp), compile_stack(fp))}")
    src = generation_dir(root, src_gen)
    if not os.path.isdir(src):
        return dict(reply, why=f"generation {src_gen} has nothing cached")
    with _Lock(root):
        added, present = _merge([(path, rel) for rel, path, _ in entries(src)], generation_dir(root, fp["id"]),
                                _link_or_copy)
    return dict(reply, seeded=added, present=present, compile_key=compile_key(fp))


# --- CLI --------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m agent.compilecache", description=__doc__.split("\n\n")[0])
    p.add_argument("--workspace", default="/workspace", help="the container's workspace (the cache is under it)")
    p.add_argument("--venv", default="/root/venv", help="the configured venv path (its generation is the current one)")
    sub = p.add_subparsers(dest="verb", required=True)
    sub.add_parser("list", help="every generation's cache: files and bytes per kind")
    s = sub.add_parser("pack", help="one generation's cache into a gzip'd tar")
    s.add_argument("--generation", default="current")
    s.add_argument("--out", required=True, help="archive path; - writes it to stdout and the reply to stderr")
    s = sub.add_parser("unpack", help="an archive into the current generation's cache")
    s.add_argument("archive", help="archive path; - reads it from stdin")
    s.add_argument("--any-gpu", action="store_true", help="import even when built for another compute capability")
    s = sub.add_parser("seed", help="the current generation starts with another's entries when both compile the same")
    s.add_argument("--from", dest="src", required=True, help="the generation to take them from")
    return p


def dispatch(args: argparse.Namespace) -> dict:
    root = root_of(args.workspace)
    if args.verb == "list":
        return op_list(root, args.venv)
    if args.verb == "pack":
        return op_pack(root, args.venv, args.generation, args.out,
                       stream=sys.stdout.buffer if args.out == "-" else None)
    if args.verb == "unpack":
        piped = args.archive == "-"
        return op_unpack(root, args.venv, "the archive on stdin" if piped else args.archive, force_gpu=args.any_gpu,
                         stream=sys.stdin.buffer if piped else None)
    if args.verb == "seed":
        return op_seed(root, args.venv, args.src)
    raise Refused(f"unknown verb {args.verb}")


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    # with the archive on stdout, the reply goes to stderr
    reply = sys.stderr if args.verb == "pack" and args.out == "-" else sys.stdout
    try:
        body = dispatch(args)
    except EnvGenError as exc:
        reply.write(wrap_payload({"ok": False, "kind": exc.kind, "error": str(exc)}))
        reply.flush()
        return ENVGEN_EXIT_REFUSED if isinstance(exc, Refused) else ENVGEN_EXIT_FAILED
    reply.write(wrap_payload(dict(body, ok=True)))
    reply.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
