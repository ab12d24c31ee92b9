"""The controller config as last parsed, named by the hash of its bytes.

Why: every `ctl` command reads the config first, and tomllib — whose import compiles its
regular expressions and pulls in datetime — was about a tenth of a one-shot command's
start-up (≈ 40 M instructions under callgrind: docs/benchmarks.md, "Shared SSH connection").
An entry is named by the sha256 of the file's bytes, so it can never be stale: a changed
file has another name and is parsed again. Only a parse that JSON gives back unchanged is kept (no TOML dates, no NaN); a file
that does not parse is never kept, so its error is tomllib's every time.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable

# A cache file no command has written for this long is removed when another is written
# beside it (a config that changed, a test's temporary one); one still in use is written again.
KEEP_UNUSED_S = 30 * 86400


def cache_dir() -> Path:
    """ctl's cache: $XDG_CACHE_HOME/dflash-ctl, else ~/.cache/dflash-ctl."""
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "dflash-ctl"


def parsed(raw: bytes, parse: Callable[[], dict]) -> dict:
    """``parse()`` of the config whose bytes are ``raw``, from the cache when it has it."""
    path = cache_dir() / "config" / f"{hashlib.sha256(raw).hexdigest()[:32]}.json"
    try:
        with open(path, "rb") as fh:
            doc = json.loads(fh.read())
        if isinstance(doc, dict):
            return doc
    except (OSError, ValueError):
        pass  # not there yet, or not ours to read: parse
    data = parse()
    try:
        text = json.dumps(data)
        if json.loads(text) == data:
            write_cached(path, text)
    except (TypeError, ValueError, OSError):
        pass  # a value JSON cannot hold, or no writable cache: parsed every time then
    return data


def write_cached(path: Path, text: str) -> None:
    """Write one of ctl's cache files (mode 0600, in a 0700 directory, atomically), removing
    the ones of its kind beside it that no command has written for KEEP_UNUSED_S."""
    from agent.protocol import atomic_write  # once per content: not on every command's path

    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    for old in path.parent.glob(f"*{path.suffix}"):
        try:
            if old.stat().st_mtime < time.time() - KEEP_UNUSED_S:
                old.unlink()
        except OSError:
            pass  # another ctl removed it first
    atomic_write(str(path), text, mode=0o600)
