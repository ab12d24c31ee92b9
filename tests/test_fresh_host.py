"""The README's main command on a host as it is after a fresh boot, not as CI left it.

CI's machine has run everything before: /run/sshd exists because some earlier sshd made
it, the node's state and the controller config are there. A freshly booted Debian machine
that just installed openssh-server without systemd has none of that, and `./scripts/demo.sh`
failed there (`Missing privilege separation directory: /run/sshd`) while every test passed.

These tests recreate the fresh state instead of trusting a green run: a new mount
namespace with an empty tmpfs on /run (what a boot gives: /run is a tmpfs), a node state
directory, HOME (so no ~/.config/dflash-ctl, no ~/.cache) and controller config that do not
exist yet. The one thing kept is the containers' rootfs cache (/var/cache/dflash-sim),
which CI keeps between runs by design (docs/sim.md); building it is the first step of any
cold `ctl sim up` and is exercised whenever its recipe changes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from sim import storage
from sim.layout import NodePaths

pytestmark = [
    pytest.mark.sim, pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("lxc-start") or not shutil.which("unshare"),
                       reason="needs root, LXC and util-linux (mount namespaces)"),
]

REPO = Path(__file__).resolve().parent.parent
NODE = "fresh"
CTIDS = "280,281"

# A boot gives an empty tmpfs on /run. Everything after that runs inside that namespace:
# sshd, the LXC monitors, the sim network namespace (/run/netns) and every ctl command.
FRESH_BOOT = 'mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /run && exec "$@"'


def _fresh_env(tmp_path: Path) -> dict:
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DFLASH_", "XDG_")) and k not in ("HOME",)}
    env.update(HOME=str(home), DFLASH_SIM_DIR=str(tmp_path / "state"),
               PATH=f"{REPO / '.venv/bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    return env


def _in_fresh_boot(script: str, env: dict, timeout: float, boot: str = FRESH_BOOT):
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", boot, "sh",
         "bash", "-c", script],
        cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)


def _nothing_left(state_root: Path) -> list[str]:
    """What a node under ``state_root`` left behind on the host: loop devices of its image,
    processes whose command line names its state directory (sshd, lxc monitors)."""
    paths = NodePaths(NODE, state_root / NODE)
    left = [f"loop device {d}" for d in storage.loop_devices(paths.btrfs_image)] if paths.btrfs_image.exists() else []
    return left + [f"process {pid}" for pid in _leftover_pids(state_root)]


def _leftover_pids(state_root: Path) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if pid.isdigit() and str(state_root) in cmd:
            pids.append(int(pid))
    return pids


@pytest.fixture
def fresh(tmp_path):
    """The fresh environment; afterwards, whatever a failing test left is taken down from
    inside the namespace that holds it, so one failure does not leak into the next run."""
    env = _fresh_env(tmp_path)
    yield env
    state_root = tmp_path / "state"
    for pid in _leftover_pids(state_root)[:1]:
        subprocess.run(["nsenter", f"--mount=/proc/{pid}/ns/mnt", "--", str(REPO / ".venv/bin/ctl"), "sim", "down",
                        "--name", NODE, "--purge"], env=env, cwd=REPO, capture_output=True, timeout=300)
    paths = NodePaths(NODE, state_root / NODE)
    if paths.btrfs_image.exists():
        for dev in storage.loop_devices(paths.btrfs_image):
            subprocess.run(["losetup", "-d", dev], check=False)


def test_demo_runs_on_a_freshly_booted_host_and_tells_the_story(tmp_path, fresh):
    """Both README steps a new user takes, on a host with no /run/sshd, no node state, no
    controller config — and the demo's story, checked step by step from its output: the good
    run becomes known good; the package upgrade is a new generation; the next launch is
    refused naming the package and both versions; after --accept-drift and a stop,
    kill-and-rollback changes that package back and verifies it; the resumed run continues
    from the checkpoint the rollback named to its last step; wandb wrote an offline run; the
    drafter comes out of the container."""
    env = fresh
    env.update(DFLASH_DEMO_NODE=NODE, DFLASH_DEMO_CTIDS=CTIDS, DFLASH_DEMO_OUT=str(tmp_path / "drafter"))
    script = (f'test ! -e /run/sshd || {{ echo "/run/sshd exists: not a fresh boot" >&2; exit 97; }}; '
              f'trap "ctl sim down --name {NODE} --purge" EXIT; scripts/demo.sh')
    proc = _in_fresh_boot(script, env, timeout=1500)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "sim node fresh up" in out
    assert (Path(env["HOME"]) / ".config/dflash-ctl/config.toml").exists(), "ctl sim up wrote no controller config"
    good = re.search(r"^ctl: run (\S+) completed; last checkpoint ", out, re.M)
    assert good, out[-3000:]
    # wandb logged the good run offline, in its run directory, and said how to upload it
    assert re.search(rf"^wandb: offline run in /workspace/runs/{good.group(1)}/wandb/offline-run-\S+; upload it "
                     rf"later with `wandb sync /workspace/runs/{good.group(1)}/wandb/offline-run-", out, re.M)
    assert re.search(r"generation (\w+) → (\w+) \(the old one is kept\)\n  ↑ numpy 2\.4\.5 → 2\.4\.6", out)
    assert (f"drift against the known-good baseline in container {CTIDS.split(',')[0]} on node {NODE}: "
            "package numpy: 2.4.5 → 2.4.6") in out and "(exit 3: refused, nothing was started)" in out
    stopped = re.search(r"^stopped   run (\S+): ended stopped \(stopped on request\); processes left: none", out, re.M)
    assert stopped, out[-3000:]
    rolled = re.search(rf"^rolled back to env:(\w+) \(the env of known-good run {good.group(1)}\)", out, re.M)
    assert rolled and re.search(rf"^verified  venv fingerprint {rolled.group(1)} == target {rolled.group(1)}  \[OK\]",
                                out, re.M)
    assert "↓ numpy 2.4.6 → 2.4.5" in out.split("rolled back to env:")[1]
    resume = re.search(r"^resume from checkpoint (\S+/step_(\d+)/checkpoint\.pt) \(step (\d+)\)", out, re.M)
    assert resume and resume.group(2) == resume.group(3) and int(resume.group(2)) > 0
    assert stopped.group(1) in resume.group(1)
    after = out.split("=== 9. ")[1]
    assert re.search(rf"--resume-from {re.escape(resume.group(1))} .*--set max-steps=400", after)
    assert re.search(rf"^training: .*steps {resume.group(2)}→", after, re.M), after[:3000]
    assert re.search(r"^ctl: run \S+ completed; last checkpoint \S+/step_400/checkpoint\.pt", after, re.M)
    exported = tmp_path / "drafter"
    assert {p.name for p in exported.iterdir()} == {"config.json", "dflash_eval.json", "model.safetensors", "modeling_dflash.py", "README.md"}
    assert _nothing_left(tmp_path / "state") == []


def test_failed_bring_up_leaves_nothing_running_or_mounted(tmp_path, fresh):
    """A bring-up that fails after it mounted the storage and started the containers (here:
    /run is read-only, so sshd's privilege-separation directory cannot be made) stops what
    it started and says why in one line."""
    env = fresh
    # /run read-only except where LXC and `ip netns` keep their state, so the failure comes
    # late: storage mounted, network made, containers started, then sshd cannot start.
    boot = ('mount -t tmpfs -o mode=0755 tmpfs /run && mkdir /run/lxc /run/netns && '
            'mount -t tmpfs tmpfs /run/lxc && mount -t tmpfs tmpfs /run/netns && '
            'mount -o remount,ro /run && exec "$@"')
    script = (f'ctl sim up --name {NODE} --ctids {CTIDS} --no-tiny; rc=$?; '
              f'echo "up exit $rc"; '
              f'ls /run; '
              f'ctl sim status --name {NODE} --json; exit $rc')
    proc = _in_fresh_boot(script, env, timeout=900, boot=boot)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "/run/sshd" in errors[0], out[-3000:]
    assert '"btrfs_mounted": false' in out, out[-3000:]
    assert '"running": false' in out, out[-3000:]
    assert '"state": "running"' not in out, out[-3000:]
    assert _nothing_left(tmp_path / "state") == []
