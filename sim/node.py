"""A simulated Proxmox node: sshd on 127.0.0.1 + real LXC containers + a `pct` emulation.

    node = SimNode("sim")          # containers 200 (btrfs, snapshots) and 201 (dir, none)
    info = node.up()               # idempotent; the first call on a machine builds the cache
    node.node_config()             # host/port/user/identity_file/known_hosts/containers
    node.status(); node.down()     # down: nothing left running, mounted or attached

A second node (e.g. ``SimNode("sim2")``, containers 300/301) gets its own state directory,
sshd port, keys and LXC path, and shares the rootfs cache. Standard library only.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Sequence

from agent.protocol import atomic_write
from sim import ctsetup, lxc, net, rootfs, storage
from sim.layout import BTRFS_STORAGE, DIR_STORAGE, NodePaths
from sim.proc import Progress, SimError, is_root, quiet, require_tools, run
from sim.sshd import Sshd, free_port, port_free

# Container ids per well-known node name: the first on snapshot-capable storage, the second
# on plain directory storage. Other names pass ctids explicitly.
DEFAULT_CTIDS = {"sim": (200, 201), "sim2": (300, 301)}
VENV = rootfs.RECIPE["venv"]
WORKSPACE = rootfs.RECIPE["workspace"]
PCT_SOURCE = Path(__file__).with_name("pct.py")

HOST_TOOLS = ["lxc-start", "lxc-attach", "lxc-stop", "lxc-wait", "lxc-info", "lxc-freeze", "debootstrap",
              "mkfs.btrfs", "btrfs", "sshd", "ssh-keygen", "unshare", "losetup", "mount", "umount", "ip", "nsenter"]

PVE_CONF = """\
arch: amd64
cores: 2
hostname: {hostname}
memory: 4096
ostype: debian
rootfs: {storage}:{ctid}/subvol-{ctid}-disk-0,size=8G
swap: 512
lxc.apparmor.profile: unconfined
lxc.net.0.type: empty
"""


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode("utf-8", "replace").split("\0")
    except OSError:
        return []


class SimNode:
    """One simulated node, addressed by name; every path and port derives from the name."""

    def __init__(self, name: str = "sim", ctids: Optional[Sequence[int]] = None):
        self.name = name
        self.paths = NodePaths.for_node(name)
        recorded = self._read_state().get("ctids")
        chosen = ctids or recorded or DEFAULT_CTIDS.get(name)
        if not chosen or len(chosen) != 2:
            raise ValueError(f"sim node {name!r}: pass ctids=(snapshot_ctid, dir_ctid), "
                             f"e.g. SimNode({name!r}, ctids=(400, 401))")
        self.ctids = tuple(int(c) for c in chosen)
        self.storage_of = {self.ctids[0]: BTRFS_STORAGE, self.ctids[1]: DIR_STORAGE}
        self.sshd = Sshd(self.paths)

    # --- public API ----------------------------------------------------------------------
    def up(self, progress: Progress = quiet) -> dict:
        """Bring the node up (or leave it up). Returns node_config() plus timing facts."""
        self._preflight()
        started = time.monotonic()
        cold = not rootfs.rootfs_path().is_dir()
        with self._lock():
            try:
                port = self._up_locked(progress)
            except (SimError, OSError) as exc:
                # A half-up node is worse than none: containers running and storage mounted
                # with no sshd to reach them. Stop everything, then say why.
                progress(f"bring-up failed; stopping what it started on node {self.name}")
                self._down_locked(progress)
                message = str(exc) if isinstance(exc, SimError) else f"sim node {self.name}: {exc}"
                raise SimError(f"{message} (nothing was left running or mounted)") from None
        info = self.node_config()
        info.update(name=self.name, cold=cold, seconds=round(time.monotonic() - started, 1))
        progress(f"sim node {self.name} is up: ssh -p {port} -i {info['identity_file']} root@127.0.0.1 "
                 f"({info['seconds']} s)")
        return info

    def _up_locked(self, progress: Progress) -> int:
        cache = rootfs.ensure_rootfs(progress)
        state = self._read_state()
        for d in (self.paths.bin, self.paths.lxcpath, self.paths.pve_lxc, self.paths.log,
                  self.paths.dir_storage):
            d.mkdir(parents=True, exist_ok=True)
        was_mounted = storage.mount_source(self.paths.btrfs_mount) is not None
        storage.ensure_btrfs(self.paths.btrfs_image, self.paths.btrfs_mount, progress)
        net.ensure_network()  # the containers' bridge (sim/net.py)
        ctsetup.ensure_scripts()  # /etc/hosts, /etc/hostname and the init at every start
        containers = state.get("containers", {})
        for ctid in self.ctids:
            containers[str(ctid)] = self._ensure_container(ctid, cache, containers.get(str(ctid), {}), progress)
        port = state.get("port")
        if not port or (self.sshd.pid() is None and not port_free(port)):
            port = free_port()
        state.update(self._state_doc(port, containers))
        atomic_write(str(self.paths.node_json), json.dumps(state, indent=1, sort_keys=True) + "\n")
        atomic_write(str(self.paths.pct), PCT_SOURCE.read_text(), mode=0o755)
        if not was_mounted and self.sshd.pid():
            # sshd's private mount namespace was copied before the storage was mounted.
            self.sshd.stop()
        self.sshd.prepare(port)
        self.sshd.start(port)
        if self.sshd.pid():
            net.expose_to(self.sshd.pid())
        return port

    def down(self, purge: bool = False, progress: Progress = quiet) -> None:
        """Stop containers and sshd, unmount the storage, detach its loop device. With
        ``purge``, also delete the node's state (containers, snapshots, keys); the rootfs
        cache always stays."""
        if not self.paths.root.exists():
            return
        self._preflight()
        with self._lock():
            self._down_locked(progress)
            if purge:
                progress(f"removing {self.paths.root}")
                shutil.rmtree(self.paths.root)

    def _down_locked(self, progress: Progress) -> None:
        for ctid in self.ctids:
            if lxc.running(self.paths.lxcpath, str(ctid)):
                progress(f"stopping container {ctid}")
            lxc.stop(self.paths.lxcpath, str(ctid))
        if self.sshd.pid():
            progress("stopping sshd")
        self.sshd.stop()
        storage.release_btrfs(self.paths.btrfs_image, self.paths.btrfs_mount)

    def status(self) -> dict:
        state = self._read_state()
        port = state.get("port")
        pid = self.sshd.pid()
        containers = {}
        for ctid in self.ctids:
            name = str(ctid)
            conf = self.paths.pve_conf(ctid)
            snaps = []
            if conf.exists():
                snaps = [line.strip()[1:-1] for line in conf.read_text().splitlines()
                         if line.startswith("[") and line.strip().endswith("]")]
            containers[name] = {
                "state": lxc.state(self.paths.lxcpath, name).lower() if self.paths.lxcpath.exists() else "missing",
                "storage": self.storage_of[ctid],
                "snapshots": snaps,
                "address": (state.get("containers", {}).get(name) or {}).get("address"),
            }
        return {
            "name": self.name,
            "state_dir": str(self.paths.root),
            "sshd": {"running": pid is not None, "pid": pid, "port": port},
            "storage": {"btrfs_mounted": storage.mount_source(self.paths.btrfs_mount) is not None,
                        "loop_devices": storage.loop_devices(self.paths.btrfs_image)
                        if self.paths.btrfs_image.exists() else []},
            "containers": containers,
        }

    def is_up(self) -> bool:
        st = self.status()
        return st["sshd"]["running"] and all(c["state"] == "running" for c in st["containers"].values())

    def node_config(self) -> dict:
        """The node's entry for the controller config, as plain data (no controller import)."""
        return {
            "host": "127.0.0.1",
            "port": self._read_state().get("port"),
            "user": "root",
            "identity_file": str(self.sshd.client_key),
            "known_hosts": str(self.sshd.known_hosts),
            "containers": {str(c): {"venv": VENV, "workspace": WORKSPACE} for c in self.ctids},
        }

    # --- internals -----------------------------------------------------------------------
    def _preflight(self) -> None:
        if not is_root():
            raise SimError("the simulated node needs root (LXC containers, loop mounts, sshd): "
                           "run as root, e.g. `sudo ctl sim up`")
        require_tools(HOST_TOOLS)

    @contextmanager
    def _lock(self):
        self.paths.root.mkdir(parents=True, exist_ok=True)
        with open(self.paths.lock, "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _read_state(self) -> dict:
        try:
            return json.loads(self.paths.node_json.read_text())
        except (OSError, ValueError):
            return {}

    def _state_doc(self, port: int, containers: dict) -> dict:
        p = self.paths
        return {
            "name": self.name,
            "port": port,
            "ctids": list(self.ctids),
            "lxcpath": str(p.lxcpath),
            "pve_lxc": str(p.pve_lxc),
            "log": str(p.log),
            "storages": {BTRFS_STORAGE: {"type": "btrfs", "path": str(p.btrfs_mount)},
                         DIR_STORAGE: {"type": "dir", "path": str(p.dir_storage)}},
            "containers": containers,
        }

    def _ensure_container(self, ctid: int, cache: Path, record: dict, progress: Progress) -> dict:
        name = str(ctid)
        where = self.storage_of[ctid]
        root = self.paths.rootfs(ctid, where)
        key = cache.name
        if not root.is_dir() or record.get("rootfs") != key:
            self._create_rootfs(ctid, where, root, cache, progress)
            self.paths.pve_conf(ctid).unlink(missing_ok=True)  # its snapshots went with the old rootfs
        address = net.address_of(self.name, ctid)
        hostname = f"{self.name}-ct{ctid}"
        lxc.write_config(self.paths.lxcpath, name, rootfs=root, hostname=hostname, init=ctsetup.INIT_IN_CT,
                         extra=[net.hook_line(address), *ctsetup.config_lines(root, hostname, address)])
        conf = self.paths.pve_conf(ctid)
        if not conf.exists():
            atomic_write(str(conf), PVE_CONF.format(hostname=hostname, storage=where, ctid=ctid))
        pid = lxc.init_pid(self.paths.lxcpath, name) if lxc.running(self.paths.lxcpath, name) else None
        if pid and ctsetup.INIT_IN_CT not in " ".join(_cmdline(pid)):
            # started by an older sim with `sleep` as PID 1, which never reaps: restart it under
            # the reaping init (its files stay; what ran in it was the last session's)
            progress(f"restarting container {ctid} under the sim's init")
            lxc.stop(self.paths.lxcpath, name)
            pid = None
        if pid is None:
            progress(f"starting container {ctid}")
            lxc.start(self.paths.lxcpath, name, logfile=self.paths.log / f"lxc-{ctid}.log")
        else:
            ctsetup.apply_now(root, hostname, address)  # the hook ran at its start; bring it up to date
        pid = lxc.init_pid(self.paths.lxcpath, name)
        if pid and not net.has_link(pid):  # started before the sim had a network
            progress(f"attaching container {ctid} to the sim network as {address}")
            net.attach_running(pid, address)
        return {"rootfs": key, "storage": where, "address": address}

    def _create_rootfs(self, ctid: int, where: str, root: Path, cache: Path, progress: Progress) -> None:
        progress(f"creating container {ctid} on {where} storage from the cached rootfs")
        lxc.stop(self.paths.lxcpath, str(ctid))
        root.parent.mkdir(parents=True, exist_ok=True)
        # Remove the old rootfs and its snapshots (subvol-N-disk-0@snap).
        for old in sorted(root.parent.glob(f"{root.name}*")):
            if where == BTRFS_STORAGE and storage.is_subvolume(old):
                storage.delete_subvolume(old)
            else:
                shutil.rmtree(old)
        # Copy to a temp name and rename, so an interrupted copy is never taken for a rootfs.
        tmp = root.with_name(root.name + ".tmp")
        if where == BTRFS_STORAGE:
            storage.create_subvolume(tmp)
        else:
            tmp.mkdir()
        run(["cp", "-a", f"{cache}/.", tmp], what=f"copy of the rootfs for container {ctid}", timeout=900)
        tmp.rename(root)
