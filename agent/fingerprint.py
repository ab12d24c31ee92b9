"""Environment fingerprint of the python that runs the trainer: python, torch and its CUDA
build, the NVIDIA driver, the exact package list and its hash.

torch is imported only in a subprocess of that python: the agent itself never imports
torch (DESIGN.md), and the venv's torch may differ from anything the agent could see.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

from agent import gpus

# Runs inside the target python. Prints one JSON document on its last line.
_PROBE = r"""
import hashlib, json, platform, sys
import importlib.metadata as md
out = {"python": sys.executable, "python_version": platform.python_version(),
       "implementation": platform.python_implementation()}
pkgs = {}
for dist in md.distributions():
    name = dist.metadata["Name"]
    if name:
        pkgs[name.lower().replace("_", "-")] = dist.version
out["packages"] = [f"{k}=={pkgs[k]}" for k in sorted(pkgs)]
try:
    import torch
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    out["torch_cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    out["cuda_available"] = bool(torch.cuda.is_available())
except Exception as exc:
    out["torch"] = None
    out["torch_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def default_python() -> str:
    return shutil.which("python3") or sys.executable


def fingerprint(python: str | None = None, timeout: float = 120.0) -> dict:
    python = python or default_python()
    result: dict = {"python": python}
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    try:
        proc = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout,
                              env=env, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        result["error"] = f"could not run {python}: {exc}"
    else:
        lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
        if proc.returncode != 0 or not lines:
            result["error"] = f"{python} exited {proc.returncode}: {proc.stderr.strip()[-500:]}"
        else:
            result.update(json.loads(lines[-1]))
    result["driver"] = gpus.driver_version()
    pkgs = result.get("packages") or []
    result["packages_sha256"] = hashlib.sha256("\n".join(pkgs).encode()).hexdigest()
    return result
