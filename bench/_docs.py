"""Writing a benchmark's section into docs/benchmarks.md (shared by the bench scripts)."""

from __future__ import annotations

import os
import re
from pathlib import Path


def write_section(path: Path, heading: str, section: str) -> None:
    """Replace the section under ``heading`` if present (re-runs), else append; other
    sections are untouched. Written through a temp file and a rename."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.M | re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _m: section + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
