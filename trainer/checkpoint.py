"""Checkpoints: ``OUTPUT/step_N/`` holds

* ``drafter/``       the inference export, as ``python -m trainer export`` writes it
                     (trainer/serve/export.py: config.json for the serving stacks, bf16
                     model.safetensors, modeling_dflash.py, README.md; world-readable)
* ``meta.json``      the checkpoint's self-description (step, config, target identity,
                     data fingerprint, schedule): read by launch validation without
                     loading tensors
* ``checkpoint.pt``  everything to resume: drafter weights, optimizer, schedule, step,
                     epoch, data position, RNG states, config, fingerprint, target identity

``checkpoint.pt`` is written last, to a temp name, fsynced and renamed: its presence means the
step directory is complete, and a kill at any moment leaves earlier checkpoints untouched.
:func:`prune` keeps the newest ``--keep-checkpoints`` of them (and every ``--keep-every``-th
step, and the ``best``); it runs only after a save completed and never removes the checkpoint
just written.

``OUTPUT/best.json`` names the checkpoint with the highest τ measured at save (``--eval-prompts``:
τ = tokens committed per target forward, what serving buys, not the validation loss): step,
τ, path. :func:`record_tau` keeps each checkpoint's τ in its ``meta.json`` and moves ``best``
when a new one beats it; retention never deletes the best; ``python -m trainer export --best``
and ``ctl export --best`` export it.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
import uuid

import numpy as np
import torch

from agent import ckptcompat
from agent.protocol import atomic_write_json
from trainer.drafter_dir import make_public_dir  # re-exported: train.py and __main__ use it from here

FORMAT = "dflash-trainer-checkpoint"
VERSION = 1
CHECKPOINT = "checkpoint.pt"
META = "meta.json"
BEST = "best.json"
DRAFTER = "drafter"
STEP_DIR = re.compile(r"step_(\d+)$")


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
    from trainer import drafter_dir as export

    from agent.leftovers import writer_tag

    d = step_dir(output_dir, step)
    make_public_dir(d)  # a server running as another user must reach drafter/ inside
    meta = {"format": FORMAT, "version": VERSION, "step": step, **meta}
    if "target_config" not in meta:  # what the export needs of the target, so it needs no target dir later
        meta["target_config"] = export.target_facts((meta.get("config") or {}).get("target_model"))
    # drafter/ first, written like `python -m trainer export` (temp dir + rename), so a
    # reader never sees half an export
    export.write_drafter_dir(os.path.join(d, DRAFTER), drafter.state_dict(), meta, replace=True,
                             evals=export.read_evals(d))
    atomic_write_json(os.path.join(d, META), meta)
    path = os.path.join(d, CHECKPOINT)
    # named with its writer: an interrupted save's temp is removed once that writer is gone
    fd, tmp_pt = tempfile.mkstemp(prefix=f".checkpoint-{writer_tag()}-", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save({**meta, **state, "rng": rng_state()}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp_pt, 0o644)  # mkstemp's 0600 would hide it from a reader of another user
        os.replace(tmp_pt, path)
    except BaseException:
        if os.path.exists(tmp_pt):
            os.unlink(tmp_pt)
        raise
    return path


def sweep_leftovers(output_dir: str, run_dir: str | None = None) -> list[dict]:
    """Remove temp files of interrupted saves of dead writers in this run's output root
    (agent/leftovers.py): at every start, so a failed run's torn saves do not stay forever."""
    from agent import leftovers

    return leftovers.sweep(leftovers.output_roots(output_dir, run_dir))


def steps(output_dir: str) -> list[tuple[int, str, bool]]:
    """(step, step directory, complete) for every OUTPUT/step_N, ascending by step."""
    try:
        names = os.listdir(output_dir)
    except OSError:
        return []
    out = []
    for name in names:
        m = STEP_DIR.match(name)
        path = os.path.join(output_dir, name)
        if m and os.path.isdir(path):
            out.append((int(m.group(1)), path, os.path.isfile(os.path.join(path, CHECKPOINT))))
    return sorted(out)


def best(output_dir: str) -> dict | None:
    """The best checkpoint by τ at save ({"step", "tau", "path", ...}), or None: none was
    measured, or the one it names is no longer complete."""
    from agent.protocol import read_json_doc

    rec = read_json_doc(os.path.join(output_dir, BEST))
    if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
        return None
    return rec if os.path.isfile(os.path.join(step_dir(output_dir, rec["step"]), CHECKPOINT)) else None


def record_tau(step_path: str, rec: dict) -> dict:
    """Keep the τ measured for the checkpoint at ``step_path`` (``rec``: tau, prompts, ... and
    by_category) in its meta.json, and make it ``best`` when its τ is higher than the best's
    (ties keep the earlier: it was reached first). Returns the best record after this one."""
    d = resolve(step_path)
    meta = read_meta(d)
    meta["eval"] = rec
    atomic_write_json(os.path.join(d, META), meta)
    output_dir = os.path.dirname(d)
    current = best(output_dir)
    if current is None or float(rec["tau"]) > float(current["tau"]):
        current = {"step": int(meta["step"]), "tau": float(rec["tau"]), "path": os.path.join(d, CHECKPOINT),
                   **({"by_category": rec["by_category"]} if rec.get("by_category") else {})}
        atomic_write_json(os.path.join(output_dir, BEST), current)
    return current


def prune(output_dir: str, saved_step: int, keep: int, keep_every: int = 0) -> list[int]:
    """After step ``saved_step`` was saved completely: remove older checkpoints beyond the
    newest ``keep`` (the one just saved counts; 0 keeps all) except every step that is a
    multiple of ``keep_every`` and the ``best`` (best.json), and incomplete step directories older than it (a save that
    died). Returns the removed steps.

    Newer step directories (an earlier, longer run in the same output dir) are left alone,
    and so is the one just saved, so the newest loadable checkpoint is never removed. A
    directory is renamed away before it is deleted, so a crash mid-delete leaves nothing
    that looks like a checkpoint."""
    if keep <= 0:
        return []
    here = steps(output_dir)
    if not any(s == saved_step and done for s, _, done in here):
        return []  # the save did not complete: remove nothing
    older = [(s, p, done) for s, p, done in here if s < saved_step]
    kept_complete = [s for s, _, done in older if done][::-1][:keep - 1]
    top = best(output_dir)  # the checkpoint that serves best stays whatever its age
    removed = []
    for s, p, done in older:
        if done and (s in kept_complete or (keep_every > 0 and s % keep_every == 0) or (top and s == top["step"])):
            continue
        _remove(p)
        removed.append(s)
    for name in os.listdir(output_dir):  # leftovers of a crash in an earlier prune
        if name.startswith(".pruned-step_"):
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
    return removed


def _remove(path: str) -> None:
    parent, name = os.path.split(path)
    gone = os.path.join(parent, f".pruned-{name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, gone)
    shutil.rmtree(gone, ignore_errors=True)


def load(path: str, map_location="cpu", mmap: bool = False) -> dict:
    """The whole checkpoint.pt. ``mmap`` maps the tensors instead of reading them (an export
    of a 27B-width drafter needs its weights, not the optimizer state beside them)."""
    d = resolve(path)
    read_meta(d)
    return torch.load(os.path.join(d, CHECKPOINT), map_location=map_location, weights_only=False, mmap=mmap)


def load_drafter(path: str, device="cpu"):
    """The drafter of a checkpoint with its fp32 master weights (not the bf16 export)."""
    from trainer.model import Drafter, DrafterConfig

    ckpt = load(path, mmap=True)
    drafter = Drafter(DrafterConfig.from_hf(ckpt["drafter_config"]))  # its architecture too (trainer/arch.py)
    drafter.load_state_dict(ckpt["model"])
    return drafter.to(device)


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


def load_init_weights(drafter, state: dict, path: str) -> None:
    """--init-from: the checkpoint's weights into this run's drafter. A DFlash checkpoint may
    start a DFlash2 drafter: its convolutions and selector, which the checkpoint lacks, keep
    their identity start, so the new drafter first drafts exactly what the checkpoint did.
    Anything else missing or extra is refused (compatibility_problems says so before any
    loading; this is the last line of defence)."""
    from trainer import arch

    missing, unexpected = drafter.load_state_dict(state, strict=False)
    lacking = [k for k in missing if not arch.is_dflash2_only(k)]
    if lacking or unexpected:
        names = ", ".join((lacking + unexpected)[:3])
        raise ValueError(f"--init-from {path}: its weights do not fit this drafter ({names}, …); "
                         "check --drafter-arch and the drafter flags against the checkpoint")


def arch_problems(theirs: dict, ours: dict, flag: str, where: str) -> list[str]:
    """The drafter architecture (trainer/arch.py) of a checkpoint against this run's: equal
    for --resume-from; --init-from may also take a DFlash checkpoint into a DFlash2 drafter."""
    from trainer import arch

    a, b = arch.of_config(theirs), arch.of_config(ours)
    if a == b == arch.DFLASH2:
        mine, yours = ours.get("dflash_config") or {}, theirs.get("dflash_config") or {}
        diff = [f"{k} {yours.get(k)} vs {mine.get(k)}" for k in arch.DFLASH2_FIELDS if yours.get(k) != mine.get(k)]
        return [f"{flag} {where}: the checkpoint's DFlash2 shape differs ({', '.join(diff)}); this trainer builds "
                f"the published shape {arch.DFLASH2_SHAPE}"] if diff else []
    if a == b or (flag == "--init-from" and a == arch.DFLASH):
        return []
    if flag == "--init-from":  # a DFlash2 checkpoint into a DFlash drafter: it would lose its convolutions
        return [f"--init-from {where}: the checkpoint is a DFlash2 drafter; a DFlash drafter cannot take its "
                "in-block convolutions and path selector: use --drafter-arch dflash2, or another checkpoint"]
    return [f"--resume-from {where}: the checkpoint is a {a} drafter, this run --drafter-arch {b}; resume with "
            f"--drafter-arch {a}" + (", or start a DFlash2 drafter from it with --init-from" if a == arch.DFLASH else "")]


def compatibility_problems(meta: dict, *, block_size: int, num_draft_layers: int, target: dict,
                           target_layer_ids: list[int], flag: str, data_fingerprint: str | None = None,
                           drafter: dict | None = None) -> list[str]:
    """Why a checkpoint cannot start this run (one line each, naming the flag): the launch
    preflight's rule, agent/ckptcompat.py. ``drafter``: this run's drafter config
    (DrafterConfig.to_hf), whose attention layout must match."""
    problems = []
    if drafter is not None:  # DFlash vs DFlash2 (trainer/arch.py)
        problems += arch_problems(meta.get("drafter_config", {}), drafter, flag, meta.get("path", "the checkpoint"))
    return problems + ckptcompat.problems(meta, {"flag": flag, "path": meta.get("path"), "block_size": block_size,
                                      "num_draft_layers": num_draft_layers, "target": target,
                                      "target_layer_ids": target_layer_ids, "data_fingerprint": data_fingerprint,
                                      "drafter": drafter})
