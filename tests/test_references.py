"""Every tracked file cites only what a reader of the repository can look up.

Three kinds of reference lead nowhere for someone holding only this repository:
- our own tracker's numbers ("issue 18", "issues 15, 20", "Issue #7", a bare "#12", an
  issue's "finding 4");
- dated occasions: a working session ("session 2", "session c", "2026-12-05d"), a device call
  ("call 8", "calls 3-4", a results folder "issue29_s2_call1"), a CI stop ("stop 35");
- the paths of the machine a file was written on: /work/..., the checkout's own absolute
  path, the writer's home, and a /tmp path written into a recorded result.
A comment or doc says the lesson instead; a measurement says its machine, date, commit and
command. Tracked file *names* are held to the first two rules as well.

What passes on purpose:
- public references that name their project: ``owner/repo#N``, ``paramiko#448, #563``,
  ``speculators #613``, ``vllm-project/vllm PR #52816``, any URL, and a Proxmox commit subject
  quoted verbatim (``"fix #5194: pct: ..."``, Proxmox's way of naming its Bugzilla);
- a plain date: a measurement is dated ("measured 2026-12-05 on one H100");
- paths that exist wherever the product runs: /root/venv, /workspace, /var/cache/dflash-sim,
  a /tmp path the code itself creates, ``pct stop 200`` (a container id, not an occasion).
This file alone is not scanned: it holds examples of what it refuses.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SELF = Path(__file__).resolve().relative_to(REPO).as_posix()

# A public reference names its project right before the number; these words never name one,
# so "(see #12)", "fixed by #12" or "also #12" stay ours.
_NOT_A_PROJECT = ("a|an|the|and|or|of|in|on|at|by|to|for|from|with|into|via|see|cf|also|as|per|"
                  "our|this|that|its|is|was|were|since|until|after|before|under|fix|fixes|fixed|"
                  "close|closes|closed|ticket|tickets|tracker|bug|bugs|issue|issues|pr|prs|item|"
                  "items|finding|findings")
_PROJECT = rf"(?<![\w./-])(?!(?:{_NOT_A_PROJECT})\b)[A-Za-z][\w.-]*(?:/[\w.-]+)?(?<![.,;:])"
_KIND = r"(?:\s+(?:issues?|PRs?|pull requests?))?"
_MORE = r"(?:\s*(?:,|/|\band\b|, and)\s*#\d+)*"
# Blanked out of a line before the rules look at it.
PUBLIC = re.compile(
    r"\b[a-z][a-z0-9+.-]*://\S+"                                  # a URL
    rf"|{_PROJECT}{_KIND}\s*#\d+{_MORE}"                          # project#N, project PR #N, ...
    rf"|\b[\w.-]+/[\w.-]+\s+issues?\s+\d+"                        # owner/repo issue N
    r'|"fix #\d+:',                                               # a quoted Proxmox commit subject
    re.IGNORECASE)

RULES: list[tuple[str, re.Pattern]] = [(name, re.compile(rx, re.IGNORECASE)) for name, rx in (
    ("tracker number", r"(?<![a-z])issues?[ _-]?#?\d+"),
    ("tracker number", r"(?<![\w&#/)])#\d+\b"),
    ("tracker finding", r"\bfindings? \d+"),
    ("dated occasion", r"\b20\d\d-\d\d-\d\d[a-z]\b"),
    ("dated occasion", r"\bsession (?:20\d\d-|\d+\b|[a-h]\b)"),
    ("dated occasion", r"\bsessions (?:20\d\d-|\d+\b|[a-h](?:\s*(?:,|/|and)\s*[a-h])+\b)"),
    ("dated occasion", r"(?<![a-z])calls?[ _-]?\d+"),
    ("dated occasion", r"(?<![\w-])(?<!pct )stop \d+\b"),
)]
PATH_RULES = [(n, rx) for n, rx in RULES if n in ("tracker number", "dated occasion")]

RESULT_SUFFIXES = (".json", ".jsonl", ".txt", ".log", ".csv")


def _machine_rules(checkout: Path) -> list[tuple[str, re.Pattern]]:
    """This machine's paths: where the project's checkouts live, this checkout, the home of
    whoever runs the test (where it is a person's, not a container's /root)."""
    paths = [r"(?<![\w.-])/work/", re.escape(checkout.as_posix()) + r"(?![\w.-])"]
    home = os.path.expanduser("~")
    if home.startswith(("/home/", "/Users/")):
        paths.append(re.escape(home) + r"(?![\w.-])")
    paths.append(r"(?<![\w.-])/tmp/pytest-of-")
    return [("machine path", re.compile("|".join(paths)))]


TMP_IN_RESULT = ("machine path", re.compile(r"(?<![\w.-])/tmp/"))


def offences_in_line(line: str, path: str, machine=()) -> list[tuple[str, str]]:
    """(rule, the text that broke it) for each rule the line breaks."""
    text = PUBLIC.sub(lambda m: " " * len(m.group()), line)
    rules = list(RULES) + list(machine)
    if path.endswith(RESULT_SUFFIXES):
        rules.append(TMP_IN_RESULT)
    out = []
    for name, rx in rules:
        m = rx.search(text)
        if m:
            start, end = max(0, m.start() - 40), min(len(line), m.end() + 40)
            out.append((name, line[start:end].strip()))
    return out


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p]


def offences(root: Path = REPO) -> list[str]:
    machine = _machine_rules(root)
    found = []
    for path in _tracked():
        for name, rx in PATH_RULES:
            if rx.search(path):
                found.append(f"{path}: file name: {name}")
        full = root / path
        if path == SELF or not full.is_file():
            continue
        data = full.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        for no, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            hits = offences_in_line(line, path, machine)
            if hits:
                rules = ", ".join(dict.fromkeys(name for name, _ in hits))
                found.append(f"{path}:{no}: {rules}: {hits[0][1][:140]}")
    return found


def test_tracked_files_cite_nothing_a_reader_cannot_look_up():
    found = offences()
    files = {f.split(":", 1)[0] for f in found}
    assert not found, (f"{len(found)} lines or file names in {len(files)} tracked files cite what a "
                       "reader cannot look up (say the lesson, not the ticket or the occasion):\n"
                       + "\n".join(found))


@pytest.mark.parametrize("line, path, rule", [
    ("# (issue 18: kill -9 of drafter rank 6)", "agent/x.py", "tracker number"),
    ("## Checkpoint size and the export (issues 15, 20)", "docs/x.md", "tracker number"),
    ("See Issue #7 for why.", "docs/x.md", "tracker number"),
    ("as agreed (#12)", "docs/x.md", "tracker number"),
    ("def test_the_model_holds_to_issue_19s_h200():", "tests/x.py", "tracker number"),
    ("fixed by #12", "docs/x.md", "tracker number"),
    ("the same leak, also #12", "docs/x.md", "tracker number"),
    ("added by PR #3605", "docs/x.md", "tracker number"),
    ('"""Corrupt state files (finding 6)."""', "tests/x.py", "tracker finding"),
    ("measured in session 2026-12-05d", "docs/x.md", "dated occasion"),
    ("the H100 calls of sessions 2026-12-05c and e", "bench/x.py", "dated occasion"),
    ("Sessions c/e ran it on H100s", "tests/x.py", "dated occasion"),
    ("(session e)", "docs/x.md", "dated occasion"),
    ("## Session 2: the head", "docs/x.md", "dated occasion"),
    ("44.8 ms of a step (2026-12-05 call 8)", "trainer/x.py", "dated occasion"),
    ("Calls 3-4 measured it", "docs/x.md", "dated occasion"),
    ('d = "bench/results/roofline/issue29_s7_call2_wgrad_split"', "tests/x.py", "tracker number"),
    ('d = "results/s7_call2_wgrad_split"', "tests/x.py", "dated occasion"),
    ('"""CI (stop 35): the agent stops leftovers."""', "tests/x.py", "dated occasion"),
    ("# see /work/.library/device/README.md", "bench/x.sh", "machine path"),
    ('"work": "/tmp/qmid/work"', "docs/q/results.json", "machine path"),
    ("File /tmp/pytest-of-root/pytest-3/x.py, line 3", "tests/x.py", "machine path"),
    # what passes
    ("a window deadlocks (paramiko#448, #563, #1778)", "controller/x.py", None),
    ("the leak (SpecForge #470)", "tests/x.py", None),
    ("| vllm-project/speculators issue #1014 | figures |", "docs/x.md", None),
    ("see https://github.com/vllm-project/recipes/pull/837 and vllm-project/vllm#51581", "docs/x.md", None),
    ('83f594f (2024-01-29, "fix #5194: pct: delete environment variables', "docs/x.md", None),
    ("measured 2026-12-05 on one H100, commit a115a86", "docs/benchmarks.md", None),
    ("`pct stop 200; pct start 200` while a run trains", "tests/x.py", None),
    ("the agent stops a failed run", "agent/x.py", None),
    ("tests count the sessions a ctl command opens", "docs/x.md", None),
    ("venv = /root/venv; data in /workspace; cache /var/cache/dflash-sim", "sim/x.py", None),
    ('W = "/tmp/sim-push-" + uuid', "sim/x.py", None),
    ("to call a function, reply in this format", "tests/x.py", None),
])
def test_the_rules_refuse_private_references_and_pass_public_ones(line, path, rule):
    found = [name for name, _ in offences_in_line(line, path, _machine_rules(REPO))]
    assert (rule in found) if rule else not found, found
