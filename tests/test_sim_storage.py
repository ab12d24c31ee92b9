"""The simulated node's btrfs storage leaves nothing in the kernel when it is released, even
when another mount namespace still holds a copy of its mount.

That is the normal case with several nodes on one machine: each node's sshd runs in a
private mount namespace copied from the host's, so it holds every storage mounted at the
time it started — another node's included. CI at e8f54f7 failed this way at session teardown
(``sim2`` and ``rb`` loop devices held by the ``sim`` node's sshd namespace).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from sim import storage
from sim.proc import wait_until

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("mkfs.btrfs") or not shutil.which("unshare"),
    reason="needs root, btrfs-progs and util-linux (loop mounts, mount namespaces)")


def _holds(pid: int, mountpoint) -> bool:
    try:
        with open(f"/proc/{pid}/mounts") as f:
            return any(line.split()[1] == str(mountpoint) for line in f)
    except OSError:
        return False


def test_release_detaches_the_loop_device_another_namespace_still_holds(tmp_path, monkeypatch):
    # Short wait: without the fix this test fails after it, not after the production 30 s.
    monkeypatch.setattr(storage, "LOOP_RELEASE_S", 3.0)
    image, mnt = tmp_path / "btrfs.img", tmp_path / "mnt"
    storage.ensure_btrfs(image, mnt)
    # Like another node's sshd: a private mount namespace copied while the storage is mounted.
    holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--",
                               "sleep", "600"], stdin=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: _holds(holder.pid, mnt), 10), "the holder never saw the mount"
        storage.release_btrfs(image, mnt)
        assert storage.loop_devices(image) == []
        assert storage.mount_source(mnt) is None
        assert not _holds(holder.pid, mnt)
        assert holder.poll() is None, "release must not kill processes it does not own"
    finally:
        holder.kill()
        holder.wait()
        for dev in storage.loop_devices(image):
            subprocess.run(["losetup", "-d", dev], check=False)


def test_release_of_storage_that_is_not_mounted_is_a_no_op(tmp_path):
    image, mnt = tmp_path / "btrfs.img", tmp_path / "mnt"
    storage.release_btrfs(image, mnt)
    assert not image.exists()
