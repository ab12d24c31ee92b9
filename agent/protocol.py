"""Wire formats shared by the agent, the trainer and the controller.

Standard library only: this module is imported inside containers (agent, trainer) and on
the operator's machine (controller). Changing a name here changes a contract; bump
PROTOCOL_VERSION when a change is not backward compatible.
"""

from __future__ import annotations

import enum
import json
import os
from typing import Any, Iterator

from agent.records import Factory, asdict, fields, record

PROTOCOL_VERSION = 1

# Machine-readable replies are printed between these lines, so that login banners, a
# noisy .bashrc or a locale warning on the same stdout cannot corrupt them.
# (SkyPilot does the same with <sky-payload>; docs/research/proxmox-and-supervision.md §1.1.)
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


# --- run directory layout (docs/design.md: contracts) -----------------------------------------
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

# The job's stdout/stderr go to these files, never to a pipe owned by the agent, so the job
# outlives an agent that dies and a re-attached agent reads on from its recorded offsets
# (docs/research/proxmox-and-supervision.md §4.8: silent log loss).
JOB_STDOUT = "job.stdout"
JOB_STDERR = "job.stderr"
JOB_PID = "job.pid"  # {"pid","starttime","boot_id","marker"}: the job monitor (PID-reuse guard)
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

# --- run ids: the one grammar, made by new_run_id and checked by every command that takes
# one (`ctl … --run ID` before anything is sent; the agent before it builds a path from it).
# <config name>-<UTC YYYYmmdd>-<HHMMSS>-<4 hex digits>; the config name starts with a letter
# or digit (controller/runconfig.py holds it to RUN_NAME_PATTERN), so no id is empty, names
# a path or reads as an option.
RUN_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
RUN_ID_PATTERN = RUN_NAME_PATTERN + r"-[0-9]{8}-[0-9]{6}-[0-9a-f]{4}"
RUN_ID_EXAMPLE = "tiny-20261201-114702-3fa9"


def new_run_id(config_name: str, now: float | None = None) -> str:
    """Sortable by start time, unique without asking the container: name-YYYYmmdd-HHMMSS-xxxx."""
    import secrets
    import time

    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now or time.time()))
    run_id = f"{config_name}-{stamp}-{secrets.token_hex(2)}"
    problem = run_id_problem(run_id)
    if problem:
        raise ValueError(problem)
    return run_id


def run_id_problem(run_id: Any) -> str | None:
    """None for an id of the grammar above; else one line saying what is wrong and the fix."""
    import re

    if not isinstance(run_id, str) or not run_id:
        return (f"--run {run_id!r}: a run id cannot be empty; name one (`ctl runs` lists them), or leave --run "
                "out for the latest run")
    if re.fullmatch(RUN_ID_PATTERN, run_id):
        return None
    if run_id.startswith("-"):
        why = "it reads as an option"
    elif "/" in run_id or run_id in (".", ".."):
        why = "it is a path, not a run id"
    else:
        why = "not a run id ctl launch makes"
    return (f"--run {run_id!r}: {why}; a run id is NAME-YYYYmmdd-HHMMSS-xxxx, e.g. {RUN_ID_EXAMPLE} "
            "(`ctl runs` lists them)")


class BadRunId(ValueError):
    """A `--run` given to an agent verb that is not a run id: run_id_problem's line."""


def check_run_arg(run: Any) -> None:
    """An agent verb's `--run`: None (the verb's default run) or a run id; BadRunId for anything
    else, so no empty id, path or option-like value is ever joined into a path in the container."""
    problem = None if run is None else run_id_problem(run)
    if problem:
        raise BadRunId(problem)


def run_path(workspace: str, run: str) -> str:
    """<workspace>/runs/<run> for a run id of the grammar (BadRunId otherwise)."""
    check_run_arg(run)
    return os.path.join(workspace, "runs", run)


# `agent follow --run ID --from SEQ` prints the records with seq > SEQ: seq starts at 1, so
# `--from 0` is the whole stream and a client reconnects with the last seq it saw. The last
# record of a finished run is a "status" record whose payload state is terminal.
FIRST_SEQ = 1

# --- exit codes: every part's, in one place (trainer/flags.py re-exports the trainer's) ------
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2  # bad input, nothing written (trainer, agent verbs)
EXIT_STOPPED = 75  # the trainer stopped on request after a checkpoint (EX_TEMPFAIL: resumable)
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, the shell's convention): stopped, nothing written
# `agent follow`: the agent is gone and the run has not finished, so the stream would never
# end (docs/research/proxmox-and-supervision.md §4.8, ray#57002): re-attach, then follow again.
EXIT_AGENT_GONE = 3
# `ctl tail --follow` (and `ctl launch --follow`): the run died because its container restarted
# or its node rebooted (every process of it is gone; resume from its last checkpoint).
EXIT_CONTAINER_RESTARTED = 5
# `agent.runview stream` (what exists now): the stream's last status record says the run
# failed, whether it was printed or lay before --from (`ctl tail --since` past it still exits
# as the tail of a failed run does).
EXIT_STREAM_RUN_FAILED = 6
EXIT_SPAWN_FAILED = 127  # the job monitor could not start the job's command (the shell's code)
# `python3 -m agent.envgen`: a refusal (nothing changed) is told apart from a failure.
ENVGEN_EXIT_FAILED = 1
ENVGEN_EXIT_REFUSED = 2


class RunState(str, enum.Enum):
    """Life of a run. Every allowed change, one line per state (agent/state.py's
    TRANSITIONS is this table; tests/test_agent_units.py holds the two to each other)::

        STARTING   → RUNNING | STOPPING | COMPLETED | FAILED
        RUNNING    → RESTARTING | STOPPING | COMPLETED | FAILED
        RESTARTING → RUNNING | STOPPING | FAILED
        STOPPING   → STOPPED | COMPLETED | FAILED

    RESTARTING: a failure with --max-restarts budget left. STOPPING: a stop was requested
    (or the trainer exited EXIT_STOPPED); it still ends COMPLETED if the job finished first,
    FAILED if the stop itself went wrong. COMPLETED: the job exited 0. FAILED: a named reason
    in result.json. STOPPED: on request, after a checkpoint. A store refuses to leave a
    terminal state.
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
    ALERT = "alert"  # payload: an agent.alerts.Alert (id, kind, run, cause, next, ...), before it is sent


# Trainer events (one JSON object per line in events.jsonl). Common keys: ts, rank, role,
# gpu, kind. Kinds and their extra keys:
#   phase       phase: loading|probing|training|saving|evaluating|done|stopping (train; "training"
#               carries paths: each kernel and precision the run takes, its reason, and "missing",
#               the faster paths not taken with their install commands: trainer/paths.py);
#               serving|regenerating|done|stopping (regenerate: role "regenerate", rank null)
#   step        step, total_steps, epoch, loss, ce, kl, cap, lr, grad_norm, tokens,
#               tokens_per_s, drafted_per_s, acc (per-slot accuracy list), mem_peak_mib, wait_s
#   checkpoint  step, path
#   eval        step, tau, by_category ({source: tau}), best_step, best_tau (the checkpoint
#               retention keeps and `ctl export --best` exports)
#   error       error (cuda_oom|exception|nccl_timeout; serve: regenerate's --serve server did not come up), message, traceback
#   probe       peak_mib per role/gpu, fits, budget
#   launch      (the launching parent, rank null) rdzv_endpoint, nproc, ranks [{rank, role, gpu}]: the
#               ranks this container will run, before torchrun starts them (the start-up deadline
#               names the ones that never heartbeat)
#   progress    (a data job: python -m trainer regenerate) done, failed, skipped, total (input rows;
#               done + failed + skipped = total once the input is gone through), skipped_by_cause,
#               in_flight, requests, output_tokens, elapsed_s, requests_per_s, output_tokens_per_s,
#               eta_s (null until a row finished); the last one of a run adds final: true and
#               stopped (true: SIGTERM, resumable)
#               Any data job may send one (trainer/kinds.py; prepare: samples, tokens, bytes_done,
#               bytes_total, samples_per_s, tokens_per_s, eta_s); rates are named <what>_per_s.
#               The agent keeps the last one as status.json's "progress"; a job that sends one
#               has started.
#   served_check_due  (train, --served-check-every K) step, checkpoint, gpu, threads, vllm_python: this
#               save is due a served check; the run's agent starts the served-check job for it
#               (agent/servedcheck.py). The trainer only says it: it never waits for the check.
#   served_check  a ServedCheck record (below): served τ of a checkpoint beside its τ at save;
#               written by the served-check job into its own events.jsonl and the checked run's
EVENT_KINDS = ("phase", "step", "checkpoint", "eval", "error", "probe", "launch", "progress", "served_check_due",
               "served_check")
PROGRESS_META = ("ts", "kind", "rank", "role", "gpu")  # event keys that are not progress fields

# Agent events (stream kind "event", payload key "kind" = "agent.<name>"): the agent's own
# observations, next to the trainer's events. "agent.failure" carries "failure" (a
# FailureKind), "rank", "gpu", "reason" (one line, printed first), "evidence" (log lines).
# "agent.served_check": a served check started (run_id), queued behind the live one (queued,
# superseded_step: the queued one it replaced) or not started (ok false, error), for step.
AGENT_EVENT_KINDS = ("agent.started", "agent.reattached", "agent.failure", "agent.stop_requested",
                     "agent.stop", "agent.restart", "agent.job_exit", "agent.served_check")


class FailureKind(str, enum.Enum):
    """What a classified failure was (agent/classify.py names them, docs/agent.md explains)."""

    CUDA_OOM = "cuda_oom"
    HOST_OOM = "host_oom"
    RANK_EXIT = "rank_exit"
    RANK_STALL = "rank_stall"
    NCCL_TIMEOUT = "nccl_timeout"
    THROUGHPUT_REGRESSION = "throughput_regression"
    JOB_EXIT = "job_exit"
    # a job across containers (agent/classify.py classify_comm)
    PEER_FAILURE = "peer_failure"
    NETWORK_FAILURE = "network_failure"
    STARTUP_TIMEOUT = "startup_timeout"  # a rank sent no heartbeat within --startup-timeout
    # every process of the run went with its container's restart / its node's reboot
    CONTAINER_RESTART = "container_restart"
    NODE_REBOOT = "node_reboot"
    # a data job's own failure, in its words (its `error` event): rows that failed, or an
    # accounting that does not add up — never a training rank's "exited with code 1"
    ROWS_FAILED = "rows_failed"
    DATA_JOB = "data_job"


# --- status.json and result.json --------------------------------------------------------------
# One typed record per file: the agent writes them only through to_json(), and every reader
# (the agent re-attaching, `agent list`, the controller's status, tail and job views) reads them
# only through from_json(). Unknown keys are ignored and missing ones take their defaults, so
# a reader of a newer or older agent's file still gets a record.

class CorruptFile(ValueError):
    """A state file that exists but is not its record (torn by hand, emptied, garbage):
    readers say it in one line naming the file, never a traceback, never act on a guess."""

    def __init__(self, path: str, why: str):
        self.path, self.why = path, why
        super().__init__(f"{path} is corrupt: {why}")


# Annotation names of the record fields → the JSON types they accept (bool is never a number).
_JSON_TYPES = {"str": (str,), "int": (int,), "float": (int, float), "list": (list,), "dict": (dict,),
               "RunState": (str,), "Checkpoint": (dict,), "RankHealth": (dict,)}


def _type_problem(annotation: str, value: Any) -> str | None:
    """Why ``value`` does not fit the field's annotation (a string: annotations are lazy)."""
    if value is None:
        return None if "None" in annotation or "=" in annotation else "is null"
    kinds = [part.strip().split("[")[0] for part in annotation.split("|")]
    allowed = tuple(t for k in kinds for t in _JSON_TYPES.get(k, ()))
    if not allowed or (isinstance(value, allowed) and not isinstance(value, bool)):
        return None
    return f"is {type(value).__name__} {json.dumps(value)[:40]}, not {' or '.join(k for k in kinds if k != 'None')}"


def _pick(cls, doc: Any, where: str | None = None) -> dict:
    """The known fields of ``doc``. With ``where`` (the file it came from) each is checked
    against its type and a misfit raises CorruptFile; without, a non-object is empty."""
    if not isinstance(doc, dict):
        if where is not None:
            raise CorruptFile(where, f"not a JSON object but {type(doc).__name__}")
        doc = {}
    out = {}
    for f in fields(cls):
        if f.name not in doc:
            continue
        if doc[f.name] is None and "None" not in str(f.type):
            continue  # null for a field with a default (restarts, lists): the default
        if where is not None:
            problem = _type_problem(str(f.type), doc[f.name])
            if problem:
                raise CorruptFile(where, f"{f.name!r} {problem}")
        out[f.name] = doc[f.name]
    return out


def load_json_object(path: str) -> dict | None:
    """The JSON object in ``path``; None when the file does not exist; CorruptFile when it
    exists but is empty, unreadable, not UTF-8 JSON, or not an object."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CorruptFile(path, f"unreadable ({exc.strerror})") from None
    if not raw.strip():
        raise CorruptFile(path, "empty file")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptFile(path, f"not JSON ({str(exc).splitlines()[0][:80]})") from None
    if not isinstance(doc, dict):
        raise CorruptFile(path, f"not a JSON object but {type(doc).__name__}")
    return doc


@record(frozen=True)
class Checkpoint:
    """A checkpoint the trainer announced (a ``checkpoint`` event): its step and path."""

    step: int
    path: str

    def to_json(self) -> dict:
        return {"step": self.step, "path": self.path}

    @classmethod
    def from_json(cls, doc: Any) -> "Checkpoint | None":
        if not isinstance(doc, dict) or not doc.get("path"):
            return None
        step = doc.get("step")
        return cls(step if isinstance(step, int) and not isinstance(step, bool) else 0, str(doc["path"]))


@record
class RankHealth:
    """One rank as its heartbeats show it. ``health``: ok | dead | done | not started (planned
    by the trainer's launch event, no heartbeat yet)."""

    step: int | None = None
    pid: int | None = None
    gpu: int | None = None
    role: str | None = None
    heartbeat_age_s: float | None = None
    health: str = "ok"


@record
class RunStatus:
    """status.json: the run as the agent sees it now, rewritten atomically (about once a
    second and at every state change); its copy is the payload of the stream's status
    records. Field names carry their units."""

    run_id: str | None = None
    run_dir: str | None = None
    state: RunState | None = None
    updated: float | None = None  # time.time() of this write
    seq: int = 0  # the stream's last seq at this write
    restarts: int = 0
    agent_pid: int | None = None
    job_pid: int | None = None  # the job monitor's pid (job.pid)
    argv: list[str] | None = None  # the current attempt's job argv
    phase: str | None = None  # the trainer's last phase event
    step: int | None = None
    total: int | None = None  # total optimizer steps
    epoch: float | None = None
    loss: float | None = None
    lr: float | None = None
    tokens_per_s: float | None = None  # the last step event's
    steady_tokens_per_s: float | None = None  # median of the last steps (classify.ThroughputMonitor)
    ranks: dict[int, RankHealth] = Factory(dict)
    launch: dict | None = None  # the trainer's launch event: rdzv_endpoint, nproc, ranks planned
    gpus: list[dict] | None = None  # the last agent/gpus.py sample's records
    gpu_state: str | None = None  # "ok" | "no GPU" | "error"
    gpu_reason: str | None = None  # why there is no GPU sample
    checkpoint: Checkpoint | None = None  # the latest the trainer announced
    progress: dict | None = None  # a data job's last progress event, less PROGRESS_META (plus its ts)
    exit: dict | None = None  # the job's exit status (job.exit.json), once it ended
    last_error: str | None = None  # the last failure's one-line reason
    reason: str | None = None  # why the run ended, once it has
    failures_history: list[dict] = Factory(list)  # per failed attempt: root cause, failures
    # Every time an agent took over a run whose agent was gone: {ts, by, why, agent_pid,
    # previous_agent_pid, seq} (agent/daemon.py: the job's monitor, `ctl status`, `ctl tail`).
    reattaches: list[dict] = Factory(list)
    # The run died with its container or node: {"kind": "container"|"node", "at": the new
    # boot's time.time(), "step": the last completed step} (agent/procs.py restart_since).
    host_restart: dict | None = None

    def to_json(self) -> dict:
        doc = asdict(self)
        doc["state"] = self.state.value if self.state else None
        doc["ranks"] = {str(r): asdict(h) for r, h in sorted(self.ranks.items())}
        doc["checkpoint"] = self.checkpoint.to_json() if self.checkpoint else None
        return doc

    @classmethod
    def from_json(cls, doc: Any, where: str | None = None) -> "RunStatus":
        """``where``: the file ``doc`` came from; its fields are then type-checked (CorruptFile)."""
        kw = _pick(cls, doc, where)
        kw["state"] = _state(kw.get("state"), where)
        try:
            kw["ranks"] = {int(r): RankHealth(**_pick(RankHealth, h, where)) for r, h in (kw.get("ranks") or {}).items()}
        except ValueError as exc:
            if isinstance(exc, CorruptFile) or where is None:
                raise
            raise CorruptFile(where, f"'ranks' has a key that is not a rank number ({exc})") from None
        kw["checkpoint"] = Checkpoint.from_json(kw.get("checkpoint"))
        kw["failures_history"] = list(kw.get("failures_history") or [])
        kw["reattaches"] = list(kw.get("reattaches") or [])
        return cls(**kw)

    @property
    def terminal(self) -> bool:
        return self.state is not None and self.state.is_terminal()

    @classmethod
    def load(cls, path: str) -> "RunStatus":
        """The status.json at ``path``; an empty record when there is none (yet);
        CorruptFile when it is there but not a status record."""
        doc = load_json_object(path)
        return cls() if doc is None else cls.from_json(doc, path)

    def save(self, path: str) -> None:
        atomic_write_json(path, self.to_json())


@record
class RunResult:
    """result.json: how a run ended, written once, just before the terminal status."""

    run_id: str | None = None
    state: RunState | None = None
    ended: float | None = None
    reason: str | None = None  # one line: "completed", "stopped on request", or the root cause's
    root_cause: dict | None = None  # the Failure (agent/classify.py) that ended it
    exit: dict | None = None
    restarts: int = 0
    stop: dict | None = None  # the stop report: signals, pids, survivors, graceful
    failures_history: list[dict] = Factory(list)
    checkpoint: Checkpoint | None = None

    def to_json(self) -> dict:
        doc = asdict(self)
        doc["state"] = self.state.value if self.state else None
        doc["checkpoint"] = self.checkpoint.to_json() if self.checkpoint else None
        return doc

    @classmethod
    def from_json(cls, doc: Any, where: str | None = None) -> "RunResult | None":
        if not isinstance(doc, dict) and where is None:
            return None
        kw = _pick(cls, doc, where)
        kw["state"] = _state(kw.get("state"), where)
        kw["checkpoint"] = Checkpoint.from_json(kw.get("checkpoint"))
        kw["failures_history"] = list(kw.get("failures_history") or [])
        return cls(**kw)

    @classmethod
    def load(cls, path: str) -> "RunResult | None":
        """The result.json at ``path``; None while the run has not ended; CorruptFile when
        it is there but not a result record."""
        doc = load_json_object(path)
        return None if doc is None else cls.from_json(doc, path)

    def save(self, path: str) -> None:
        atomic_write_json(path, self.to_json())


@record
class ServedCheck:
    """A served check of one checkpoint (the ``served_check`` event, and ``served`` in the
    checkpoint's meta.json): served τ in the engine beside the τ the checkpoint was measured at
    when it was saved (the reference), the verdict, and its causes. One home for the fields:
    the served-check job writes it (trainer/serve/served_job.py), the agent relays and
    runview reads it, ``ctl status`` prints it (controller/status.py).

    ``verdict``: pass | below reference (served τ more than ``tolerance`` under ``tau_at_save``) |
    not lossless (output is not the target's greedy output) | broken export (a trained
    config.json field changed) | not served (the engine refused it) | no reference (τ at save
    not measured or not comparable: served τ held to our evaluator on the export)."""

    step: int | None = None
    checkpoint: str | None = None  # the step directory checked
    tau_served: float | None = None  # vLLM's own counters: 1 + accepted / drafts
    tau_at_save: float | None = None  # the reference (None: none usable, see verdict)
    tau_export: float | None = None  # our evaluator on the export as served
    ok: bool | None = None
    verdict: str | None = None
    causes: list[str] = Factory(list)  # served.py's causes(): one line each, the likely cause first
    tolerance: float | None = None
    prompts: int | None = None
    max_new_tokens: int | None = None
    engine: str | None = None  # e.g. "vllm 0.32.0 cpu"
    device: str | None = None  # "cpu" or "cuda:N" (the GPU reserved for it)
    elapsed_s: float | None = None
    run_id: str | None = None  # the served-check job's own run
    checked_run: str | None = None  # the run whose checkpoint it is
    ts: float | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Any) -> "ServedCheck | None":
        if not isinstance(doc, dict) or not isinstance(doc.get("step"), int):
            return None
        kw = _pick(cls, doc)
        kw["causes"] = [str(c) for c in (kw.get("causes") or [])]
        return cls(**kw)


SERVED_VERDICTS = ("pass", "below reference", "not lossless", "broken export", "not served", "no reference")


def _state(value: Any, where: str | None) -> "RunState | None":
    if value is None:
        return None
    try:
        return RunState(value)
    except ValueError:
        if where is None:
            raise
        raise CorruptFile(where, f"'state' is {value!r}, not one of {', '.join(s.value for s in RunState)}") from None


def atomic_write(path: str, data: str | bytes, mode: int = 0o644) -> None:
    """Write to a temp file in the same directory, fsync, rename: readers never see half."""
    import tempfile  # here: a reader (`ctl status` in the container) need not pay for it

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


def fmt_duration(seconds: float | None) -> str:
    """How every part shows a duration or an ETA (ctl status and tail, the regenerate job): 1h02m, 3m05s, 42s."""
    if seconds is None:
        return "—"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


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
