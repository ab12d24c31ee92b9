"""Paths and small file helpers of one run directory (docs/design.md: run directory)."""

from __future__ import annotations

import fcntl
import json
import os
import time

from agent import protocol


class RunDir:
    def __init__(self, path: str):
        self.path = os.path.abspath(path)

    def __getattr__(self, name: str) -> str:
        # rd.status → <dir>/status.json, using the protocol's file names
        table = {"spec": protocol.SPEC, "status": protocol.STATUS, "stream": protocol.STREAM, "output_log": protocol.OUTPUT_LOG,
                 "result": protocol.RESULT, "events": protocol.EVENTS, "heartbeat_dir": protocol.HEARTBEAT_DIR,
                 "job_stdout": protocol.JOB_STDOUT, "job_stderr": protocol.JOB_STDERR, "job_pid": protocol.JOB_PID,
                 "job_exit": protocol.JOB_EXIT, "agent_pid": protocol.AGENT_PID, "agent_lock": protocol.AGENT_LOCK,
                 "agent_log": protocol.AGENT_LOG, "stop_request": protocol.STOP_REQUEST, "fingerprint": protocol.FINGERPRINT}
        if name in table:
            return os.path.join(self.path, table[name])
        raise AttributeError(name)

    @property
    def run_id(self) -> str:
        spec = read_json(self.spec) or {}
        return spec.get("run_id") or os.path.basename(self.path)


def read_json(path: str) -> dict | None:
    """A JSON object from ``path``, or None (missing, torn, not an object): for files that are
    rewritten while read (heartbeats, pid files). State files go through agent/protocol.py's
    typed loaders, which tell a corrupt file from a missing one."""
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def resolve(run: str | None = None, workspace: str | None = None, run_dir: str | None = None) -> RunDir:
    """--run-dir wins; else <workspace>/runs/<run> with workspace from --workspace,
    $DFLASH_WORKSPACE or /workspace."""
    if run_dir:
        return RunDir(run_dir)
    if not run:
        raise ValueError("name the run: --run ID (with --workspace W) or --run-dir DIR")
    ws = workspace or os.environ.get(protocol.ENV_WORKSPACE) or protocol.DEFAULT_WORKSPACE
    return RunDir(protocol.run_path(ws, run))


def last_stream_status(rd: RunDir, window: int = 4 << 20) -> dict | None:
    """The payload of the stream's last status record (within its last ``window`` bytes)."""
    try:
        with open(rd.stream, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - window))
            lines = fh.read().split(b"\n")
    except OSError:
        return None
    for raw in reversed(lines):
        if b'"kind":"status"' in raw:
            try:
                payload = json.loads(raw).get("payload")
            except (ValueError, AttributeError):
                continue
            if isinstance(payload, dict):
                return payload
    return None


def read_status(rd: RunDir) -> tuple[protocol.RunStatus, str | None]:
    """The run's status and, when status.json is corrupt, one line saying so. A corrupt
    status.json is never taken for "no status": the stream's last status record (the same
    document, written at every state change) stands in, so a finished run stays finished
    with its step and checkpoint (an emptied status.json of a completed run was once re-attached
    and lost both)."""
    try:
        return protocol.RunStatus.load(rd.status), None
    except protocol.CorruptFile as exc:
        payload = last_stream_status(rd)
        try:
            st = protocol.RunStatus.from_json(payload, rd.stream) if payload else None
        except protocol.CorruptFile:
            st = None
        if st is None:
            return protocol.RunStatus(), f"{exc}; the stream has no status record to show instead"
        return st, f"{exc}; shown from the stream's last status record (seq {st.seq})"


def finished(rd: RunDir) -> bool:
    """The run has ended: result.json is there (whatever it holds: it is written once, just
    before the terminal status) or its status says so. A finished run is never re-attached."""
    return os.path.exists(rd.result) or read_status(rd)[0].terminal


class Lock:
    """agent.lock: held (flock) for its whole life by the one process that may append to the
    stream. The kernel drops it when that process dies, even by SIGKILL, so "is an agent
    alive for this run" is answered without trusting a pidfile."""

    def __init__(self, path: str):
        self.path = path
        self.fd: int | None = None

    def acquire(self, timeout: float = 1.0) -> bool:
        # retried briefly: a reader probing agent_alive() holds a shared lock for microseconds
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return False
                time.sleep(0.05)
        self.fd = fd
        return True

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def agent_alive(rd: RunDir) -> bool:
    if not os.path.exists(rd.agent_lock):
        return False
    fd = os.open(rd.agent_lock, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def agent_live_or_none(pidfile: str) -> bool | None:
    """Whether the process recorded in ``pidfile`` is alive (None: no pidfile)."""
    from agent.procs import Identity

    data = read_json(pidfile)
    if not data:
        return None
    return Identity.from_json(data).alive()
