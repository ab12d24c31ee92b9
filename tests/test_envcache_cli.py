"""`ctl env cache export/import`: what an operator can type wrong is refused before anything
connects or is written, one line naming the value and the fix (the sim tests cover the
transfers and the container's own refusals: tests/test_envcache_sim.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CTL = [str(Path(sys.executable).with_name("ctl"))]


def ctl(tmp_path: Path, *args) -> subprocess.CompletedProcess:
    # a config that does not exist: reaching for it would be an error of its own
    env = {**os.environ, "DFLASH_CTL_CONFIG": str(tmp_path / "no-config.toml"), "COLUMNS": "200"}
    return subprocess.run(CTL + [str(a) for a in args], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)


@pytest.mark.parametrize("out, words", [
    (".", "is a directory: name the archive file, e.g."),
    ("missing/c.tar.gz", "the directory"),
    ("", "is a directory"),  # an unset $VAR
])
def test_export_refuses_an_out_it_cannot_write_before_connecting(tmp_path, out, words):
    p = ctl(tmp_path, "env", "cache", "export", "--container", "200", "--out", out)
    assert p.returncode == 2 and words in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert "no-config.toml" not in p.stderr  # refused before the config was read
    assert sorted(os.listdir(tmp_path)) == []


def test_import_refuses_a_directory_a_missing_file_and_a_non_archive_before_connecting(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "junk.tar.gz").write_bytes(b"\x1f\x8b junk")
    for name, words in (("d", "is not a file (a directory)"), ("nope.tar.gz", "is not a file"),
                        ("junk.tar.gz", "is not a compile-cache archive")):
        p = ctl(tmp_path, "env", "cache", "import", tmp_path / name, "--container", "200")
        assert p.returncode == 2 and words in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert "no-config.toml" not in p.stderr


def test_import_refuses_an_archive_whose_manifest_is_not_an_object(tmp_path):
    import gzip
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        doc = b"[1, 2]"
        info = tarfile.TarInfo("MANIFEST.json")
        info.size = len(doc)
        tar.addfile(info, io.BytesIO(doc))
    (tmp_path / "list.tar.gz").write_bytes(gzip.compress(buf.getvalue()))
    p = ctl(tmp_path, "env", "cache", "import", tmp_path / "list.tar.gz", "--container", "200")
    assert p.returncode == 2 and "archive format ?" in p.stderr and "Traceback" not in p.stderr, p.stderr
