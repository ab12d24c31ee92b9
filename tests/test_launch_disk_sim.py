"""A launch whose kept checkpoints cannot fit the output disk is refused before anything
starts (issue 20, item 6), on the simulated node as an operator meets it: container 201
gets a 2 GiB tmpfs as its output disk for the test (mounted inside the container, removed
after; tmpfs holds only what is written), and a run that keeps all of 3,000 checkpoints of
~0.9 MiB is launched on it. Before, 2 GiB free drew only a warning ("--output-dir: 2.0 GiB
free on …") and the run started; now `ctl launch` (torch not importable) exits 3 with one
line naming need, free and what to change, and nothing is started or written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sim, pytest.mark.slow]

CT = 201
WS = "/workspace"
REPO = Path(__file__).resolve().parent.parent
NAME = "disktest"
CTL = [str(Path(sys.executable).with_name("ctl"))]
BLOCKER = '''
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in the controller (tests/test_launch_disk_sim.py)")
        return None
sys.meta_path.insert(0, _NoTorch())
'''


def ctl(env, *args, timeout=600):
    return subprocess.run(CTL + [str(a) for a in args], env=env, capture_output=True, text=True, timeout=timeout)


def sh(env, *argv, check=True) -> str:
    p = ctl(env, "exec", "-c", CT, "--", *argv)
    assert not check or p.returncode == 0, f"{argv}: {p.stderr}"
    return p.stdout


@pytest.fixture(scope="module")
def env(sim_node, ctl_config, tmp_path_factory):
    from controller import config as cfg
    from controller.container import Container
    from controller.provision import provision_tiny
    from controller.transport import open_runner

    blocker = tmp_path_factory.mktemp("no-torch")
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    e = {**os.environ, "PYTHONPATH": f"{blocker}{os.pathsep}{REPO}", "DFLASH_CTL_CONFIG": str(ctl_config),
         "DFLASH_CTL_SSH_CONFIG": "none", "COLUMNS": "200"}
    conf = cfg.load(str(ctl_config))
    name, node = conf.node()
    with open_runner(name, node) as runner:
        provision_tiny(Container(runner, name, node, CT))
    return e


@pytest.fixture
def small_disk(env):
    """A 2 GiB tmpfs in container 201, unmounted and removed after the test."""
    mnt = f"{WS}/{NAME}-{os.getpid()}"
    sh(env, "sh", "-c", 'mkdir -p "$1" && mount -t tmpfs -o size=2g tmpfs "$1"', "sh", mnt)
    try:
        yield mnt
    finally:
        sh(env, "sh", "-c", 'umount "$1"; rmdir "$1"', "sh", mnt, check=False)
    assert NAME not in sh(env, "cat", "/proc/mounts")


def runs(env) -> list[str]:
    return sorted(r for r in sh(env, "sh", "-c", f"ls -1 {WS}/runs 2>/dev/null || true").split() if r.startswith(NAME))


def test_a_launch_whose_checkpoints_cannot_fit_the_output_disk_is_refused_before_anything_starts(env, small_disk,
                                                                                                  tmp_path):
    toml = tmp_path / f"{NAME}.toml"
    toml.write_text((REPO / "examples" / "tiny.toml").read_text().replace('name = "tiny"', f'name = "{NAME}"'))
    before = runs(env)
    p = ctl(env, "launch", "--container", CT, "--config", toml, "--from-scratch", "--accept-drift",
            "--output-dir", f"{small_disk}/out", "--set", "epochs=200", "--set", "max-steps=3000",
            "--set", "save-interval=1", "--set", "keep-checkpoints=0")
    assert p.returncode == 3, p.stdout + p.stderr
    assert "launch refused — nothing was started" in p.stderr and "Traceback" not in p.stderr + p.stdout
    line = next(ln.strip() for ln in p.stderr.splitlines() if f"--output-dir {small_disk}/out:" in ln)
    print(line)
    # need, free, what to change
    assert "3000 checkpoints of " in line and "--keep-checkpoints 0 keeps every one: at least 3000 steps" in line, line
    assert " need 2." in line and f"{small_disk} has 2.0 GiB free; set --keep-checkpoints (e.g. 3)" in line, line
    assert runs(env) == before
    assert sh(env, "ls", "-A", small_disk).strip() == ""  # nothing written on that disk
    assert f"{WS}/runs/{NAME}-" not in sh(env, "ps", "-eo", "args=")
