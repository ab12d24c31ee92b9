"""Build tiny pure-python wheels with the standard library, for tests that need a package
with two versions in a wheelhouse (one working, one deliberately broken) and no registry."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_wheel(outdir: Path, name: str, version: str, module_source: str) -> Path:
    """A wheel of distribution ``name`` holding one module ``name`` with ``module_source``."""
    outdir.mkdir(parents=True, exist_ok=True)
    mod = name.replace("-", "_")
    dist_info = f"{mod}-{version}.dist-info"
    files = {
        f"{mod}.py": module_source.encode(),
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        # A console script, so tests see where pip points its #! line.
        f"{dist_info}/entry_points.txt": f"[console_scripts]\n{name}-ok = {mod}:ok\n".encode(),
    }
    path = outdir / f"{mod}-{version}-py3-none-any.whl"
    record = [_record_line(n, d) for n, d in files.items()] + [f"{dist_info}/RECORD,,"]
    with zipfile.ZipFile(path, "w") as zf:
        for n, d in files.items():
            zf.writestr(n, d)
        zf.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
    return path


GOOD = 'VERSION = "{v}"\n\ndef ok():\n    return True\n'
BROKEN = 'raise ImportError("dflashprobe {v} is deliberately broken (test fixture)")\n'


def probe_wheelhouse(outdir: Path, name: str = "dflashprobe") -> Path:
    """Wheelhouse with ``name`` 1.0 (works) and 2.0 (raises on import)."""
    build_wheel(outdir, name, "1.0", GOOD.format(v="1.0"))
    build_wheel(outdir, name, "2.0", BROKEN.format(v="2.0"))
    return outdir
