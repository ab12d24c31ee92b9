"""The regenerate job's accounting and how it is shown: ``progress`` events in the run's
events.jsonl (agent/protocol.py: the agent and ``ctl`` read them), a line rewritten in place
on a terminal, a plain line every so often otherwise, and the end summary.

Every input row ends in exactly one of done, failed or skipped (by cause), so
done + failed + skipped = input is the check that nothing was lost or counted twice.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import TextIO

from agent.protocol import fmt_duration
from trainer.telemetry import Events, Heartbeat


class Progress:
    def __init__(self, total: int, events: Events | None, out: TextIO = sys.stdout, every_s: float = 30.0,
                 heartbeat: Heartbeat | None = None):
        self.total = total
        self.done = 0  # this run and earlier ones
        self.done_before = 0
        self.failed = 0
        self.skipped: Counter[str] = Counter()
        self.requests = 0
        self.output_tokens = 0
        self.in_flight = 0
        self.events = events
        self.heartbeat = heartbeat  # the agent's liveness signal; "step" is the rows done
        self.out = out
        self.tty = out.isatty()
        self.every_s = 1.0 if self.tty else every_s
        self.started = time.monotonic()
        self.last_shown = self.started

    # -- counting
    def skip(self, cause: str) -> None:
        self.skipped[cause] += 1

    def already_done(self) -> None:
        self.done += 1
        self.done_before += 1

    def answered(self, output_tokens: int) -> None:
        self.requests += 1
        self.output_tokens += output_tokens

    # -- derived
    @property
    def n_skipped(self) -> int:
        return sum(self.skipped.values())

    def accounted(self) -> int:
        return self.done + self.failed + self.n_skipped

    def adds_up(self) -> bool:
        return self.accounted() == self.total

    def snapshot(self) -> dict:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rows_now = self.done - self.done_before + self.failed
        remaining = max(self.total - self.accounted(), 0)
        rate = rows_now / elapsed
        return {
            "done": self.done, "failed": self.failed, "skipped": self.n_skipped, "total": self.total,
            "skipped_by_cause": dict(sorted(self.skipped.items())), "in_flight": self.in_flight,
            "requests": self.requests, "output_tokens": self.output_tokens, "elapsed_s": round(elapsed, 3),
            "requests_per_s": round(self.requests / elapsed, 3),
            "output_tokens_per_s": round(self.output_tokens / elapsed, 1),
            "eta_s": (0.0 if remaining == 0 else round(remaining / rate, 1)) if rate > 0 else None,
        }

    def line(self, snap: dict | None = None) -> str:
        s = snap or self.snapshot()
        pct = 100.0 * (s["done"] + s["failed"] + s["skipped"]) / max(s["total"], 1)
        return (f"regenerate: {pct:5.1f}% done {s['done']:,} failed {s['failed']:,} skipped {s['skipped']:,} "
                f"of {s['total']:,} | {s['requests_per_s']:.2f} req/s {s['output_tokens_per_s']:,.0f} tok/s "
                f"| ETA {fmt_duration(s['eta_s'])}")

    # -- showing
    def tick(self, force: bool = False) -> None:
        """A progress event and line when ``every_s`` has passed (or ``force``)."""
        now = time.monotonic()
        if not force and now - self.last_shown < self.every_s:
            return
        self.last_shown = now
        snap = self.snapshot()
        if self.events is not None:
            self.events.emit("progress", **snap)
        if self.heartbeat is not None:
            self.heartbeat.beat(self.done)
        if self.tty:
            self.out.write("\r\x1b[2K" + self.line(snap))
        else:
            self.out.write(self.line(snap) + "\n")
        self.out.flush()

    def summary(self, stopped: bool = False) -> tuple[str, dict]:
        snap = self.snapshot()
        if self.events is not None:
            self.events.emit("progress", final=True, stopped=stopped, **snap)
        causes = ", ".join(f"{c} {n:,}" for c, n in sorted(self.skipped.items()))
        sign = "=" if self.adds_up() else "≠"
        text = (f"done {self.done:,} + failed {self.failed:,} + skipped {self.n_skipped:,}"
                f"{f' ({causes})' if causes else ''} {sign} {self.total:,} input rows; "
                f"{self.requests:,} requests, {self.output_tokens:,} output tokens in {fmt_duration(snap['elapsed_s'])} "
                f"({snap['requests_per_s']:.2f} req/s, {snap['output_tokens_per_s']:,.0f} tok/s)")
        if self.tty:
            self.out.write("\r\x1b[2K")
            self.out.flush()
        return text, snap
