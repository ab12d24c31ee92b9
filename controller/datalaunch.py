"""`ctl launch` of a data job (trainer/kinds.py: prepare, regenerate) into one container.

The same two round trips and the same guarantees as a training launch (controller/launch.py):
a preflight that writes nothing, then one commit that writes start.sh and the launch record
and starts the agent, undoing itself on failure. What differs is only what the preflight
asks: the job's input paths and the live runs that share its paths — no GPU, torch, model,
memory or checkpoint checks, which only mean something for training. The job then runs
under the same agent as a training run: detached, surviving the SSH session, its failures
named, stopped the same way; its progress events become status.json's "progress".

A data job has no start decision: launching the same config again after a stop resumes it
(its kind's ``resumes_by``).
"""

from __future__ import annotations

import posixpath
import time
from typing import Callable, Optional

from controller.agentcall import AgentCallError, AgentCaller
from controller.container import Container
from controller.launch import SECRETS_DIR, LaunchRefused, LaunchResult, new_run_id, start_argv


class DataLauncher:
    def __init__(self, container: Container, config, *, say: Callable[[str], None] = print,
                 run_id: Optional[str] = None, agent_options: Optional[dict] = None):
        self.ct = container
        self.config = config
        self.kind = config.job_kind
        self.say = say
        self.workspace = container.config.workspace
        self.run_id = run_id or new_run_id(config.name)
        self.run_dir = posixpath.join(self.workspace, "runs", self.run_id)
        self.values = config.resolve(run_id=self.run_id, run_dir=self.run_dir, workspace=self.workspace)
        self.argv = config.argv(self.values)
        self.caller = AgentCaller(container, say)
        self.agent_options = {**config.supervision.agent_options(), **(agent_options or {})}

    def _call(self, module: str, verb: str, request: dict, what: str) -> dict:
        try:
            return self.caller.call(module, [verb], request, what)
        except AgentCallError as exc:
            raise LaunchRefused(str(exc)) from None

    def _options(self, dests) -> list[str]:
        out = []
        for d in dests:
            v = self.values.get(d)
            n = len(v) if isinstance(v, (list, tuple)) else (1 if v else 0)
            out += [f"[{self.kind.table}] {d.replace('_', '-')}"] * n
        return out

    def preflight(self) -> dict:
        request = {"workspace": self.workspace, "run_id": self.run_id, "config": self.config.name,
                   "kind": self.kind.name, "paths": self.config.paths(self.values),
                   "read_options": self._options(self.kind.reads)}
        return self._call("agent.preflight", "check", request, "the launch preflight")

    def report(self, pf: dict) -> list[str]:
        py, disk = pf.get("python") or {}, pf.get("disk") or {}
        lines = [f"job      {self.kind.name}: python -m trainer {' '.join(self.argv)}",
                 f"python   {py.get('executable')} {py.get('version')} (venv {py.get('venv') or 'none'}, "
                 f"{pf.get('packages_count')} packages)",
                 f"disk     {disk.get('free_gib')} GiB free at {disk.get('measured_at')}",
                 f"resumes  by {self.kind.resumes_by}"]
        return lines + [f"warning: {w}" for w in pf.get("warnings") or []]

    def commit(self, pf: dict) -> dict:
        from controller import render

        secrets_file = posixpath.join(self.workspace, SECRETS_DIR, f"{self.run_id}.env")
        script = render.render_job_script(self.argv, container=self.ct.config, bundle=self.caller.bundle_path,
                                          run_id=self.run_id, run_dir=self.run_dir, secrets_file=secrets_file)
        record = {"run_id": self.run_id, "ts": time.time(), "config": self.config.name, "kind": self.kind.name,
                  "config_file": self.config._source_file, "sets": list(self.config._command_line_sets),
                  "start": {"kind": "rerun", "path": None}, "paths": self.config.paths(self.values),
                  "argv": self.argv, "fingerprint": pf.get("fingerprint"), "gpus": {}}
        request = {"workspace": self.workspace, "run_id": self.run_id, "record": record, "run_dir": self.run_dir,
                   "script": script, "secrets_file": secrets_file, "secret": None,
                   "start_argv": start_argv(self.ct, self.run_dir, self.run_id, self.agent_options)}
        reply = self._call("agent.preflight", "commit", request, "starting the job")
        if not reply.get("ok"):
            raise LaunchRefused(f"the job did not start in {self.ct}: {reply.get('error')}; nothing was left behind")
        return reply

    def run(self) -> LaunchResult:
        t0 = time.monotonic()
        pf = self.preflight()
        lines = self.report(pf)
        for line in lines:
            self.say(line)
        if pf.get("errors"):
            raise LaunchRefused(f"preflight refused the launch in {self.ct}:\n  " + "\n  ".join(pf["errors"]), lines)
        reply = self.commit(pf)
        return LaunchResult(self.run_id, self.run_dir, lines, reply.get("start") or {}, pf,
                            self.caller.round_trips, {"total_s": time.monotonic() - t0})
