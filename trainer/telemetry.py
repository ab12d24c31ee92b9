"""What the trainer tells the outside world: events.jsonl, heartbeats, wandb.

Formats are agent/protocol.py's (the trainer → agent contract). Every rank may write
events (errors carry the rank and GPU); one line per event, appended with a single
O_APPEND write so lines from several processes never interleave.
"""

from __future__ import annotations

import json
import os
import time

from agent.protocol import EVENTS, HEARTBEAT_DIR, atomic_write_json


class Events:
    def __init__(self, run_dir: str, rank: int, role: str, gpu: int):
        self.base = {"rank": rank, "role": role, "gpu": gpu}
        self.path = os.path.join(run_dir, EVENTS)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, kind: str, **payload) -> None:
        rec = {"ts": time.time(), **self.base, "kind": kind, **payload}
        os.write(self.fd, (json.dumps(rec, sort_keys=True) + "\n").encode())

    def close(self) -> None:
        os.close(self.fd)


class Heartbeat:
    """heartbeat/rank-N, rewritten atomically: the agent's liveness signal per rank."""

    def __init__(self, run_dir: str, rank: int, role: str, gpu: int):
        d = os.path.join(run_dir, HEARTBEAT_DIR)
        os.makedirs(d, exist_ok=True)
        self.path = os.path.join(d, f"rank-{rank}")
        self.base = {"rank": rank, "role": role, "gpu": gpu, "pid": os.getpid()}
        self.step = 0

    def beat(self, step: int | None = None, state: str = "running") -> None:
        """``step``: the last completed optimizer step; None keeps the last one said (a
        failure's beat names where the rank was, never a made-up step)."""
        if step is not None:
            self.step = step
        atomic_write_json(self.path, {**self.base, "step": self.step, "ts": time.time(), "state": state})


class NullLogger:
    """Stands in for wandb when it is off, so the loop never asks ``if wandb:``."""

    def log(self, metrics: dict, step: int) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbLogger:
    def __init__(self, project: str, name: str | None, mode: str, run_dir: str, config: dict):
        import wandb

        # WANDB_DIR from the environment wins; else the run directory (never the cwd).
        directory = os.environ.get("WANDB_DIR") or run_dir
        os.makedirs(directory, exist_ok=True)
        self.run = wandb.init(project=project, name=name, mode=mode, config=config, dir=directory)
        if mode == "offline":
            # the run's own directory (wandb/offline-run-…), which `wandb sync` uploads later
            where = os.path.dirname(self.run.dir.rstrip("/"))
            print(f"wandb: offline run in {where}; upload it later with `wandb sync {where}`", flush=True)

    def log(self, metrics: dict, step: int) -> None:
        flat = {}
        for k, v in metrics.items():
            if isinstance(v, (list, tuple)):  # per-slot accuracy → acc/1, acc/2, ...
                flat.update({f"{k}/{i + 1}": x for i, x in enumerate(v)})
            elif v is not None:
                flat[k] = v
        self.run.log(flat, step=step)

    def finish(self) -> None:
        self.run.finish()


def make_logger(enabled: bool, project, name, mode, run_dir, config):
    if not enabled or not project or mode == "disabled":
        return NullLogger()
    return WandbLogger(project, name, mode, run_dir, config)
