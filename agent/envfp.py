"""The environment fingerprint: what a python that runs the trainer holds, in one shape.

    {"python": "3.11.2",                      # the interpreter's version
     "packages": {"torch": "2.13.0+cu130", …},  # every distribution, PEP 503 names
     "torch": {"version", "cuda", "hip", "build"} | None,   # build: cu130 | rocm6.2 | cpu
     "id": "3f2a9c0d1b7e",                    # 12 hex digits of sha256(python, packages, torch build)
     "executable": "/root/venv/bin/python3", "venv": "/root/venv" | None}   # where, not in the id

torch is read from the text of its ``version.py``, never imported: an import costs seconds,
and a broken torch (the thing a rollback repairs) must still be fingerprinted. The id names a
venv generation (agent/envgen.py: ``gen-<id>``), so the same packages and build always give
the same id. Who adds what: the launch preflight and `agent fingerprint` add ``driver``
(agent/gpus.py); the generations store keeps :func:`core` only.

Readers: controller/drift.py (env drift against the known-good run), controller/rollback.py
(which generation holds the known-good packages), agent/envgen.py (diff, match),
trainer/runtime_env.py (the compile cache's directory per generation).

This file also runs as a script under another python (``python -I -c <this file's text>``
prints that interpreter's fingerprint), so it imports nothing but the standard library.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import subprocess
import sys

CORE = ("python", "packages", "torch", "id")
_NAME_SEPARATORS = re.compile(r"[-_.]+")


def canonical_name(name: str) -> str:
    """PEP 503 normalisation: 'Typing_Extensions' and 'typing-extensions' are one package."""
    return _NAME_SEPARATORS.sub("-", name).lower()


def packages() -> dict[str, str]:
    """{canonical name: version} of every distribution this interpreter can import."""
    from importlib import metadata

    out: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            out.setdefault(canonical_name(name), dist.version)
    return dict(sorted(out.items()))


def _version_value(text: str, key: str) -> str | None:
    m = re.search(r"^" + key + r"\s*(?::[^=\n]*)?=\s*['\"]?([^'\"\n]*)['\"]?\s*$", text, re.M)
    value = m.group(1).strip() if m else None
    return None if value in (None, "", "None") else value


def torch_build(path: list[str] | None = None) -> dict | None:
    """torch's version and build from the first ``torch/version.py`` on ``path``, or None."""
    for entry in sys.path if path is None else path:
        version_py = os.path.join(entry or ".", "torch", "version.py")
        if not os.path.isfile(version_py):
            continue
        with open(version_py, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        cuda, hip = _version_value(text, "cuda"), _version_value(text, "hip")
        build = f"cu{cuda.replace('.', '')}" if cuda else f"rocm{hip}" if hip else "cpu"
        return {"version": _version_value(text, "__version__"), "cuda": cuda, "hip": hip, "build": build}
    return None


def fingerprint_id(fp: dict) -> str:
    """12 hex digits of the sha256 of the package set: same packages + build → same id."""
    torch = fp.get("torch") or {}
    key = {"python": fp.get("python"), "packages": dict(sorted((fp.get("packages") or {}).items())),
           "torch_build": torch.get("build")}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def collect() -> dict:
    """The fingerprint of the running interpreter."""
    fp = {"python": platform.python_version(), "packages": packages(), "torch": torch_build()}
    fp["id"] = fingerprint_id(fp)
    in_venv = sys.prefix != getattr(sys, "base_prefix", sys.prefix)
    fp.update(executable=sys.executable, venv=sys.prefix if in_venv else None)
    return fp


def core(fp: dict) -> dict:
    """The part that names an environment wherever it lives (what a generation records)."""
    return {k: fp.get(k) for k in CORE}


class FingerprintError(RuntimeError):
    """The python to describe did not run; the message says which one and why."""


def of_python(python: str, timeout: float = 120.0) -> dict:
    """The fingerprint of another interpreter, taken by that interpreter itself.

    ``-I`` (isolated): no PYTHON* variables, no user site, no script directory on sys.path,
    so it sees exactly its own site-packages (a venv's, or a build directory's)."""
    with open(os.path.abspath(__file__), encoding="utf-8") as fh:
        source = fh.read()
    try:
        proc = subprocess.run([python, "-I", "-c", source], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FingerprintError(f"could not run {python}: {exc}") from None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise FingerprintError(f"{python} exited {proc.returncode}: {proc.stderr.strip()[-800:]}")
    return json.loads(lines[-1])


if __name__ == "__main__":
    print(json.dumps(collect(), sort_keys=True))
