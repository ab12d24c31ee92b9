"""`ctl tail` and `ctl status` of a job across containers: every container's stream merged in
time order, each line labelled ``node:ctid rank N``.

One follower thread per container (each on its own SSH connection, each the same
reconnecting ``controller.tail.tail`` a single-container tail uses) feeds a queue; the main
thread holds records for ``HOLD_S`` and prints them ordered by their ``ts``, so lines from
two containers interleave as they happened (the containers share one clock on the sim; on
real nodes, NTP keeps them within milliseconds, well inside the hold).

Ranks: in a job torchrun prefixes worker lines with ``[local<N>]:`` (``--role local --tee 3``,
trainer/multinode.py); the container's first global rank is the sum of the rank counts of
the containers before it (``--job-layout``), so the global rank is that base plus N.

Fail fast across containers, from the controller's side: while following, when one
container's run has failed and another's is still running ``STOP_PEERS_AFTER_S`` later, the
controller stops it (agent stop: SIGTERM, checkpoint, exit). torch.distributed usually gets
there first (a dead peer's sockets close); this covers a peer that blocks on something else.
"""

from __future__ import annotations

import heapq
import json
import queue
import re
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from agent.protocol import EXIT_STREAM_RUN_FAILED, EXIT_USAGE, RunState, RunStatus
from controller import config as cfg
from controller.container import Container, ContainerError, ContainerStopped
from controller.job import Member
from controller.tail import FOLLOW_AGENT_GONE

# `agent follow` / `agent.runview stream` exit codes that are their answer about the run.
AGENT_ANSWERS = (FOLLOW_AGENT_GONE, EXIT_STREAM_RUN_FAILED, EXIT_USAGE)
from controller.transport import ContainerNotRunning

LAST_LAUNCH = "last-launch.json"


class NoSuchRun(ContainerError):
    """The run named does not exist in the container (bad input: ctl exits 2)."""

    exit_code = 2


class CorruptRun(ContainerError):
    """A state file of the run is not its record: the status cannot be known (ctl exits 1)."""

    exit_code = 1

# --- where: remembered last launch ------------------------------------------------------------

def last_launch_path(ctl_config: Optional[str]) -> Path:
    return cfg.config_path(ctl_config).parent / LAST_LAUNCH


def remember(ctl_config: Optional[str], node: str, container: str, run_id: str) -> None:
    from agent.protocol import atomic_write_json

    path = last_launch_path(ctl_config)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(str(path), {"node": node, "container": container, "run_id": run_id, "ts": time.time()})
    except OSError:
        pass  # a convenience only; never fail a launch over it


# --- stream source over the product's exec path ------------------------------------------------

class ContainerStream:
    """tail.StreamSource for one container: `agent follow` live, `agent.runview stream` once."""

    def __init__(self, ct: Container, caller):
        self.ct = ct
        self.caller = caller
        self.workspace = ct.config.workspace

    def follow(self, run_id: Optional[str], after: int, on_line, *, once: bool) -> int:
        """``run_id`` None (``once`` only): the container's latest run, resolved in the same call."""
        named = ["--run", run_id] if run_id else []
        if once:
            module, args = "agent.runview", ["stream", "--workspace", self.workspace, *named, "--from", after]
        else:
            module, args = "agent", ["follow", "--workspace", self.workspace, *named, "--from", after]
        try:
            result = self.caller.run(module, args, capture=False, on_stdout=on_line)
        except ContainerStopped as exc:
            # stopped under the follow (a restart): reconnect once it is back, then say so
            raise ContainerNotRunning(str(exc)) from None
        # The agent's own codes are its answers, whatever their words ("the agent … is not
        # running" once read as pct's "not running" and looped a follower for good).
        if result.failed and result.returncode not in AGENT_ANSWERS and Container.looks_unreachable(result):
            raise ContainerNotRunning(f"container {self.ct.ctid} was not running: {result.tail('stderr', 1)}")
        if result.failed and result.returncode != FOLLOW_AGENT_GONE:
            tail = result.tail("stderr", 3)
            if "no run directory" in tail:
                raise NoSuchRun(f"no run {run_id!r} in container {self.ct.ctid}: `ctl runs --container "
                                f"{self.ct.ctid}` lists them")
            if "no runs in" in tail:
                raise NoSuchRun(f"container {self.ct.ctid}: {tail.strip().split(': ', 1)[-1]}")
        return result.returncode

    def state(self, run_id: str) -> dict:
        from controller.agentcall import AgentCallError

        try:
            reply = self.caller.call("agent.runview", ["status", "--workspace", self.workspace, "--run", run_id])
        except ContainerStopped as exc:
            raise ContainerNotRunning(str(exc)) from None
        except AgentCallError as exc:
            if exc.result is not None and Container.looks_unreachable(exc.result):  # stopped, and already back
                raise ContainerNotRunning(f"container {self.ct.ctid} was not running") from None
            raise
        if not reply.get("ok"):
            # A run that cannot be read (a corrupt state file, gone) ends the follow with its
            # one line: asking again would never get a better answer (it used to hang).
            raise CorruptRun(f"container {self.ct.ctid}: {reply.get('error')}")
        return dict(reply.get("status") or {}, _reply=reply)

    def revive(self, run_id: str) -> bool:
        """The run's agent is gone: start one that re-attaches (the stream goes on from where
        it was, nothing lost or repeated); False when the run's --revive is 0 or it failed."""
        import sys

        from controller.agentcall import AgentCallError

        run_dir = f"{self.workspace}/runs/{run_id}"
        try:
            reply = self.caller.call("agent", ["start", "--run-dir", run_dir, "--reattach", "--auto", "--by", "ctl tail"],
                                     what="re-attaching an agent")
        except AgentCallError as exc:
            reply = {"error": str(exc)}
        if not reply.get("ok"):
            print(f"ctl: the agent of run {run_id} is gone and no new one started: {reply.get('error')}", file=sys.stderr)
            return False
        print(f"ctl: the agent of run {run_id} was gone; agent pid {reply.get('agent_pid')} supervises it now, "
              "following on", file=sys.stderr)
        return True


HOLD_S = 1.0
STOP_PEERS_AFTER_S = 5.0
_LOCAL = re.compile(r"^\[local(\d+)\]:\s?")


def rank_bases(members: list[Member]) -> dict[str, int]:
    bases, n = {}, 0
    for m in members:
        bases[m.label] = n
        n += len(m.target_gpus) if m.colocated else len(m.target_gpus) + len(m.drafter_gpus)
    return bases


def label_record(rec: dict, m: Member, base: int) -> dict:
    """The record with node/container and, for a log line, the global rank."""
    rec = dict(rec, node=m.node, container=m.ctid)
    payload = rec.get("payload") or {}
    if rec.get("kind") == "log":
        line = payload.get("line", "")
        mm = _LOCAL.match(line)
        if mm:
            payload = dict(payload, rank=base + int(mm.group(1)), line=line[mm.end():])
        elif payload.get("rank") is None and (len(m.target_gpus) + len(m.drafter_gpus) == 1 or
                                              (m.colocated and len(m.target_gpus) == 1)):
            payload = dict(payload, rank=base)  # one rank in this container: it said it
        rec["payload"] = payload
    return rec


def merged(members: list[Member], sources: list, run_id: str, write: Callable[[str], None], *, follow: bool,
           raw: bool = False, stop: Optional[Callable[[Member], None]] = None, since: int = 0) -> dict:
    """Follow (or print once) every member's stream, merged in time order. Returns each
    stream's TailResult by label and the containers this controller stopped."""
    from controller.tail import Printer, tail

    bases = rank_bases(members)
    q: queue.Queue = queue.Queue()
    results: dict[str, object] = {}
    printers = {}
    for m in members:
        prefix = f"{m.label} "

        def w(line: str, prefix=prefix) -> None:
            write(prefix + line)

        printers[m.label] = Printer(w, raw=raw)

    def run(m: Member, source) -> None:
        try:
            results[m.label] = tail(source, run_id, lambda rec: q.put((rec.get("ts") or time.time(), m.label, rec)),
                                    since=since, follow=follow)
        except BaseException as exc:  # noqa: BLE001 — reported by the main thread
            results[m.label] = exc
        finally:
            q.put(m.label)  # this stream has ended

    threads = [threading.Thread(target=run, args=(m, s), daemon=True) for m, s in zip(members, sources)]
    for t in threads:
        t.start()
    by_label = {m.label: m for m in members}
    heap: list = []
    seq = 0
    done = 0
    failed_at: Optional[float] = None
    stopped: set[str] = set()

    def flush(until: float) -> None:
        while heap and heap[0][0] <= until:
            ts, _, label, rec = heapq.heappop(heap)
            m = by_label[label]
            rec = label_record(rec, m, bases[label])
            if raw:
                write(json.dumps(rec, sort_keys=True))
                continue
            payload = rec.get("payload") or {}
            if rec.get("kind") == "log" and payload.get("rank") is not None:
                write(f"{label} rank {payload['rank']} | {payload.get('line', '')}")
            else:
                printers[label](rec)

    # Merge by watermark: a record is printed once every stream still open has delivered
    # something at least as late (so a backlog replays in true order), or — following a live
    # run — once a quiet stream has been silent for HOLD_S (it cannot block the others).
    last_ts: dict[str, float] = {m.label: float("-inf") for m in members}
    last_seen: dict[str, float] = {m.label: time.monotonic() for m in members}
    open_streams = set(last_ts)
    while done < len(threads):
        try:
            item = q.get(timeout=0.2)
        except queue.Empty:
            item = ()
        if isinstance(item, str):
            done += 1
            open_streams.discard(item)
        elif item:
            ts, label, rec = item
            seq += 1
            heapq.heappush(heap, (float(ts), seq, label, rec))
            last_ts[label] = max(last_ts[label], float(ts))
            last_seen[label] = time.monotonic()
            payload = rec.get("payload") or {}
            if rec.get("kind") == "status" and failed_at is None and \
                    RunStatus.from_json(payload).state == RunState.FAILED:
                failed_at = time.monotonic()
        now = time.monotonic()
        marks = [last_ts[l] if not follow or now - last_seen[l] < HOLD_S else max(last_ts[l], time.time() - HOLD_S)
                 for l in open_streams]
        flush(min(marks) if marks else float("inf"))
        if follow and stop and failed_at is not None and time.monotonic() - failed_at >= STOP_PEERS_AFTER_S:
            for m in members:
                r = results.get(m.label)
                if r is None and m.label not in stopped:  # still following: its run goes on
                    stopped.add(m.label)
                    write(f"{m.label} ctl: another container of the job failed; stopping this one")
                    stop(m)
    flush(float("inf"))
    for t in threads:
        t.join(5)
    errors = {k: v for k, v in results.items() if isinstance(v, BaseException)}
    if errors:
        label, exc = next(iter(errors.items()))
        raise exc
    return {"results": results, "stopped": sorted(stopped)}


def statuses(members: list[Member], callers: list, run_id: str) -> list[tuple[Member, dict]]:
    out = []
    for m, caller in zip(members, callers):
        ct = caller.ct
        reply = caller.call("agent.runview", ["status", "--workspace", ct.config.workspace, "--run", run_id],
                            what=f"run status in {m.label}")
        out.append((m, reply))
    return out

