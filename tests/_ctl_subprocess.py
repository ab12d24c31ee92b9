"""`ctl` run as the operator runs it, for the simulated-node tests: a subprocess whose
Python cannot import torch (a sitecustomize meta-path blocker), so each such test also shows
the controller side never needs torch; this checkout's code first on its path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CTL = [str(Path(sys.executable).with_name("ctl"))]
BLOCKER = '''
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in the controller (tests/_ctl_subprocess.py)")
        return None
sys.meta_path.insert(0, _NoTorch())
'''


def no_torch_env(ctl_config, directory: Path) -> dict:
    """The environment for `ctl`: the blocker in ``directory``, the test's controller config."""
    (directory / "sitecustomize.py").write_text(BLOCKER)
    return {**os.environ, "PYTHONPATH": f"{directory}{os.pathsep}{REPO}", "DFLASH_CTL_CONFIG": str(ctl_config),
            "DFLASH_CTL_SSH_CONFIG": "none", "COLUMNS": "200"}


def ctl(env: dict, *args, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(CTL + [str(a) for a in args], env=env, capture_output=True, text=True, timeout=timeout)


def sh(env: dict, *argv, ct: int, check: bool = True) -> str:
    """A command in container ``ct`` through `ctl exec` (the product's own path)."""
    p = ctl(env, "exec", "-c", ct, "--", *argv)
    assert not check or p.returncode == 0, f"{argv}: {p.stderr}"
    return p.stdout


# A shared container's baseline (agent/knowngood.py) is whatever the modules before left: a
# run of theirs that reached steady state became it, and then the next module's launches
# were judged against it (refused for drift, or its run id printed before theirs). A module
# that launches sets the baseline and launch records aside for its own time, and puts them
# back as found.
def baseline_aside(workspace: str, saved: str) -> list[str]:
    """argv, run in the container: move ``<workspace>/.dflash-ctl``'s known-good record and
    launch records into the folder ``saved`` (an earlier save that was never put back is the
    state as found: it is put back first)."""
    return ["sh", "-c", 'set -e; s="$1"; d="$2"; mkdir -p "$d"; '
            'if [ -d "$s" ]; then rm -rf "$d/known-good.json" "$d/launches"; cp -a "$s"/. "$d"/; rm -rf "$s"; fi; '
            'mkdir -p "$s"; for f in known-good.json launches; do if [ -e "$d/$f" ]; then mv "$d/$f" "$s/"; fi; done',
            "sh", saved, f"{workspace}/.dflash-ctl"]


def baseline_back(workspace: str, saved: str) -> list[str]:
    """argv, run in the container: drop what the module's runs made of the baseline and put
    ``baseline_aside``'s copy back."""
    return ["sh", "-c", 's="$1"; d="$2"; [ -d "$s" ] || exit 0; rm -rf "$d/known-good.json" "$d/launches"; '
            'mkdir -p "$d" && cp -a "$s"/. "$d"/ && rm -rf "$s"', "sh", saved, f"{workspace}/.dflash-ctl"]
