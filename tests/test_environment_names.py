"""Every DFLASH_* environment variable the product reads or sets is documented, with its kind,
in docs/environment.md, and the table names nothing the code no longer has: a benchmark's
switch cannot creep back in unseen."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"\bDFLASH_[A-Z0-9_]*[A-Z0-9]\b")
# where the product lives (bench/ and tests/ only use what it reads)
PRODUCT = ("agent/", "controller/", "trainer/", "sim/", "scripts/", "templates/", ".ci/")
KINDS = {"setting", "knob", "escape hatch", "contract", "measurement", "test hook"}


def _code_names() -> dict[str, str]:
    files = subprocess.run(["git", "ls-files", *PRODUCT], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    seen: dict[str, str] = {}
    for f in files:
        try:
            text = (ROOT / f).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for name in NAME.findall(text):
            seen.setdefault(name, f)
    return seen


def _documented() -> dict[str, str]:
    rows = {}
    for line in (ROOT / "docs" / "environment.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`DFLASH_"):
            for name in NAME.findall(cells[0]):
                rows[name] = cells[1]
    return rows


def test_every_dflash_variable_in_the_code_is_documented_with_its_kind():
    code, docs = _code_names(), _documented()
    missing = {n: f for n, f in code.items() if n not in docs}
    assert not missing, "undocumented in docs/environment.md: " + ", ".join(f"{n} ({f})" for n, f in sorted(missing.items()))
    assert {k for k in docs.values()} <= KINDS, docs


def test_the_table_names_nothing_the_code_no_longer_has():
    code, docs = _code_names(), _documented()
    stale = sorted(set(docs) - set(code))
    assert not stale, f"docs/environment.md names variables the product no longer reads or sets: {stale}"


def test_the_removed_benchmark_switches_stay_removed():
    code = _code_names()
    for gone in ("DFLASH_CAST_ONCE", "DFLASH_DIRECT_MASKS", "DFLASH_RUN_CUMSUM", "DFLASH_SELECTOR_FUSED",
                 "DFLASH_HEAD_TRITON", "DFLASH_TEACHER_SPANS", "DFLASH_HEAD_BALANCED", "DFLASH_FLEX_OPTIONS",
                 "DFLASH_ADD_KERNEL", "DFLASH_SILU_KERNEL", "DFLASH_WGRAD_INTO_GRAD"):
        assert gone not in code, gone
