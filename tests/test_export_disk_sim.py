"""Disks and exports on the simulated node, with `ctl` run as the operator runs it (a
subprocess in which torch cannot be imported), in container 201.

`ctl export`: a tiny run launched there, its drafter exported in the container and streamed
back over SSH; the directory on this side equals the container's (sha256 of every file,
against the checkpoint's own step_N/drafter/), and every refusal leaves nothing behind, here
or in the container.

Disks: the container gets a 2 GiB tmpfs as its output disk for the test
(mounted inside the container, removed after; tmpfs holds only what is written), and a run
that keeps all of 3,000 checkpoints of ~0.8 MiB is launched on it. Before, 2 GiB free drew
only a warning ("--output-dir: 2.0 GiB free on …") and the run started; now `ctl launch`
exits 3 with one line naming need, free and what to change, and nothing is started or
written."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import stat
from pathlib import Path

import pytest

import _ctl_subprocess as C

pytestmark = [pytest.mark.sim, pytest.mark.slow]

CT = 201
WS = "/workspace"
NAME = "exporttest"
ctl = C.ctl
sh = functools.partial(C.sh, ct=CT)


@pytest.fixture(scope="module")
def env(ctl_config, tmp_path_factory):
    return C.no_torch_env(ctl_config, tmp_path_factory.mktemp("no-torch"))


@pytest.fixture(scope="module")
def toml(sim_node, env, tmp_path_factory):
    """examples/tiny.toml under our own name, its target and data provisioned in the container."""
    from controller import config as cfg
    from controller.container import Container
    from controller.provision import provision_tiny
    from controller.session import open_runner

    conf = cfg.load(env["DFLASH_CTL_CONFIG"])
    name, node = conf.node()
    with open_runner(name, node) as runner:
        provision_tiny(Container(runner, name, node, CT))
    path = tmp_path_factory.mktemp("cfg") / f"{NAME}.toml"
    path.write_text((C.REPO / "examples" / "tiny.toml").read_text().replace('name = "tiny"', f'name = "{NAME}"'))
    return path


@pytest.fixture(scope="module")
def run(env, toml):
    """A 4-step tiny run in container 201 (checkpoints at steps 2 and 4); on teardown our runs
    and launch records go and .dflash-ctl is put back as found."""
    saved = f"/tmp/dflash-{NAME}-saved"
    sh(env, *C.baseline_aside(WS, saved))
    launch = ctl(env, "launch", "--container", CT, "--config", toml, "--from-scratch", "--accept-drift", "--json",
                 "--set", "max-steps=4", "--set", "save-interval=2")
    assert launch.returncode == 0, launch.stdout + launch.stderr
    run_id = json.loads(launch.stdout.strip().splitlines()[-1])["run_id"]
    done = ctl(env, "tail", "--container", CT, "--run", run_id, "--follow")
    assert done.returncode == 0, done.stdout + done.stderr
    yield {"run_id": run_id, "output": f"{WS}/runs/{run_id}/output"}
    sh(env, "sh", "-c", f'rm -rf {WS}/runs/{NAME}-* {WS}/.dflash-ctl/secrets/{NAME}-*')
    sh(env, *C.baseline_back(WS, saved))


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
    assert sorted(mine) == ["README.md", "config.json", "dflash_eval.json", "model.safetensors", "modeling_dflash.py"]
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
    empty = f"{NAME}-20261201-000000-0000"  # the run-id grammar; a run with no checkpoint
    sh(env, "mkdir", "-p", f"{WS}/runs/{empty}")
    try:
        refused(env, ["--container", CT, "--run", empty, "--to", tmp_path / "y"], "no complete checkpoint", tmp_path)
    finally:
        sh(env, "rm", "-rf", "--", f"{WS}/runs/{empty}")


# --- disks -----------------------------------------------------------------------------------

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


def test_a_launch_whose_checkpoints_cannot_fit_the_output_disk_is_refused_before_anything_starts(env, toml,
                                                                                                  small_disk):
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
