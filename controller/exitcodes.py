"""`ctl`'s exit codes: the one home of them. Every command module uses these names; the
table in docs/launch.md is generated from MEANINGS (``table_markdown``) and a test holds
the two to each other. `ctl exec` passes the remote command's own code through instead.

Standard library only: `ctl status` and `ctl tail` import it on their start-up path.
"""

from __future__ import annotations

import enum


class CtlExit(enum.IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    REFUSED = 3
    NOT_DONE = 4
    # The same code as agent/protocol.py's EXIT_CONTAINER_RESTARTED: a follower passes it on.
    CONTAINER_RESTARTED = 5
    INTERRUPTED = 130
    TRANSPORT = 255


MEANINGS: dict[CtlExit, str] = {
    CtlExit.OK: "ok: the command did what it was asked (a followed run completed; `ctl status`/`ctl tail` of a "
                "run that has not failed)",
    CtlExit.FAILED: "the run failed (a followed run, or `ctl status`/`ctl tail` of a failed run), or a command in "
                    "the container failed",
    CtlExit.USAGE: "bad input, nothing sent or changed: an option, a run id, a config value or encoding, a "
                   "container that does not exist",
    CtlExit.REFUSED: "refused, nothing started or changed: preflight, drift, busy GPUs or rank slots, another "
                     "launch or kill-and-rollback holding them",
    CtlExit.NOT_DONE: "the run stopped, or its agent is gone, before it completed",
    CtlExit.CONTAINER_RESTARTED: "the run's container restarted (or its node rebooted) under it, or stayed stopped "
                                 "past `ctl tail --wait-stopped`: the run is dead; the message says how to resume",
    CtlExit.INTERRUPTED: "interrupted (Ctrl-C); the message says what was started, if anything, and how to follow "
                         "or stop it",
    CtlExit.TRANSPORT: "the node could not be reached (like ssh(1))",
}


def table_markdown() -> str:
    """The exit-code table of docs/launch.md, exactly as it stands there."""
    rows = ["| code | meaning |", "| --- | --- |"]
    rows += [f"| {code.value} | {MEANINGS[code]} |" for code in CtlExit]
    return "\n".join(rows)


if __name__ == "__main__":
    print(table_markdown())
