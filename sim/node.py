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
from sim import bastion as bastion_mod
from sim import ctsetup, gpu, lxc, net, rootfs, storage, users, vllm
from sim.layout import BTRFS_STORAGE, DIR_STORAGE, NodePaths
from sim.pct import DEFAULT_PVE, PVE_RELEASES
from sim.proc import Progress, SimError, is_root, quiet, require_tools, run
from sim.sshd import Sshd, free_port, port_free

# Container ids per well-known node name: the first on snapshot-capable storage, the second
# on plain directory storage. Other names pass ctids explicitly.
DEFAULT_CTIDS = {"sim": (200, 201), "sim2": (300, 301)}
VENV = rootfs.RECIPE["venv"]
WORKSPACE = rootfs.RECIPE["workspace"]
PCT_SOURCE = Path(__file__).with_name("pct.py")
KERNLOG_SOURCE = Path(__file__).with_name("kernlog.py")  # the node's journalctl and dmesg

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

    def __init__(self, name: str = "sim", ctids: Optional[Sequence[int]] = None, pve: Optional[str] = None):
        self.name = name
        self.paths = NodePaths.for_node(name)
        recorded = self._read_state().get("ctids")
        chosen = ctids or recorded or DEFAULT_CTIDS.get(name)
        if not chosen or len(chosen) != 2:
            raise ValueError(f"sim node {name!r}: pass ctids=(snapshot_ctid, dir_ctid), "
                             f"e.g. SimNode({name!r}, ctids=(400, 401))")
        self.ctids = tuple(int(c) for c in chosen)
        if pve is not None and pve not in PVE_RELEASES:
            raise ValueError(f"--pve {pve}: the sim emulates Proxmox VE {', '.join(PVE_RELEASES)}")
        # The release its pct behaves as: as asked, else as recorded, else the newest.
        self.pve = pve or self._read_state().get("pve") or DEFAULT_PVE
        self.storage_of = {self.ctids[0]: BTRFS_STORAGE, self.ctids[1]: DIR_STORAGE}
        self.sshd = Sshd(self.paths)
        self.bastion = bastion_mod.bastion(self.paths)

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
        engine = vllm.plan(cache)
        progress(f"containers get vLLM at {vllm.IN_CT} (read-only, from {vllm.HOST_VENV})" if not engine.reason
                 else f"containers get no vLLM: {engine.reason}")
        containers = state.get("containers", {})
        for ctid in self.ctids:
            containers[str(ctid)] = self._ensure_container(ctid, cache, containers.get(str(ctid), {}), progress)
        port = state.get("port")
        if not port or (self.sshd.pid() is None and not port_free(port)):
            port = free_port()
        bport = state.get("bastion_port")
        if not bport or bport == port or (self.bastion.pid() is None and not port_free(bport)):
            bport = free_port()
        state.update(self._state_doc(port, containers), bastion_port=bport)
        atomic_write(str(self.paths.node_json), json.dumps(state, indent=1, sort_keys=True) + "\n")
        atomic_write(str(self.paths.pct), PCT_SOURCE.read_text(), mode=0o755)
        atomic_write(str(self.paths.bin / "pveversion"), PCT_SOURCE.read_text(), mode=0o755)
        for tool in ("journalctl", "dmesg"):
            atomic_write(str(self.paths.bin / tool), KERNLOG_SOURCE.read_text(), mode=0o755)
        if not was_mounted and self.sshd.pid():
            # sshd's private mount namespace was copied before the storage was mounted.
            self.sshd.stop()
        self.sshd.ensure_keys()  # the client key the users' files need
        accounts = users.write(self.paths, Path(f"{self.sshd.client_key}.pub").read_text(), self.sshd.bashrc())
        binds = (*accounts.binds, self._dpkg_status())
        self.sshd.prepare(port, (*binds, *self.kept_under_root(engine.mounts)))
        self.sshd.start(port)
        if self.sshd.pid():
            net.expose_to(self.sshd.pid())
        self.bastion.prepare(bport, (*binds, bastion_mod.hosts_file(self.paths)))
        self.bastion.start(bport)
        atomic_write(str(self.paths.ssh / "known_hosts_via_bastion"),
                     self.bastion.known_hosts_line("127.0.0.1", bport)
                     + self.sshd.known_hosts_line(bastion_mod.internal_name(self.name), port), mode=0o644)
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
        self.bastion.stop()
        storage.release_btrfs(self.paths.btrfs_image, self.paths.btrfs_mount)

    def kept_under_root(self, mounts) -> tuple[tuple[str, str], ...]:
        """Binds that keep host paths under /root visible in sshd's namespace, where the node's
        home hides the host's /root. A container's mounts are resolved by whoever starts it, and
        `pct start` over SSH runs in that namespace: a vLLM venv made from a pyenv python
        (/root/.pyenv/versions/X) failed to mount there, and ``optional`` hid it. Each path is
        bound at the same place inside the node's home, which then goes over /root with it."""
        keep = []
        for host, _ in mounts:
            if host.is_relative_to("/root"):
                inside = self.paths.home / host.relative_to("/root")
                inside.mkdir(parents=True, exist_ok=True)
                keep.append((str(host), str(inside)))
        return tuple(keep)

    def _dpkg_status(self) -> tuple[str, str]:
        """dpkg's status file as the node's sessions see it: the host's, plus the
        pve-container (and pve-manager) of the emulated release, so `dpkg-query -W
        pve-container` answers as on a Proxmox node. Rewritten in place: it is bind-mounted."""
        rel = PVE_RELEASES[self.pve]
        stanzas = "".join(
            f"Package: {pkg}\nStatus: install ok installed\nPriority: optional\nSection: admin\n"
            f"Maintainer: Proxmox Support Team <support@proxmox.com>\nArchitecture: all\nVersion: {ver}\n"
            f"Description: {pkg} (dflash-ctl's simulated node)\n\n"
            for pkg, ver in (("pve-container", rel["container"]), ("pve-manager", rel["manager"])))
        host = Path("/var/lib/dpkg/status").read_text() if Path("/var/lib/dpkg/status").exists() else ""
        host = "\n\n".join(st for st in host.split("\n\n") if not st.startswith(("Package: pve-container\n",
                                                                                  "Package: pve-manager\n")))
        target = self.paths.root / "etc" / "dpkg-status"
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "w") as fh:
            fh.write(host.rstrip("\n") + "\n\n" + stanzas)
        return str(target), "/var/lib/dpkg/status"

    def set_pve(self, version: str) -> None:
        """Make the node's pct (and pveversion) behave as Proxmox VE ``version`` from the next
        call on; the containers and everything else stay as they are."""
        if version not in PVE_RELEASES:
            raise ValueError(f"the sim emulates Proxmox VE {', '.join(PVE_RELEASES)}, not {version}")
        with self._lock():
            state = self._read_state()
            state["pve"] = self.pve = version
            atomic_write(str(self.paths.node_json), json.dumps(state, indent=1, sort_keys=True) + "\n")
            self._dpkg_status()

    def set_gpu(self, ctid: int, state: str, gpus: int = 1, free_mib: int = 143000,
                progress: Progress = quiet) -> None:
        """Present GPU state ``state`` (sim/gpu.py: STATES) in container ``ctid``: its LXC and
        Proxmox config, its nvidia-smi and libraries, the node's nvidia-smi; then restart it,
        as a passthrough change on Proxmox needs."""
        if ctid not in self.ctids:
            raise ValueError(f"container {ctid} is not on sim node {self.name} ({', '.join(map(str, self.ctids))})")
        from sim.pct import parse_conf, render_conf

        with self._lock():
            gpu.write_state(self.paths.root, ctid, state, gpus, free_mib)
            _, pve_lines = gpu.lxc_lines(self.paths.root, ctid)
            conf_path = self.paths.pve_conf(ctid)
            conf = parse_conf(conf_path.read_text())
            conf["lxc"] = [(k, v) for k, v in conf["lxc"]
                           if not (k.startswith("lxc.cgroup2.devices") or (k == "lxc.mount.entry" and "nvidia" in v))]
            conf["lxc"] += [tuple(x.strip() for x in line.split(":", 1)) for line in pve_lines]
            atomic_write(str(conf_path), render_conf(conf))
            progress(f"container {ctid}: GPU state {state}; restarting it")
            lxc.stop(self.paths.lxcpath, str(ctid))
            record = self._read_state().get("containers", {}).get(str(ctid), {})
            root = self.paths.rootfs(ctid, self.storage_of[ctid])
            gpu.install(self.paths.root, ctid, root, self.paths.bin)
            self._ensure_container(ctid, rootfs.rootfs_path(), record, progress)

    def set_gpu_health(self, ctid: int, index: int, condition: str) -> None:
        """GPU ``index`` of container ``ctid`` (and of the node) reports ``condition``
        (sim/gpu.py: HEALTH) from the next nvidia-smi call on; nothing restarts."""
        if ctid not in self.ctids:
            raise ValueError(f"container {ctid} is not on sim node {self.name} ({', '.join(map(str, self.ctids))})")
        with self._lock():
            gpu.write_health(self.paths.root, ctid, index, condition)
            gpu.install(self.paths.root, ctid, self.paths.rootfs(ctid, self.storage_of[ctid]), self.paths.bin)

    def kernel_log(self, *messages: str, ts: Optional[float] = None, priority: int = 3) -> float:
        """Append ``messages`` to the node's kernel log, as the kernel would have printed them
        at ``ts`` (default now), each a microsecond after the one before; the node's own
        ``journalctl -k`` and ``dmesg`` show them (sim/kernlog.py). Returns the first one's time."""
        start = time.time() if ts is None else float(ts)
        lines = "".join(json.dumps({"ts": round(start + i * 1e-6, 6), "priority": priority, "message": m}) + "\n"
                        for i, m in enumerate(messages))
        self.paths.root.mkdir(parents=True, exist_ok=True)
        with open(self.paths.kernel_log, "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)  # one append at a time: records never interleave
            fh.write(lines)
            fh.flush()
        return start

    def clear_kernel_log(self) -> None:
        """Empty the node's kernel log, as a fresh boot leaves it (a test's records start clean)."""
        if self.paths.kernel_log.exists():
            with open(self.paths.kernel_log, "r+") as fh:
                fcntl.flock(fh, fcntl.LOCK_EX)
                fh.truncate(0)

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
            "pve": state.get("pve") or DEFAULT_PVE,
            "state_dir": str(self.paths.root),
            "sshd": {"running": pid is not None, "pid": pid, "port": port},
            "bastion": {"running": self.bastion.pid() is not None, "port": state.get("bastion_port"),
                        "node_name": bastion_mod.internal_name(self.name)},
            "storage": {"btrfs_mounted": storage.mount_source(self.paths.btrfs_mount) is not None,
                        "loop_devices": storage.loop_devices(self.paths.btrfs_image)
                        if self.paths.btrfs_image.exists() else []},
            "containers": containers,
        }

    def is_up(self) -> bool:
        st = self.status()
        return st["sshd"]["running"] and all(c["state"] == "running" for c in st["containers"].values())

    def node_config(self, access: str = "root") -> dict:
        """The node's entry for the controller config, as plain data (no controller import).

        ``access="root"``: root straight to the node's sshd. ``access="bastion"``: as operators
        behind a jump host have it: through the bastion, as the non-root ``dflash-op`` whose
        pct runs through ``sudo -n`` (``"bastion-password"``: a user whose sudo rule wants a
        password), both host keys in one known_hosts file."""
        state = self._read_state()
        entry = {
            "host": "127.0.0.1",
            "port": state.get("port"),
            "user": "root",
            "identity_file": str(self.sshd.client_key),
            "known_hosts": str(self.sshd.known_hosts),
            "containers": {str(c): {"venv": VENV, "workspace": WORKSPACE} for c in self.ctids},
        }
        if access in ("bastion", "bastion-password"):
            entry.update(host=bastion_mod.internal_name(self.name),
                         user=users.OPERATOR if access == "bastion" else users.PASSWORD_OPERATOR,
                         sudo=True, pct=str(self.paths.pct), journalctl=str(self.paths.bin / "journalctl"),
                         dmesg=str(self.paths.bin / "dmesg"),
                         proxy_jump=f"{users.JUMP}@127.0.0.1:{state.get('bastion_port')}",
                         known_hosts=str(self.paths.ssh / "known_hosts_via_bastion"))
        elif access != "root":
            raise ValueError(f"access {access!r}: root, bastion or bastion-password")
        return entry

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
            "pve": self.pve,
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
        gpu_lines, _ = gpu.lxc_lines(self.paths.root, ctid)
        engine_lines = vllm.lxc_lines(root)  # the host's vLLM venv at /opt/vllm, read-only
        old_conf = self.paths.lxcpath / name / "config"
        old_conf = old_conf.read_text() if old_conf.exists() else ""
        extra = [net.hook_line(address), *ctsetup.config_lines(root, hostname, address), *gpu_lines, *engine_lines]
        lxc.write_config(self.paths.lxcpath, name, rootfs=root, hostname=hostname, init=ctsetup.INIT_IN_CT,
                         extra=extra)
        new_mounts = [line for line in extra if line.startswith("lxc.mount.entry") and line not in old_conf]
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
        elif pid and new_mounts:
            # LXC mounts only at a start: a container started before its config had these mounts
            # (/dev/shm, the host's vLLM venv) gets them now, once (its files stay)
            progress(f"restarting container {ctid} for its new mounts: "
                     + ", ".join("/" + line.split()[3] for line in new_mounts))
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
