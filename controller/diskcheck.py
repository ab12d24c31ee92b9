"""The launch's disk verdict: do the checkpoints the run will keep fit its output disk?

The story: a 27B-width drafter's checkpoint (fp32 masters + AdamW state + the bf16 export)
is ~36 GB, and six epochs at --save-interval 2000 used to keep every one of them until the
disk filled, hours in. The container reports free space where --output-dir will be
(agent/preflight.py, a fact); the size of one checkpoint comes from the drafter's shape
(trainer/plan/ckptsize.py, stdlib) and the number kept at once from --keep-checkpoints and
--keep-every (the newest N, plus the one being written before the oldest is pruned), plus
the best by τ when the run measures it (--eval-prompts).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from trainer import multinode

from trainer.plan import ckptsize


def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def saves_here(values: Mapping[str, Any]) -> bool:
    """Whether this container writes the checkpoints: a job's first container with drafter
    ranks (the first drafter rank saves), or the only container."""
    if not multinode.is_job(values):
        return True
    layout = multinode.parse_layout(values.get("job_layout"))
    first = next((i for i, (_, d, colocated) in enumerate(layout) if d or colocated), 0)
    return int(values.get("node_rank") or 0) == first


def disk_refusal(values: Mapping[str, Any], pf: Mapping[str, Any]) -> Optional[str]:
    """One line — need, free, what to change — when the checkpoints the run keeps at once
    cannot fit the free space the preflight measured at --output-dir; else None (also when a
    figure is missing: the preflight then refuses for that reason, e.g. no target config)."""
    disk = pf.get("disk") or {}
    target = (pf.get("model") or {}).get("config")
    free = disk.get("free_bytes")
    if free is None and disk.get("free_gib") is not None:
        free = disk["free_gib"] * (1 << 30)
    if not target or free is None or not saves_here(values):
        return None
    from trainer import family

    if family.unsupported(dict(target)) is not None:
        return None  # refused for that, in its own words (Launcher.assess)
    each = ckptsize.checkpoint_bytes(target, values)
    ranks = multinode.totals(values)[1] if multinode.is_job(values) else len(values.get("drafter_gpus") or ()) or 1
    steps = ckptsize.steps_at_least(values, (pf.get("data") or {}).get("stats") or {}, ranks) or 1
    interval = int(values.get("save_interval") or 1)
    keep, every = int(values.get("keep_checkpoints") or 0), int(values.get("keep_every") or 0)
    best = bool(values.get("eval_prompts"))  # τ at each save: prune keeps the best too
    slots = ckptsize.retained_peak(steps, interval, keep, every, best)
    need = slots * each
    if need <= free:
        return None
    if keep == 0:
        why = f"--keep-checkpoints 0 keeps every one: at least {steps} steps at --save-interval {interval}"
    else:
        why = (f"--keep-checkpoints {keep} + the one being written" + (f" + every {every}th step" if every else "")
               + (" + the best by τ (--eval-prompts)" if best else ""))
    fits = [k for k in range(1, max(keep, 1)) if ckptsize.retained_peak(steps, interval, k, every, best) * each <= free]
    if fits:
        fix = f"lower --keep-checkpoints to {fits[-1]}"
    elif every:
        fix = f"drop --keep-every {every}" + ("" if ckptsize.retained_peak(steps, interval, 1, 0, best) * each <= free else
                                               ", free space or choose another --output-dir")
    elif keep == 0:
        fix = "set --keep-checkpoints (e.g. 3)" + ("" if 2 * each <= free else ", and free space or choose another --output-dir")
    else:
        fix = f"free {_size(need - free)} or choose another --output-dir"
    return (f"--output-dir {values.get('output_dir')}: {slots} checkpoints of {_size(each)} each ({why}) need "
            f"{_size(need)}, {disk.get('measured_at')} has {_size(free)} free; {fix}")
