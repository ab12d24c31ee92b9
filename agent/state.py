"""The run's state machine (agent.protocol.RunState) and a store that enforces it."""

from __future__ import annotations

from typing import Callable

from agent.protocol import RunState

# The table in RunState's docstring, as data (a test holds the two to each other).
TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    RunState.STARTING: frozenset({RunState.RUNNING, RunState.STOPPING, RunState.COMPLETED, RunState.FAILED}),
    RunState.RUNNING: frozenset({RunState.RESTARTING, RunState.STOPPING, RunState.COMPLETED, RunState.FAILED}),
    RunState.RESTARTING: frozenset({RunState.RUNNING, RunState.STOPPING, RunState.FAILED}),
    RunState.STOPPING: frozenset({RunState.STOPPED, RunState.COMPLETED, RunState.FAILED}),
    RunState.COMPLETED: frozenset(),
    RunState.FAILED: frozenset(),
    RunState.STOPPED: frozenset(),
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
