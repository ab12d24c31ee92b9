"""Where the simulated node keeps things.

Two roots, both overridable so CI can point them at a persistent disk:

- the rootfs cache, shared by every sim node on the machine and kept between runs:
  ``$DFLASH_SIM_CACHE`` or ``/var/cache/dflash-sim``;
- one state directory per node: ``$DFLASH_SIM_DIR/<node>`` or ``/var/lib/dflash-sim/<node>``.

A node's state directory::

    node.json            name, sshd port, containers and their storage (read by bin/pct)
    bin/pct              the pct emulation, first non-polluted entry of the login PATH
    bin/journalctl, bin/dmesg   the node's kernel log readers (sim/kernlog.py)
    kernel.jsonl         the node's kernel log: what tests inject (SimNode.kernel_log)
    home/                the clean-but-polluted home bound over /root for sshd
    ssh/                 host key, client key, authorized_keys, known_hosts, sshd_config, log
    lxc/<ctid>/config    LXC configs (lxc-* -P <state>/lxc)
    pve/lxc/<ctid>.conf  Proxmox-style container configs with [snapshot] sections
    storage/btrfs.img    loop image of the snapshot-capable storage, mounted on storage/btrfs
    storage/dir/         plain directory storage (no snapshots)
    log/                 lxc-start logs
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "DFLASH_SIM_CACHE"
DIR_ENV = "DFLASH_SIM_DIR"
DEFAULT_CACHE = "/var/cache/dflash-sim"
DEFAULT_STATE_ROOT = "/var/lib/dflash-sim"

NODE_NAME = re.compile(r"^[a-z][a-z0-9-]{0,30}$")

# Storage ids as a Proxmox node would name them (pvesm): one snapshot-capable, one not.
BTRFS_STORAGE = "local-btrfs"
DIR_STORAGE = "local"


def cache_root() -> Path:
    # resolve(): LXC refuses a rootfs path with a symlink in it (docs/research/sim-node.md).
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).resolve()


def state_root() -> Path:
    return Path(os.environ.get(DIR_ENV) or DEFAULT_STATE_ROOT).resolve()


@dataclass(frozen=True)
class NodePaths:
    name: str
    root: Path

    @classmethod
    def for_node(cls, name: str) -> "NodePaths":
        if not NODE_NAME.match(name):
            raise ValueError(f"sim node name {name!r} must be lowercase letters, digits and '-', "
                             "starting with a letter")
        return cls(name=name, root=state_root() / name)

    @property
    def node_json(self) -> Path:
        return self.root / "node.json"

    @property
    def lock(self) -> Path:
        return self.root / ".lock"

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def pct(self) -> Path:
        return self.bin / "pct"

    @property
    def kernel_log(self) -> Path:
        """The node's kernel log (sim/kernlog.py reads it as journalctl and dmesg)."""
        return self.root / "kernel.jsonl"

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def ssh(self) -> Path:
        return self.root / "ssh"

    @property
    def lxcpath(self) -> Path:
        return self.root / "lxc"

    @property
    def pve_lxc(self) -> Path:
        return self.root / "pve" / "lxc"

    @property
    def log(self) -> Path:
        return self.root / "log"

    @property
    def btrfs_image(self) -> Path:
        return self.root / "storage" / "btrfs.img"

    @property
    def btrfs_mount(self) -> Path:
        return self.root / "storage" / "btrfs"

    @property
    def dir_storage(self) -> Path:
        return self.root / "storage" / "dir"

    def rootfs(self, ctid: int, storage: str) -> Path:
        """The container's root filesystem: a btrfs subvolume, or a plain directory."""
        base = self.btrfs_mount if storage == BTRFS_STORAGE else self.dir_storage
        return base / "images" / str(ctid) / f"subvol-{ctid}-disk-0"

    def pve_conf(self, ctid: int) -> Path:
        return self.pve_lxc / f"{ctid}.conf"
