"""The Proxmox versions operators run: the sim's pct as PVE 7.4, 8.1, 8.2 and 9.1 behave
(sim/pct.py: PVE_RELEASES; docs/sim.md cites the pve-container commit of each difference),
and ctl's exec, launch, tail, status and kill-and-rollback on each.

The bug this guards: a node whose pct predates pve-container 5.0.9 (PVE 8.1 and older) has no
`--keep-env`, and every ctl command failed there with `Unknown option: keep-env`. The node now
decides in the command's own session (controller/pct.py: dpkg's pve-container, then the
option or not); the container process's environment is the same `env -i` one on every version.

These run on the rollback tests' own node (tests/_rollback_node.py: `rb`, container 260),
whose pct release each test sets and which the module puts back to the default at its end.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from _rollback_node import (  # noqa: F401 (fixtures)
    SNAP_CT, Handle, ctl, ctl_popen, rb_config, rb_node, reset_to_pristine, started_run, tiny_config,
)
from sim.pct import DEFAULT_PVE, PVE_RELEASES

pytestmark = [pytest.mark.sim, pytest.mark.slow]

CT = str(SNAP_CT)
OLD = ("7.4", "8.1")  # pve-container < 5.0.9: no --keep-env


@pytest.fixture(scope="module")
def node(rb_node, rb_config):
    reset_to_pristine(rb_config)
    assert ctl(rb_config, "env", "adopt", "--container", CT).returncode == 0
    yield rb_node
    rb_node.set_pve(DEFAULT_PVE)


def pct_calls(node) -> list[dict]:
    path = Path(node.paths.log) / "pct-calls.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("pve", list(PVE_RELEASES))
def test_pct_surface_follows_the_release(node, rb_config, pve):
    node.set_pve(pve)
    h = Handle(rb_config, SNAP_CT)
    try:
        version = h.runner.run([str(node.paths.bin / "pveversion")]).stdout
        assert version.startswith(f"pve-manager/{PVE_RELEASES[pve]['manager']}/")
        keep = h.pct("exec", CT, "--keep-env", "0", "--", "true")
        help_text = h.pct("help", "exec").stdout
        stop_help = h.pct("help", "stop").stdout
    finally:
        h.close()
    if pve in OLD:
        assert keep.returncode == 255
        assert keep.stderr.splitlines()[:2] == ["Unknown option: keep-env", "400 unable to parse option"]
        assert "keep-env" not in help_text and "overrule-shutdown" not in stop_help
    else:
        assert keep.ok, keep.stderr
        assert "--keep-env <boolean>   (default = 1)" in help_text and "overrule-shutdown" in stop_help


def test_the_container_environment_is_identical_on_every_release(node, rb_config):
    seen = {}
    for pve in PVE_RELEASES:
        node.set_pve(pve)
        before = len(pct_calls(node))
        # cat's own environment, read by the kernel: no shell in between to add PWD or SHLVL
        proc = ctl(rb_config, "exec", "--container", CT, "--", "cat", "/proc/self/environ")
        assert proc.returncode == 0, proc.stderr
        seen[pve] = proc.stdout
        calls = pct_calls(node)[before:]
        # One pct call: the release was learned from the pve-container package (dpkg-query,
        # no Perl start), and the exec built for it.
        assert [c["argv"][:2] for c in calls] == [["exec", CT]], calls
        assert (calls[0]["argv"][2] == "--keep-env") == (pve not in OLD), calls
    first = seen[next(iter(seen))]
    assert first.split("\0") == ["PATH=/root/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                                  "HOME=/root", "LANG=C.UTF-8", ""]
    assert all(out == first for out in seen.values()), seen


def sessions(node) -> list[str]:
    """The SSH sessions run on the node, one line each (its login shell logs them: sim/sshd.py)."""
    path = Path(node.paths.log) / "ssh-sessions.log"
    return path.read_text().splitlines() if path.exists() else []


def test_a_node_upgraded_or_downgraded_between_two_commands_gets_its_own_pct_exec_at_once(node, rb_config):
    """What an operator meets: the node's Proxmox changes between two ctl commands (an upgrade,
    or pve-container rolled back). The next command runs the `pct exec` that release takes, at
    once: one SSH session, one pct call, nothing asked first and nothing retried, the same
    container environment — there is no remembered answer to go stale (controller/pct.py)."""
    for pve in ("9.1", "7.4", "8.2", "8.1", "9.1"):  # down, up, down, up
        node.set_pve(pve)
        before_sessions, before_calls = len(sessions(node)), len(pct_calls(node))
        proc = ctl(rb_config, "exec", "--container", CT, "--", "cat", "/proc/self/environ")
        assert proc.returncode == 0, (pve, proc.stderr)
        assert proc.stdout.split("\0")[:3] == [
            "PATH=/root/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root",
            "LANG=C.UTF-8"], (pve, proc.stdout)
        keep = ["--keep-env"] if pve not in OLD else ["--"]
        assert [c["argv"] for c in pct_calls(node)[before_calls:]] == [["exec", CT, *keep]], pve
        assert len(sessions(node)[before_sessions:]) == 1, (pve, sessions(node)[before_sessions:])


@pytest.mark.parametrize("pve", list(PVE_RELEASES))
def test_launch_tail_status_and_kill_and_rollback_on_each_release(node, rb_config, tmp_path, pve):
    node.set_pve(pve)
    good = ctl(rb_config, "launch", "--container", CT, "--config", str(tiny_config(tmp_path, max_steps=4)),
               "--from-scratch", "--follow")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "completed" in good.stdout
    long = ctl(rb_config, "launch", "--container", CT, "--config",
               str(tiny_config(tmp_path, max_steps=100000, save_interval=3)), "--from-scratch")
    assert long.returncode == 0, long.stdout + long.stderr
    run_id = started_run(long.stdout)
    follow = ctl_popen(rb_config, "tail", "--container", CT, "--run", run_id, "--follow")
    try:
        lines = []
        for line in follow.stdout:  # until the run has trained a step, then detach as Ctrl-C does
            lines.append(line)
            if line.startswith("step "):
                break
        follow.send_signal(signal.SIGINT)
        rest, err = follow.communicate(timeout=60)
    finally:
        follow.kill()
    assert any(line.startswith("step ") for line in lines), "".join(lines) + err
    assert "detached" in err, err
    status = ctl(rb_config, "status", "--container", CT, "--run", run_id)
    assert status.returncode == 0 and run_id in status.stdout, status.stdout + status.stderr
    assert "running" in status.stdout
    rolled = ctl(rb_config, "kill-and-rollback", "--container", CT, "--run", run_id, "--grace", "30", "--yes")
    out = rolled.stdout + rolled.stderr
    assert rolled.returncode == 0, out
    assert "--resume-from" in out, out


@pytest.mark.parametrize("pve", list(PVE_RELEASES))
def test_a_pct_not_installed_as_a_package_runs_without_keep_env(node, pve):
    """No pve-container in dpkg's records (this machine's own, outside the sim's sshd): the
    form every pct accepts is the one run — no --keep-env, one pct call, nothing asked first —
    and env -i gives the container process the same environment."""
    from controller.config import ContainerConfig, NodeConfig
    from controller.container import Container
    from controller.transport import LocalRunner

    node.set_pve(pve)
    local = NodeConfig(host="localhost", transport="local", pct=str(node.paths.pct),
                       containers={CT: ContainerConfig()})
    before = len(pct_calls(node))
    result = Container(LocalRunner(), "local", local, CT).exec(["cat", "/proc/self/environ"], check=True)
    assert result.stdout.split("\0") == [
        "PATH=/root/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root",
        "LANG=C.UTF-8", ""]
    assert [c["argv"] for c in pct_calls(node)[before:]] == [["exec", CT, "--"]]
