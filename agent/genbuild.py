"""The journaled steps of envgen's operations (agent/envgen.py): adopt a real venv directory
as a generation, build one (copy, pip, fingerprint, rename), switch the venv link, and finish
whatever an interrupted operation's journal says is left. Each step looks at what is on disk
and does only what is left, so running it again after a crash completes it.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from typing import Optional

from agent.genstore import (ENV_NO_EXCHANGE, META, EnvGenError, Refused, Store, clear_journal, exchange, fault,
                            fingerprint, fsync_dir, read_journal, rmtree, write_journal)
from agent.protocol import atomic_write_json

def switch_link(store: Store, gid: str) -> None:
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
    fsync_dir(store.parent)


def clean_stale_links(store: Store) -> None:
    prefix = f".{os.path.basename(store.venv)}.link-"
    for name in os.listdir(store.parent):
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(store.parent, name))
            except FileNotFoundError:
                pass


def adopt_steps(store: Store, gid: str) -> None:
    """Make the real venv directory generation ``gid`` and the venv path a link to it.
    Idempotent: looks at what is on disk and does only what is left."""
    gdir = store.gen_dir(gid)
    if os.path.islink(store.venv) and store.current() == gid and os.path.isdir(gdir):
        return
    if os.path.isdir(store.venv) and not os.path.islink(store.venv):
        if os.path.lexists(gdir):
            rmtree(gdir)  # a leftover link from an exchange that did not happen
        # Preferred: swap the real directory with a ready link in one step, so the venv
        # path never goes missing (a run starting at that instant still finds a python).
        os.symlink(store.link_target(gid), gdir)
        fault("adopt:before-exchange")
        if not os.environ.get(ENV_NO_EXCHANGE) and exchange(store.venv, gdir):
            fsync_dir(store.parent)
            fsync_dir(store.dir)
            return
        os.unlink(gdir)
        # Fallback (no renameat2 here): move, then link. The journal covers the gap.
        os.rename(store.venv, gdir)
        fsync_dir(store.parent)
        fault("adopt:after-move")
    if not os.path.lexists(store.venv) and os.path.isdir(gdir):
        switch_link(store, gid)
        return
    if os.path.islink(store.venv) and os.path.isdir(gdir):
        return  # already a link (to another generation): adoption of gid is done
    raise EnvGenError(f"cannot finish adopting {store.venv} as generation {gid}: "
                      f"neither {store.venv} nor {gdir} is a venv directory")


def fix_shebangs(build: str, venv: str) -> None:
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


def install_steps(store: Store, j: dict) -> dict:
    """copy → pip → fingerprint → rename → switch, resuming from ``j['state']``."""
    build = os.path.join(store.dir, j["build"])
    state = j["state"]
    if state in ("copy", "pip"):
        # The build dir is never live; anything half-done there is thrown away and redone.
        if os.path.lexists(build):
            rmtree(build)
        j["state"] = "pip"
        write_journal(store, j)
        cp = subprocess.run(["cp", "-a", "--reflink=auto", store.gen_dir(j["from"]), build],
                            capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if cp.returncode != 0:
            abandon_build(store, build)
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
            abandon_build(store, build)
            tail = "\n".join((pip.stdout + pip.stderr).strip().splitlines()[-15:])
            where = f"wheelhouse {j['wheelhouse']}" if j.get("wheelhouse") else "the package index"
            raise Refused(f"pip could not install {' '.join(j['specs'])} from {where} into a copy of "
                          f"generation {j['from']}; nothing changed, {store.venv} still runs {j['from']}.\n{tail}")
        fix_shebangs(build, store.venv)
        fault("install:after-pip")
        fp = fingerprint(build)
        gid = fp["id"]
        if gid == j["from"] or os.path.isdir(store.gen_dir(gid)):
            rmtree(build)  # same package set as an existing generation: reuse that one
        else:
            meta = {"id": gid, "fingerprint": fp, "created": time.time(), "parent": j["from"],
                    "specs": j["specs"], "wheelhouse": j.get("wheelhouse"), "adopted": False}
            atomic_write_json(os.path.join(build, META), meta)
            os.rename(build, store.gen_dir(gid))
            fsync_dir(store.dir)
        j.update(state="switch", to=gid)
        write_journal(store, j)
        fault("install:before-switch")
        state = "switch"
    if state == "switch":
        switch_link(store, j["to"])
    return {"from": j["from"], "to": j["to"]}


def abandon_build(store: Store, build: str) -> None:
    if os.path.lexists(build):
        rmtree(build)
    clear_journal(store)


def resume_pending(store: Store) -> Optional[dict]:
    """Finish whatever a previous, interrupted operation left in the journal."""
    j = read_journal(store)
    clean_stale_links(store) if os.path.isdir(store.parent) else None
    if j is None:
        return None
    op = j.get("op")
    if op == "adopt":
        adopt_steps(store, j["gen"])
    elif op == "install":
        install_steps(store, j)
    elif op == "switch":
        switch_link(store, j["to"])
    elif op == "remove":
        trash = os.path.join(store.dir, j["trash"])
        if os.path.isdir(store.gen_dir(j["gen"])) and not os.path.lexists(trash):
            os.rename(store.gen_dir(j["gen"]), trash)
        if os.path.lexists(trash):
            rmtree(trash)
    clear_journal(store)
    return {"resumed": op, "journal": j}



def ensure_adopted(store: Store) -> str:
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
    write_journal(store, {"op": "adopt", "gen": gid, "started": time.time()})
    adopt_steps(store, gid)
    clear_journal(store)
    return gid
