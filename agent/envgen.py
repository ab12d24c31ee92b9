"""Environment generations of a container's venv: adopt, build, switch, list, diff, remove.

Why this exists (docs/design.md, the story): a torch upgrade cu128 → cu130 ate ~200 MB per GPU
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
keeps working when the venv is the thing being repaired. This file holds the verbs and the
CLI; agent/genstore.py the store on disk (paths, lock, journal, references, fingerprint,
fault points), agent/genbuild.py the journaled steps (adopt, build, switch, resume) and
agent/pkgdiff.py the package diff. Run as
``python3 -m agent.envgen <verb> --venv /root/venv …``; replies are sentinel-wrapped JSON
(agent.protocol.wrap_payload).

Fault injection for tests: ``DFLASH_ENVGEN_FAULT=<point>=die|pause`` makes the process
SIGKILL itself, or announce ``envgen: paused at <point>`` on stderr and sleep
(``DFLASH_ENVGEN_PAUSE_S``, default 120 s), at a named point (agent/genstore.py: FAULT_POINTS).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from typing import Optional

from agent import envfp
from agent.genbuild import ensure_adopted, install_steps, resume_pending, switch_link
from agent.genstore import (BUILD_PREFIX, TRASH_PREFIX, EnvGenError, Locked, Refused, Store, clear_journal, fault,
                            fingerprint, read_journal, read_meta, read_refs, ref_path, rmtree, write_journal)
from agent.pkgdiff import diff_fingerprints
from agent.protocol import ENVGEN_EXIT_FAILED, ENVGEN_EXIT_REFUSED, atomic_write_json, wrap_payload

# --- operations (each holds the lock and first completes any pending journal) -----------

def op_status(store: Store) -> dict:
    return {"venv": store.venv, "store": store.dir, "current": store.current(),
            "managed": store.current() is not None, "generations": store.generations(),
            "pending": read_journal(store)}


def op_adopt(store: Store) -> dict:
    with Locked(store):
        resumed = resume_pending(store)
        was = store.current()
        gid = ensure_adopted(store)
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
        resumed = resume_pending(store)
        cur = ensure_adopted(store)
        j = {"op": "install", "from": cur, "build": f"{BUILD_PREFIX}{uuid.uuid4().hex[:10]}",
             "specs": specs, "wheelhouse": wheelhouse, "pip_args": pip_args, "state": "copy",
             "started": time.time()}
        write_journal(store, j)
        res = install_steps(store, j)
        clear_journal(store)
        res["diff"] = diff_fingerprints(read_meta(store, res["from"]).get("fingerprint", {}),
                                        read_meta(store, res["to"]).get("fingerprint", {}))
        res["current"] = store.current()
        res["resumed"] = resumed
        return res


def op_switch(store: Store, ref: str) -> dict:
    with Locked(store):
        resumed = resume_pending(store)
        cur = ensure_adopted(store)
        gid = store.resolve(ref)
        gdir = store.gen_dir(gid)
        if not os.path.exists(os.path.join(gdir, "bin", "python3")):
            raise Refused(f"generation {gid} at {gdir} has no bin/python3: it is damaged; not switching")
        write_journal(store, {"op": "switch", "from": cur, "to": gid, "started": time.time()})
        switch_link(store, gid)
        clear_journal(store)
        after = fingerprint(store.venv)
        expected = read_meta(store, gid).get("fingerprint", {})
        return {"from": cur, "to": gid, "current": store.current(), "fingerprint_after": after,
                "verified": after["id"] == gid,
                "diff": diff_fingerprints(read_meta(store, cur).get("fingerprint", {}), expected)}


def op_resume(store: Store) -> dict:
    with Locked(store):
        return {"resumed": resume_pending(store), "current": store.current()}


def op_list(store: Store) -> dict:
    cur = store.current()
    refs = read_refs(store)
    gens = []
    for gid in store.generations():
        meta = read_meta(store, gid)
        fp = meta.get("fingerprint", {})
        gens.append({"id": gid, "current": gid == cur, "created": meta.get("created"),
                     "parent": meta.get("parent"), "specs": meta.get("specs", []),
                     "adopted": meta.get("adopted", False), "python": fp.get("python"),
                     "torch": fp.get("torch"), "packages": len(fp.get("packages", {})),
                     "refs": [r["ref"] for r in refs if r.get("gen") == gid]})
    gens.sort(key=lambda g: g.get("created") or 0)
    return {"venv": store.venv, "store": store.dir, "current": cur, "managed": cur is not None,
            "generations": gens, "pending": read_journal(store)}


def op_show(store: Store, ref: str) -> dict:
    if store.current() is None and ref in ("current", "@") and os.path.isdir(store.venv):
        fp = fingerprint(store.venv)  # not adopted yet: describe the venv as it stands
        return {"id": fp["id"], "current": True, "managed": False, "fingerprint": fp}
    gid = store.resolve(ref)
    meta = read_meta(store, gid)
    if "fingerprint" not in meta:
        meta["fingerprint"] = fingerprint(store.gen_dir(gid))
    meta["current"] = gid == store.current()
    meta["refs"] = [r["ref"] for r in read_refs(store) if r.get("gen") == gid]
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
        have = read_meta(store, gid).get("fingerprint", {}).get("packages")
        if have is not None and have == want:
            hits.append(gid)
    return {"matches": hits}


def op_pin(store: Store, ref: str, gen: str, reason: str) -> dict:
    with Locked(store):
        gid = store.resolve(gen)
        os.makedirs(store.refs, exist_ok=True)
        atomic_write_json(ref_path(store, ref), {"ref": ref, "gen": gid, "reason": reason, "ts": time.time()})
        return {"ref": ref, "gen": gid}


def op_unpin(store: Store, ref: str) -> dict:
    with Locked(store):
        try:
            os.unlink(ref_path(store, ref))
            return {"ref": ref, "removed": True}
        except FileNotFoundError:
            return {"ref": ref, "removed": False}


def op_remove(store: Store, ref: str) -> dict:
    with Locked(store):
        resume_pending(store)
        gid = store.resolve(ref)
        if gid == store.current():
            raise Refused(f"generation {gid} is the current one of {store.venv}; switch away first")
        holders = [r["ref"] for r in read_refs(store) if r.get("gen") == gid]
        if holders:
            raise Refused(f"generation {gid} is referenced by {', '.join(holders)} (known-good runs "
                          f"keep their environment); unpin them first")
        trash = f"{TRASH_PREFIX}{gid}-{uuid.uuid4().hex[:6]}"
        write_journal(store, {"op": "remove", "gen": gid, "trash": trash, "started": time.time()})
        os.rename(store.gen_dir(gid), os.path.join(store.dir, trash))
        fault("remove:after-trash")
        rmtree(os.path.join(store.dir, trash))
        clear_journal(store)
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
