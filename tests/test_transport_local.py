"""The local runner, the result object and the login-noise gate (no node needed)."""

from __future__ import annotations

import os
import time

import pytest

from controller.transport import CommandError, LocalRunner, TransportError, MarkerGate, _Sink


def test_result_reports_ok_failed_code_and_tail():
    result = LocalRunner().run(["sh", "-c", "echo out; for i in 1 2 3; do echo e$i >&2; done; exit 4"])
    assert (result.ok, result.failed, result.returncode) == (False, True, 4)
    assert result.stdout == "out\n"
    assert result.tail("stderr", 2) == "e2\ne3"


def test_check_raises_showing_command_code_and_end_of_stderr():
    with pytest.raises(CommandError) as info:
        LocalRunner().run(["sh", "-c", "echo 'it broke' >&2; exit 9"], check=True)
    text = str(info.value)
    assert "exit code 9" in text and "it broke" in text and "sh -c" in text
    assert info.value.result.returncode == 9


def test_signal_killed_process_reports_128_plus_n():
    result = LocalRunner().run(["sh", "-c", "kill -TERM $$"])
    assert (result.returncode, result.signal) == (143, 15)
    assert "SIGTERM" in result.describe_failure()


def test_missing_program_is_a_transport_error_naming_it():
    with pytest.raises(TransportError, match="no-such-program-xyz"):
        LocalRunner().run(["no-such-program-xyz"])


def test_50mb_on_both_streams_at_once_and_line_callbacks():
    script = ("import sys\nblock = b'y' * 65535 + b'\\n'\n"
              "for i in range(800):\n    sys.stdout.buffer.write(block)\n    sys.stderr.buffer.write(block)\n")
    counts = {"out": 0, "err": 0}
    result = LocalRunner().run(["python3", "-c", script], capture=False,
                               on_stdout=lambda _l: counts.__setitem__("out", counts["out"] + 1),
                               on_stderr=lambda _l: counts.__setitem__("err", counts["err"] + 1))
    assert result.ok and counts == {"out": 800, "err": 800}
    assert len(result.stdout_bytes) <= 128 * 1024  # capture=False keeps a tail only


def test_lines_stream_while_the_command_runs():
    seen: list[str] = []
    LocalRunner().run(["sh", "-c", "echo one; read x; echo two"], stdin=b"go\n",
                      on_stdout=lambda line: seen.append(line))
    assert seen == ["one", "two"]


def test_interrupted_stdin_stops_the_process_and_leaves_none(tmp_path):
    pidfile = tmp_path / "pid"

    class Breaks:
        sent = False

        def read(self, n):
            if not self.sent:
                self.sent = True
                return b"partial"
            deadline = time.monotonic() + 10  # interrupt once the command has really started
            while not pidfile.exists() or not pidfile.read_text().strip():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        LocalRunner().run(["sh", "-c", f'echo $$ > {pidfile}; cat > /dev/null; sleep 60'], stdin=Breaks())
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_marker_gate_drops_noise_before_the_marker_only():
    sink = _Sink(True, None, None)
    gate = MarkerGate(b"--m--", sink)
    for piece in (b"noise line\nmore --m-- not alone\n--", b"m--\nreal ", b"output\n--m--\n"):
        gate.feed(piece)
    gate.close()
    assert sink.value() == b"real output\n--m--\n"


def test_transport_modules_import_without_torch():
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "import controller.transport, controller.ssh, controller.pct, controller.container, "
            "controller.bundle, controller.render, controller.commands.remote\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


from hypothesis import given, settings, strategies as st  # noqa: E402

_ARG = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=20)


@settings(max_examples=150, deadline=None)
@given(st.lists(_ARG, max_size=6))
def test_the_ssh_command_string_reaches_argv_intact_through_a_login_shell(args):
    # What sshd does with our command: `$SHELL -c <string>`. The string is exactly what
    # both SSH runners send (transport.marked_command: prelude + marker + shlex.join); bash must
    # hand back the same bytes.
    from controller.transport import _PRELUDE
    import shlex

    marker = "--m--"
    remote = shlex.join(["sh", "-c", _PRELUDE, marker, "printf", "%s\\0", "first", *args])
    result = LocalRunner().run(["bash", "-c", remote], check=True)
    out = result.stdout_bytes
    assert out.startswith(marker.encode() + b"\n")
    assert out[len(marker) + 1:] == b"".join(a.encode() + b"\0" for a in ["first", *args])


def test_a_failing_line_callback_does_not_stop_draining_and_is_raised_at_the_end():
    script = "import sys\nfor i in range(20000):\n    print('x' * 200)\nsys.exit(4)\n"

    def explode(line):
        raise RuntimeError("consumer bug")

    with pytest.raises(RuntimeError, match="consumer bug"):
        LocalRunner().run(["python3", "-c", script], on_stdout=explode)


def test_a_closed_raw_sink_is_dropped_and_the_command_still_completes(tmp_path):
    import io

    class Closed(io.RawIOBase):
        def writable(self):
            return True

        def write(self, b):
            raise BrokenPipeError

    result = LocalRunner().run(["python3", "-c", "print('y' * 10_000_000)"], stdout_sink=Closed())
    assert result.ok and len(result.stdout_bytes) == 10_000_001


def test_timeout_raises_timeouterror_and_kills_the_command(tmp_path):
    pidfile = tmp_path / "pid"
    with pytest.raises(TimeoutError, match="did not finish within 2 s"):
        LocalRunner().run(["sh", "-c", f"echo $$ > {pidfile}; exec sleep 60"], timeout=2)
    if pidfile.exists() and pidfile.read_text().strip():  # else it was killed before it got that far
        with pytest.raises(ProcessLookupError):
            os.kill(int(pidfile.read_text()), 0)
