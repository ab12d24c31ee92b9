"""Checkpoints: ``OUTPUT/step_N/`` holds

* ``drafter/``       config.json + model.safetensors (inference export, z-lab layout)
* ``meta.json``      the checkpoint's self-description (step, config, target identity,
                     data fingerprint, schedule): read by launch validation without
                     loading tensors
* ``checkpoint.pt``  everything to resume: drafter weights, optimizer, schedule, step,
                     epoch, data position, RNG states, config, fingerprint, target identity

``checkpoint.pt`` is written last, to a temp name, fsynced and renamed: its presence means the
step directory is complete, and a kill at any moment leaves earlier checkpoints untouched.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile

import numpy as np
import torch

from agent import ckptcompat
from agent.protocol import atomic_write_json

FORMAT = "dflash-trainer-checkpoint"
VERSION = 1
CHECKPOINT = "checkpoint.pt"
META = "meta.json"
DRAFTER = "drafter"


def step_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"step_{step}")


def resolve(path: str) -> str:
    """A step directory or its checkpoint.pt → the step directory."""
    path = os.path.abspath(path)
    return os.path.dirname(path) if os.path.basename(path) == CHECKPOINT else path


def read_meta(path: str) -> dict:
    """meta.json of a checkpoint (``path``: step dir or checkpoint.pt); raises ValueError
    with a one-line reason when it is not a complete checkpoint."""
    d = resolve(path)
    if not os.path.isfile(os.path.join(d, CHECKPOINT)):
        raise ValueError(f"{d} holds no {CHECKPOINT} (not a checkpoint, or its save was interrupted); "
                         "name a complete OUTPUT/step_N directory")
    try:
        with open(os.path.join(d, META)) as fh:
            meta = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{os.path.join(d, META)} is unreadable ({exc}); name another checkpoint")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{d} is not a {FORMAT} (format {meta.get('format')!r})")
    return meta


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():  # this process's device only: a resume may use other GPU ids
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if isinstance(state.get("cuda"), torch.Tensor) and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(output_dir: str, step: int, drafter, meta: dict, state: dict) -> str:
    """Write step_N/ (drafter export, meta.json, then checkpoint.pt atomically); return the
    checkpoint.pt path. ``meta`` is JSON-able; ``state`` adds the tensors."""
    d = step_dir(output_dir, step)
    os.makedirs(d, exist_ok=True)
    # drafter/ first, via a temp dir + rename, so a reader never sees half an export
    tmp = tempfile.mkdtemp(prefix=".drafter-", dir=d)
    drafter.save_pretrained(tmp)
    final = os.path.join(d, DRAFTER)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    meta = {"format": FORMAT, "version": VERSION, "step": step, **meta}
    atomic_write_json(os.path.join(d, META), meta)
    path = os.path.join(d, CHECKPOINT)
    fd, tmp_pt = tempfile.mkstemp(prefix=".checkpoint-", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save({**meta, **state, "rng": rng_state()}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_pt, path)
    except BaseException:
        if os.path.exists(tmp_pt):
            os.unlink(tmp_pt)
        raise
    return path


def load(path: str, map_location="cpu") -> dict:
    d = resolve(path)
    read_meta(d)
    return torch.load(os.path.join(d, CHECKPOINT), map_location=map_location, weights_only=False)


def is_export(path: str) -> bool:
    """An exported drafter directory (this trainer's step_N/drafter, or z-lab's release layout)."""
    return os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(path, "model.safetensors"))


def read_init_meta(path: str) -> dict:
    """--init-from accepts a checkpoint or an exported drafter directory; the latter has no
    target identity, so only its shapes can be checked against the target."""
    if is_export(path):
        with open(os.path.join(path, "config.json")) as fh:
            return {"drafter_config": json.load(fh), "target": None}
    return read_meta(path)


def init_weights(path: str) -> dict:
    if is_export(path):
        from safetensors.torch import load_file

        return load_file(os.path.join(path, "model.safetensors"))
    return load(path)["model"]


def compatibility_problems(meta: dict, *, block_size: int, num_draft_layers: int, target: dict,
                           target_layer_ids: list[int], flag: str, data_fingerprint: str | None = None) -> list[str]:
    """Why a checkpoint cannot start this run (one line each, naming the flag): the launch
    preflight's rule, agent/ckptcompat.py."""
    return ckptcompat.problems(meta, {"flag": flag, "path": meta.get("path"), "block_size": block_size,
                                      "num_draft_layers": num_draft_layers, "target": target,
                                      "target_layer_ids": target_layer_ids, "data_fingerprint": data_fingerprint})
