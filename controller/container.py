"""A handle on one LXC container of one node: run argv in it, move files. The agent is
called through controller/agentcall.py.

Everything goes through a Runner (controller/transport.py) and ``pct exec`` with a
scrubbed environment (controller/pct.py), so the same code runs over SSH, locally on the
node, and against the simulated node in tests.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
import os
from typing import IO, Mapping, Optional, Sequence

from controller import pct
from controller.config import ContainerConfig, NodeConfig
from controller.exitcodes import CtlExit
from controller.transport import CommandError, Result, Runner, Stdin


class ContainerError(Exception):
    """Something about the container stops us; the message names it and what to do."""


class ContainerStopped(ContainerError):
    """The container is not running (stopped, or restarting): a follower waits for it."""


class ContainerMissing(ContainerError):
    """The container id names no container on the node: bad input, like a wrong option."""

    exit_code = CtlExit.USAGE


class AgentError(ContainerError):
    """The in-container agent failed or answered with something we cannot read."""

    def __init__(self, message: str, payload: Optional[dict] = None, result: Optional[Result] = None):
        super().__init__(message)
        self.payload = payload
        self.result = result


# Fixed scripts, values only as positional parameters ("$1"…), never interpolated.
# Write: receive stdin into a temp file next to the destination, verify size and sha256
# (a dropped connection gives cat an early EOF, not an error: the check is what makes a
# killed upload leave nothing), then chmod and rename over the destination.
_WRITE_SCRIPT = (
    'umask 077; '
    'if cat > "$1" && [ "$(wc -c < "$1")" -eq "$4" ] && got=$(sha256sum < "$1") && [ "${got%% *}" = "$5" ] '
    '&& chmod "$3" "$1" && mv -f "$1" "$2"; then exit 0; fi; '
    'rm -f "$1"; echo "upload of $2 was incomplete or failed; nothing was written" >&2; exit 1'
)

# pct's own words for a container that is not running / not there (real pct and the sim).
_NOT_RUNNING = re.compile(r"not running|Failed to get init pid|is stopped", re.I)
_MISSING = re.compile(r"does not exist|no such container|not found", re.I)


class Container:
    """Container ``ctid`` on node ``node_name``, reached through ``runner``."""

    def __init__(self, runner: Runner, node_name: str, node: NodeConfig, ctid: int | str):
        self.runner = runner
        self.node_name = node_name
        self.node = node
        self.ctid = str(ctid)
        self.config: ContainerConfig = node.container(ctid)

    def __str__(self) -> str:
        return f"container {self.ctid} on node {self.node_name}"

    # -- running commands ------------------------------------------------------------------
    def pct(self, *args: str, **kw) -> Result:
        """``pct <args…>`` on the node (through sudo when configured); a pct that cannot be run
        at all raises PctAccessError with the fix."""
        result = self.runner.run(pct.argv(self.node, *args), **kw)
        problem = pct.access_problem(self.node_name, self.node, result)
        if problem:
            raise pct.PctAccessError(problem)
        return result

    def exec(self, argv: Sequence[str], *, env: Optional[Mapping[str, str]] = None, stdin: Stdin = None,
             check: bool = False, capture: bool = True, on_stdout=None, on_stderr=None,
             stdout_sink: Optional[IO[bytes]] = None, stderr_sink: Optional[IO[bytes]] = None,
             timeout: Optional[float] = None) -> Result:
        """Run ``argv`` in the container with exactly PATH, HOME, LANG and ``env`` set."""
        try:
            command = pct.pct_exec_argv(self.node, self.ctid, argv, container=self.config, env=env)
        except pct.PctUsageError as exc:
            raise ContainerError(f"cannot run that in {self}: {exc}") from None
        result = self.runner.run(pct.on_node_choice(command), stdin=stdin, capture=capture, on_stdout=on_stdout,
                                 on_stderr=on_stderr, stdout_sink=stdout_sink, stderr_sink=stderr_sink, timeout=timeout)
        result.argv = command  # messages name the pct command, not the script before it
        problem = pct.access_problem(self.node_name, self.node, result)
        if problem:
            raise pct.PctAccessError(problem)
        if result.failed and self.looks_unreachable(result):
            self.check_running()  # raises the clear message when the container is the problem
        if check and result.failed:
            raise CommandError(result)
        return result

    @staticmethod
    def looks_unreachable(result: Result) -> bool:
        """pct itself (not the command) may have failed because the container is down/absent."""
        tail = result.tail("stderr", 3)
        return bool(_NOT_RUNNING.search(tail) or (_MISSING.search(tail) and "conf" in tail))

    def status(self) -> str:
        """'running' or 'stopped'; raises ContainerError when the container does not exist."""
        result = self.pct("status", self.ctid)
        text = result.stdout + "\n" + result.stderr
        match = re.search(r"status:\s*(\w+)", result.stdout)
        if result.ok and match:
            return match.group(1)
        if _MISSING.search(text):
            raise ContainerMissing(f"container {self.ctid} does not exist on node {self.node_name}: "
                                 f"check the id (`{pct.command_text(self.node, 'list')}` on the node)")
        raise ContainerError(f"cannot get the status of {self}: `{result.command}` said: "
                             f"{result.tail('stderr', 3) or result.tail('stdout', 3) or f'exit code {result.returncode}'}")

    def check_running(self) -> None:
        state = self.status()
        if state != "running":
            raise ContainerStopped(f"container {self.ctid} on node {self.node_name} is {state}: "
                                 f"start it with {pct.start_hint(self.node, self.ctid)}")

    # -- files ----------------------------------------------------------------------------
    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Atomically replace ``path`` in the container with ``data``: uploaded through stdin
        into a temp file in the same directory, verified, then renamed."""
        if isinstance(data, str):
            data = data.encode()
        result = self.exec(self.write_argv(path, data, mode), stdin=data)
        if result.failed:
            raise ContainerError(f"cannot write {path} in {self}: {result.tail('stderr', 3)}")

    def write_argv(self, path: str, data: bytes, mode: int = 0o644) -> list[str]:
        """The in-container argv that receives ``data`` on stdin for :meth:`write_file`."""
        self._check_path(path)
        directory, base = posixpath.split(path)
        tmp = posixpath.join(directory, f".{base}.ctl-{os.urandom(6).hex()}.tmp")
        return ["sh", "-c", _WRITE_SCRIPT, "sh", tmp, path, f"{mode:o}", str(len(data)),
                hashlib.sha256(data).hexdigest()]

    def read_file(self, path: str) -> bytes:
        self._check_path(path)
        result = self.exec(["cat", "--", path])
        if result.failed:
            raise ContainerError(f"cannot read {path} in {self}: {result.tail('stderr', 3)}")
        return result.stdout_bytes

    def _check_path(self, path: str) -> None:
        if not path.startswith("/") or "\n" in path or "\0" in path:
            raise ContainerError(f"{path!r} is not an absolute path usable in {self}")
