"""`ctl tail --follow` on a terminal: the log scrolls, one status line stays at the bottom
(step/total, tokens/s against the baseline, loss, ETA), as rich's live display does. On a
pipe, or with --json, the tail stays line-oriented (controller/tail.py's Printer alone).

The status line is redrawn from each step event; the ETA is the remaining steps over the
step rate of the last few minutes of events (not the whole run: the first steps compile)."""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Optional

from rich.console import Console
from rich.live import Live
from rich.text import Text

from controller.status import fmt_duration
from controller.tail import fmt_rate

RATE_WINDOW = 20  # step events the ETA's rate is taken over


def eta_text(seconds: Optional[float]) -> str:
    return "ETA " + fmt_duration(None if seconds is None or seconds < 0 else seconds)


class StepClock:
    """The step rate over the last RATE_WINDOW step events, for the ETA."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.seen: deque[tuple[float, int]] = deque(maxlen=RATE_WINDOW)

    def step(self, step: int) -> None:
        self.seen.append((self.clock(), step))

    def eta(self, total: Optional[int]) -> Optional[float]:
        if not total or len(self.seen) < 2:
            return None
        (t0, s0), (t1, s1) = self.seen[0], self.seen[-1]
        if s1 <= s0 or t1 <= t0:
            return None
        return (total - s1) * (t1 - t0) / (s1 - s0)


def status_text(step: dict, clock: StepClock, baseline_tok_s: Optional[float]) -> str:
    total = step.get("total_steps")
    n = step.get("step")
    parts = [f"step {n if n is not None else '—'}" + (f"/{total}" if total else "")]
    rate = step.get("tokens_per_s")
    tok = f"{fmt_rate(rate)} tok/s"
    if baseline_tok_s and rate:
        tok += f" ({100 * rate / baseline_tok_s:.0f} % of baseline {fmt_rate(baseline_tok_s)})"
    parts.append(tok)
    loss = step.get("loss")
    parts.append(f"loss {loss:.4f}" if isinstance(loss, (int, float)) else "loss —")
    parts.append(eta_text(clock.eta(total)))
    return "  ".join(parts)


class LiveTail:
    """The printer's lines above, the status line below, until closed."""

    def __init__(self, console: Console, baseline_tok_s: Optional[float] = None):
        self.console = console
        self.baseline = baseline_tok_s
        self.clock = StepClock()
        self.live = Live(Text(""), console=console, refresh_per_second=4, transient=False,
                         redirect_stdout=False, redirect_stderr=False)
        self.last = ""

    def __enter__(self) -> "LiveTail":
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.__exit__(*exc)

    def write(self, line: str) -> None:
        self.console.print(Text(line), soft_wrap=True)

    def on_step(self, step: dict) -> None:
        if step.get("step") is not None:
            self.clock.step(int(step["step"]))
        self.last = status_text(step, self.clock, self.baseline)
        self.live.update(Text(self.last, style="bold"), refresh=True)
