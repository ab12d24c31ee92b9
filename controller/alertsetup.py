"""A launched run's alerts set up in its container (one agent call right after the start):
the effective ``[notify]`` settings (controller/notifyconfig.py), where the run is, the next
commands an alert names, and — on stdin only — the values of the channels' secret variables
that are set on this machine, so the container can deliver by itself. A variable that is not
set here is said in a warning line; `ctl watch` (which runs where it is set) delivers then.
"""

from __future__ import annotations

import shlex
from typing import Callable, Optional

from controller import notifyconfig


def commands(ct, run_id: str, launch: Optional[dict]) -> dict:
    """The next-command templates ({checkpoint} filled in by the agent)."""
    from controller.resume import resume_line

    where = ["--node", ct.node_name, "--container", str(ct.ctid)] if ct.node_name else ["--container", str(ct.ctid)]
    out = {"status": shlex.join(["ctl", "status", *where, "--run", run_id]),
           "tail": shlex.join(["ctl", "tail", *where, "--run", run_id])}
    if launch is not None:
        line = resume_line(ct.ctid, ct.node_name, launch, {"path": "CHECKPOINT"})
        out["resume"] = line.replace("CHECKPOINT", "{checkpoint}")
        out["export"] = shlex.join(["ctl", "export", *where, "--run", run_id, "--to", f"./{run_id}-drafter"])
    return out


def configure_run(caller, ct, run_id: str, run_dir: str, run_notify: Optional[dict] = None,
                  launch: Optional[dict] = None, say: Callable[[str], None] = print) -> bool:
    """Send the run's notify settings; False (and nothing sent) when no level has a channel."""
    settings = notifyconfig.for_container(ct.node, ct.ctid, run_notify)
    if not settings["channels"] and not settings["thresholds"]:
        return False
    values, missing = notifyconfig.secrets(settings["channels"])
    for name in missing:
        say(f"alerts   warning: ${name} is not set here: the container cannot deliver through the channels "
            f"that read it; `ctl watch` delivers them where it is set")
    config = {**settings, "where": {"node": ct.node_name, "container": str(ct.ctid)},
              "commands": commands(ct, run_id, launch)}
    reply = caller.call("agent.alertcmd", ["configure", "--run-dir", run_dir],
                        request={"config": config, "secrets": values}, what="alert settings")
    if not reply.get("ok"):
        say(f"alerts   warning: the alert settings did not reach {ct}: {reply.get('error')}; `ctl watch` delivers "
            "this run's alerts")
        return False
    say(f"alerts   {', '.join(sorted(settings['channels'])) or 'no channel'} (docs/alerts.md)")
    return True
