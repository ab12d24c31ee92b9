"""The run's state machine (agent.protocol.RunState) and a store that enforces it."""

from __future__ import annotations

from typing import Callable

from agent.protocol import RunState

S = RunState
TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    S.STARTING: frozenset({S.RUNNING, S.STOPPING, S.FAILED, S.COMPLETED}),
    S.RUNNING: frozenset({S.RESTARTING, S.STOPPING, S.COMPLETED, S.FAILED}),
    S.RESTARTING: frozenset({S.RUNNING, S.STOPPING, S.FAILED}),
    S.STOPPING: frozenset({S.STOPPED, S.FAILED, S.COMPLETED}),
    S.COMPLETED: frozenset(),
    S.FAILED: frozenset(),
    S.STOPPED: frozenset(),
}


class TerminalStateError(RuntimeError):
    """A finished run was asked to change state: its result is final."""


class StateStore:
    """Holds the current state; refuses to leave a terminal state or to jump illegally.

    ``on_change(old, new)`` runs after each real change (the supervisor writes status.json
    and a status record there).
    """

    def __init__(self, state: RunState = RunState.STARTING,
                 on_change: Callable[[RunState, RunState], None] | None = None):
        self.state = RunState(state)
        self.on_change = on_change

    def set(self, new: RunState) -> bool:
        new = RunState(new)
        if new == self.state:
            return False
        if self.state.is_terminal():
            raise TerminalStateError(f"run is {self.state.value}; refusing to change it to {new.value}")
        if new not in TRANSITIONS[self.state]:
            raise ValueError(f"illegal run state change {self.state.value} → {new.value}")
        old, self.state = self.state, new
        if self.on_change:
            self.on_change(old, new)
        return True

    @property
    def terminal(self) -> bool:
        return self.state.is_terminal()
