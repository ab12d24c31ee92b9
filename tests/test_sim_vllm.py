"""What the simulated node mounts so its containers have the host's vLLM venv (sim/vllm.py): the
venv at /opt/vllm, and the interpreter it was made from where the container has none of its
own — on venvs made by `python3 -m venv`, against container roots with and without that python.

The engine serving inside a container: tests/test_served_check_vllm_sim.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sim import vllm

SYSTEM_PYTHON = Path("/usr/bin/python3.11")  # bookworm's, as on the containers and CI's host


def make_venv(python: str, where: Path) -> Path:
    subprocess.run([python, "-m", "venv", "--without-pip", str(where)], check=True, capture_output=True, timeout=120)
    return where


def container_root(tmp_path: Path, *files: str) -> Path:
    root = tmp_path / "rootfs"
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("")
    root.mkdir(exist_ok=True)
    return root


@pytest.mark.skipif(not SYSTEM_PYTHON.exists(), reason="needs Debian's python3.11 (every bookworm host has it)")
def test_a_venv_of_the_system_python_runs_on_the_containers_own(tmp_path):
    venv = make_venv(str(SYSTEM_PYTHON), tmp_path / "venv")
    plan = vllm.plan(container_root(tmp_path, "usr/bin/python3.11"), venv)
    assert plan.reason is None and plan.mounts == [(venv.resolve(), "/opt/vllm")]
    # a container without that python gets nothing, and the node says why
    plan = vllm.plan(container_root(tmp_path / "other", "usr/bin/python3.13"), venv)
    assert plan.mounts == [] and "system python 3.11, which the container lacks" in plan.reason


def test_a_venv_of_an_interpreter_elsewhere_brings_its_prefix_at_the_same_path(tmp_path):
    # an interpreter under a prefix of its own (a pyenv or /opt build): a copy of this venv's base
    prefix = tmp_path / "pythons" / "3.11.9"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "python3.11").symlink_to(Path(subprocess.check_output(
        ["python3", "-c", "import sys, os; print(os.path.realpath(sys._base_executable))"], text=True).strip()))
    venv = make_venv(str(prefix / "bin" / "python3.11"), tmp_path / "venv")
    root = container_root(tmp_path)
    plan = vllm.plan(root, venv)
    assert plan.reason is None and plan.mounts == [(venv.resolve(), "/opt/vllm"), (prefix.resolve(), str(prefix.resolve()))]
    assert vllm.lxc_lines(root, venv) == [
        f"lxc.mount.entry = {venv.resolve()} opt/vllm none bind,ro,optional,create=dir 0 0",
        f"lxc.mount.entry = {prefix.resolve()} {str(prefix.resolve()).lstrip('/')} none bind,ro,optional,create=dir 0 0"]
    # LXC's create=dir makes only the last directory: in a fresh rootfs the prefix's mount point
    # (several levels deep) must exist before the container starts, or the optional mount is skipped
    assert (root / "opt" / "vllm").is_dir() and (root / str(prefix.resolve()).lstrip("/")).is_dir()


def test_a_prefix_over_the_containers_own_files_is_never_mounted(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to("/usr/local/bin/python3.11")
    (venv / "pyvenv.cfg").write_text("home = /usr/local/bin\nversion = 3.11.9\n")
    plan = vllm.plan(container_root(tmp_path), venv)
    assert plan.mounts == [] and "under /usr/local, which cannot be mounted over the container's own" in plan.reason


def test_no_venv_on_the_host_mounts_nothing(tmp_path):
    root = container_root(tmp_path)
    assert vllm.lxc_lines(root, tmp_path / "absent") == []
    assert "scripts/setup.sh builds it" in vllm.plan(root, tmp_path / "absent").reason


@pytest.mark.sim
def test_a_container_restarted_by_pct_start_over_ssh_still_runs_the_engine(sim_node):
    # `pct start` over the node's SSH resolves the container's mounts in sshd's namespace, where
    # the node's home hides the host's /root: a venv made from a pyenv python under /root lost
    # its interpreter there (the bind failed, `optional` hid it) until Node.kept_under_root.
    from _multi_sim import attach, over_ssh

    if not (vllm.HOST_VENV / "pyvenv.cfg").is_file():
        pytest.fail(f"{vllm.HOST_VENV} missing: run scripts/setup.sh (it builds .venv-vllm/)")
    over_ssh(sim_node, ["pct", "stop", "200"], ["pct", "start", "200"])
    out = attach(sim_node, 200, vllm.PYTHON_IN_CT, "-c", "import sys; print(sys.prefix)").stdout
    assert out.strip() == vllm.IN_CT
