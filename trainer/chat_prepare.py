"""Conversations → (input_ids, loss_mask) samples, on every core, in input order.

The main process only cuts the input into batches of raw rows (JSONL lines stay bytes);
worker processes, forked with the target's tokenizer already loaded, decode and normalize
each row (trainer/chatrows.py), render it once with the target's template and encode each
batch once (trainer/chat_template.py). At most ``workers + 4`` batches are in flight, so
memory stays flat whatever the input size. Rows that cannot be used come back as
``(where, cause)`` and are counted; ``strict`` turns the first into a DataError.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from agent.protocol import fmt_duration
from trainer import chatrows
from trainer.progress import eta_s
from trainer.chat_template import RENDER_CAUSES, Renderer

CAUSES = {**chatrows.CAUSES, **RENDER_CAUSES}
TOO_LONG = ("truncate", "drop")
# A worker's batch: one encode_batch call each. Large batches cost markedly less CPU per
# token in tokenizers (measured: 640 conversations in one call ~30 % less than 64 per call;
# 1,000 about 10 % less than 500, docs/benchmarks.md), so a batch is up to 2,048 rows or
# 8 MiB of JSONL (measured: a worker's peak RSS 0.58 GB with 8 MiB batches as with 4, most
# of it the tokenizer and libraries shared with the parent), and at most
# workers + 4 batches are in flight (memory: a few batches, whatever the input size).
BATCH_ROWS = 2048
BATCH_BYTES = 8 << 20
# Near the end of a file of known size the batches shrink (to a share of what is left, at
# least TAIL_BYTES) so the workers finish together: with full batches to the end one worker
# encodes the last batch alone while the others idle (measured: up to 6 % of the wall time
# on 5,000 conversations, docs/benchmarks.md).
TAIL_BYTES = 256 << 10
FIRST_NAMED = 5  # bad rows named by file:line in the summary


@dataclass
class ChatOptions:
    target: str
    thinking: bool | None = None
    last_turn_only: bool = False
    max_seq_len: int | None = None
    too_long: str = "truncate"
    form: str | None = None
    strict: bool = False
    workers: int = 0  # 0: every core this process may use


@dataclass
class ChatStats:
    rows: int = 0
    skipped: collections.Counter = field(default_factory=collections.Counter)
    first_bad: list = field(default_factory=list)
    truncated: int = 0
    dropped_too_long: int = 0
    done_bytes: int | None = None  # of JSONL input consumed, for the ETA

    def bad(self, where: str, cause: str) -> None:
        self.skipped[cause] += 1
        if len(self.first_bad) < FIRST_NAMED:
            self.first_bad.append(f"{where} ({cause})")

    def meta(self) -> dict:
        return {"rows": self.rows, "skipped": dict(sorted(self.skipped.items())),
                # file names, not paths: meta.json stays the same wherever the input lay
                "skipped_first": [os.path.basename(w) for w in self.first_bad], "truncated": self.truncated,
                "dropped_too_long": self.dropped_too_long}


class BadRow(ValueError):
    """--strict: the first unusable row, one line naming it."""


class WorkerDied(RuntimeError):
    """A worker process was killed; one line."""


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# -- worker side ---------------------------------------------------------------------------

_RENDERER: Renderer | None = None
_FORM: str | None = None


def _init_worker(form: str | None) -> None:
    global _FORM
    _FORM = form
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what Ctrl-C means
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _work(batch: list) -> list:
    """A batch of raw rows → per row either (ids, mask) or (where, cause)."""
    rows = []
    for item in batch:
        if isinstance(item[0], bytes) and item[2] is None:
            rows.append(chatrows.row_from_line(item[0], item[1], _FORM))
        elif item[2] is not None:
            rows.append(chatrows.ChatRow("", [], item[1], item[2]))
        else:
            rows.append(chatrows.row_from_obj(item[0], item[1], _FORM))
    out: list = [None] * len(rows)
    rendered, at = [], []
    for i, row in enumerate(rows):
        if row.problem:
            out[i] = (row.where, row.problem)
            continue
        got = _RENDERER.spans(row.messages, row.tools)
        if isinstance(got, str):
            out[i] = (row.where, got)
        else:
            rendered.append(got)
            at.append(i)
    for i, sample in zip(at, _RENDERER.encode(rendered) if rendered else ()):
        out[i] = sample
    return out


# -- main side -----------------------------------------------------------------------------

def _raw_items(path: str, fmt: str) -> Iterator[tuple]:
    """(raw, where, problem) per row: JSONL lines stay bytes (the workers decode them)."""
    if fmt == "jsonl":
        for line, where in chatrows.iter_lines(path):
            yield line, where, None
    else:
        yield from chatrows.iter_objects(path, fmt)


def _batches(items: Iterator[tuple], rows: int, size: int, total: int | None = None,
             workers: int = 1) -> Iterator[list]:
    """Batches of at most ``rows`` rows or ``size`` bytes of JSONL; with ``total`` (the file's
    size) the last ones shrink to about 1/(2·workers) of what is left, so the workers end together."""
    batch, nbytes, done, limit = [], 0, 0, size
    for item in items:
        batch.append(item)
        nbytes += len(item[0]) if isinstance(item[0], bytes) else 0
        if len(batch) == rows or nbytes >= limit:
            yield batch
            done += nbytes
            batch, nbytes = [], 0
            if total:
                limit = min(size, max(TAIL_BYTES, (total - done) // (2 * workers)))
    if batch:
        yield batch


def iter_samples(path: str, opts: ChatOptions, renderer: Renderer, stats: ChatStats,
                 fmt: str, form: str | None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The file's usable samples, in file order; bad rows counted in ``stats``."""
    global _RENDERER
    _RENDERER = renderer  # inherited by the forked workers: no tokenizer load per worker
    workers = opts.workers or cores()
    # concurrent.futures, not multiprocessing.Pool: a worker killed (the OOM killer) while it
    # waits for a batch dies inside its queue's read lock, and Pool.terminate then waits on that
    # lock for ever (CI hung so); the executor marks itself broken and kills the rest instead.
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                               initializer=_init_worker, initargs=(form,))
    pending: collections.deque = collections.deque()
    finished = False
    try:
        total = os.path.getsize(path) if fmt == "jsonl" and os.path.isfile(path) else None
        feed = _batches(_raw_items(path, fmt), BATCH_ROWS, BATCH_BYTES, total, workers)
        while True:
            while len(pending) < workers + 4:
                batch = next(feed, None)
                if batch is None:
                    break
                size = sum(len(item[0]) for item in batch) if fmt == "jsonl" else None
                pending.append((pool.submit(_work, batch), size))
            if not pending:
                break
            job, size = pending.popleft()
            results = job.result()
            if size is not None:
                stats.done_bytes = (stats.done_bytes or 0) + size
            for result in results:
                stats.rows += 1
                if isinstance(result[0], str):
                    if opts.strict:
                        raise BadRow(f"{result[0]}: {CAUSES[result[1]]} ({result[1]}); "
                                     "fix or remove the row, or leave out --strict to skip such rows")
                    stats.bad(*result)
                    continue
                ids, mask = result
                if opts.max_seq_len and len(ids) > opts.max_seq_len:
                    if opts.too_long == "drop":
                        stats.dropped_too_long += 1
                        continue
                    stats.truncated += 1
                    ids, mask = ids[:opts.max_seq_len], mask[:opts.max_seq_len]
                yield ids, mask
        finished = True
    except BrokenProcessPool:
        raise WorkerDied("prepare: a worker process died (killed, perhaps for memory); "
                         "nothing written — try fewer --workers") from None
    finally:
        if not finished:  # stopped early (a signal, --strict, an error): the workers' batches are not wanted
            for proc in multiprocessing.active_children():  # this process's only children are the workers
                proc.kill()
        pool.shutdown(wait=True, cancel_futures=True)


class Progress:
    """A bar on a terminal (redrawn at most 5×/s), plain lines every N samples otherwise."""

    def __init__(self, log, every: int, total_bytes: int | None, stream=None):
        self.log, self.every, self.total_bytes = log, every, total_bytes
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.monotonic()
        self.last_draw = 0.0
        from trainer.progress import Progress as JobProgress

        # Under the agent (a prepare job: trainer/kinds.py) the same figures go to events.jsonl.
        self.job = JobProgress()
        self._event(0, 0, 0 if total_bytes else None, force=True)

    def _event(self, samples: int, tokens: int, done_bytes: int | None, force: bool = False) -> None:
        secs = self.job.elapsed()
        self.job.update(force, samples=samples, tokens=tokens, bytes_done=done_bytes, bytes_total=self.total_bytes,
                        samples_per_s=round(samples / secs, 1), tokens_per_s=round(tokens / secs, 1),
                        eta_s=eta_s(done_bytes or 0, self.total_bytes, secs) if done_bytes is not None else None)

    def update(self, samples: int, tokens: int, done_bytes: int | None, where: str) -> None:
        self.last = (samples, tokens, done_bytes)
        if self.job.due():
            self._event(samples, tokens, done_bytes)
        now = time.monotonic()
        if self.tty:
            if now - self.last_draw >= 0.2:
                self.last_draw = now
                self.stream.write("\r" + self.text(samples, tokens, done_bytes, bar=True) + "\x1b[K")
                self.stream.flush()
        elif self.every and samples % self.every == 0:
            self.log(f"prepare: {self.text(samples, tokens, done_bytes)} ({where})")

    def text(self, samples: int, tokens: int, done_bytes: int | None, bar: bool = False) -> str:
        secs = max(time.monotonic() - self.t0, 1e-9)
        parts = [f"{samples:,} samples", f"{tokens:,} tokens", f"{samples / secs:,.0f} samples/s",
                 f"{tokens / secs:,.0f} tokens/s"]
        frac = (done_bytes / self.total_bytes) if self.total_bytes and done_bytes is not None else None
        if frac:
            parts.append(f"ETA {fmt_duration(eta_s(done_bytes, self.total_bytes, secs))}")
        if bar and frac is not None:
            n = int(24 * min(frac, 1.0))
            parts.insert(0, f"[{'#' * n}{'.' * (24 - n)}] {frac:4.0%}")
        return ", ".join(parts) if not bar else "prepare " + "  ".join(parts)

    def finish(self) -> None:
        self._event(*getattr(self, "last", (0, 0, None)), force=True)
        self.job.close()
        if self.tty and self.last_draw:
            self.stream.write("\n")
            self.stream.flush()
