"""Environment generations of a container's venv: adopt, build, switch, list, diff, remove.

Why this exists (DESIGN.md, the story): a torch upgrade cu128 → cu130 ate ~200 MB per GPU
and rolling it back was done by hand. Here every package set a venv has held is kept as a
*generation*, identified by its fingerprint (python version, every installed distribution
and version, the torch build), and the configured venv path is a symlink to one of them:

    /root/venv -> .venv-generations/gen-3f2a9c0d1b7e       (relative link, same directory)
    /root/.venv-generations/
        gen-3f2a9c0d1b7e/          a complete venv; dflash-generation.json describes it
        gen-91be04d2aa51/
        refs/<name>.json           "this generation is used by a known-good run": never removed
        journal.json               the operation in progress (absent when none)
        .lock                      flock: one operation per venv at a time

Crash safety. Every operation writes its journal before it touches anything and removes
it after the last step; each step is idempotent, and a journal left behind (ssh dropped,
`ctl` killed, the process SIGKILLed) is completed by the next invocation of any verb or
by ``resume``. The live path is only ever changed by one rename(2) (or renameat2
RENAME_EXCHANGE when a real directory is adopted), so a reader sees the old generation or
the new one, never a half-built venv. A new generation is built in ``.build-<nonce>``
beside the others (cp -a --reflink=auto of the current one, then pip run by the copy's
own python, --no-index --find-links WHEELHOUSE when the container has no registry), and
only renamed to ``gen-<id>`` once complete and fingerprinted.

Standard library only: this runs inside the container with the *system* python3, so it
keeps working when the venv is the thing being repaired. Run as
``python3 -m agent.envgen <verb> --venv /root/venv …``; replies are sentinel-wrapped JSON
(agent.protocol.wrap_payload).

Fault injection for tests: ``DFLASH_ENVGEN_FAULT=<point>=die|pause`` makes the process
SIGKILL itself, or announce ``envgen: paused at <point>`` on stderr and sleep
(``DFLASH_ENVGEN_PAUSE_S``, default 120 s), at a named point (see FAULT_POINTS).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from typing import Any, Optional

from agent import envfp
from agent.protocol import ENVGEN_EXIT_FAILED, ENVGEN_EXIT_REFUSED, atomic_write_json, wrap_payload

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


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rmtree(path: str) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


# --- renameat2(RENAME_EXCHANGE) ----------------------------------------------------------

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> bool:
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


# --- version ordering and diff (stdlib; enough of PEP 440 to say up or down) ------------

_PRE = {"dev": 0, "a": 1, "alpha": 1, "b": 2, "beta": 2, "rc": 3, "c": 3, "pre": 3, "preview": 3}


def version_key(v: str) -> tuple:
    """Sort key for a version string: release, then dev < a < b < rc < final < post, then
    the local label (``+cu128``). Unknown shapes compare as text after every known one."""
    main, _, local = v.strip().lower().partition("+")
    main = main.lstrip("v")
    m = re.match(r"^(?:(\d+)!)?(\d+(?:\.\d+)*)(.*)$", main)
    if not m:
        return (1, v)
    epoch = int(m.group(1) or 0)
    release = [int(x) for x in m.group(2).split(".")]
    while release and release[-1] == 0:
        release.pop()
    rest = m.group(3)
    phase = (4, 0)  # final
    post = -1
    dev = None
    for tag, num in re.findall(r"[._-]?(dev|alpha|beta|preview|pre|rc|post|a|b|c)[._-]?(\d*)", rest):
        n = int(num or 0)
        if tag == "post":
            post = n
        elif tag == "dev":
            dev = n
        else:
            phase = (_PRE[tag], n)
    if dev is not None and phase == (4, 0) and post < 0:
        phase = (0, dev)  # 1.0.dev1 sorts before 1.0a1
    return (0, epoch, tuple(release), phase, post, dev if dev is not None else 1 << 30, local)


def diff_packages(old: dict, new: dict) -> dict:
    """What changes when going from package set ``old`` to ``new`` ({name: version})."""
    out: dict[str, Any] = {"up": [], "down": [], "added": [], "removed": []}
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if a == b:
            continue
        if a is None:
            out["added"].append({"name": name, "to": b})
        elif b is None:
            out["removed"].append({"name": name, "from": a})
        else:
            key = "up" if version_key(b) > version_key(a) else "down"
            out[key].append({"name": name, "from": a, "to": b})
    return out


def diff_fingerprints(old: dict, new: dict) -> dict:
    d = diff_packages(old.get("packages", {}), new.get("packages", {}))
    tb_old = (old.get("torch") or {}).get("build")
    tb_new = (new.get("torch") or {}).get("build")
    d["torch_build"] = None if tb_old == tb_new else {"from": tb_old, "to": tb_new}
    d["python"] = None if old.get("python") == new.get("python") else {
        "from": old.get("python"), "to": new.get("python")}
    d["from"], d["to"] = old.get("id"), new.get("id")
    d["changed"] = any(d[k] for k in ("up", "down", "added", "removed", "torch_build", "python"))
    return d


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


def _write_journal(store: Store, entry: dict) -> None:
    atomic_write_json(store.journal, entry)
    _fsync_dir(store.dir)


def _read_journal(store: Store) -> Optional[dict]:
    try:
        with open(store.journal, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        return None  # atomic_write never leaves a torn file; treat garbage as nothing pending


def _clear_journal(store: Store) -> None:
    try:
        os.unlink(store.journal)
    except FileNotFoundError:
        pass
    _fsync_dir(store.dir)


def _read_meta(store: Store, gid: str) -> dict:
    try:
        with open(os.path.join(store.gen_dir(gid), META), encoding="utf-8") as fh:
            return json.load(fh)
    except (FileNotFoundError, json.JSONDecodeError):
        return {"id": gid}


# --- the steps --------------------------------------------------------------------------

def _switch_link(store: Store, gid: str) -> None:
    """Point the venv path at ``gid`` with one rename(2): a temp link, renamed over it."""
    if not os.path.isdir(store.gen_dir(gid)):
        raise EnvGenError(f"generation {gid} of {store.venv} is missing from {store.dir}")
    if store.current() == gid:
        return
    if os.path.exists(store.venv) and not os.path.islink(store.venv):
        raise EnvGenError(f"{store.venv} is a real directory, not a generation link: run adopt first")
    tmp = os.path.join(store.parent, f".{os.path.basename(store.venv)}.link-{uuid.uuid4().hex[:8]}")
    os.symlink(store.link_target(gid), tmp)
    fault("switch:after-link")
    os.replace(tmp, store.venv)
    _fsync_dir(store.parent)


def _clean_stale_links(store: Store) -> None:
    prefix = f".{os.path.basename(store.venv)}.link-"
    for name in os.listdir(store.parent):
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(store.parent, name))
            except FileNotFoundError:
                pass


def _adopt_steps(store: Store, gid: str) -> None:
    """Make the real venv directory generation ``gid`` and the venv path a link to it.
    Idempotent: looks at what is on disk and does only what is left."""
    gdir = store.gen_dir(gid)
    if os.path.islink(store.venv) and store.current() == gid and os.path.isdir(gdir):
        return
    if os.path.isdir(store.venv) and not os.path.islink(store.venv):
        if os.path.lexists(gdir):
            _rmtree(gdir)  # a leftover link from an exchange that did not happen
        # Preferred: swap the real directory with a ready link in one step, so the venv
        # path never goes missing (a run starting at that instant still finds a python).
        os.symlink(store.link_target(gid), gdir)
        fault("adopt:before-exchange")
        if not os.environ.get(ENV_NO_EXCHANGE) and _exchange(store.venv, gdir):
            _fsync_dir(store.parent)
            _fsync_dir(store.dir)
            return
        os.unlink(gdir)
        # Fallback (no renameat2 here): move, then link. The journal covers the gap.
        os.rename(store.venv, gdir)
        _fsync_dir(store.parent)
        fault("adopt:after-move")
    if not os.path.lexists(store.venv) and os.path.isdir(gdir):
        _switch_link(store, gid)
        return
    if os.path.islink(store.venv) and os.path.isdir(gdir):
        return  # already a link (to another generation): adoption of gid is done
    raise EnvGenError(f"cannot finish adopting {store.venv} as generation {gid}: "
                      f"neither {store.venv} nor {gdir} is a venv directory")


def _fix_shebangs(build: str, venv: str) -> None:
    """pip wrote console scripts whose #! names the build dir's python; after the rename
    they must name the configured venv path, like the scripts copied from the parent do."""
    old = (build.rstrip("/") + "/bin/").encode()
    new = (venv.rstrip("/") + "/bin/").encode()
    bindir = os.path.join(build, "bin")
    for name in os.listdir(bindir):
        path = os.path.join(bindir, name)
        if os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, "rb") as fh:
            head = fh.read(1024)
            if not head.startswith(b"#!") or old not in head:
                continue
            data = head + fh.read()
        st = os.stat(path)
        with open(path, "wb") as fh:
            fh.write(data.replace(old, new))
        os.chmod(path, st.st_mode)


def _install_steps(store: Store, j: dict) -> dict:
    """copy → pip → fingerprint → rename → switch, resuming from ``j['state']``."""
    build = os.path.join(store.dir, j["build"])
    state = j["state"]
    if state in ("copy", "pip"):
        # The build dir is never live; anything half-done there is thrown away and redone.
        if os.path.lexists(build):
            _rmtree(build)
        j["state"] = "pip"
        _write_journal(store, j)
        cp = subprocess.run(["cp", "-a", "--reflink=auto", store.gen_dir(j["from"]), build],
                            capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if cp.returncode != 0:
            _abandon_build(store, build)
            raise EnvGenError(f"copying generation {j['from']} to {build} failed: {cp.stderr.strip()} "
                              f"(is the disk full?); the current generation is unchanged")
        fault("install:after-copy")
        argv = [os.path.join(build, "bin", "python3"), "-m", "pip", "install", "--no-input",
                "--disable-pip-version-check", "--no-cache-dir", "--no-warn-script-location"]
        if j.get("wheelhouse"):
            argv += ["--no-index", "--find-links", j["wheelhouse"]]
        argv += list(j.get("pip_args") or []) + list(j["specs"])
        env = dict(os.environ)
        for key in list(env):
            if key.startswith("PIP_") or key in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
                env.pop(key)
        pip = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env)
        if pip.returncode != 0:
            _abandon_build(store, build)
            tail = "\n".join((pip.stdout + pip.stderr).strip().splitlines()[-15:])
            where = f"wheelhouse {j['wheelhouse']}" if j.get("wheelhouse") else "the package index"
            raise Refused(f"pip could not install {' '.join(j['specs'])} from {where} into a copy of "
                          f"generation {j['from']}; nothing changed, {store.venv} still runs {j['from']}.\n{tail}")
        _fix_shebangs(build, store.venv)
        fault("install:after-pip")
        fp = fingerprint(build)
        gid = fp["id"]
        if gid == j["from"] or os.path.isdir(store.gen_dir(gid)):
            _rmtree(build)  # same package set as an existing generation: reuse that one
        else:
            meta = {"id": gid, "fingerprint": fp, "created": time.time(), "parent": j["from"],
                    "specs": j["specs"], "wheelhouse": j.get("wheelhouse"), "adopted": False}
            atomic_write_json(os.path.join(build, META), meta)
            os.rename(build, store.gen_dir(gid))
            _fsync_dir(store.dir)
        j.update(state="switch", to=gid)
        _write_journal(store, j)
        fault("install:before-switch")
        state = "switch"
    if state == "switch":
        _switch_link(store, j["to"])
    return {"from": j["from"], "to": j["to"]}


def _abandon_build(store: Store, build: str) -> None:
    if os.path.lexists(build):
        _rmtree(build)
    _clear_journal(store)


def _resume(store: Store) -> Optional[dict]:
    """Finish whatever a previous, interrupted operation left in the journal."""
    j = _read_journal(store)
    _clean_stale_links(store) if os.path.isdir(store.parent) else None
    if j is None:
        return None
    op = j.get("op")
    if op == "adopt":
        _adopt_steps(store, j["gen"])
    elif op == "install":
        _install_steps(store, j)
    elif op == "switch":
        _switch_link(store, j["to"])
    elif op == "remove":
        trash = os.path.join(store.dir, j["trash"])
        if os.path.isdir(store.gen_dir(j["gen"])) and not os.path.lexists(trash):
            os.rename(store.gen_dir(j["gen"]), trash)
        if os.path.lexists(trash):
            _rmtree(trash)
    _clear_journal(store)
    return {"resumed": op, "journal": j}


# --- operations (each holds the lock and first completes any pending journal) -----------

def _ensure_adopted(store: Store) -> str:
    cur = store.current()
    if cur is not None:
        return cur
    if os.path.islink(store.venv):
        raise Refused(f"{store.venv} is a link to {os.readlink(store.venv)}, not to a generation "
                      f"in {store.dir}; fix or remove the link by hand")
    if not os.path.isdir(store.venv):
        raise Refused(f"{store.venv} does not exist in this container; create the venv first "
                      f"(or set the container's venv in the ctl config)")
    if os.path.ismount(store.venv):
        raise Refused(f"{store.venv} is a mount point (bind mount?): it cannot be turned into "
                      f"generations in place; copy it into the container instead")
    if os.stat(store.venv).st_dev != os.stat(store.parent).st_dev:
        raise Refused(f"{store.venv} is on another filesystem than {store.parent}")
    fp = fingerprint(store.venv)
    gid = fp["id"]
    meta = {"id": gid, "fingerprint": fp, "created": time.time(), "parent": None, "specs": [],
            "wheelhouse": None, "adopted": True}
    # Written into the live venv before anything moves: an extra file at a venv's top level
    # is ignored by python and pip.
    atomic_write_json(os.path.join(store.venv, META), meta)
    _write_journal(store, {"op": "adopt", "gen": gid, "started": time.time()})
    _adopt_steps(store, gid)
    _clear_journal(store)
    return gid


def op_status(store: Store) -> dict:
    return {"venv": store.venv, "store": store.dir, "current": store.current(),
            "managed": store.current() is not None, "generations": store.generations(),
            "pending": _read_journal(store)}


def op_adopt(store: Store) -> dict:
    with Locked(store):
        resumed = _resume(store)
        was = store.current()
        gid = _ensure_adopted(store)
        return {"current": gid, "adopted": was is None, "resumed": resumed}


def requirement_problem(spec: str) -> Optional[str]:
    """Why ``spec`` cannot be one requirement for pip, or None. pip reads a word that starts
    with '-' as its own option (-e PATH, -r FILE, --index-url URL), not as a requirement."""
    if not spec.strip():
        return "a requirement cannot be empty; name a package, e.g. 'torch==2.9.1'"
    if spec.lstrip().startswith("-"):
        return (f"{spec!r} is a pip option, not a requirement: name packages, e.g. 'torch==2.9.1' "
                "(offline wheels: --wheelhouse DIR)")
    return None


def requirements_problem(specs: list[str]) -> Optional[str]:
    """The first of ``specs``' problems (requirement_problem), or None."""
    return next(filter(None, map(requirement_problem, specs)), None)


def op_install(store: Store, specs: list[str], wheelhouse: Optional[str], pip_args: list[str]) -> dict:
    if not specs:
        raise Refused("name at least one requirement to install, e.g. 'torch==2.9.1'")
    why = requirements_problem(specs)
    if why:
        raise Refused(why)
    if wheelhouse and not os.path.isdir(wheelhouse):
        raise Refused(f"wheelhouse {wheelhouse} does not exist in this container; copy the wheels "
                      f"there or bind-mount the node's wheelhouse")
    with Locked(store):
        resumed = _resume(store)
        cur = _ensure_adopted(store)
        j = {"op": "install", "from": cur, "build": f"{BUILD_PREFIX}{uuid.uuid4().hex[:10]}",
             "specs": specs, "wheelhouse": wheelhouse, "pip_args": pip_args, "state": "copy",
             "started": time.time()}
        _write_journal(store, j)
        res = _install_steps(store, j)
        _clear_journal(store)
        res["diff"] = diff_fingerprints(_read_meta(store, res["from"]).get("fingerprint", {}),
                                        _read_meta(store, res["to"]).get("fingerprint", {}))
        res["current"] = store.current()
        res["resumed"] = resumed
        return res


def op_switch(store: Store, ref: str) -> dict:
    with Locked(store):
        resumed = _resume(store)
        cur = _ensure_adopted(store)
        gid = store.resolve(ref)
        gdir = store.gen_dir(gid)
        if not os.path.exists(os.path.join(gdir, "bin", "python3")):
            raise Refused(f"generation {gid} at {gdir} has no bin/python3: it is damaged; not switching")
        _write_journal(store, {"op": "switch", "from": cur, "to": gid, "started": time.time()})
        _switch_link(store, gid)
        _clear_journal(store)
        after = fingerprint(store.venv)
        expected = _read_meta(store, gid).get("fingerprint", {})
        return {"from": cur, "to": gid, "current": store.current(), "fingerprint_after": after,
                "verified": after["id"] == gid,
                "diff": diff_fingerprints(_read_meta(store, cur).get("fingerprint", {}), expected)}


def op_resume(store: Store) -> dict:
    with Locked(store):
        return {"resumed": _resume(store), "current": store.current()}


def _refs(store: Store) -> list[dict]:
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


def op_list(store: Store) -> dict:
    cur = store.current()
    refs = _refs(store)
    gens = []
    for gid in store.generations():
        meta = _read_meta(store, gid)
        fp = meta.get("fingerprint", {})
        gens.append({"id": gid, "current": gid == cur, "created": meta.get("created"),
                     "parent": meta.get("parent"), "specs": meta.get("specs", []),
                     "adopted": meta.get("adopted", False), "python": fp.get("python"),
                     "torch": fp.get("torch"), "packages": len(fp.get("packages", {})),
                     "refs": [r["ref"] for r in refs if r.get("gen") == gid]})
    gens.sort(key=lambda g: g.get("created") or 0)
    return {"venv": store.venv, "store": store.dir, "current": cur, "managed": cur is not None,
            "generations": gens, "pending": _read_journal(store)}


def op_show(store: Store, ref: str) -> dict:
    if store.current() is None and ref in ("current", "@") and os.path.isdir(store.venv):
        fp = fingerprint(store.venv)  # not adopted yet: describe the venv as it stands
        return {"id": fp["id"], "current": True, "managed": False, "fingerprint": fp}
    gid = store.resolve(ref)
    meta = _read_meta(store, gid)
    if "fingerprint" not in meta:
        meta["fingerprint"] = fingerprint(store.gen_dir(gid))
    meta["current"] = gid == store.current()
    meta["refs"] = [r["ref"] for r in _refs(store) if r.get("gen") == gid]
    meta["managed"] = True
    return meta


def op_diff(store: Store, a: str, b: str) -> dict:
    fa = op_show(store, a)["fingerprint"]
    fb = op_show(store, b)["fingerprint"]
    return diff_fingerprints(fa, fb)


def op_match(store: Store, packages: dict) -> dict:
    """Which generation holds exactly this package set (e.g. a known-good run's)."""
    want = {envfp.canonical_name(k): v for k, v in packages.items()}
    hits = []
    for gid in store.generations():
        have = _read_meta(store, gid).get("fingerprint", {}).get("packages")
        if have is not None and have == want:
            hits.append(gid)
    return {"matches": hits}


def _ref_path(store: Store, ref: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9._:@-]{1,200}", ref) or ref.startswith("."):
        raise Refused(f"reference name {ref!r} may hold only letters, digits and ._:@-")
    return os.path.join(store.refs, ref + ".json")


def op_pin(store: Store, ref: str, gen: str, reason: str) -> dict:
    with Locked(store):
        gid = store.resolve(gen)
        os.makedirs(store.refs, exist_ok=True)
        atomic_write_json(_ref_path(store, ref), {"ref": ref, "gen": gid, "reason": reason, "ts": time.time()})
        return {"ref": ref, "gen": gid}


def op_unpin(store: Store, ref: str) -> dict:
    with Locked(store):
        try:
            os.unlink(_ref_path(store, ref))
            return {"ref": ref, "removed": True}
        except FileNotFoundError:
            return {"ref": ref, "removed": False}


def op_remove(store: Store, ref: str) -> dict:
    with Locked(store):
        _resume(store)
        gid = store.resolve(ref)
        if gid == store.current():
            raise Refused(f"generation {gid} is the current one of {store.venv}; switch away first")
        holders = [r["ref"] for r in _refs(store) if r.get("gen") == gid]
        if holders:
            raise Refused(f"generation {gid} is referenced by {', '.join(holders)} (known-good runs "
                          f"keep their environment); unpin them first")
        trash = f"{TRASH_PREFIX}{gid}-{uuid.uuid4().hex[:6]}"
        _write_journal(store, {"op": "remove", "gen": gid, "trash": trash, "started": time.time()})
        os.rename(store.gen_dir(gid), os.path.join(store.dir, trash))
        fault("remove:after-trash")
        _rmtree(os.path.join(store.dir, trash))
        _clear_journal(store)
        return {"removed": gid}


# --- CLI --------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m agent.envgen", description=__doc__.split("\n\n")[0])
    p.add_argument("--venv", default="/root/venv", help="the configured venv path (default /root/venv)")
    sub = p.add_subparsers(dest="verb", required=True)
    sub.add_parser("status", help="is the venv managed, which generation is current, anything pending")
    sub.add_parser("adopt", help="turn the existing venv directory into the first generation")
    sub.add_parser("list", help="all generations, oldest first")
    s = sub.add_parser("show", help="one generation with its packages")
    s.add_argument("gen", nargs="?", default="current")
    s = sub.add_parser("diff", help="packages up/down/added/removed from A to B")
    s.add_argument("a")
    s.add_argument("b", nargs="?", default="current")
    s = sub.add_parser("install", help="build a new generation with these requirements and switch to it")
    s.add_argument("specs", nargs="+")
    s.add_argument("--wheelhouse", help="directory of wheels in the container (pip --no-index --find-links)")
    s.add_argument("--pip-arg", action="append", default=[], help="extra pip install argument")
    s = sub.add_parser("switch", help="make an existing generation current")
    s.add_argument("gen")
    sub.add_parser("resume", help="complete an operation that was interrupted")
    sub.add_parser("match", help="the generation holding a package set (JSON {name: version} on stdin)")
    sub.add_parser("compare", help='diff of two fingerprints, JSON {"old": FP, "new": FP} on stdin')
    s = sub.add_parser("pin", help="record that a run uses a generation: it will not be removed")
    s.add_argument("--ref", required=True)
    s.add_argument("--gen", default="current")
    s.add_argument("--reason", default="known-good")
    s = sub.add_parser("unpin")
    s.add_argument("--ref", required=True)
    s = sub.add_parser("remove", help="delete a generation that is neither current nor referenced")
    s.add_argument("gen")
    s = sub.add_parser("fingerprint", help="fingerprint of a venv directory (default: the venv path)")
    s.add_argument("path", nargs="?")
    return p


def dispatch(args: argparse.Namespace) -> dict:
    store = Store(args.venv)
    verb = args.verb
    if verb == "status":
        return op_status(store)
    if verb == "adopt":
        return op_adopt(store)
    if verb == "list":
        return op_list(store)
    if verb == "show":
        return op_show(store, args.gen)
    if verb == "diff":
        return op_diff(store, args.a, args.b)
    if verb == "install":
        return op_install(store, args.specs, args.wheelhouse, args.pip_arg)
    if verb == "switch":
        return op_switch(store, args.gen)
    if verb == "resume":
        return op_resume(store)
    if verb == "match":
        return op_match(store, json.load(sys.stdin))
    if verb == "compare":
        doc = json.load(sys.stdin)
        return diff_fingerprints(doc["old"], doc["new"])
    if verb == "pin":
        return op_pin(store, args.ref, args.gen, args.reason)
    if verb == "unpin":
        return op_unpin(store, args.ref)
    if verb == "remove":
        return op_remove(store, args.gen)
    if verb == "fingerprint":
        return fingerprint(args.path or store.venv)
    raise Refused(f"unknown verb {verb}")


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        body = dispatch(args)
    except EnvGenError as exc:
        sys.stdout.write(wrap_payload({"ok": False, "kind": exc.kind, "error": str(exc)}))
        sys.stdout.flush()
        # the controller tells a refusal (nothing changed, operator must act) from a failure
        # (something went wrong while acting; the journal says what is left)
        return ENVGEN_EXIT_REFUSED if isinstance(exc, Refused) else ENVGEN_EXIT_FAILED
    body = dict(body)
    body["ok"] = True
    sys.stdout.write(wrap_payload(body))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
