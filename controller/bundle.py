"""The agent + trainer code as one versioned, content-addressed bundle (docs/design.md).

The bundle is the ``.py`` files of ``agent/`` and ``trainer/``; its version is the sha256 of
their relative paths and contents. It is uploaded once per version to
``<workspace>/.dflash-ctl/bundles/<hash>/`` and put on PYTHONPATH; the container's own venv
supplies torch. Upload: a tar through stdin into a temp directory beside the destination,
size- and hash-checked, extracted, then renamed into place, so a half upload never looks
complete and two uploaders racing both end with the same finished directory. This module
only builds; the caller uploads (controller/agentcall.py).
"""

from __future__ import annotations

import hashlib
import posixpath
import os
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("agent", "trainer")
REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLES_DIR = ".dflash-ctl/bundles"

# Receive the tar into "$1/.bundle.tar", check size and sha256, extract, rename "$1" → "$2".
# If "$2" already exists (another upload won the race), ours is removed and that one stands.
_UPLOAD_SCRIPT = (
    'umask 022; mkdir -p "$(dirname "$1")" && mkdir "$1" || exit 1; '
    'if cat > "$1/.bundle.tar" && [ "$(wc -c < "$1/.bundle.tar")" -eq "$3" ] '
    '&& got=$(sha256sum < "$1/.bundle.tar") && [ "${got%% *}" = "$4" ] '
    '&& tar -xf "$1/.bundle.tar" -C "$1" --no-same-owner && rm -f "$1/.bundle.tar"; then '
    '  mv -T "$1" "$2" 2>/dev/null || { rm -rf "$1"; [ -d "$2" ] || exit 1; }; exit 0; fi; '
    'rm -rf "$1"; echo "bundle upload to $2 was incomplete or failed; nothing was installed" >&2; exit 1'
)


@dataclass(frozen=True)
class Bundle:
    """The files of one bundle version, in a fixed order."""

    version: str
    files: tuple[tuple[str, bytes], ...]

    def tar(self) -> bytes:
        """A deterministic tar (fixed mtimes, owners and modes): same version, same bytes."""
        # Only an upload builds one: `ctl status` and `ctl tail` need the version alone, and
        # tarfile (with its compression modules) was ≈ 5 ms of their start-up.
        import io
        import tarfile

        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            (version_info := tarfile.TarInfo("VERSION")).size = len(self.version) + 1
            version_info.mode = 0o644
            tar.addfile(version_info, io.BytesIO(self.version.encode() + b"\n"))
            for rel, data in self.files:
                info = tarfile.TarInfo(rel)
                info.size, info.mode, info.mtime = len(data), 0o644, 0
                tar.addfile(info, io.BytesIO(data))
        return buf.getvalue()


def build(root: Path = REPO_ROOT, packages: tuple[str, ...] = PACKAGES) -> Bundle:
    files = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            files.append((path.relative_to(root).as_posix(), path.read_bytes()))
    digest = hashlib.sha256()
    for rel, data in files:
        digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
    return Bundle(digest.hexdigest()[:16], tuple(files))


def agent_env(bundle_path: str) -> dict[str, str]:
    """What an agent or trainer process started from the bundle needs on top of the
    container's clean environment (controller/pct.py: container_env)."""
    return {"PYTHONPATH": bundle_path, "PYTHONUNBUFFERED": "1"}


def remote_path(workspace: str, version: str) -> str:
    return posixpath.join(workspace, BUNDLES_DIR, version)


def upload_argv(dest: str, data: bytes) -> list[str]:
    """The in-container argv that receives the bundle tar ``data`` on stdin and installs it
    at ``dest`` (via a temp directory beside it)."""
    tmp = posixpath.join(posixpath.dirname(dest), f".tmp-{posixpath.basename(dest)}-{os.urandom(4).hex()}")
    return ["sh", "-c", _UPLOAD_SCRIPT, "sh", tmp, dest, str(len(data)), hashlib.sha256(data).hexdigest()]
