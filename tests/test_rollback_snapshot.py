"""`ctl launch --snapshot` and `ctl kill-and-rollback --to snapshot:NAME` on the simulated
node of tests/_rollback_node.py: container 260 on btrfs storage (Proxmox snapshots work),
261 on dir storage (pct refuses: "snapshot feature is not available")."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from _rollback_node import (started_run, DIR_CT, SNAP_CT, Handle, ctl, rb_config, rb_node,  # noqa: F401 (fixtures)
                            reset_to_pristine, tiny_config)

pytestmark = [pytest.mark.sim, pytest.mark.slow]

SITE = "/root/venv/lib/python3.11/site-packages"


@pytest.fixture(scope="module")
def node(rb_node, rb_config):
    reset_to_pristine(rb_config)
    h = Handle(rb_config, SNAP_CT)
    yield h
    h.close()


@pytest.fixture(scope="module")
def run_config(tmp_path_factory) -> Path:
    return tiny_config(tmp_path_factory.mktemp("runcfg"))


@pytest.fixture(scope="module")
def long_config(tmp_path_factory) -> Path:
    """A run that trains long enough to be stopped while it runs."""
    return tiny_config(tmp_path_factory.mktemp("runcfg-long"), max_steps=100000, save_interval=100000)


def test_snapshot_launch_then_damage_then_rollback_restores_files_and_the_container_runs(node, rb_config,
                                                                                         long_config):
    h = node
    proc = ctl(rb_config, "launch", "--container", str(SNAP_CT), "--config", str(long_config), "--from-scratch",
               "--snapshot")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_id = started_run(proc.stdout)
    snap = next(w for w in proc.stdout.split() if w.startswith("ctl-"))
    assert snap == "ctl-" + run_id and f"snapshot {snap} of container {SNAP_CT} taken" in proc.stdout
    assert snap in h.pct("listsnapshot", str(SNAP_CT)).stdout
    events = f"/workspace/runs/{run_id}/events.jsonl"
    deadline = time.monotonic() + 300
    while not h.sh("grep", "-q", '"step"', events).ok:
        assert time.monotonic() < deadline, f"run {run_id} never reached a training step"
        time.sleep(2)

    # Damage while it runs: a package vanishes from the venv, a stray file appears.
    h.sh("rm", "-rf", f"{SITE}/safetensors", f"{SITE}/safetensors-0.8.0.dist-info")
    h.ct.write_file("/etc/dflash-damaged", "x")

    proc = ctl(rb_config, "kill-and-rollback", "--container", str(SNAP_CT), "--to", f"snapshot:{snap}",
               "--yes", "--grace", "30")
    report = proc.stdout
    assert proc.returncode == 0, report + proc.stderr
    assert f"pct rollback {SNAP_CT} {snap}" in report
    assert f"stopped   run {run_id}" in report
    assert "[OK]" in report and "+ safetensors 0.8.0" in report
    assert h.pct("status", str(SNAP_CT)).stdout.strip() == "status: running"
    assert not h.sh("test", "-e", "/etc/dflash-damaged").ok
    assert h.sh("/root/venv/bin/python3", "-c", "import safetensors").ok
    # The whole root filesystem went back to before the launch, run directory included; the
    # history (in the workspace) was written after the rollback, so it has both records.
    assert not h.sh("test", "-d", f"/workspace/runs/{run_id}").ok
    hist = ctl(rb_config, "history", "--container", str(SNAP_CT), "--json").stdout.splitlines()
    recs = [json.loads(line) for line in hist if line.startswith("{")]
    assert [(r["event"], r["to"] if r["event"] == "rollback" else r["run"]) for r in recs[-2:]] == \
        [("kill", run_id), ("rollback", f"snapshot:{snap}")]
    h.pct("delsnapshot", str(SNAP_CT), snap)


def test_dir_storage_refuses_a_snapshot_launch_and_starts_nothing(node, rb_config, run_config):
    d = Handle(rb_config, DIR_CT)
    try:
        before = d.sh("ls", "/workspace/runs").stdout
        proc = ctl(rb_config, "launch", "--container", str(DIR_CT), "--config", str(run_config), "--from-scratch",
                   "--snapshot")
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert f"container {DIR_CT}" in proc.stderr and "cannot be snapshotted" in proc.stderr
        assert "snapshot feature is not available" in proc.stderr and "Nothing was started" in proc.stderr
        assert d.sh("ls", "/workspace/runs").stdout == before
        assert "ctl-" not in d.pct("listsnapshot", str(DIR_CT)).stdout

        proc = ctl(rb_config, "kill-and-rollback", "--container", str(DIR_CT), "--to", "snapshot:ctl-any", "--yes")
        assert proc.returncode == 3 and "does not exist" in proc.stderr, proc.stderr
    finally:
        d.close()


def test_a_snapshot_launch_refused_in_preflight_leaves_no_snapshot_behind(node, rb_config, run_config):
    # --snapshot is taken before the preflight; a refused launch used to leave its ctl-<run>
    # snapshot on the container, which a failed launch must not change.
    h = node
    before = h.pct("listsnapshot", str(SNAP_CT)).stdout
    proc = ctl(rb_config, "launch", "--container", str(SNAP_CT), "--config", str(run_config), "--from-scratch",
               "--snapshot", "--set", "data-dir=/workspace/no-such-data")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "/workspace/no-such-data" in proc.stderr and "nothing was started" in proc.stderr
    assert "removed: the launch did not start" in proc.stdout
    assert h.pct("listsnapshot", str(SNAP_CT)).stdout == before
