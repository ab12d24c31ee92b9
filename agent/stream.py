"""The seq-numbered durable stream (stream.jsonl) and its reader for `agent follow`.

One record per line: {"seq","ts","kind","payload"} plus "src": [source, end offset] on
records copied from a source file (job.stdout, job.stderr, events.jsonl).

Why this survives `kill -9` of the agent without loss or duplication: the stream is its own
commit log. A record and the source offset it consumed are written in the same line, by one
append, so after a crash a new writer reads the stream's tail, takes the last seq and, per
source, the last offset, truncates a torn last line (never shown to a follower: followers
only emit complete lines), and continues reading each source from exactly there. Nothing
else has to agree with the stream. fsync is a group commit about once a second (and at
every state change); it only matters for a machine crash, where the stream and its offsets
roll back together, so the re-read lines get the same seqs again — still no gap.
stream.idx is a hint (a checkpoint of the scan) so recovery does not read the whole file.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import IO, Callable, Iterable, Optional

from agent.protocol import EXIT_AGENT_GONE, EXIT_OK, EXIT_STREAM_RUN_FAILED, RunState, STREAM, STREAM_INDEX, atomic_write_json


_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode  # built once: 2× faster


class StreamWriter:
    """Appends records; only one process may hold it (the caller holds agent.lock)."""

    def __init__(self, run_dir: str, fsync_interval: float = 1.0):
        self.path = os.path.join(run_dir, STREAM)
        self.index_path = os.path.join(run_dir, STREAM_INDEX)
        self.fsync_interval = fsync_interval
        self.seq = 0
        self.offsets: dict[str, int] = {}
        self.size = 0
        self._dirty = False
        self._last_sync = time.monotonic()
        self._recover()
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _recover(self) -> None:
        try:
            size = os.path.getsize(self.path)
        except FileNotFoundError:
            return
        start = 0
        try:
            with open(self.index_path) as fh:
                idx = json.load(fh)
            if 0 < int(idx["bytes"]) <= size:
                start, self.seq = int(idx["bytes"]), int(idx["seq"])
                self.offsets = {k: int(v) for k, v in idx["offsets"].items()}
        except (OSError, ValueError, KeyError, TypeError):
            start = 0
        good = start
        with open(self.path, "rb") as fh:
            fh.seek(start)
            for raw in fh:
                if not raw.endswith(b"\n"):
                    break  # torn by a kill mid-append: closed below, re-read from the source
                good += len(raw)
                try:
                    rec = json.loads(raw)
                except json.JSONDecodeError:
                    continue
                self.seq = max(self.seq, int(rec.get("seq", 0)))
                src = rec.get("src")
                if src:
                    self.offsets[src[0]] = int(src[1])
        if good < size:
            # Never rewrite bytes a follower may already hold: end the torn line instead, so
            # the file stays append-only; readers skip a line that is not valid JSON.
            with open(self.path, "ab") as fh:
                fh.write(b"\n")
            size += 1
        self.size = size

    def append(self, records: Iterable[tuple[str, dict, tuple[str, int] | None]], ts: float | None = None) -> int:
        """Append (kind, payload, src) records in one write; returns the last seq."""
        now = round(time.time() if ts is None else ts, 6)
        lines = []
        seq = self.seq
        offsets = dict(self.offsets)
        for kind, payload, src in records:
            seq += 1
            rec = {"seq": seq, "ts": now, "kind": kind, "payload": payload}
            if src is not None:
                rec["src"] = [src[0], src[1]]
                offsets[src[0]] = src[1]
            lines.append(_dumps(rec))
        if not lines:
            return self.seq
        data = ("\n".join(lines) + "\n").encode("utf-8", "replace")
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        self.seq, self.offsets = seq, offsets
        self.size += len(data)
        self._dirty = True
        return seq

    def sync(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self._dirty or (not force and now - self._last_sync < self.fsync_interval):
            return
        os.fsync(self.fd)
        atomic_write_json(self.index_path, {"bytes": self.size, "seq": self.seq, "offsets": self.offsets})
        self._dirty = False
        self._last_sync = now

    def close(self) -> None:
        try:
            self.sync(force=True)
        finally:
            os.close(self.fd)


def _seq_of(raw: bytes) -> int:
    """Records are written with "seq" as the first key: {"seq":N,...}; parse without json.
    Raises ValueError for a line that is not a record."""
    if not raw.startswith(b'{"seq":'):
        raise ValueError("not a record")
    return int(raw[7:raw.index(b",", 7)])


def _strip_src(raw: bytes) -> bytes:
    """The record as the contract shows it: "src" is the agent's bookkeeping, last key."""
    i = raw.rfind(b',"src":[')
    return raw[:i] + b"}\n" if i >= 0 else raw


def _status_state(raw: bytes) -> Optional[RunState]:
    """The state a status record carries; None for any other record."""
    if b'"kind":"status"' not in raw:
        return None
    try:
        return RunState(json.loads(raw)["payload"].get("state"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


# How long a follower waits, after the run's final status, for an agent still writing (its
# shutdown stops leftover processes and appends that report and the status again).
FINAL_WRITES_WAIT_S = 30.0


def _unread(fh: IO[bytes]) -> bool:
    """Whether the file has grown past what was read (the loop's next read takes it)."""
    return os.fstat(fh.fileno()).st_size > fh.tell()


def follow(run_dir: str, after: int, out: IO[bytes], agent_alive: Callable[[], bool],
           poll: float = 0.1, dead_check: float = 2.0, once: bool = False,
           writer_alive: Optional[Callable[[], bool]] = None) -> int:
    """Print records with seq > ``after`` until the run's terminal status record and, while
    ``writer_alive`` says the agent still holds the stream, what it appends after that.

    Returns EXIT_OK at the end of a finished run, EXIT_AGENT_GONE when the agent is gone and
    the run is not finished (the stream would never end: say so rather than hang; research
    §4.8, ray#57002).
    """
    path = os.path.join(run_dir, STREAM)
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        if time.monotonic() > deadline and not agent_alive():
            print(f"agent follow: {path} does not exist and no agent is running", file=sys.stderr)
            return EXIT_AGENT_GONE
        time.sleep(poll)
    buf = b""
    last_seq = after
    last_state: Optional[RunState] = None  # of the last status record read, printed or not (records
    # such as a GPU sample may follow a run's final status)
    last_check = time.monotonic()
    terminal_since: Optional[float] = None
    with open(path, "rb") as fh:
        while True:
            chunk = fh.read(1 << 20)
            if chunk:
                buf += chunk
                lines = buf.split(b"\n")
                buf = lines.pop()
                emitted = []
                for line in lines:
                    if not line:
                        continue
                    raw = line + b"\n"
                    try:
                        seq = _seq_of(raw)
                    except ValueError:
                        continue  # a line torn by a killed agent (see StreamWriter._recover)
                    state = _status_state(raw)
                    if seq <= last_seq:
                        last_state = state or last_state
                        continue
                    try:
                        json.loads(raw)
                    except ValueError:
                        continue  # torn: its seq is reused by the next valid record
                    last_state = state or last_state
                    last_seq = seq
                    emitted.append(_strip_src(raw))
                if emitted:
                    out.write(b"".join(emitted))
                    out.flush()
                continue
            if once:
                return EXIT_STREAM_RUN_FAILED if last_state is RunState.FAILED else EXIT_OK
            if last_state is not None and last_state.is_terminal():
                # The run's final status has been read. An agent still holding the stream may
                # append after it (its shutdown's leftover-process report and the status again):
                # wait for it to let go, then read once more; what came after the status (a
                # re-attached agent's GPU sample) is printed too.
                terminal_since = terminal_since or time.monotonic()
                if writer_alive is not None and writer_alive() \
                        and time.monotonic() - terminal_since < FINAL_WRITES_WAIT_S:
                    time.sleep(poll)
                    continue
                if _unread(fh):
                    continue
                return EXIT_OK
            now = time.monotonic()
            if now - last_check >= dead_check:
                last_check = now
                if not agent_alive():
                    # One last read: the agent may have written its final records and exited.
                    if _unread(fh):
                        continue
                    print(f"agent follow: the agent of {run_dir} is not running and the run has not "
                          "finished; re-attach with `python3 -m agent start --run-dir DIR --reattach`",
                          file=sys.stderr)
                    return EXIT_AGENT_GONE
            time.sleep(poll)
