"""Node configuration: which Proxmox nodes exist, how to reach them, and per container the
venv and workspace a run uses. TOML on disk, validated by pydantic on load.

Location: ``--config PATH`` > ``$DFLASH_CTL_CONFIG`` > ``~/.config/dflash-ctl/config.toml``.
``ctl sim up`` writes the simulated node's entry here.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Optional

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from agent.protocol import atomic_write

DEFAULT_PATH = Path("~/.config/dflash-ctl/config.toml")
ENV_CONFIG = "DFLASH_CTL_CONFIG"

# The PATH a container process gets: the container's own system dirs only. The venv's bin
# is put first per container (ContainerConfig.path). Nothing of the node's PATH travels.
CONTAINER_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ConfigError(Exception):
    """A config problem the operator must fix; the message names the file and field."""


class ContainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    venv: str = Field("/root/venv", description="venv in the container whose python runs the agent and trainer")
    workspace: str = Field("/workspace", description="directory in the container for bundles and runs")
    home: str = Field("/root", description="HOME for processes started in the container")

    @field_validator("venv", "workspace", "home")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"must be an absolute path inside the container, got {value!r}")
        return value.rstrip("/") or "/"

    @property
    def python(self) -> str:
        return f"{self.venv}/bin/python3"

    @property
    def path(self) -> str:
        return f"{self.venv}/bin:{CONTAINER_SYSTEM_PATH}"


class NodeConfig(BaseModel):
    """One Proxmox node reached over SSH (or locally with ``transport = "local"``)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field(..., description="hostname, IP or ~/.ssh/config alias")
    port: Optional[int] = Field(None, ge=1, le=65535, description="SSH port (default: ~/.ssh/config, else 22)")
    user: Optional[str] = Field(None, description="SSH user (default: ~/.ssh/config, else root)")
    identity_file: Optional[str] = Field(None, description="private key file")
    known_hosts: Optional[str] = Field(None, description="known_hosts file holding this node's host key")
    transport: str = Field("ssh", pattern="^(ssh|local)$", description="ssh, or local when ctl runs on the node")
    pct: str = Field("pct", description="pct command on the node (its full path, e.g. /usr/sbin/pct, with sudo)")
    sudo: bool = Field(False, description="run pct through `sudo -n` (an SSH user other than root with a "
                                          "NOPASSWD sudoers rule for pct)")
    proxy_jump: Optional[str] = Field(None, description="reach the node through this bastion: [user@]host[:port] "
                                                        "or a ~/.ssh/config alias; a comma list hops in order "
                                                        "(like OpenSSH's ProxyJump, which ~/.ssh/config may also set)")
    containers: dict[str, ContainerConfig] = Field(default_factory=dict, description="per-container settings by CT id")

    @field_validator("containers")
    @classmethod
    def _ctids(cls, value: dict[str, ContainerConfig]) -> dict[str, ContainerConfig]:
        for key in value:
            if not key.isdigit() or not 100 <= int(key) <= 999_999_999:
                raise ValueError(f"container id {key!r} is not a Proxmox VMID (an integer from 100)")
        return value

    def container(self, ctid: int | str) -> ContainerConfig:
        return self.containers.get(str(ctid)) or ContainerConfig()


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    default_node: Optional[str] = None
    nodes: dict[str, NodeConfig] = Field(default_factory=dict)

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
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {format_validation_error(exc)}") from exc


def save(config: Config, explicit: Optional[str | Path] = None) -> Path:
    path = config_path(explicit)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = config.model_dump(exclude_none=True)
    atomic_write(str(path), tomli_w.dumps(data), mode=0o600)
    return path


def format_validation_error(exc: ValidationError) -> str:
    """'field.path: message (got value)' per problem, one line each."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        got = err.get("input")
        suffix = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
        lines.append(f"{where}: {err['msg']}{suffix}")
    return "; ".join(lines)
