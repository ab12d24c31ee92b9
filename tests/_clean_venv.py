"""A venv that holds torch, transformers and safetensors and nothing of this project, made
in about a second on any machine that already has them (a fresh CI machine included: no
download, no copy).

``python -m venv --without-pip`` gives an interpreter whose sys.path is the standard library
and its own empty site-packages. Into that site-packages go symlinks to exactly the
distributions torch, transformers and safetensors require (their installed requirement
closure, extras off, markers evaluated here), each with its .dist-info, so
``importlib.metadata`` and transformers' own version checks see what they expect. Nothing
else is linked: not the editable install of dflash-ctl (its ``__editable__*.pth``), not the
repository. :func:`prove_clean` runs the venv's interpreter and fails unless ``trainer``,
``agent``, ``controller``, ``sim`` and ``bench`` are all unimportable and no sys.path entry
lies in this repository or the main venv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WANTED = ("torch", "transformers", "safetensors")
OURS = ("trainer", "agent", "controller", "sim", "bench")


def closure(names=WANTED) -> list[metadata.Distribution]:
    from packaging.requirements import Requirement

    seen: dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional platform dependency this machine does not have
        seen[key] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def build(dest: Path) -> Path:
    """The clean venv at ``dest``; returns its python."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(dest)], check=True)
    python = dest / "bin" / "python"
    site = Path(subprocess.run([str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    for dist in closure():
        root = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in sorted(tops):
            link, source = site / top, root / top
            if source.exists() and not link.exists() and not top.endswith(".pth"):
                link.symlink_to(source)
    return python


PROOF = r"""
import importlib.util, json, sys
print(json.dumps({"path": sys.path, "ours": {m: importlib.util.find_spec(m) is not None for m in %r}}))
"""


def prove_clean(python: Path, cwd: Path) -> dict:
    """Fails unless none of this project is importable by ``python`` run as the tests run it."""
    p = subprocess.run([str(python), "-I", "-c", PROOF % (OURS,)], cwd=cwd, env=clean_env(cwd),
                       capture_output=True, text=True, check=True)
    doc = json.loads(p.stdout)
    assert not any(doc["ours"].values()), f"project packages importable in the clean venv: {doc['ours']}"
    main_site = Path(metadata.distribution("torch").locate_file("")).resolve()
    for entry in doc["path"]:
        resolved = Path(entry or cwd).resolve()
        assert REPO not in (resolved, *resolved.parents), f"sys.path entry {entry} is in the repository"
        assert resolved != main_site, f"sys.path entry {entry} is the main venv's site-packages"
    return doc


def clean_env(home: Path) -> dict:
    """An environment with nothing of the caller's: no PYTHONPATH, a private HOME and HF cache."""
    return {"PATH": "/usr/bin:/bin", "HOME": str(home), "HF_HOME": str(home / "hf"), "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8"}
