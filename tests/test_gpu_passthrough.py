"""GPUs as LXC gives them: a run that names GPUs the container cannot see is refused, with
the cause named, and never quietly trains on CPU; and a job is assessed (memory verdict
included) in every container before any starts.

The sim presents each state (sim/gpu.py): nvidia-smi is emulated (the machine has no GPU);
the device nodes (major 195) and the cgroup device rule are real, so EPERM on opening
/dev/nvidiactl comes from the kernel. Runs on the rollback tests' node (`rb`, 260/261),
whose containers this module restarts and gives back without GPUs.
"""

from __future__ import annotations

import pytest

from _rollback_node import (  # noqa: F401 (fixtures)
    DIR_CT, SNAP_CT, Handle, ctl, rb_config, rb_node, tiny_config,
)

pytestmark = [pytest.mark.sim, pytest.mark.slow]


@pytest.fixture(scope="module")
def node(rb_node, rb_config):
    h = Handle(rb_config, DIR_CT)  # the job below needs the tiny target and data in both
    try:
        if not h.sh("test", "-f", "/workspace/tiny/target/config.json").ok:
            from controller.provision import provision_tiny

            provision_tiny(h.ct)
    finally:
        h.close()
    yield rb_node
    for ct in (SNAP_CT, DIR_CT):
        rb_node.set_gpu(ct, "none")


def runs(rb_config, ct: int) -> list[str]:
    h = Handle(rb_config, ct)
    try:
        out = h.sh("sh", "-c", "ls /workspace/runs 2>/dev/null; true").stdout.split()
    finally:
        h.close()
    return out


def launch_gpu(rb_config, tmp_path, *args: str):
    return ctl(rb_config, "launch", "--config", str(tiny_config(tmp_path)), "--from-scratch",
               "--set", "device=auto", *args)


@pytest.mark.parametrize("state, cause", [
    ("none", "the node shows no NVIDIA driver either"),
    ("no-devices", "the container has no /dev/nvidia* device nodes (node driver 580.159.03)"),
    ("no-cgroup", "is there but the container's cgroup refuses it (EPERM)"),
    ("mismatch", "driver/library version mismatch: the node's kernel module is 580.159.03, the container's "
                 "libnvidia-ml is 570.86.15"),
])
def test_a_gpu_config_is_refused_with_its_cause_named(node, rb_config, tmp_path, state, cause):
    node.set_gpu(SNAP_CT, state)
    before = runs(rb_config, SNAP_CT)
    proc = launch_gpu(rb_config, tmp_path, "--container", str(SNAP_CT))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert f"the run names GPU 0 but container {SNAP_CT} sees none" in out, out
    assert cause in out, out
    assert 'device = "cpu"' in out  # the way to train on CPU on purpose
    if state == "no-devices":
        assert f"/etc/pve/lxc/{SNAP_CT}.conf" in out and "lxc.mount.entry: /dev/nvidia0 dev/nvidia0" in out
    if state == "no-cgroup":
        assert "lxc.cgroup2.devices.allow: c 195:* rwm" in out
    assert runs(rb_config, SNAP_CT) == before, "a refused launch left a run directory"


def test_the_sim_presents_the_states_the_way_pct_config_shows_them(node, rb_config):
    node.set_gpu(SNAP_CT, "no-cgroup")
    h = Handle(rb_config, SNAP_CT)
    try:
        config = h.pct("config", str(SNAP_CT)).stdout
        smi = h.sh("nvidia-smi")
        opened = h.sh("python3", "-c", "import os; os.open('/dev/nvidiactl', os.O_RDWR)")
    finally:
        h.close()
    assert "lxc.mount.entry: /dev/nvidiactl dev/nvidiactl" in config and "devices.allow" not in config
    assert smi.stdout.strip() == "Failed to initialize NVML: Unknown Error" and smi.returncode == 255
    assert "Operation not permitted" in opened.stderr  # the kernel's cgroup check, not an emulation


def test_job_refuses_a_gpu_that_does_not_fit_before_any_container_starts(node, rb_config, tmp_path):
    """The job path had no memory verdict: a container whose GPU cannot hold its role could
    be started beside others before the trainer refused. Now every container is assessed,
    the memory model's verdict included, before any starts."""
    node.set_gpu(SNAP_CT, "ok", free_mib=143000)
    node.set_gpu(DIR_CT, "ok", free_mib=200)
    before = {ct: runs(rb_config, ct) for ct in (SNAP_CT, DIR_CT)}
    proc = launch_gpu(rb_config, tmp_path, "-c", f"rb:{SNAP_CT}", "-c", f"rb:{DIR_CT}",
                      "--target-gpus", f"rb:{SNAP_CT}=0", "--drafter-gpus", f"rb:{DIR_CT}=0")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert "nothing was started" in out
    memory = [line for line in out.splitlines() if line.strip().startswith(f"rb:{DIR_CT}: GPU 0")]
    assert memory and "short by" in memory[0], out
    assert {ct: runs(rb_config, ct) for ct in (SNAP_CT, DIR_CT)} == before
