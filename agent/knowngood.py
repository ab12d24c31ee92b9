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


HISTORY_KEEP = 20  # earlier baselines kept, to fall back to when a provisional one is taken back


def update(workspace: str, now: Optional[float] = None) -> dict:
    """Fold every launch record not yet judged into the known-good record; return it.

    What becomes known good: a run that reached steady state — ``2 × steady_steps`` step
    events whose throughput settled (``steady_state``) — and did not fail. A run still going
    when it reaches steady state is known good provisionally ("pending"): if it then ends
    FAILED it is taken back and the baseline before it returns; a run that ended in a
    failure never becomes known good, so a rollback never restores what failed. A launch that
    accepted drift becomes the baseline only once its run completed. Runs still going are
    looked at again next time.
    """
    doc = load(workspace)
    directory = os.path.join(state_dir(workspace), LAUNCHES)
    changed = _settle_pending(workspace, doc)
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        names = []
    checked = set(doc.get("checked", []))
    records = []
    for name in names:
        if not name.endswith(".json") or name[:-5] in checked:
            continue
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as fh:
                rec = json.load(fh)
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict):
            records.append(rec)
    for rec in sorted(records, key=lambda r: r.get("ts", 0) if isinstance(r.get("ts"), (int, float)) else 0):
        run_id = rec.get("run_id")
        if not isinstance(run_id, str) or not run_id:
            continue
        if (rec.get("kind") or "train") != "train":  # a data job (trainer/kinds.py) is never a training baseline
            checked.add(run_id)
            changed = True
            continue
        base = rec.get("baseline") or {}
        run = run_dir(workspace, run_id)
        state = _state(run)
        if state == "failed":  # ended in a failure: never a baseline, however steady it was
            checked.add(run_id)
            changed = True
            continue
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
            if state != "completed":
                if _finished(run) or not os.path.isdir(run):
                    checked.add(run_id)
                    changed = True
                continue
        entry = {"run_id": run_id, "ts": now or time.time(), "launched": rec.get("ts"),
                 "steady": steady, "config": rec.get("config")}
        _push(doc, "env", {**entry, "fingerprint": rec.get("fingerprint")})
        if rec.get("config"):
            _push(doc, "configs", {**entry, "data_dir": rec.get("data_dir"), "data": rec.get("data"),
                                   "gpus": rec.get("gpus")}, rec["config"])
        if not _finished(run):
            doc["pending"] = sorted(set(doc.get("pending") or []) | {run_id})
        checked.add(run_id)
        changed = True
    if changed:
        doc["checked"] = sorted(checked)
        os.makedirs(state_dir(workspace), exist_ok=True)
        atomic_write_json(known_good_path(workspace), doc)
    return doc


def _push(doc: dict, key: str, entry: dict, config: Optional[str] = None) -> None:
    """Make ``entry`` the baseline (env, or the config's), keeping the one it replaces."""
    history = doc.setdefault("history", {})
    slot = f"config:{config}" if config else "env"
    old = doc.get("env") if config is None else (doc.get("configs") or {}).get(config)
    if old:
        history[slot] = ([*history.get(slot, []), old])[-HISTORY_KEEP:]
    if config is None:
        doc[key] = entry
    else:
        doc.setdefault("configs", {})[config] = entry


def _settle_pending(workspace: str, doc: dict) -> bool:
    """Provisional baselines whose runs have ended since: kept when they did not fail, taken
    back (the previous baseline returns) when they did."""
    pending = list(doc.get("pending") or [])
    if not pending:
        return False
    left = []
    for run_id in pending:
        run = run_dir(workspace, run_id)
        if _state(run) == "failed":
            _revoke(doc, run_id)
        elif not (_finished(run) or not os.path.isdir(run)):
            left.append(run_id)
    doc["pending"] = left
    return left != pending


def _revoke(doc: dict, run_id: str) -> None:
    history = doc.setdefault("history", {})
    for slot in list(history):
        history[slot] = [e for e in history[slot] if e.get("run_id") != run_id]
    if (doc.get("env") or {}).get("run_id") == run_id:
        earlier = history.get("env") or []
        doc["env"] = earlier[-1] if earlier else None
        history["env"] = earlier[:-1]
    for config, entry in list((doc.get("configs") or {}).items()):
        if (entry or {}).get("run_id") == run_id:
            earlier = history.get(f"config:{config}") or []
            if earlier:
                doc["configs"][config] = earlier[-1]
                history[f"config:{config}"] = earlier[:-1]
            else:
                del doc["configs"][config]


def _state(run: str) -> Optional[str]:
    """The run's state: result.json's (final) when there is one, else status.json's."""
    from agent.protocol import RESULT, STATUS, RunResult, RunStatus

    for load, name in ((RunResult.load, RESULT), (RunStatus.load, STATUS)):
        try:
            rec = load(os.path.join(run, name))
        except ValueError:  # corrupt (agent/protocol.py CorruptFile): ask the other
            continue
        if rec is not None and rec.state is not None:
            return rec.state.value
    return None


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
