"""The exact `ctl launch` line that continues a run, as the launch recorded it (its config
file and `--set`s), shown by `ctl status` after a container restart, by kill-and-rollback and
in every alert. Standard library only: the one-shot commands (`ctl status`, `ctl env`) print it
without loading the launch's run-config models or templates."""

from __future__ import annotations

import shlex
from typing import Optional


def resume_line(ctid, node_name: Optional[str], launch: Optional[dict], checkpoint: Optional[dict]) -> str:
    """The exact `ctl launch` that continues a run: its config file and `--set`s as it was
    launched, from its checkpoint (a training run) or again (a data job resumes by itself)."""
    launch = launch or {}
    config = launch.get("config_file") or (f"{launch['config']}.toml" if launch.get("config") else "RUN_CONFIG.toml")
    argv = ["ctl", "launch", "--container", str(ctid), "--config", config]
    if node_name:
        argv[2:2] = ["--node", node_name]
    if (launch.get("kind") or "train") != "train":
        pass  # a data job resumes by launching its config again (trainer/kinds.py)
    elif checkpoint and checkpoint.get("exists", True):
        argv += ["--resume-from", checkpoint["path"]]
    else:
        argv += ["--from-scratch"]
    for item in launch.get("sets") or []:  # what its launch changed over the file, so it runs on alike
        argv += ["--set", item]
    return shlex.join(argv)
