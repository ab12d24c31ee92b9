"""Calls into the in-container modules agent.envgen (venv generations), agent.compilecache (a
generation's compile cache, packed and unpacked) and agent.recovery (survivor scan, GPU
sample, history), with the container's *system* python3.

Both run on the container's system python (AgentCaller's ``python="system"``, which says
why); this module maps their replies to refused/interrupted errors.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

from agent.protocol import ENVGEN_EXIT_REFUSED, PayloadError, extract_payload
from controller.agentcall import AgentCaller
from controller.container import Container, ContainerError

# Fault-injection switches of agent.envgen, passed through from ctl's own environment so
# tests (and an operator reproducing a failure) can make a step die or pause at a named point.
FORWARDED_ENV = ("DFLASH_ENVGEN_FAULT", "DFLASH_ENVGEN_PAUSE_S", "DFLASH_ENVGEN_NO_EXCHANGE")


class EnvGenRefused(ContainerError):
    """The container side refused; nothing was changed."""


class EnvGenInterrupted(ContainerError):
    """The container-side process was killed mid-operation. Its journal lets a rerun finish."""


def _refusal(ct: Container, module: str):
    """Maps envgen's and recovery's replies to their errors (AgentCaller's reply hook)."""

    def hook(result, payload) -> None:
        if result.returncode in (137, 143) or result.signal:
            raise EnvGenInterrupted(
                f"{module} in {ct} was killed midway (exit code {result.returncode}). "
                f"The venv {ct.config.venv} holds either the old or the new generation, intact; rerun the "
                f"same command (or `ctl env resume --container {ct.ctid}`) to complete it.")
        if payload is not None and not payload.get("ok", result.ok):
            error = payload.get("error") or result.tail("stderr", 5)
            if payload.get("kind") == "refused" or result.returncode == ENVGEN_EXIT_REFUSED:
                raise EnvGenRefused(f"{ct}: {error}")
            raise ContainerError(f"{ct}: {error}")
    return hook


def _call(ct: Container, module: str, args: Sequence[str], stdin: Optional[bytes] = None) -> dict:
    env = {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}
    caller = AgentCaller(ct, python="system", env=env)
    return caller.call(module, args, stdin=stdin, what=module, on_reply=_refusal(ct, module))


def envgen(ct: Container, *args: str, stdin: Optional[bytes] = None) -> dict:
    """``python3 -m agent.envgen --venv <the container's venv> <args…>``."""
    return _call(ct, "agent.envgen", ["--venv", ct.config.venv, *args], stdin=stdin)


def recovery(ct: Container, *args: str, stdin: Optional[bytes] = None) -> dict:
    """``python3 -m agent.recovery --workspace <the container's workspace> <args…>``."""
    return _call(ct, "agent.recovery", ["--workspace", ct.config.workspace, *args], stdin=stdin)


def append_history(ct: Container, record: dict) -> dict:
    return recovery(ct, "history-append", stdin=json.dumps(record).encode())["record"]


def compile_cache(ct: Container, *args: str, stdin=None) -> dict:
    """``python3 -m agent.compilecache --workspace … --venv … <args…>`` (stdin: an archive
    for ``unpack -``, streamed from a file object)."""
    return _call(ct, "agent.compilecache", ["--workspace", ct.config.workspace, "--venv", ct.config.venv, *args],
                 stdin=stdin)


def compile_cache_pack(ct: Container, sink, generation: str = "current") -> dict:
    """Stream one generation's compile-cache archive into ``sink`` (a binary writer) from
    ``agent.compilecache pack --out -``: the archive on stdout, the reply on stderr, so no
    archive is left behind in the container. Returns the reply (its manifest)."""
    import io

    env = {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}
    caller = AgentCaller(ct, python="system", env=env)
    caller.ensure_bundle()  # the stderr a missing bundle would show is not captured below
    err = io.BytesIO()
    args = ["--workspace", ct.config.workspace, "--venv", ct.config.venv, "pack", "--generation", generation, "--out", "-"]
    result = caller.run("agent.compilecache", args, capture=False, stdout_sink=sink, stderr_sink=err)
    text = err.getvalue().decode("utf-8", "replace")
    try:
        payload = extract_payload(text)
    except PayloadError:
        raise ContainerError(f"packing the compile cache in {ct} gave no reply (exit code {result.returncode}): "
                             f"{text.strip()[-600:]}") from None
    if not payload.get("ok"):
        cls = EnvGenRefused if payload.get("kind") == "refused" else ContainerError
        raise cls(f"{ct}: {payload.get('error')}")
    return payload
