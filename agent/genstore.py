"""Where a venv's generations live on disk (agent/envgen.py tells the whole design): the
store's paths, its lock and journal, each generation's description file, the references that
keep a generation, the fingerprint of a venv directory, and the named points where tests make
an operation die or pause. Standard library only, like everything envgen runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import sys
import time
from typing import Optional

from agent import envfp
from agent.protocol import atomic_write_json

GEN_PREFIX = "gen-"
BUILD_PREFIX = ".build-"
TRASH_PREFIX = ".trash-"
META = "dflash-generation.json"
JOURNAL = "journal.json"
LOCK = ".lock"
REFS = "refs"
ENV_FAULT = "DFLASH_ENVGEN_FAULT"
ENV_PAUSE = "DFLASH_ENVGEN_PAUSE_S"
ENV_NO_EXCHANGE = "DFLASH_ENVGEN_NO_EXCHANGE"  # tests: take the rename+link fallback path
FAULT_POINTS = (
    "adopt:before-exchange",   # journal written, the venv is still a real directory
    "adopt:after-move",        # fallback path only: directory moved, link not yet created
    "install:after-copy",      # build dir copied from the current generation
    "install:after-pip",       # packages installed into the build dir
    "install:before-switch",   # build renamed to gen-<id>, live link still old
    "switch:after-link",       # temp link created, not yet renamed over the venv path
    "remove:after-trash",      # generation moved to .trash-*, not yet deleted
    "cache-import:mid-merge",  # agent/compilecache.py: one staged entry moved into the cache, the rest not
)


class EnvGenError(Exception):
    """A failure while acting. The message names the venv/generation and what to do."""

    kind = "failed"


class Refused(EnvGenError):
    """Nothing was changed: the request cannot be done as asked."""

    kind = "refused"


# --- fault injection --------------------------------------------------------------------

def fault(point: str) -> None:
    spec = os.environ.get(ENV_FAULT, "")
    if not spec:
        return
    name, _, action = spec.partition("=")
    if name != point:
        return
    if action == "pause":
        sys.stderr.write(f"envgen: paused at {point} pid {os.getpid()}\n")
        sys.stderr.flush()
        time.sleep(float(os.environ.get(ENV_PAUSE, "120")))
        return
    sys.stderr.write(f"envgen: dying at {point}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


# --- paths ------------------------------------------------------------------------------

class Store:
    """Where the generations of one venv path live: a hidden sibling directory, so renames
    between it and the venv path stay on one filesystem (rename(2) is atomic only there)."""

    def __init__(self, venv: str):
        venv = os.path.abspath(venv).rstrip("/")
        if venv in ("", "/"):
            raise Refused("the venv path must be a directory below /, e.g. /root/venv")
        self.venv = venv
        self.parent = os.path.dirname(venv)
        self.name = f".{os.path.basename(venv)}-generations"
        self.dir = os.path.join(self.parent, self.name)

    def gen_dir(self, gid: str) -> str:
        return os.path.join(self.dir, GEN_PREFIX + gid)

    def link_target(self, gid: str) -> str:
        # Relative to the venv's directory: the same text is right before and after an
        # exchange (adopt) and needs no knowledge of where the parent is mounted.
        return f"{self.name}/{GEN_PREFIX}{gid}"

    @property
    def journal(self) -> str:
        return os.path.join(self.dir, JOURNAL)

    @property
    def refs(self) -> str:
        return os.path.join(self.dir, REFS)

    def generations(self) -> list[str]:
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        return sorted(n[len(GEN_PREFIX):] for n in names
                      if n.startswith(GEN_PREFIX) and os.path.isdir(os.path.join(self.dir, n)))

    def current(self) -> Optional[str]:
        """The generation the venv path points at, or None when it is not (yet) a link."""
        if not os.path.islink(self.venv):
            return None
        target = os.readlink(self.venv).rstrip("/")
        base = os.path.basename(target)
        return base[len(GEN_PREFIX):] if base.startswith(GEN_PREFIX) else None

    def resolve(self, ref: str) -> str:
        """'current', a full id, or a unique prefix of one → the id. Refuses otherwise."""
        gens = self.generations()
        if ref in ("current", "@"):
            cur = self.current()
            if cur is None:
                raise Refused(f"{self.venv} is not managed as generations yet (no current generation)")
            return cur
        ref = ref[len(GEN_PREFIX):] if ref.startswith(GEN_PREFIX) else ref
        if ref in gens:
            return ref
        hits = [g for g in gens if g.startswith(ref)] if ref else []
        if len(hits) == 1:
            return hits[0]
        known = ", ".join(gens) or "none"
        if not hits:
            raise Refused(f"generation {ref!r} does not exist for {self.venv} (known: {known}); "
                          f"see `ctl env list`")
        raise Refused(f"generation prefix {ref!r} is ambiguous for {self.venv}: {', '.join(hits)}")


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rmtree(path: str) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


# --- renameat2(RENAME_EXCHANGE) ----------------------------------------------------------

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux ≥ 3.15, glibc ≥ 2.28). False when unsupported here."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), a)


# --- fingerprint ------------------------------------------------------------------------

def fingerprint(venv_dir: str) -> dict:
    """{"id", "python", "packages", "torch"} of the venv at ``venv_dir`` (may be a build dir),
    taken by that venv's own python (agent/envfp.py)."""
    python = os.path.join(venv_dir, "bin", "python3")
    if not os.path.exists(python):
        raise EnvGenError(f"{venv_dir} has no bin/python3: not a venv (or a broken one)")
    try:
        return envfp.core(envfp.of_python(python))
    except envfp.FingerprintError as exc:
        raise EnvGenError(f"cannot fingerprint {venv_dir}: {exc}") from None


# --- journal and lock -------------------------------------------------------------------

class Locked:
    """flock on the store: released by the kernel if the holder dies, so no stale lock."""

    def __init__(self, store: Store):
        self.store = store
        self.fd = -1

    def __enter__(self) -> "Locked":
        os.makedirs(self.store.dir, exist_ok=True)
        self.fd = os.open(os.path.join(self.store.dir, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fcntl.flock(self.fd, fcntl.LOCK_EX)  # another envgen is running: wait our turn
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)


def write_journal(store: Store, entry: dict) -> None:
    atomic_write_json(store.journal, entry)
    fsync_dir(store.dir)


def read_journal(store: Store) -> Optional[dict]:
    try:
        with open(store.journal, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        return None  # atomic_write never leaves a torn file; treat garbage as nothing pending


def clear_journal(store: Store) -> None:
    try:
        os.unlink(store.journal)
    except FileNotFoundError:
        pass
    fsync_dir(store.dir)


def read_meta(store: Store, gid: str) -> dict:
    try:
        with open(os.path.join(store.gen_dir(gid), META), encoding="utf-8") as fh:
            return json.load(fh)
    except (FileNotFoundError, json.JSONDecodeError):
        return {"id": gid}


# --- references: generations a known-good run keeps ------------------------------------

def read_refs(store: Store) -> list[dict]:
    out = []
    try:
        names = sorted(os.listdir(store.refs))
    except FileNotFoundError:
        return out
    for name in names:
        if name.endswith(".json"):
            try:
                with open(os.path.join(store.refs, name), encoding="utf-8") as fh:
                    out.append(json.load(fh))
            except (OSError, json.JSONDecodeError):
                continue
    return out



def ref_path(store: Store, ref: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9._:@-]{1,200}", ref) or ref.startswith("."):
        raise Refused(f"reference name {ref!r} may hold only letters, digits and ._:@-")
    return os.path.join(store.refs, ref + ".json")
