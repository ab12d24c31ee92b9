"""Wire formats shared by the agent, the trainer and the controller.

Standard library only: this module is imported inside containers (agent, trainer) and on
the operator's machine (controller). Changing a name here changes a contract; bump
PROTOCOL_VERSION when a change is not backward compatible.
"""

from __future__ import annotations

import enum
import json
import os
import tempfile
from typing import Any, Iterator

PROTOCOL_VERSION = 1

# Machine-readable replies are printed between these lines, so that login banners, a
# noisy .bashrc or a locale warning on the same stdout cannot corrupt them.
# (SkyPilot does the same with <sky-payload>; research/proxmox-and-supervision.md §1.1.)
BEGIN = "<<<DFLASH-CTL-PAYLOAD>>>"
END = "<<<END-DFLASH-CTL-PAYLOAD>>>"


def wrap_payload(obj: Any) -> str:
    """One JSON document between sentinel lines, protocol version included."""
    body = dict(obj) if isinstance(obj, dict) else {"value": obj}
    body.setdefault("protocol", PROTOCOL_VERSION)
    return f"{BEGIN}\n{json.dumps(body, sort_keys=True)}\n{END}\n"


class PayloadError(ValueError):
    pass


def extract_payload(text: str) -> dict:
    """The last sentinel-wrapped JSON document in ``text``; noise around it is ignored."""
    end = text.rfind(END)
    start = text.rfind(BEGIN, 0, end if end >= 0 else None)
    if start < 0 or end < 0:
        raise PayloadError("no payload between sentinel lines in the reply")
    body = text[start + len(BEGIN):end].strip()
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        raise PayloadError(f"payload is not JSON: {exc}") from exc
    if obj.get("protocol") != PROTOCOL_VERSION:
        raise PayloadError(f"protocol {obj.get('protocol')} != {PROTOCOL_VERSION}: agent and controller versions differ")
    return obj


# --- run directory layout (DESIGN.md: contracts) -----------------------------------------
SPEC = "spec.json"
START_SCRIPT = "start.sh"
FINGERPRINT = "fingerprint.json"
STATUS = "status.json"
STREAM = "stream.jsonl"
OUTPUT_LOG = "output.log"
RESULT = "result.json"
EVENTS = "events.jsonl"  # written by the trainer
HEARTBEAT_DIR = "heartbeat"  # heartbeat/rank-N, written by the trainer
ENV_RUN_DIR = "DFLASH_RUN_DIR"  # the agent passes the run directory to the job in this variable

# Added for the agent (issue 3). The job's stdout/stderr go to these files, never to a pipe
# owned by the agent, so the job outlives an agent that dies and a re-attached agent reads on
# from its recorded offsets (research §4.8: silent log loss).
JOB_STDOUT = "job.stdout"
JOB_STDERR = "job.stderr"
JOB_PID = "job.pid"  # {"pid","starttime","boot_id","marker"}: the job monitor (PID-reuse guard)
# The trainer's "stopped on request after a checkpoint" exit code (trainer/flags.py
# EXIT_STOPPED), repeated here because the agent never imports the trainer.
TRAINER_EXIT_STOPPED = 75
JOB_EXIT = "job.exit.json"  # written by the job monitor when the job's top process exits
AGENT_PID = "agent.pid"  # same shape, for the supervising agent
AGENT_LOCK = "agent.lock"  # flock held by the one process allowed to append to stream.jsonl
AGENT_LOG = "agent.log"  # the agent's own stderr (tracebacks of the agent itself)
STOP_REQUEST = "stop-request.json"  # written by `agent stop`, acted on by the live agent
STREAM_INDEX = "stream.idx"  # recovery checkpoint of stream.jsonl (bytes, seq, source offsets)
ENV_RUN_ID = "DFLASH_RUN_ID"  # run marker in every job process's environment (stop sweeps by it)
# On a restart (--max-restarts) the agent replaces a start flag it finds in the job argv by
# --resume-from CKPT; it also sets this variable, so a start script whose flags are inside
# it (bash start.sh) can do the same replacement.
ENV_RESUME_FROM = "DFLASH_RESUME_FROM"
ENV_WORKSPACE = "DFLASH_WORKSPACE"  # agent default workspace; runs live in <workspace>/runs/<id>
DEFAULT_WORKSPACE = "/workspace"

# `agent follow --run ID --from SEQ` prints the records with seq > SEQ: seq starts at 1, so
# `--from 0` is the whole stream and a client reconnects with the last seq it saw. The last
# record of a finished run is a "status" record whose payload state is terminal.
FIRST_SEQ = 1


class RunState(str, enum.Enum):
    """Life of a run::

        STARTING ──▶ RUNNING ──▶ STOPPING ──▶ STOPPED
            │           │  ▲                     (stopped on request, after checkpoint)
            │           │  └── RESTARTING (--max-restarts budget left)
            │           ├──▶ COMPLETED   (job exited 0)
            └───────────┴──▶ FAILED      (named reason in result.json)

    A store refuses to leave a terminal state.
    """

    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED = "stopped"

    def is_terminal(self) -> bool:
        return self in (RunState.COMPLETED, RunState.FAILED, RunState.STOPPED)


class StreamKind(str, enum.Enum):
    """``kind`` of a stream record: ``{"seq", "ts", "kind", "payload"}``."""

    LOG = "log"  # payload: {"stream": "stdout"|"stderr", "line": str, "rank": int|None}
    EVENT = "event"  # payload: a trainer event (below) or an agent event (failure, stop, restart)
    GPU = "gpu"  # payload: {"gpus": [sample...]} or {"gpus": [], "state": "no GPU", "reason": str}
    STATUS = "status"  # payload: the status.json document at a state change and at the end


# Trainer events (one JSON object per line in events.jsonl). Common keys: ts, rank, role,
# gpu, kind. Kinds and their extra keys:
#   phase       phase: loading|probing|training|saving|evaluating|done|stopping
#   step        step, total_steps, epoch, loss, ce, kl, cap, lr, grad_norm, tokens,
#               tokens_per_s, drafted_per_s, acc (per-slot accuracy list), mem_peak_mib, wait_s
#   checkpoint  step, path
#   eval        step, tau
#   error       error (cuda_oom|exception|nccl_timeout), message, traceback
#   probe       peak_mib per role/gpu, fits, budget
EVENT_KINDS = ("phase", "step", "checkpoint", "eval", "error", "probe")

# Agent events (stream kind "event", payload key "kind" = "agent.<name>"): the agent's own
# observations, next to the trainer's events. "agent.failure" carries "failure" (one of
# FAILURE_KINDS), "rank", "gpu", "reason" (one line, printed first), "evidence" (log lines).
AGENT_EVENT_KINDS = ("agent.started", "agent.reattached", "agent.failure", "agent.stop_requested",
                     "agent.stop", "agent.restart", "agent.job_exit")
FAILURE_KINDS = ("cuda_oom", "host_oom", "rank_exit", "rank_stall", "nccl_timeout",
                 "throughput_regression", "job_exit",
                 # a job across containers (agent/classify.py classify_comm)
                 "peer_failure", "network_failure")


def atomic_write(path: str, data: str | bytes, mode: int = 0o644) -> None:
    """Write to a temp file in the same directory, fsync, rename: readers never see half."""
    directory = os.path.dirname(os.path.abspath(path)) or "."
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_json(path: str, obj: Any, mode: int = 0o644) -> None:
    atomic_write(path, json.dumps(obj, sort_keys=True, indent=1) + "\n", mode)


def read_json_doc(path: str) -> dict | None:
    """A JSON object from a file; None when it is missing, unreadable or not an object."""
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return None


def read_json_lines(path: str, offset: int = 0) -> Iterator[tuple[int, dict]]:
    """(next offset, record) for each complete line from ``offset``; a torn last line is left."""
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return
    with fh:
        fh.seek(offset)
        for raw in fh:
            if not raw.endswith(b"\n"):
                break
            offset += len(raw)
            try:
                yield offset, json.loads(raw)
            except json.JSONDecodeError:
                continue
