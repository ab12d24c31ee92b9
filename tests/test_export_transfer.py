"""`ctl export`'s receiving side without a node: a tar stream is extracted only as the
manifest names it, a tampered or truncated stream is refused, and the sender is never left
blocked on a full pipe (the receiver drains after an error)."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest

from controller.commands.export import ExportFailed, TarReceiver, check_destination, verify


def make_export(d: Path) -> dict:
    d.mkdir()
    (d / "config.json").write_text('{"a": 1}\n')
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 4096)  # 1 MiB: several pipe buffers
    files = [{"path": p.name, "size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in sorted(d.iterdir())]
    return {"files": files, "bytes": sum(f["size"] for f in files)}


def tar_of(d: Path, extra: dict[str, bytes] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(str(d), arcname=".")
        for name, data in (extra or {}).items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def receive(stream: bytes, dest: Path, manifest: dict, chunk: int = 7000) -> TarReceiver:
    dest.mkdir()
    seen = []
    rx = TarReceiver(dest, {f["path"]: f for f in manifest["files"]}, seen.append)
    for i in range(0, len(stream), chunk):
        rx.write(stream[i:i + chunk])
    rx.close()
    assert sum(seen) == len(stream)  # progress saw every byte
    return rx


def test_a_whole_stream_arrives_and_verifies(tmp_path):
    manifest = make_export(tmp_path / "src")
    rx = receive(tar_of(tmp_path / "src"), tmp_path / "got", manifest)
    assert rx.error is None
    verify(rx.got, manifest)
    assert (tmp_path / "got" / "model.safetensors").read_bytes() == (tmp_path / "src" / "model.safetensors").read_bytes()


def test_a_file_the_manifest_does_not_name_is_refused_and_the_stream_drained(tmp_path):
    manifest = make_export(tmp_path / "src")
    rx = receive(tar_of(tmp_path / "src", {"../../etc/evil": b"x" * 100}), tmp_path / "got", manifest)
    assert rx.error and "does not name" in rx.error


def test_a_changed_byte_or_a_short_stream_fails_verification(tmp_path):
    manifest = make_export(tmp_path / "src")
    stream = tar_of(tmp_path / "src")
    rx = receive(stream, tmp_path / "got", manifest)
    bad = dict(manifest, files=[dict(f, sha256="0" * 64) if f["path"] == "config.json" else f for f in manifest["files"]])
    with pytest.raises(ExportFailed, match="config.json: received"):
        verify(rx.got, bad)
    short = receive(stream[:len(stream) // 2], tmp_path / "half", manifest)
    with pytest.raises(ExportFailed, match="ended without"):
        verify(short.got, manifest)


def test_destination_must_be_absent_or_empty(tmp_path):
    check_destination(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    check_destination(tmp_path / "empty")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ExportFailed, match="is not empty"):
        check_destination(tmp_path / "full")
    with pytest.raises(ExportFailed, match="does not exist"):
        check_destination(tmp_path / "no" / "such")
