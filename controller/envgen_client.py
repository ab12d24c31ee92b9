"""Calls into the in-container modules agent.envgen (venv generations) and agent.recovery
(survivor scan, GPU sample, history), with the container's *system* python3.

Why the system python and not the venv's (Container.agent_call uses the venv's): these
calls rearrange the venv itself. Adopting moves the venv directory, and a switch may target
a generation whose python is broken. The interpreter that does the work must not be the
thing being repaired. Both modules are stdlib only, so /usr/bin/python3 is enough.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

from agent.protocol import PayloadError, extract_payload
from controller.container import Container, ContainerError

SYSTEM_PYTHON = "/usr/bin/python3"
# Fault-injection switches of agent.envgen, passed through from ctl's own environment so
# tests (and an operator reproducing a failure) can make a step die or pause at a named point.
FORWARDED_ENV = ("DFLASH_ENVGEN_FAULT", "DFLASH_ENVGEN_PAUSE_S", "DFLASH_ENVGEN_NO_EXCHANGE")
EXIT_REFUSED = 2


class EnvGenRefused(ContainerError):
    """The container side refused; nothing was changed."""


class EnvGenInterrupted(ContainerError):
    """The container-side process was killed mid-operation. Its journal lets a rerun finish."""


def _call(ct: Container, module: str, verb: str, args: Sequence[str], stdin: Optional[bytes] = None,
          timeout: Optional[float] = None) -> dict:
    env = ct.agent_env(ct.ensure_bundle())
    env.update({k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)})
    result = ct.exec([SYSTEM_PYTHON, "-m", module, *[str(a) for a in args]], env=env, stdin=stdin,
                     timeout=timeout)
    if result.returncode in (137, 143) or result.signal:
        raise EnvGenInterrupted(
            f"{module} {verb} in {ct} was killed midway (exit code {result.returncode}). "
            f"The venv {ct.config.venv} holds either the old or the new generation, intact; rerun the "
            f"same command (or `ctl env resume --container {ct.ctid}`) to complete it.")
    try:
        payload = extract_payload(result.stdout)
    except PayloadError as exc:
        tail = result.tail("stderr", 8) or result.tail("stdout", 8)
        hint = ""
        if "No such file" in tail and SYSTEM_PYTHON in tail:
            hint = f" ({SYSTEM_PYTHON} is missing in the container: install python3 there)"
        raise ContainerError(f"{module} in {ct} gave no readable reply ({exc}), exit code "
                             f"{result.returncode}{hint}: {tail}") from None
    if not payload.get("ok", result.ok):
        error = payload.get("error") or result.tail("stderr", 5)
        if payload.get("kind") == "refused" or result.returncode == EXIT_REFUSED:
            raise EnvGenRefused(f"{ct}: {error}")
        raise ContainerError(f"{ct}: {error}")
    return payload


def envgen(ct: Container, *args: str, stdin: Optional[bytes] = None) -> dict:
    """``python3 -m agent.envgen --venv <the container's venv> <args…>``."""
    return _call(ct, "agent.envgen", args[0], ["--venv", ct.config.venv, *args], stdin=stdin)


def recovery(ct: Container, *args: str, stdin: Optional[bytes] = None) -> dict:
    """``python3 -m agent.recovery --workspace <the container's workspace> <args…>``."""
    return _call(ct, "agent.recovery", args[0], ["--workspace", ct.config.workspace, *args], stdin=stdin)


def append_history(ct: Container, record: dict) -> dict:
    return recovery(ct, "history-append", stdin=json.dumps(record).encode())["record"]
