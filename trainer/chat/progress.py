"""Progress events of a data job (trainer/kinds.py), for the agent that supervises it.

Inside a run (``$DFLASH_RUN_DIR`` set by the agent) each update becomes a ``progress`` event
in events.jsonl (agent/protocol.py names the fields), at most every ``every_s`` seconds
and always when forced (start, end); outside a run it does nothing. `ctl status` and
`ctl tail` show the last one: done / failed / rates / ETA.
"""

from __future__ import annotations

import os
import time

from agent.protocol import ENV_RUN_DIR


class Progress:
    def __init__(self, every_s: float = 2.0, clock=time.monotonic):
        run_dir = os.environ.get(ENV_RUN_DIR)
        self.events = None
        if run_dir and os.path.isdir(run_dir):
            from trainer.telemetry import Events

            self.events = Events(run_dir, None, "job", None)
        self.every_s = every_s
        self.clock = clock
        self.started = clock()
        self._last = float("-inf")

    def elapsed(self) -> float:
        return max(self.clock() - self.started, 1e-9)

    def due(self) -> bool:
        return self.events is not None and self.clock() - self._last >= self.every_s

    def update(self, force: bool = False, **fields) -> None:
        if self.events is None or not (force or self.due()):
            return
        self._last = self.clock()
        self.events.emit("progress", elapsed_s=round(self.elapsed(), 3), **fields)

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
            self.events = None


def eta_s(done: float, total: float | None, elapsed: float) -> float | None:
    """Remaining seconds at the average rate so far; None before anything is done."""
    if not total or done <= 0:
        return None
    return round(max(0.0, (total - done) * elapsed / done), 1)
