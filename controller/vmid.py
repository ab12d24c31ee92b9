"""A container id as Proxmox takes it: pve-common's ``pve-vmid`` (PVE/JSONSchema.pm), an
integer written ``[1-9][0-9]{2,8}``, so 100 to 999,999,999. Checked before a node is
contacted: `ctl status -c 5` is one line naming the rule, not pct's parameter verification
error relayed from the node with exit 1. Standard library only (the config and the one-shot
commands' front never load typer)."""

from __future__ import annotations

import re
from typing import Optional

VMID_MIN = 100
VMID_MAX = 999_999_999
_FORMAT = re.compile(r"[1-9][0-9]{2,8}")


def problem(value: object) -> Optional[str]:
    """None for a valid container id (an int, or its text), else what is wrong, in words that
    follow the value: ``f"--container {value}: {problem}"``."""
    text = str(value).strip()  # as int() reads it
    if _FORMAT.fullmatch(text):
        return None
    return (f"not a Proxmox VMID: a container id is an integer from {VMID_MIN} to {VMID_MAX}, e.g. 200 "
            "(`pct list` on the node lists them)")
