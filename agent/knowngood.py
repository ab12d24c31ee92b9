"""The container's known-good baseline: the environment, data statistics and throughput of
the last run that reached steady state. Later launches report drift against it.

Who records it and when: the container side, because it sees the run's events first and
needs no controller attached. ``update(workspace)`` is idempotent and cheap; it runs inside
every launch preflight (and ``ctl status``), and any long-lived process may call it. It reads
the launch records ``ctl launch`` left in ``<workspace>/.dflash-ctl/launches/<run-id>.json``
(config name, env fingerprint and data statistics taken right before the start) and the
run's ``events.jsonl``; a run whose step events show ``steady_steps`` steps in a row with
tokens/s within ``throughput_tolerance`` of their median becomes the baseline. The record
is written atomically: a reader sees the old baseline or the new one, never half.

Standard library only (runs in the container under the container's own python).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Iterable, Optional

from agent.protocol import EVENTS, atomic_write_json, read_json_lines

STATE_DIR = ".dflash-ctl"
KNOWN_GOOD = "known-good.json"
LAUNCHES = "launches"
RECORD_VERSION = 1


def state_dir(workspace: str) -> str:
    return os.path.join(workspace, STATE_DIR)


def known_good_path(workspace: str) -> str:
    return os.path.join(state_dir(workspace), KNOWN_GOOD)


def launch_record_path(workspace: str, run_id: str) -> str:
    return os.path.join(state_dir(workspace), LAUNCHES, f"{run_id}.json")


def run_dir(workspace: str, run_id: str) -> str:
    return os.path.join(workspace, "runs", run_id)


def steady_state(steps: Iterable[dict], steady_steps: int, tolerance: float) -> Optional[dict]:
    """The first point where throughput has settled: the median tokens/s of the last
    ``steady_steps`` step events (one rank's) is within ``tolerance`` (relative) of the median
    of the ``steady_steps`` before them. None until then.

    Medians of windows, not every single step: one slow step (a checkpoint save, a noisy
    neighbour on the node) must not keep a run from ever counting as steady, while a
    ramp-up (warming caches, growing batches) still shows as a change between windows. The
    first step never counts: it carries start-up.
    """
    import statistics  # here: a `ctl status` that finds nothing new to measure need not pay for it

    series = [s for s in steps if isinstance(s.get("tokens_per_s"), (int, float))]
    if not series:
        return None
    ranks = sorted({s.get("rank", 0) for s in series}, key=lambda r: (r is None, r))
    series = [s for s in series if s.get("rank", 0) == ranks[0]][1:]
    n = steady_steps
    for end in range(2 * n, len(series) + 1):
        before = statistics.median(float(s["tokens_per_s"]) for s in series[end - 2 * n:end - n])
        now = statistics.median(float(s["tokens_per_s"]) for s in series[end - n:end])
        if before > 0 and abs(now - before) <= tolerance * before:
            return {"step": series[end - 1].get("step"), "tokens_per_s": round(now, 3),
                    "window": [series[end - n].get("step"), series[end - 1].get("step")],
                    "previous_tokens_per_s": round(before, 3)}
    return None


def load(workspace: str) -> dict:
    try:
        with open(known_good_path(workspace), encoding="utf-8") as fh:
            doc = json.load(fh)
        if isinstance(doc, dict) and doc.get("version") == RECORD_VERSION:
            return doc
    except (OSError, ValueError):
        pass
    return {"version": RECORD_VERSION, "env": None, "configs": {}, "checked": []}


def _step_events(run: str) -> list[dict]:
    return [rec for _, rec in read_json_lines(os.path.join(run, EVENTS)) if rec.get("kind") == "step"]


def update(workspace: str, now: Optional[float] = None) -> dict:
    """Fold every launch record not yet judged into the known-good record; return it.

    A launch is judged once it reached steady state (→ baseline) or its run ended without it
    (→ never a baseline). A launch that accepted drift becomes the baseline only once its
    run completed. Runs still going are looked at again next time.
    """
    doc = load(workspace)
    directory = os.path.join(state_dir(workspace), LAUNCHES)
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return doc
    checked = set(doc.get("checked", []))
    changed = False
    records = []
    for name in names:
        if not name.endswith(".json") or name[:-5] in checked:
            continue
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as fh:
                records.append(json.load(fh))
        except (OSError, ValueError):
            continue
    for rec in sorted(records, key=lambda r: r.get("ts", 0)):
        run_id = rec.get("run_id")
        if not run_id:
            continue
        if (rec.get("kind") or "train") != "train":  # a data job (trainer/kinds.py) is never a training baseline
            checked.add(run_id)
            changed = True
            continue
        base = rec.get("baseline") or {}
        run = run_dir(workspace, run_id)
        steady = steady_state(_step_events(run), int(base.get("steady_steps", 20)),
                              float(base.get("throughput_tolerance", 0.25)))
        if steady is None:
            if _finished(run) or not os.path.isdir(run):
                checked.add(run_id)
                changed = True
            continue
        if rec.get("accepted_drift"):
            # Launched on an environment that differed from the known good: steady speed is
            # not enough (the story's run OOMed later, not at ramp-up); it must complete.
            state = _state(run)
            if state != "completed":
                if _finished(run) or not os.path.isdir(run):
                    checked.add(run_id)
                    changed = True
                continue
        entry = {"run_id": run_id, "ts": now or time.time(), "launched": rec.get("ts"),
                 "steady": steady, "config": rec.get("config")}
        doc["env"] = {**entry, "fingerprint": rec.get("fingerprint")}
        if rec.get("config"):
            doc.setdefault("configs", {})[rec["config"]] = {
                **entry, "data_dir": rec.get("data_dir"), "data": rec.get("data"),
                "gpus": rec.get("gpus")}
        checked.add(run_id)
        changed = True
    if changed:
        doc["checked"] = sorted(checked)
        os.makedirs(state_dir(workspace), exist_ok=True)
        atomic_write_json(known_good_path(workspace), doc)
    return doc


def _state(run: str) -> Optional[str]:
    from agent.protocol import STATUS, RunStatus

    try:
        state = RunStatus.load(os.path.join(run, STATUS)).state
    except ValueError:
        return None
    return state.value if state else None


def _finished(run: str) -> bool:
    """The run reached a terminal state (status.json says so, or result.json exists)."""
    from agent.protocol import RESULT, STATUS, RunStatus

    if os.path.exists(os.path.join(run, RESULT)):
        return True
    try:
        return RunStatus.load(os.path.join(run, STATUS)).terminal
    except ValueError:
        return False


def write_launch_record(workspace: str, record: dict[str, Any]) -> str:
    path = launch_record_path(workspace, record["run_id"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_json(path, record)
    return path
