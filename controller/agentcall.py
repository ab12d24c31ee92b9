"""The one way into the in-container side: ``python3 -m <module> …`` from this checkout's
bundle, in one round trip when the bundle is there.

The call runs straight from the bundle's path; the bundle is uploaded only when python
answers "No module named" — so a launch or a ``ctl status`` against a container that
already has this version costs one round trip per call, and a container that lacks it
still gets it. Replies are the sentinel-wrapped JSON of agent.protocol.

Which python: the venv's (``python="venv"``, the default: the agent and trainer run on the
torch the run uses) or the container's system python (``python="system"``, for
agent.envgen/agent.recovery): those calls rearrange the venv itself — adopting moves its
directory, a switch may target a generation whose python is broken — and the interpreter
that does the work must not be the thing being repaired. Both modules are stdlib only.
"""

from __future__ import annotations

import json
from typing import Callable, Optional, Sequence

from agent.protocol import PayloadError, extract_payload
from controller import bundle as bundle_mod
from controller.container import AgentError, Container, ContainerError
from controller.transport import Result, Stdin

SYSTEM_PYTHON = "/usr/bin/python3"

# The read-only views an operator types many times a minute (`ctl status`, `ctl tail`, a
# followed stream) run the agent's own standard-library code and import nothing from
# site-packages, so their interpreter starts without site (-S): no site-packages scan and no
# .pth files (the venv's distutils-precedence.pth) — the part of the call that is python's
# start-up, not the answer (docs/benchmarks.md). Not -I or -E: the bundle reaches
# python through PYTHONPATH. Processes these calls start (an agent re-attached by
# `runview status`) are exec'd fresh from sys.executable and get site as usual. Every other
# call keeps site: the trainer and GPU sampling (nvidia-ml-py) import from the venv.
NO_SITE_CALLS = frozenset({("agent.runview", "status"), ("agent.runview", "stream"), ("agent", "follow")})


def interpreter_flags(module: str, args: Sequence[str]) -> list[str]:
    """The python flags for ``python3 -m module args…``: -S for NO_SITE_CALLS, none otherwise."""
    return ["-S"] if (module, str(args[0]) if args else "") in NO_SITE_CALLS else []

# reply hook: (result, payload or None) → raise to refuse it; the payload is returned otherwise
ReplyHook = Callable[[Result, Optional[dict]], None]


class AgentCallError(AgentError):
    """The in-container call gave no usable answer; the message says what to do."""


class AgentCaller:
    """Runs ``python3 -m <module> …`` from this checkout's bundle in one container."""

    def __init__(self, ct: Container, say: Callable[[str], None] = lambda line: None, *,
                 python: str = "venv", env: Optional[dict[str, str]] = None,
                 bundle: Optional[bundle_mod.Bundle] = None):
        if python not in ("venv", "system"):
            raise ValueError(f"python must be 'venv' or 'system', not {python!r}")
        self.ct = ct
        self.say = say
        self.python = ct.config.python if python == "venv" else SYSTEM_PYTHON
        self.extra_env = dict(env or {})
        self.bundle = bundle or bundle_mod.build()
        self.bundle_path = bundle_mod.remote_path(ct.config.workspace, self.bundle.version)
        self.round_trips = 0
        self.uploaded = False

    def env(self) -> dict[str, str]:
        return {**bundle_mod.agent_env(self.bundle_path), **self.extra_env}

    def _missing_bundle(self, result: Result) -> bool:
        return result.failed and "No module named" in result.stderr and ("agent" in result.stderr or "trainer" in result.stderr)

    def ensure_bundle(self) -> str:
        """Upload this checkout's bundle unless that version is there; its path in the container."""
        self.round_trips += 1
        if self.ct.exec(["test", "-d", self.bundle_path]).ok:
            return self.bundle_path
        self._upload()
        return self.bundle_path

    def _upload(self) -> None:
        self.say(f"installing agent bundle {self.bundle.version} in {self.ct}")
        self.round_trips += 1
        data = self.bundle.tar()
        result = self.ct.exec(bundle_mod.upload_argv(self.bundle_path, data), stdin=data)
        if result.failed:
            raise ContainerError(f"cannot install the agent bundle {self.bundle.version} at {self.bundle_path} in "
                                 f"{self.ct}: {result.tail('stderr', 3)}")
        self.uploaded = True

    def run(self, module: str, args: Sequence[str] = (), *, stdin: Stdin = None, **kw) -> Result:
        """The raw result (streaming callbacks allowed through ``kw``)."""
        argv = [self.python, *interpreter_flags(module, args), "-m", module, *[str(a) for a in args]]
        for attempt in (1, 2):
            self.round_trips += 1
            result = self.ct.exec(argv, env=self.env(), stdin=stdin, **kw)
            if attempt == 1 and self._missing_bundle(result):
                self._upload()
                continue
            if result.failed and "No such file or directory" in result.stderr and self.python in result.stderr:
                where = (f"create the venv at {self.ct.config.venv} or set `venv` for container {self.ct.ctid} in "
                         "the controller config" if self.python != SYSTEM_PYTHON else "install python3 there")
                raise AgentCallError(f"{self.ct}: {self.python} does not exist; {where}", result=result)
            return result
        return result

    def call(self, module: str, args: Sequence[str] = (), request: Optional[dict] = None, what: str = "", *,
             stdin: Stdin = None, check: bool = False, on_reply: Optional[ReplyHook] = None,
             timeout: Optional[float] = None) -> dict:
        """The sentinel-wrapped JSON reply. A non-zero exit with a reply returns the reply,
        unless ``check`` (then AgentCallError names the error); ``on_reply`` sees every
        result first and may raise its own error (e.g. envgen's refused/interrupted)."""
        what = what or f"{module} {args[0] if args else ''}".strip()
        if request is not None:
            stdin = json.dumps(request)
        result = self.run(module, args, stdin=stdin, timeout=timeout)
        try:
            payload = extract_payload(result.stdout)
        except PayloadError as exc:
            payload = None
            if on_reply is not None:
                on_reply(result, None)
            raise AgentCallError(f"{what} in {self.ct} gave no readable reply ({exc}); exit code {result.returncode}: "
                                 f"{result.tail('stderr', 6) or result.tail('stdout', 6)}", result=result) from None
        if on_reply is not None:
            on_reply(result, payload)
        if check and result.failed:
            why = payload.get("error") or result.tail("stderr", 5)
            raise AgentCallError(f"{what} in {self.ct} failed (exit code {result.returncode}): {why}",
                                 payload=payload, result=result)
        return payload
