"""How the controller runs a command: one Runner interface, a local and an SSH implementation.

Shaped like invoke's Runner (STYLE.md): ``run(argv)`` starts the command, reads stdout and
stderr concurrently, streams them line by line to callbacks, and returns a :class:`Result`
(``ok``, ``failed``, ``returncode``, ``stdout``, ``stderr``, ``tail()``). With
``check=True`` a non-zero exit raises :class:`CommandError` showing the command, the code
and the end of stderr. The ``pct exec`` wrapping (controller/pct.py) and the container
handle (controller/container.py) sit on top of either runner, so tests and the local demo
use the same code path as a real node.

Commands are argv lists everywhere. The SSH runner turns an argv into the one shell string
an SSH server needs with ``shlex.join`` and nothing else.

Why paramiko and not fabric's ``Connection``: fabric unconditionally installs
``AutoAddPolicy`` (research §3), i.e. it trusts any host key it has not seen. A Proxmox node
is a fixed, long-lived host: an unknown or changed key must stop us, not be learned.
"""

from __future__ import annotations

import shlex
import signal as _signal
import subprocess
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import IO, Callable, Iterable, Optional, Sequence, Union

LineCallback = Callable[[str], None]
Stdin = Union[bytes, str, IO[bytes], None]

# Bytes kept for error messages when the caller asked us not to capture everything.
TAIL_BYTES = 64 * 1024
# A line longer than this is handed to the callback in pieces rather than buffered whole.
MAX_LINE = 1 << 20
CHUNK = 64 * 1024


class TransportError(Exception):
    """Could not reach or talk to the node; the message says what to do."""


class HostKeyError(TransportError):
    """The node's host key is unknown or has changed: never retried, never learned silently."""


class CommandError(Exception):
    """A command exited non-zero and the caller asked for ``check=True``."""

    def __init__(self, result: "Result"):
        self.result = result
        super().__init__(result.describe_failure())


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


@dataclass
class Result:
    """The outcome of one command.

    ``returncode`` follows the shell convention: a process killed by signal N reports
    128+N (as lxc-attach does, research §1.1), and ``signal`` names N when it is known.
    ``stdout_bytes``/``stderr_bytes`` hold the output unless the caller passed
    ``capture=False``, in which case only the last TAIL_BYTES are kept (for ``tail()``).
    """

    argv: list[str]
    returncode: int
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    signal: Optional[int] = None
    where: str = "local"

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def failed(self) -> bool:
        return not self.ok

    @property
    def stdout(self) -> str:
        return _decode(self.stdout_bytes)

    @property
    def stderr(self) -> str:
        return _decode(self.stderr_bytes)

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    def tail(self, stream: str = "stderr", lines: int = 10) -> str:
        text = self.stderr if stream == "stderr" else self.stdout
        return "\n".join(text.rstrip("\n").splitlines()[-lines:])

    def describe_failure(self) -> str:
        how = f"exit code {self.returncode}"
        if self.signal:
            try:
                how += f" (killed by {_signal.Signals(self.signal).name})"
            except ValueError:
                how += f" (killed by signal {self.signal})"
        text = f"command failed on {self.where} with {how}: {self.command}"
        tail = self.tail("stderr") or self.tail("stdout")
        if tail:
            text += "\n--- end of output ---\n" + tail
        return text


class _Sink:
    """Collects one stream: optional capture, a bounded tail, line callbacks, a raw sink."""

    def __init__(self, capture: bool, on_line: Optional[LineCallback], raw: Optional[IO[bytes]]):
        self.capture = capture
        self.on_line = on_line
        self.raw = raw
        self.parts: list[bytes] = []
        self.tail = bytearray()
        self.pending = bytearray()
        # A failing consumer must not stop the draining: an undrained stream fills its window
        # and blocks the remote command (paramiko#1778). Errors are kept and raised at the end.
        self.error: Optional[BaseException] = None
        self.raw_closed = False  # the raw sink went away (e.g. `ctl exec … | head`)

    def feed(self, data: bytes) -> None:
        if not data:
            return
        if self.capture:
            self.parts.append(data)
        else:
            self.tail += data
            if len(self.tail) > 2 * TAIL_BYTES:
                del self.tail[:-TAIL_BYTES]
        if self.raw is not None:
            try:
                self.raw.write(data)
                self.raw.flush()
            except (BrokenPipeError, ValueError):
                self.raw, self.raw_closed = None, True
        if self.on_line is not None and self.error is None:
            try:
                self._lines(data)
            except Exception as exc:  # noqa: BLE001 - re-raised by _finish once the command ended
                self.error = exc

    def _lines(self, data: bytes) -> None:
        self.pending += data
        while True:
            nl = self.pending.find(b"\n")
            if nl < 0:
                if len(self.pending) > MAX_LINE:
                    self.on_line(_decode(bytes(self.pending)))
                    self.pending.clear()
                return
            self.on_line(_decode(bytes(self.pending[:nl])))
            del self.pending[: nl + 1]

    def close(self) -> None:
        if self.on_line is not None and self.pending and self.error is None:
            self.on_line(_decode(bytes(self.pending)))
            self.pending.clear()

    def value(self) -> bytes:
        return b"".join(self.parts) if self.capture else bytes(self.tail[-TAIL_BYTES:])


class _MarkerGate:
    """Drops everything a stream carries before a marker line, then passes the rest through.

    A node's login shell may print to stdout or stderr before our command starts (a
    .bashrc that echoes, a locale warning: research §1.1, skypilot#4814). The SSH runner
    has the remote side print a random marker line first; what came before it is noise.
    """

    def __init__(self, marker: bytes, sink: _Sink):
        self.marker = marker + b"\n"
        self.sink = sink
        self.open = False
        self.noise = bytearray()

    def feed(self, data: bytes) -> None:
        if self.open:
            self.sink.feed(data)
            return
        self.noise += data
        at = self.noise.find(self.marker)
        if at >= 0 and (at == 0 or self.noise[at - 1 : at] == b"\n"):
            rest = bytes(self.noise[at + len(self.marker):])
            self.noise.clear()
            self.open = True
            self.sink.feed(rest)
        elif len(self.noise) > 4 * TAIL_BYTES:
            del self.noise[: -2 * TAIL_BYTES]

    def close(self) -> None:
        self.sink.close()


def _stdin_chunks(stdin: Stdin) -> Iterable[bytes]:
    if stdin is None:
        return
    if isinstance(stdin, str):
        stdin = stdin.encode()
    if isinstance(stdin, (bytes, bytearray, memoryview)):
        view = memoryview(stdin)
        for i in range(0, len(view), CHUNK):
            yield bytes(view[i : i + CHUNK])
        return
    # read1 returns what is there (interactive stdin); read(n) would wait for n bytes.
    read = getattr(stdin, "read1", None) or stdin.read
    while True:
        chunk = read(CHUNK)
        if not chunk:
            return
        yield chunk


class Runner(ABC):
    """Runs argv lists somewhere (this machine, a node over SSH) and reports a Result."""

    where: str = "local"

    @abstractmethod
    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: Stdin = None,
        check: bool = False,
        capture: bool = True,
        on_stdout: Optional[LineCallback] = None,
        on_stderr: Optional[LineCallback] = None,
        stdout_sink: Optional[IO[bytes]] = None,
        stderr_sink: Optional[IO[bytes]] = None,
        timeout: Optional[float] = None,
    ) -> Result:
        """Run ``argv`` to completion. Never retried: a command may have side effects.

        ``on_stdout``/``on_stderr`` get each line (without its newline) as it arrives;
        ``stdout_sink``/``stderr_sink`` get the raw bytes (for byte-exact pass-through).
        """

    def close(self) -> None:
        pass

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _finish(argv, returncode, out: _Sink, err: _Sink, sig, where, check) -> Result:
    out.close()
    err.close()
    for sink in (out, err):
        if sink.error is not None:
            raise sink.error
    result = Result(list(argv), returncode, out.value(), err.value(), sig, where)
    if check and result.failed:
        raise CommandError(result)
    return result


class LocalRunner(Runner):
    """Runs argv on this machine with subprocess (no shell). Used with ``transport = "local"``
    (ctl running on the node itself) and by tests."""

    where = "local"

    def run(self, argv, *, stdin=None, check=False, capture=True, on_stdout=None, on_stderr=None,
            stdout_sink=None, stderr_sink=None, timeout=None) -> Result:
        argv = [str(a) for a in argv]
        out = _Sink(capture, on_stdout, stdout_sink)
        err = _Sink(capture, on_stderr, stderr_sink)
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as exc:
            raise TransportError(f"cannot start {argv[0]!r} on this machine: {exc.strerror}") from exc
        readers = [threading.Thread(target=_pump, args=(proc.stdout.read1, out), daemon=True),
                   threading.Thread(target=_pump, args=(proc.stderr.read1, err), daemon=True)]
        for t in readers:
            t.start()
        try:
            if stdin is not None:
                try:
                    for chunk in _stdin_chunks(stdin):
                        proc.stdin.write(chunk)
                    proc.stdin.close()
                except BrokenPipeError:
                    pass  # the command stopped reading; its exit code says why
            proc.wait(timeout=timeout)
        except BaseException as exc:
            # Interrupted, timed out or stdin failed: stop it, so no half-fed process lingers
            # (research §4 item 3). Here, unlike over SSH, we own the process and can kill it.
            _close_quietly(proc.stdin)
            proc.kill()
            proc.wait()
            for t in readers:
                t.join(5)
            if isinstance(exc, subprocess.TimeoutExpired):
                raise TimeoutError(f"{shlex.join(argv)} did not finish within {timeout} s on {self.where}; "
                                   "it was killed") from None
            raise
        for t in readers:
            t.join()
        rc = proc.returncode
        sig = None
        if rc < 0:  # killed by a signal: report it the way lxc-attach and shells do
            sig, rc = -rc, 128 - rc
        return _finish(argv, rc, out, err, sig, self.where, check)


def _pump(read: Callable[[int], bytes], sink) -> None:
    while True:
        data = read(CHUNK)
        if not data:
            return
        sink.feed(data)


def _close_quietly(fh) -> None:
    try:
        if fh is not None:
            fh.close()
    except OSError:
        pass


def open_runner(node_name: str, node, *, trust_new_host_key: bool = False) -> Runner:
    """The runner for a configured node: SSH, or local when ctl runs on the node itself."""
    if node.transport == "local":
        return LocalRunner()
    from controller.ssh import SSHRunner  # paramiko only when a node is remote

    return SSHRunner.for_node(node_name, node, trust_new_host_key=trust_new_host_key)
