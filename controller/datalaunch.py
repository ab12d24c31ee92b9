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

import os
import posixpath
import re
import time
from typing import Callable, Mapping, Optional

from controller.agentcall import AgentCallError, AgentCaller
from controller.container import Container
from controller.launch import SECRETS_DIR, LaunchRefused, LaunchResult, new_run_id, start_argv
from controller.render import DEFAULT_SECRET_KEYS
from controller.runconfig import RunConfigError

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def job_secret(config, environ: Optional[Mapping[str, str]] = None) -> tuple[Optional[str], tuple[str, ...]]:
    """(the run's secret file text or None, the variable names start.sh lets through) for the
    options of the job's kind that name a secret's environment variable (trainer/kinds.py
    ``secret_envs``: regenerate's ``api-key-env``).

    The value is read here, on the operator's machine, when ``ctl launch`` runs — as
    ``[wandb] api-key-env`` is for training — and travels only in the commit request into
    ``<workspace>/.dflash-ctl/secrets/<run-id>.env`` (root, 0600). The run config, start.sh,
    the launch record, the job's argv, its logs and events carry the variable's name only.
    """
    environ = os.environ if environ is None else environ
    kind, values = config.job_kind, config.values()
    lines, names = [], []
    for dest in kind.secret_envs:
        name = values.get(dest)
        if not name:
            continue
        where = f"[{kind.table}] {dest.replace('_', '-')} = {name!r}"
        if not _ENV_NAME.fullmatch(name) or name.startswith("DFLASH_"):
            raise RunConfigError(f"{where}: not a usable environment variable name (letters, digits and _, "
                                 "not DFLASH_…); name the variable that holds the key")
        value = environ.get(name, "").strip()
        if not value:
            raise RunConfigError(f"{where}: that environment variable is unset or empty on this machine; export "
                                 "the key in it before ctl launch (it goes into the run's root-only secret file, "
                                 "never into the run config)")
        if "\n" in value or "\0" in value:
            raise RunConfigError(f"{where}: its value holds a line break or NUL byte; a key is one line")
        lines.append(f"{name}={value}\n")
        names.append(name)
    return ("".join(lines) or None), tuple(names)


class DataLauncher:
    def __init__(self, container: Container, config, *, say: Callable[[str], None] = print,
                 run_id: Optional[str] = None, agent_options: Optional[dict] = None,
                 secret: Optional[tuple[Optional[str], tuple[str, ...]]] = None):
        self.secret, self.secret_names = secret if secret is not None else job_secret(config)
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
                   "read_options": self._options(self.kind.reads),
                   # the job's own start checks run in the container (its --preflight)
                   "argv": self.argv}
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
                                          run_id=self.run_id, run_dir=self.run_dir, secrets_file=secrets_file,
                                          secret_keys=DEFAULT_SECRET_KEYS + self.secret_names)
        record = {"run_id": self.run_id, "ts": time.time(), "config": self.config.name, "kind": self.kind.name,
                  "config_file": self.config._source_file, "sets": list(self.config._command_line_sets),
                  "start": {"kind": "rerun", "path": None}, "paths": self.config.paths(self.values),
                  "argv": self.argv, "fingerprint": pf.get("fingerprint"), "gpus": {}}
        request = {"workspace": self.workspace, "run_id": self.run_id, "record": record, "run_dir": self.run_dir,
                   "script": script, "secrets_file": secrets_file, "secret": self.secret,
                   # checked again against every live run under the container's launch lock
                   "paths": record["paths"],
                   "start_argv": start_argv(self.ct, self.run_dir, self.run_id, self.agent_options)}
        reply = self._call("agent.preflight", "commit", request, "starting the job")
        if reply.get("conflicts"):
            raise LaunchRefused(f"refused in {self.ct} as the job was being created:\n  " + "\n  ".join(reply["conflicts"]))
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
