"""How the controller runs a command: one Runner interface, a local and an SSH implementation.

Shaped like invoke's Runner (pyinvoke/invoke, invoke/runners.py), whose one interface serves
local and remote commands alike: ``Runner.run(argv)`` is one template that starts the
command through the transport's ``_start`` (a :class:`Process`: receive stdout/stderr, send
stdin, wait, abort), reads stdout and stderr concurrently, streams them line by line to
callbacks, and returns a :class:`Result`
(``ok``, ``failed``, ``returncode``, ``stdout``, ``stderr``, ``tail()``). With
``check=True`` a non-zero exit raises :class:`CommandError` showing the command, the code
and the end of stderr. The ``pct exec`` wrapping (controller/pct.py) and the container
handle (controller/container.py) sit on top of either runner, so tests and the local demo
use the same code path as a real node.

Commands are argv lists everywhere. The SSH runners turn an argv into the one shell string
an SSH server needs with ``shlex.join`` and nothing else (:func:`marked_command`). There are
two of them: controller/ssh.py (paramiko: one connection for many commands) and
controller/openssh.py (the operator's own ``ssh``, for a command that runs one thing);
controller/session.py picks.

Why paramiko and not fabric's ``Connection``: fabric unconditionally installs
``AutoAddPolicy`` (docs/research/proxmox-and-supervision.md §3), i.e. it trusts any host key
it has not seen. A Proxmox node is a fixed, long-lived host: an unknown or changed key must
stop us, not be learned.
"""

from __future__ import annotations

import os
import shlex
import signal as _signal
import subprocess
import threading
import time
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


class ContainerNotRunning(TransportError):
    """The node answered, the container did not: it is stopped (or restarting). A follower
    waits a bounded time for it (controller/tail.py), then says the run died with it."""


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
    128+N (as lxc-attach does, docs/research/proxmox-and-supervision.md §1.1), and ``signal``
    names N when it is known.
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
            except Exception as exc:  # noqa: BLE001 - re-raised by Runner.run once the command ended
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


class MarkerGate:
    """Drops everything a stream carries before a marker line, then passes the rest through.

    A node's login shell may print to stdout or stderr before our command starts (a
    .bashrc that echoes, a locale warning: docs/research/proxmox-and-supervision.md §1.1,
    skypilot#4814). The SSH runner has the remote side print a random marker line first; what
    came before it is noise.
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


# Printed first by the remote side; everything a login shell printed before it is noise.
# "$0" is the marker (passed as an argument, never interpolated); the command's status is
# that of "$@", so a signal-killed command reports 128+N through sh, like lxc-attach.
_PRELUDE = 'printf "%s\\n" "$0"; printf "%s\\n" "$0" >&2; "$@"'


def marked_command(argv: Sequence[str]) -> tuple[bytes, str]:
    """The one shell string an SSH server runs for ``argv`` (sshd hands it to the login shell),
    and the random marker line its output starts with on stdout and on stderr."""
    marker = f"--dflash-ctl-begin-{os.urandom(16).hex()}--"
    return marker.encode(), shlex.join(["sh", "-c", _PRELUDE, marker, *argv])


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


class Process(ABC):
    """One started command, as a transport sees it. The runner's template (:meth:`Runner.run`)
    owns everything else: sinks, reader threads, the stdin pump, the timeout, the result."""

    # What a timed-out command's error adds: whether it was stopped, or may still be running.
    timeout_note = "it was stopped"

    def gate(self, stream: str, sink: "_Sink"):
        """What the bytes of ``stream`` ("stdout"/"stderr") are fed to (default: the sink)."""
        return sink

    @abstractmethod
    def recv_out(self, n: int) -> bytes:
        """Up to ``n`` bytes of stdout; b"" at its end."""

    @abstractmethod
    def recv_err(self, n: int) -> bytes:
        """Up to ``n`` bytes of stderr; b"" at its end."""

    @abstractmethod
    def send_in(self, data: bytes) -> bool:
        """Give the command ``data`` on stdin; False once it stopped reading (not an error:
        its exit code says why)."""

    @abstractmethod
    def close_in(self) -> None:
        """End of stdin."""

    @abstractmethod
    def wait(self, timeout: Optional[float]) -> tuple[int, Optional[int]]:
        """(return code, signal) once both streams ended; 128+N for a signal N. Raises
        TimeoutError when it has not ended within ``timeout`` seconds."""

    @abstractmethod
    def abort(self) -> None:
        """Interrupted or timed out: stop it (locally) or let go of it (remotely)."""


class Runner(ABC):
    """Runs argv lists somewhere (this machine, a node over SSH) and reports a Result.

    Shaped like invoke's Runner: :meth:`run` is the one template and a transport fills in
    :meth:`_start`, which returns the started :class:`Process`."""

    where: str = "local"

    # SSH connections opened by every runner in this process ($DFLASH_CTL_STATS, benchmarks).
    connections_opened = 0
    _count_lock = threading.Lock()

    @classmethod
    def _count_connection(cls) -> None:
        with Runner._count_lock:
            Runner.connections_opened += 1

    @abstractmethod
    def _start(self, argv: list[str], with_stdin: bool) -> Process:
        """Start ``argv``; raise TransportError when it cannot be started at all."""

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
        argv = [str(a) for a in argv]
        out = _Sink(capture, on_stdout, stdout_sink)
        err = _Sink(capture, on_stderr, stderr_sink)
        proc = self._start(argv, stdin is not None)
        # Both streams are drained concurrently: reading one while the other fills its
        # window deadlocks the command (paramiko#448, #563, #1778).
        readers = [threading.Thread(target=_pump, args=(proc.recv_out, proc.gate("stdout", out)), daemon=True),
                   threading.Thread(target=_pump, args=(proc.recv_err, proc.gate("stderr", err)), daemon=True)]
        for t in readers:
            t.start()
        try:
            if stdin is not None:
                for chunk in _stdin_chunks(stdin):
                    if not proc.send_in(chunk):
                        break
            proc.close_in()
            deadline = None if timeout is None else time.monotonic() + timeout

            def left() -> Optional[float]:
                return None if deadline is None else max(0.0, deadline - time.monotonic())

            try:
                for t in readers:
                    t.join(left())
                    if t.is_alive():
                        raise TimeoutError
                returncode, sig = proc.wait(left())
            except TimeoutError:
                raise TimeoutError(f"{shlex.join(argv)} did not finish within {timeout} s on {self.where}; "
                                   f"{proc.timeout_note}") from None
        except BaseException:
            # Interrupted, timed out or stdin failed: the input is incomplete. No half-fed
            # process lingers where we own it (docs/research/proxmox-and-supervision.md §4
            # item 3); remotely, closing is not a kill (§1.1 there), so writers verify what
            # arrived (container.write_file).
            proc.abort()
            for t in readers:
                t.join(5)
            raise
        out.close()
        err.close()
        for sink in (out, err):
            if sink.error is not None:
                raise sink.error
        result = Result(argv, returncode, out.value(), err.value(), sig, self.where)
        if check and result.failed:
            raise CommandError(result)
        return result

    def close(self) -> None:
        pass

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _LocalProcess(Process):
    timeout_note = "it was killed"

    def __init__(self, popen: subprocess.Popen):
        self.popen = popen

    def recv_out(self, n: int) -> bytes:
        return self.popen.stdout.read1(n)

    def recv_err(self, n: int) -> bytes:
        return self.popen.stderr.read1(n)

    def send_in(self, data: bytes) -> bool:
        try:
            self.popen.stdin.write(data)
            return True
        except BrokenPipeError:
            return False

    def close_in(self) -> None:
        _close_quietly(self.popen.stdin)

    def wait(self, timeout: Optional[float]) -> tuple[int, Optional[int]]:
        try:
            rc = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError from None
        if rc < 0:  # killed by a signal: report it the way lxc-attach and shells do
            return 128 - rc, -rc
        return rc, None

    def abort(self) -> None:
        # Here, unlike over SSH, we own the process and can kill it.
        _close_quietly(self.popen.stdin)
        self.popen.kill()
        self.popen.wait()


class LocalRunner(Runner):
    """Runs argv on this machine with subprocess (no shell). Used with ``transport = "local"``
    (ctl running on the node itself) and by tests."""

    where = "local"

    def _start(self, argv: list[str], with_stdin: bool) -> Process:
        try:
            popen = subprocess.Popen(argv, stdin=subprocess.PIPE if with_stdin else subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as exc:
            raise TransportError(f"cannot start {argv[0]!r} on this machine: {exc.strerror}") from exc
        return _LocalProcess(popen)


def _pump(read: Callable[[int], bytes], sink) -> None:
    while True:
        try:
            data = read(CHUNK)
        except (OSError, EOFError, ValueError):
            data = b""  # the stream broke: as good as its end; the exit status says more
        if not data:
            return
        sink.feed(data)


def _close_quietly(fh) -> None:
    try:
        if fh is not None:
            fh.close()
    except OSError:
        pass
