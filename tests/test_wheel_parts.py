"""bench/gpu_setup/wheel_parts.py: a wheel over one device call's carry, sent in parts over several
calls and rebuilt on the device byte for byte, or refused when a part does not match."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = [sys.executable, os.path.join(ROOT, "bench", "gpu_setup", "wheel_parts.py")]
NAME = "demo_libs-1.0-cp312-cp312-manylinux_2_28_x86_64.whl"


def _wheel(tmp_path) -> str:
    path = str(tmp_path / NAME)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("demo_libs/lib.so", os.urandom(300_000))
        z.writestr("demo_libs-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nTag: cp312-cp312-manylinux_2_28_x86_64\n")
    return path


def _run(*args):
    return subprocess.run(TOOL + list(args), capture_output=True, text=True, timeout=60)


def test_parts_sent_over_two_calls_rebuild_the_wheel_byte_for_byte(tmp_path):
    wheel = _wheel(tmp_path)
    a, b = str(tmp_path / "first"), str(tmp_path / "second")
    r = _run("split", wheel, "--into", a, b, "--part-bytes", "120000")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(a)) == [NAME + ".part.00", NAME + ".part.02", NAME + ".parts.json"]
    assert sorted(os.listdir(b)) == [NAME + ".part.01", NAME + ".parts.json"]
    stage, out = str(tmp_path / "stage"), str(tmp_path / "wheels")
    # the first call brings parts 00 and 02: the wheel waits for part 01
    r = _run("gather", "--from", a, "--stage", stage, "--out", out)
    assert r.returncode == 3 and f"{NAME}.part.01" in r.stderr
    assert os.listdir(out) == []
    # the second call (the staging folder kept on the warm machine) brings part 01
    r = _run("gather", "--from", b, "--stage", stage, "--out", out)
    assert r.returncode == 0, r.stderr
    with open(os.path.join(out, NAME), "rb") as got, open(wheel, "rb") as want:
        assert got.read() == want.read()
    assert zipfile.ZipFile(os.path.join(out, NAME)).testzip() is None


def test_a_part_that_does_not_match_is_refused_and_no_wheel_is_left(tmp_path):
    wheel = _wheel(tmp_path)
    a = str(tmp_path / "parts")
    assert _run("split", wheel, "--into", a, "--part-bytes", "200000").returncode == 0
    with open(os.path.join(a, NAME + ".part.01"), "r+b") as fh:
        fh.write(b"X")
    out = str(tmp_path / "wheels")
    r = _run("gather", "--from", a, "--stage", str(tmp_path / "stage"), "--out", out)
    assert r.returncode == 2 and "do not add up" in r.stderr and "Traceback" not in r.stderr
    assert os.listdir(out) == []


def test_split_refuses_what_is_not_a_wheel(tmp_path):
    (tmp_path / "x.txt").write_text("x")
    r = _run("split", str(tmp_path / "x.txt"), "--into", str(tmp_path / "d"))
    assert r.returncode == 2 and "not a wheel file" in r.stderr
    assert not (tmp_path / "d").exists()
