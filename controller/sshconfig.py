"""What both SSH runners (controller/ssh.py: paramiko; controller/openssh.py: the ``ssh``
binary) take from the same place: which ssh config file ctl honours, the default
known_hosts, the connect timeout and the keepalive interval. No paramiko here, so a command
carried by the ``ssh`` binary never imports it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

# Which ssh_config file to honour. Tests point this at their own file (or "none") so a
# developer's ~/.ssh/config never changes what a test does (fabric's tests do the same).
ENV_SSH_CONFIG = "DFLASH_CTL_SSH_CONFIG"
DEFAULT_SSH_CONFIG = "~/.ssh/config"
DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"

KEEPALIVE_S = 15
# The ssh binary's keepalive (its shared master's above all): a peer that stopped answering is
# given up after 5 × 3 s, as SkyPilot's ssh options do (sky/utils/command_runner.py).
SERVER_ALIVE_S = 5
SERVER_ALIVE_COUNT = 3
CONNECT_TIMEOUT_S = 10
CONNECT_ATTEMPTS = 4


def ssh_config_path() -> Optional[Path]:
    """The ssh config file to read, or None for none. A file named by $DFLASH_CTL_SSH_CONFIG
    that does not exist is returned as is: the caller says so."""
    raw = os.environ.get(ENV_SSH_CONFIG)
    if raw is not None:
        if raw.strip().lower() in ("", "none", "/dev/null"):
            return None
        return Path(raw).expanduser()
    path = Path(DEFAULT_SSH_CONFIG).expanduser()
    return path if path.exists() else None


def missing_config_message(path: Path) -> str:
    return f"ssh config {path} (from ${ENV_SSH_CONFIG}) does not exist"
