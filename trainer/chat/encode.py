"""Conversations → (input_ids, loss_mask) samples, on every core, in input order.

The main process only cuts the input into batches of raw rows (JSONL lines stay bytes);
worker processes, forked with the target's tokenizer already loaded, decode and normalize
each row (trainer/chat/rows.py), render it once with the target's template and encode each
batch once (trainer/chat/template.py). Each worker has one batch at a time, and results run
at most ``workers + 4`` batches ahead of the one awaited, so memory stays flat whatever the
input size. Rows that cannot be used come back as
``(where, cause)`` and are counted; ``strict`` turns the first into a DataError.
"""

from __future__ import annotations

import collections
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from agent.protocol import fmt_duration
from trainer.chat import rows as chatrows
from trainer.chat.progress import eta_s
from trainer.chat.template import RENDER_CAUSES, Renderer

CAUSES = {**chatrows.CAUSES, **RENDER_CAUSES}
TOO_LONG = ("truncate", "drop")
# A worker's batch: one encode_batch call each. Large batches cost markedly less CPU per
# token in tokenizers (measured: 640 conversations in one call ~30 % less than 64 per call;
# 1,000 about 10 % less than 500, docs/benchmarks.md), so a batch is up to 2,048 rows or
# 8 MiB of JSONL (measured: a worker's peak RSS 0.58 GB with 8 MiB batches as with 4, most
# of it the tokenizer and libraries shared with the parent), and at most
# workers + 4 batches are under way (memory: a few batches, whatever the input size).
BATCH_ROWS = 2048
BATCH_BYTES = 8 << 20
# Near the end of a file of known size the batches shrink (to a share of what is left, at
# least TAIL_BYTES) so the workers finish together: with full batches to the end one worker
# encodes the last batch alone while the others idle (measured: up to 6 % of the wall time
# on 5,000 conversations, docs/benchmarks.md).
TAIL_BYTES = 256 << 10
# While the caller works through a batch's samples, finished workers get their next batch
# every this many samples (a select(2) with no wait), not only when the caller asks for the
# next batch: a worker's result would otherwise sit unread while the caller writes shards.
TEND_EVERY = 256
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


def _serve(conn, inherited: list, form: str | None) -> None:
    """A worker: batches in, results out, on its own pipe until the parent closes it or dies."""
    global _FORM
    _FORM = form
    for other in inherited:
        other.close()
    # The parent decides what Ctrl-C and the agent's SIGTERM (sent to every process of the
    # job) mean, and kills its workers itself when it stops early.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        try:
            batch = conn.recv()
        except (EOFError, OSError):
            return
        try:
            answer = (True, _work(batch))
        except Exception as exc:  # a bug; the parent stops with this one line
            answer = (False, f"{type(exc).__name__}: {exc}")
        try:
            conn.send(answer)
        except OSError:  # the parent is gone
            return


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
    total = os.path.getsize(path) if fmt == "jsonl" and os.path.isfile(path) else None
    feed = _batches(_raw_items(path, fmt), BATCH_ROWS, BATCH_BYTES, total, workers)
    pool = _Pool(workers, form, feed)
    finished = False
    try:
        while (got := pool.next_batch()) is not None:
            batch, results = got
            if fmt == "jsonl":
                stats.done_bytes = (stats.done_bytes or 0) + sum(len(item[0]) for item in batch)
            for i, result in enumerate(results):
                if i % TEND_EVERY == TEND_EVERY - 1:
                    pool.tend()
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
    finally:
        # stopped early (a signal, --strict, an error): the workers' batches are not wanted
        pool.close(kill=not finished)


class _Pool:
    """Forked workers, each on its own pipe with one batch at a time; results in batch order.

    Not concurrent.futures: its workers share one result pipe, and a worker killed while it
    writes a result (the OOM killer; our own stop on Ctrl-C or SIGTERM) leaves half a message
    there, which the executor's manager thread then waits to complete for ever, in shutdown
    and again at interpreter exit (CI hung so: test_a_signal_mid_run_stops_with_nothing_written;
    test_a_worker_killed_mid_result_then_a_stop_ends_the_run reproduces it). Here nothing is
    shared: a dead worker is the end of its own pipe, and closing kills and reaps, no thread
    waits on anything.
    """

    def __init__(self, n: int, form: str | None, batches: Iterator[list]):
        ctx = multiprocessing.get_context("fork")
        self.conns: list = []
        self.procs: list = []
        # Also at interpreter exit, before multiprocessing's own hook joins its children (they
        # would wait for the end of a pipe this process holds): a pool its caller abandoned,
        # or one interrupted while forking, is killed, not waited for.
        self._stop = weakref.finalize(self, _stop_workers, self.conns, self.procs, True)
        pipes = [ctx.Pipe() for _ in range(n)]
        self.conns.extend(mine for mine, _ in pipes)
        for mine, theirs in pipes:
            # every other end this child inherits is closed in it, so that a worker sees the
            # parent's death as the end of its own pipe
            inherited = [c for pair in pipes for c in pair if c is not theirs]
            proc = ctx.Process(target=_serve, args=(theirs, inherited, form), name="prepare-worker")
            proc.start()
            self.procs.append(proc)
        for _, theirs in pipes:
            theirs.close()
        self.batches, self.more = batches, True
        self.idle, self.busy = list(range(n)), {}  # busy: worker → (batch number, batch)
        self.done: dict[int, tuple[list, list]] = {}
        self.sent = self.wanted = 0

    def next_batch(self) -> tuple[list, list] | None:
        """The next (batch, its results) in input order; None after the last."""
        while True:
            self._refill()
            if self.wanted in self.done:
                self.wanted += 1
                return self.done.pop(self.wanted - 1)
            if not self.busy:
                return None
            self._collect(None)

    def tend(self) -> None:
        """Take in the results that are ready and give their workers new batches, without
        waiting: called while the caller works through a batch, so no worker idles then."""
        self._collect(0)
        self._refill()

    def _refill(self) -> None:
        # at most workers + 4 batches ahead of the one awaited: memory stays flat
        while self.more and self.idle and self.sent - self.wanted < len(self.conns) + 4:
            batch = next(self.batches, None)
            if batch is None:
                self.more = False
                return
            w = self.idle.pop()
            self._send(w, batch)
            self.busy[w] = (self.sent, batch)
            self.sent += 1

    def _collect(self, timeout: float | None) -> None:
        # idle workers too: one that is ready has died (the end of its pipe)
        for conn in multiprocessing.connection.wait(self.conns, timeout):
            w = self.conns.index(conn)
            if w not in self.busy:
                raise WorkerDied(_DIED)
            number, batch = self.busy.pop(w)
            self.done[number] = (batch, self._receive(w))
            self.idle.append(w)

    def _send(self, w: int, batch: list) -> None:
        try:
            self.conns[w].send(batch)
        except OSError:  # BrokenPipeError: it died
            raise WorkerDied(_DIED) from None

    def _receive(self, w: int) -> list:
        try:
            ok, payload = self.conns[w].recv()
        except (EOFError, OSError):  # it died, perhaps halfway through its answer
            raise WorkerDied(_DIED) from None
        if not ok:
            raise RuntimeError(f"prepare: a worker failed on a batch: {payload}")
        return payload

    def close(self, kill: bool) -> None:
        self._stop.detach()
        _stop_workers(self.conns, self.procs, kill)


def _stop_workers(conns: list, procs: list, kill: bool) -> None:
    for conn in conns:
        conn.close()  # an idle worker sees the end of its pipe and exits
    for proc in procs:
        if kill:
            proc.kill()
        proc.join()


_DIED = "prepare: a worker process died (killed, perhaps for memory); nothing written — try fewer --workers"


class Progress:
    """A bar on a terminal (redrawn at most 5×/s), plain lines every N samples otherwise."""

    def __init__(self, log, every: int, total_bytes: int | None, stream=None):
        self.log, self.every, self.total_bytes = log, every, total_bytes
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.monotonic()
        self.last_draw = 0.0
        from trainer.chat.progress import Progress as JobProgress

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
