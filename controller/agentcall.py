"""Calling the in-container side from the bundle, in one round trip when the bundle is there.

``Container.agent_call`` checks for the bundle first (``test -d``) on every new connection:
one extra round trip per command. Here the call runs straight from the bundle's path and
the bundle is uploaded only when python answers "No module named" — so a launch or a
``ctl status`` against a container that already has this version costs one round trip per
call, and a container that lacks it still gets it.
"""

from __future__ import annotations

import json
from typing import Callable, Optional, Sequence

from agent.protocol import PayloadError, extract_payload
from controller import bundle as bundle_mod
from controller.container import Container, ContainerError
from controller.transport import Result


class AgentCallError(ContainerError):
    """The in-container call gave no usable answer; the message says what to do."""


class AgentCaller:
    """Runs ``python3 -m <module> …`` from this checkout's bundle in one container."""

    def __init__(self, ct: Container, say: Callable[[str], None] = lambda line: None):
        self.ct = ct
        self.say = say
        self.bundle = bundle_mod.build()
        self.bundle_path = bundle_mod.remote_path(ct, self.bundle.version)
        self.round_trips = 0
        self.uploaded = False

    def env(self) -> dict[str, str]:
        return self.ct.agent_env(self.bundle_path)

    def _missing_bundle(self, result: Result) -> bool:
        return result.failed and "No module named" in result.stderr and ("agent" in result.stderr or "trainer" in result.stderr)

    def _upload(self) -> None:
        self.say(f"installing agent bundle {self.bundle.version} in {self.ct}")
        self.round_trips += 2  # test -d + upload
        bundle_mod.ensure_bundle(self.ct, self.bundle)
        self.uploaded = True

    def run(self, module: str, args: Sequence[str] = (), *, stdin: Optional[str] = None, **kw) -> Result:
        """The raw result (streaming callbacks allowed through ``kw``)."""
        argv = [self.ct.config.python, "-m", module, *[str(a) for a in args]]
        for attempt in (1, 2):
            self.round_trips += 1
            result = self.ct.exec(argv, env=self.env(), stdin=stdin, **kw)
            if attempt == 1 and self._missing_bundle(result):
                self._upload()
                continue
            if result.failed and "No such file or directory" in result.stderr and self.ct.config.python in result.stderr:
                raise AgentCallError(f"{self.ct}: {self.ct.config.python} does not exist; create the venv at "
                                     f"{self.ct.config.venv} or set `venv` for container {self.ct.ctid} in the "
                                     "controller config")
            return result
        return result

    def call(self, module: str, args: Sequence[str] = (), request: Optional[dict] = None, what: str = "") -> dict:
        """The sentinel-wrapped JSON reply (also when the command exits non-zero with one)."""
        result = self.run(module, args, stdin=json.dumps(request) if request is not None else None)
        try:
            return extract_payload(result.stdout)
        except PayloadError:
            raise AgentCallError(f"{what or module} in {self.ct} gave no readable answer (exit code "
                                 f"{result.returncode}): {result.tail('stderr', 6) or result.tail('stdout', 6)}") from None
