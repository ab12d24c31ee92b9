"""Node configuration: which Proxmox nodes exist, how to reach them, and per container the
venv and workspace a run uses. TOML on disk, validated on load and on construction.

Location: ``--config PATH`` > ``$DFLASH_CTL_CONFIG`` > ``~/.config/dflash-ctl/config.toml``.
``ctl sim up`` writes the simulated node's entry here.

Why plain dataclasses and not pydantic (which the run config, controller/runconfig.py, does
use): every `ctl` command reads this file first, and importing pydantic and building its
models was about half of what `ctl exec` spent before it connected (bench/ctl_exec/roundtrip.py).
Ten fields with simple rules do not need it; the messages keep its shape
(``nodes.sim.port: … (got …)``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from controller import configcache
from controller import vmid

DEFAULT_PATH = Path("~/.config/dflash-ctl/config.toml")
ENV_CONFIG = "DFLASH_CTL_CONFIG"

# The PATH a container process gets: the container's own system dirs only. The venv's bin
# is put first per container (ContainerConfig.path). Nothing of the node's PATH travels.
CONTAINER_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ConfigError(Exception):
    """A config problem the operator must fix; the message names the file and field."""


class _Invalid(ValueError):
    """One field's problem: where (dotted) and what."""

    def __init__(self, where: str, message: str, got: Any = None):
        suffix = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
        super().__init__(f"{where}: {message}{suffix}")


def _check(where: str, value: Any, kind: type, optional: bool = False) -> None:
    if value is None and optional:
        return
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise _Invalid(where, f"must be {'an integer' if kind is int else 'true or false' if kind is bool else 'text'}",
                       value)


def _ssh_word(where: str, value: str, what: str) -> None:
    """A host or user name as ssh takes it: not empty (ssh would try to resolve ""), no space
    or control character, not option-like (the argv ends options with "--" anyway)."""
    if not value or value.startswith("-") or any(c.isspace() or not c.isprintable() for c in value):
        raise _Invalid(where, f"must be a {what}: not empty, no spaces or control characters, not starting "
                              "with '-'", value)


def _absolute(where: str, value: str) -> str:
    _check(where, value, str)
    if not value.startswith("/"):
        raise _Invalid(where, "must be an absolute path inside the container", value)
    return value.rstrip("/") or "/"


@dataclass(frozen=True)
class ContainerConfig:
    """venv: the venv whose python runs the agent and trainer; workspace: the directory for
    bundles and runs; home: HOME for processes started in the container."""

    venv: str = "/root/venv"
    workspace: str = "/workspace"
    home: str = "/root"
    notify: Optional[dict] = None  # this container's [notify] over its node's (controller/notifyconfig.py)

    def __post_init__(self) -> None:
        for name in ("venv", "workspace", "home"):
            object.__setattr__(self, name, _absolute(name, getattr(self, name)))
        _check_notify(self.notify)

    @property
    def python(self) -> str:
        return f"{self.venv}/bin/python3"

    @property
    def path(self) -> str:
        return f"{self.venv}/bin:{CONTAINER_SYSTEM_PATH}"


@dataclass(frozen=True)
class NodeConfig:
    """One Proxmox node reached over SSH (or locally with ``transport = "local"``).

    host: hostname, IP or ~/.ssh/config alias; port/user: default ~/.ssh/config, else 22 and
    root; identity_file: private key; known_hosts: the file holding this node's (and its
    bastions') host keys; pct: the pct command (its full path with sudo); journalctl, dmesg:
    the node's kernel log readers (likewise); sudo: run pct and those through `sudo -n`; proxy_jump: [user@]host[:port] of a bastion, a comma list hops in
    order (like ProxyJump, which ~/.ssh/config may set instead); control_persist: seconds the
    one-shot commands' shared SSH connection is kept after its last use (default 300; 0: no
    sharing; controller/sshmux.py); containers: per CT id."""

    host: str
    port: Optional[int] = None
    user: Optional[str] = None
    identity_file: Optional[str] = None
    known_hosts: Optional[str] = None
    transport: str = "ssh"
    pct: str = "pct"
    sudo: bool = False
    # the node's kernel log readers (controller/kernellog.py); their full paths with sudo,
    # as the sudoers rule names them
    journalctl: str = "journalctl"
    dmesg: str = "dmesg"
    proxy_jump: Optional[str] = None
    control_persist: Optional[int] = None
    containers: dict[str, ContainerConfig] = field(default_factory=dict)
    notify: Optional[dict] = None  # this node's [notify] over the file's (controller/notifyconfig.py)

    def __post_init__(self) -> None:
        _check("host", self.host, str)
        _ssh_word("host", self.host, "hostname, IP address or ~/.ssh/config alias")
        if self.port is not None:
            _check("port", self.port, int)
            if not 1 <= self.port <= 65535:
                raise _Invalid("port", "must be between 1 and 65535", self.port)
        for name in ("user", "identity_file", "known_hosts", "proxy_jump"):
            _check(name, getattr(self, name), str, optional=True)
        if self.user is not None:
            _ssh_word("user", self.user, "login name")
        if self.control_persist is not None:
            _check("control_persist", self.control_persist, int)
            if self.control_persist < 0:
                raise _Invalid("control_persist", "must be 0 (no shared connection) or more seconds",
                               self.control_persist)
        _check("pct", self.pct, str)
        _check("journalctl", self.journalctl, str)
        _check("dmesg", self.dmesg, str)
        _check("sudo", self.sudo, bool)
        if self.transport not in ("ssh", "local"):
            raise _Invalid("transport", "must be 'ssh', or 'local' when ctl runs on the node", self.transport)
        if not isinstance(self.containers, dict):
            raise _Invalid("containers", "must be a table of container ids", self.containers)
        fixed = {}
        for key, value in self.containers.items():
            key = str(key)
            why = vmid.problem(key)
            if why:
                raise _Invalid("containers", f"container id {key!r}: {why}")
            if isinstance(value, dict):
                value = _build(ContainerConfig, value, f"containers.{key}")
            fixed[key] = value
        object.__setattr__(self, "containers", fixed)

    def container(self, ctid: int | str) -> ContainerConfig:
        return self.containers.get(str(ctid)) or ContainerConfig()


def _check_notify(table: Any) -> None:
    if table is None:
        return
    from controller.notifyconfig import check_table  # only a config with a [notify] table pays for it

    try:
        check_table(table)
    except ValueError as exc:
        where, _, what = str(exc).partition(": ")
        raise _Invalid(where, what) from None


@dataclass
class Config:
    default_node: Optional[str] = None
    nodes: dict[str, NodeConfig] = field(default_factory=dict)
    notify: Optional[dict] = None  # [notify]: alert channels and thresholds (docs/alerts.md)

    def __post_init__(self) -> None:
        _check("default_node", self.default_node, str, optional=True)
        _check_notify(self.notify)
        self.nodes = {name: _build(NodeConfig, n, f"nodes.{name}") if isinstance(n, dict) else n
                      for name, n in (self.nodes or {}).items()}
        for node in self.nodes.values():
            # every node carries the file's [notify] (not a field: never written back per node)
            object.__setattr__(node, "notify_base", self.notify)

    def node(self, name: Optional[str] = None) -> tuple[str, NodeConfig]:
        name = name or self.default_node or (next(iter(self.nodes)) if len(self.nodes) == 1 else None)
        if name is None:
            if not self.nodes:
                raise ConfigError("no node is configured: run `ctl sim up` for the simulated node, "
                                  "or add a [nodes.NAME] table to the config file")
            raise ConfigError(f"several nodes are configured ({', '.join(self.nodes)}): "
                              "pass --node NAME or set default_node")
        if name not in self.nodes:
            raise ConfigError(f"node {name!r} is not in the config (known: {', '.join(self.nodes) or 'none'})")
        return name, self.nodes[name]


def _build(cls, data: Any, where: str):
    """``cls(**data)`` with unknown or missing keys and bad values named by their dotted path."""
    if not isinstance(data, dict):
        raise _Invalid(where, "must be a table", data)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise _Invalid(f"{where}.{unknown[0]}", f"unknown key (known: {', '.join(sorted(known))})")
    try:
        return cls(**data)
    except TypeError as exc:  # a required key is missing
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in data
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        raise _Invalid(f"{where}.{missing[0]}" if missing else where, "field required") from exc
    except _Invalid as exc:
        raise _Invalid(f"{where}.{str(exc)}".split(":", 1)[0], str(exc).split(": ", 1)[1]) from None


def config_path(explicit: Optional[str | Path] = None) -> Path:
    raw = explicit or os.environ.get(ENV_CONFIG) or DEFAULT_PATH
    return Path(raw).expanduser()


def load(explicit: Optional[str | Path] = None) -> Config:
    path = config_path(explicit)
    if not path.exists():
        if explicit:
            raise ConfigError(f"config file {path} does not exist")
        return Config()
    try:
        raw = path.read_bytes()
        data = configcache.parsed(raw, lambda: _parse_toml(path, raw))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
                          "save it as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror})") from None
    try:
        unknown = sorted(set(data) - {"default_node", "nodes", "notify"})
        if unknown:
            raise _Invalid(unknown[0], "unknown key (known: default_node, nodes, notify)")
        return Config(default_node=data.get("default_node"), nodes=data.get("nodes") or {}, notify=data.get("notify"))
    except _Invalid as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _parse_toml(path: Path, raw: bytes) -> dict:
    import tomllib  # only for a config not parsed before (controller/configcache.py)

    # As Path.read_text read it before: text mode's newlines (\r\n and \r become \n).
    text = raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if getattr(obj, f.name) is not None}
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def save(config: Config, explicit: Optional[str | Path] = None) -> Path:
    import tomli_w  # only the commands that write the file pay for it (and for agent.protocol)

    from agent.protocol import atomic_write

    path = config_path(explicit)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(str(path), tomli_w.dumps(_plain(config)), mode=0o600)
    return path
