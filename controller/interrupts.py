"""Ctrl-C during a command that changes a container: before the change begins it aborts
(nothing was started), once it has begun it is held until the command has said what it did
(a run id and how to follow or stop it; a complete export). Never a silent run.

    with interrupts.guarded():
        prepare()                # a SIGINT here raises KeyboardInterrupt: undo, say so
        interrupts.hold()        # from here a SIGINT is recorded, not raised
        commit(); report()
    if interrupts.interrupted(): …exit 130, having reported

``pause_point(name)`` is the test hook that makes "a signal at this moment" exact without
timing races: with ``DFLASH_CTL_PAUSE_AT=name`` and ``DFLASH_CTL_PAUSE_DIR=DIR`` in the
environment, the command writes ``DIR/name.reached`` there and waits for ``DIR/name.go``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Iterator

ENV_PAUSE_AT = "DFLASH_CTL_PAUSE_AT"
ENV_PAUSE_DIR = "DFLASH_CTL_PAUSE_DIR"

_state = {"guarded": False, "holding": False, "pending": False}


def _on_sigint(signum, frame) -> None:
    if _state["holding"]:
        _state["pending"] = True
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """SIGINT raises until :func:`hold`, then is recorded; the old handler comes back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, _on_sigint)
    _state.update(guarded=True, holding=False, pending=False)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _state.update(guarded=False, holding=False)


def hold() -> None:
    """The change has begun: a SIGINT from now on waits until the command has reported."""
    if _state["guarded"]:
        _state["holding"] = True


def holding() -> bool:
    return _state["holding"]


def interrupted() -> bool:
    """A SIGINT came while holding (the command reported first; now it exits 130)."""
    return _state["pending"]


def pause_point(name: str) -> None:
    """The test hook (module docstring); nothing unless DFLASH_CTL_PAUSE_AT names ``name``."""
    if os.environ.get(ENV_PAUSE_AT) != name or not os.environ.get(ENV_PAUSE_DIR):
        return
    directory = os.environ[ENV_PAUSE_DIR]
    with open(os.path.join(directory, f"{name}.reached"), "w") as fh:
        fh.write(str(os.getpid()))
    go = os.path.join(directory, f"{name}.go")
    while not os.path.exists(go):
        time.sleep(0.02)


def how_to_follow_and_stop(follow_line: str, stop_line: str) -> list[str]:
    """The two lines printed after every start, single run or job."""
    return [f"  follow: {follow_line}", f"  stop:   {stop_line}"]


def went_on(what: str, follow_line: str, stop_line: str, where: str = "") -> str:
    """Ctrl-C arrived after ``what`` started: the message says it goes on and how to reach it."""
    return f"interrupted after {what} started{where}: it goes on; follow: `{follow_line}`; stop: `{stop_line}`"
