"""`ctl export` against the simulated node, run as the operator runs it (a `ctl` subprocess in
which torch cannot be imported): a tiny run launched in container 201, its drafter exported
in the container and streamed back over SSH; the directory on this side equals the
container's (sha256 of every file, against the checkpoint's own step_N/drafter/), and every
refusal leaves nothing behind, here or in the container."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest


pytestmark = [pytest.mark.sim, pytest.mark.slow]

CT = 201
WS = "/workspace"
REPO = Path(__file__).resolve().parent.parent
NAME = "exporttest"
CTL = [str(Path(sys.executable).with_name("ctl"))]
BLOCKER = '''
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in the controller (tests/test_export_sim.py)")
        return None
sys.meta_path.insert(0, _NoTorch())
'''


def ctl(env, *args, timeout=600):
    return subprocess.run(CTL + [str(a) for a in args], env=env, capture_output=True, text=True, timeout=timeout)


def sh(env, *argv) -> str:
    p = ctl(env, "exec", "-c", CT, "--", *argv)
    assert p.returncode == 0, f"{argv}: {p.stderr}"
    return p.stdout


@pytest.fixture(scope="module")
def env(ctl_config, tmp_path_factory):
    blocker = tmp_path_factory.mktemp("no-torch")
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    return {**os.environ, "PYTHONPATH": f"{blocker}{os.pathsep}{REPO}", "DFLASH_CTL_CONFIG": str(ctl_config),
            "DFLASH_CTL_SSH_CONFIG": "none", "COLUMNS": "200"}


@pytest.fixture(scope="module")
def run(sim_node, env, tmp_path_factory):
    """A 4-step tiny run in container 201 (checkpoints at steps 2 and 4); on teardown our runs
    and launch records go and .dflash-ctl is put back as found."""
    from controller import config as cfg
    from controller.container import Container
    from controller.provision import provision_tiny
    from controller.transport import open_runner

    conf = cfg.load(env["DFLASH_CTL_CONFIG"])
    name, node = conf.node()
    with open_runner(name, node) as runner:
        provision_tiny(Container(runner, name, node, CT))
    toml = tmp_path_factory.mktemp("cfg") / f"{NAME}.toml"
    toml.write_text((REPO / "examples" / "tiny.toml").read_text().replace('name = "tiny"', f'name = "{NAME}"'))
    saved = f"/tmp/dflash-{NAME}-saved"
    sh(env, "sh", "-c", f'mkdir -p {WS}/.dflash-ctl && rm -rf "$1" && cp -a {WS}/.dflash-ctl "$1"', "sh", saved)
    launch = ctl(env, "launch", "--container", CT, "--config", toml, "--from-scratch", "--accept-drift", "--json",
                 "--set", "max-steps=4", "--set", "save-interval=2")
    assert launch.returncode == 0, launch.stdout + launch.stderr
    run_id = json.loads(launch.stdout.strip().splitlines()[-1])["run_id"]
    done = ctl(env, "tail", "--container", CT, "--run", run_id, "--follow")
    assert done.returncode == 0, done.stdout + done.stderr
    yield {"run_id": run_id, "output": f"{WS}/runs/{run_id}/output"}
    sh(env, "sh", "-c", f'rm -rf {WS}/runs/{NAME}-* {WS}/.dflash-ctl/secrets/{NAME}-* && '
                        f'rm -rf {WS}/.dflash-ctl/known-good.json {WS}/.dflash-ctl/launches && '
                        f'cp -a "$1"/. {WS}/.dflash-ctl/ && rm -rf "$1"', "sh", saved)


def local_sums(directory: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def container_sums(env, directory: str) -> dict:
    out = sh(env, "sh", "-c", 'cd "$1" && sha256sum -- *', "sh", directory)
    return {line.split()[1]: line.split()[0] for line in out.splitlines()}


def leftovers(env) -> str:
    return sh(env, "sh", "-c", f"ls -A {WS}/.dflash-ctl/exports 2>/dev/null || true").strip()


def test_ctl_export_brings_the_containers_drafter_and_checksums_match(run, env, tmp_path):
    dest = tmp_path / "drafter"
    p = ctl(env, "export", "--container", CT, "--run", run["run_id"], "--to", dest, "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(p.stdout.strip().splitlines()[-1])
    assert doc["step"] == 4 and doc["checkpoint"] == f"{run['output']}/step_4"
    mine = local_sums(dest)
    assert mine == {f["path"]: f["sha256"] for f in doc["files"]}
    # the container's own step_4/drafter/, written by the trainer at save time: the same bytes
    assert mine == container_sums(env, f"{run['output']}/step_4/drafter")
    assert sorted(mine) == ["README.md", "config.json", "model.safetensors", "modeling_dflash.py"]
    assert stat.S_IMODE(dest.stat().st_mode) == 0o755
    assert {stat.S_IMODE(f.stat().st_mode) for f in dest.iterdir()} == {0o644}
    assert json.loads((dest / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    assert leftovers(env) == ""  # the container's temp copy is gone
    assert [x.name for x in tmp_path.iterdir()] == ["drafter"]  # no temp dir left here


def test_ctl_export_step_picks_that_checkpoint(run, env, tmp_path):
    dest = tmp_path / "step2"
    p = ctl(env, "export", "--container", CT, "--run", run["run_id"], "--step", 2, "--to", dest, "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    assert local_sums(dest) == container_sums(env, f"{run['output']}/step_2/drafter")


def refused(env, args, expect, tmp_path, code=2):
    before = sorted(x.name for x in tmp_path.iterdir())
    p = ctl(env, "export", *args)
    assert p.returncode == code, p.stdout + p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("ctl: error:")]
    assert len(errors) == 1 and expect in errors[0], p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    assert sorted(x.name for x in tmp_path.iterdir()) == before
    assert leftovers(env) == ""


def test_refusals_leave_nothing_behind(run, env, tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine.txt").write_text("keep")
    refused(env, ["--container", CT, "--run", run["run_id"], "--to", full], "is not empty", tmp_path)
    assert [x.name for x in full.iterdir()] == ["mine.txt"]
    refused(env, ["--container", CT, "--run", run["run_id"], "--step", 3, "--to", tmp_path / "x"],
            "--step 3: ", tmp_path)
    # a run that never saved: a run directory with no checkpoint events
    empty = f"{NAME}-nockpt"
    sh(env, "mkdir", "-p", f"{WS}/runs/{empty}")
    try:
        refused(env, ["--container", CT, "--run", empty, "--to", tmp_path / "y"], "no complete checkpoint", tmp_path)
    finally:
        sh(env, "rm", "-rf", "--", f"{WS}/runs/{empty}")
