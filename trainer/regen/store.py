"""The regenerate job's output directory: what is written, and what a restart finds.

``DIR/regenerated.jsonl`` holds one chat row per done source row (``id``, ``messages``, and
``regen``: how it was made); ``DIR/failures.jsonl`` one line per row that failed for good
(``id``, ``where``, ``error``). Both are appended in batches, one ``write`` per batch, then
fsynced: a SIGKILL can tear only the last line, and a restart cuts that line off (the row is
done again) — a row is never written twice. ``DIR/regenerate.json`` records the settings the
rows were made with (a restart with others is refused) and, at the end, the summary.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from agent.protocol import atomic_write_json

OUTPUT = "regenerated.jsonl"
FAILURES = "failures.jsonl"
MANIFEST = "regenerate.json"
MANIFEST_FORMAT = "dflash-regenerate"


class StoreError(ValueError):
    """The output directory cannot be continued; one line saying why and what to do."""


def _read_ids(path: str) -> tuple[list, int]:
    """The ids in a JSONL file this module wrote, and the byte length of its whole lines.
    Streams (a 15-hour job's output is gigabytes): memory holds the ids only. A last line
    without its newline, or that does not parse, is torn (the caller cuts it off); a bad
    line before the last is corruption nothing here wrote."""
    ids: list = []
    good = 0
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return ids, 0
    with fh:
        for lineno, line in enumerate(fh, 1):
            if not line.endswith(b"\n"):
                break  # torn: the write stopped inside this line
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict) or not isinstance(rec.get("id"), (str, int)):
                    raise ValueError("no id")
            except ValueError:
                if not fh.read(1):
                    break  # a torn last line that happens to end in a newline byte
                raise StoreError(f"{path}:{lineno}: not a line this job wrote; move the file aside or use a new --out")
            ids.append(rec["id"])
            good += len(line)
    return ids, good


class Appender:
    """One JSONL file, appended in batches: one write and one fsync per flush."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.pending: list[bytes] = []

    def add(self, record: dict) -> None:
        self.pending.append((json.dumps(record, ensure_ascii=False) + "\n").encode())

    def flush(self) -> int:
        if not self.pending:
            return 0
        data, n = b"".join(self.pending), len(self.pending)
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        os.fsync(self.fd)
        self.pending.clear()
        return n

    def close(self) -> None:
        self.flush()
        os.close(self.fd)


class Store:
    """Opened on an output directory: the ids already done, the ids that failed before, and
    appenders for both files. ``flush()`` makes everything added so far durable."""

    def __init__(self, out_dir: str, settings: dict[str, Any]):
        self.dir = out_dir
        os.makedirs(out_dir, exist_ok=True)
        self.manifest_path = os.path.join(out_dir, MANIFEST)
        self._check_settings(settings)
        out_path = os.path.join(out_dir, OUTPUT)
        ids, good = _read_ids(out_path)
        self.torn = self._cut(out_path, good)
        self.done: set = set(ids)
        fail_path = os.path.join(out_dir, FAILURES)
        ids, good = _read_ids(fail_path)
        self._cut(fail_path, good)
        # failed before and not done since: tried again by this run
        self.failed_before: set = set(ids) - self.done
        self.output = Appender(out_path)
        self.failures = Appender(fail_path)
        self.failed_now: dict = {}
        self.last_flush = time.monotonic()

    def _check_settings(self, settings: dict[str, Any]) -> None:
        try:
            with open(self.manifest_path, encoding="utf-8") as fh:
                old = json.load(fh)
        except FileNotFoundError:
            atomic_write_json(self.manifest_path, {"format": MANIFEST_FORMAT, "settings": settings})
            return
        except ValueError as exc:
            raise StoreError(f"{self.manifest_path}: unreadable ({exc}); use a new --out") from exc
        before = old.get("settings") or {}
        for key, value in settings.items():
            if before.get(key) != value:
                raise StoreError(f"{key} {value!r} differs from the run already in {self.dir} ({before.get(key)!r}): "
                                 "continue it with the same settings, or give a new --out")

    @staticmethod
    def _cut(path: str, good: int) -> bool:
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            return False
        if size == good:
            return False
        with open(path, "r+b") as fh:
            fh.truncate(good)
            fh.flush()
            os.fsync(fh.fileno())
        return True

    def add_done(self, record: dict) -> None:
        self.output.add(record)
        self.done.add(record["id"])
        self.failed_now.pop(record["id"], None)

    def add_failed(self, row_id, where: str, error: str) -> None:
        rec = {"id": row_id, "where": where, "error": error}
        self.failures.add(rec)
        self.failed_now[row_id] = rec

    def pending(self) -> int:
        return len(self.output.pending) + len(self.failures.pending)

    def flush(self) -> None:
        self.output.flush()
        self.failures.flush()
        self.last_flush = time.monotonic()

    def close(self, summary: dict | None) -> None:
        """Flush and close; with a summary (a run that went through its input), rewrite the
        failures file to hold only the rows still failed, and record the summary."""
        self.output.close()
        self.failures.close()
        if summary is None:
            return
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.failed_now.values())
        path = os.path.join(self.dir, FAILURES)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(lines)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        with open(self.manifest_path, encoding="utf-8") as fh:
            doc = json.load(fh)
        doc["summary"] = summary
        atomic_write_json(self.manifest_path, doc)
