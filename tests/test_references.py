"""Every tracked file cites only what a reader of the repository can look up.

Four kinds of reference lead nowhere for someone holding only this repository:
- our own tracker's numbers ("issue 18", "issues 15, 20", "Issue #7", a bare "#12", an
  issue's "finding 4");
- dated occasions: a working session ("session 2", "session c", "2026-12-05d"), a device call
  ("call 8", "calls 3-4", a results folder "issue29_s2_call1"), a CI stop ("stop 35");
- the paths of the machine a file was written on: /work/..., the checkout's own absolute
  path, the writer's home, and a /tmp path written into a recorded result;
- a document it does not hold: a ``NAME.md`` or ``path/to/doc.md`` that ``git ls-files``
  lists neither from the repository's root nor from the citing file's folder (a design, a
  spec or a review kept beside the checkout).
A comment or doc says the lesson instead; a measurement says its machine, date, commit and
command; a fact from a document cites the document's path in docs/. Tracked file *names* are
held to the first two rules as well.

What passes on purpose:
- public references that name their project: ``owner/repo#N``, ``paramiko#448, #563``,
  ``speculators #613``, ``vllm-project/vllm PR #52816``, any URL, and a Proxmox commit subject
  quoted verbatim (``"fix #5194: pct: ..."``, Proxmox's way of naming its Bugzilla);
- a plain date: a measurement is dated ("measured 2026-12-05 on one H100");
- paths that exist wherever the product runs: /root/venv, /workspace, /var/cache/dflash-sim,
  a /tmp path the code itself creates, ``pct stop 200`` (a container id, not an occasion);
- another project's document, where its project is named right before it
  (``z-lab/dflash:README.md``, ``SpecForge:docs/concepts/DFlash2.md``,
  ``dstackai/dstack contributing/RUNNER-AND-SHIM.md``) or it is part of a URL; a name a
  program builds (``"flags.md"`` as a whole string literal in code) and a placeholder folder
  (``OUT/table.md``).
This file alone is not scanned: it holds examples of what it refuses.
"""

from __future__ import annotations

import os
import posixpath
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


# A document cited by its path: NAME.md, optionally below folders. What may stand right before
# it names another project: ``owner/repo:`` or ``Project:``, or ``owner/repo `` (a space).
_DOC = re.compile(
    r"(?<![\w./*{}<>$%@-])"
    r"(?P<project>[A-Za-z0-9][\w.-]*(?:/[\w.-]+)?:|[A-Za-z0-9][\w.-]*/[\w.-]+ )?"
    r"(?P<path>(?:[\w.-]+/)*[\w-][\w.-]*\.md)(?![\w/-])")
_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+")
_PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")   # DIR/, OUT/: a folder the reader picks
_PROSE = (".md", ".txt", ".rst")


def dangling_documents_in_line(line: str, path: str, tracked: frozenset[str],
                               built: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """("dangling document", the name) for each document the line cites that the repository
    does not hold, looked up from the root and from the citing file's folder. ``built``: the
    names code writes (``"table.md"``); a bare mention of one is an output, not a citation."""
    text = _URL.sub(lambda m: " " * len(m.group()), line)
    out = []
    for m in _DOC.finditer(text):
        doc = m.group("path")
        if m.group("project") and not m.group("project").rstrip(" :").endswith(".md"):
            continue  # another project's document, named with its project
        if not path.endswith(_PROSE) and m.start() > 0 and m.end() < len(text) \
                and text[m.start() - 1] in "\"'" and text[m.end()] == text[m.start() - 1]:
            continue  # a whole string literal: a name the program builds, not a citation
        if any(_PLACEHOLDER.fullmatch(part) for part in doc.split("/")[:-1]) or doc in built:
            continue
        here = posixpath.dirname(path)
        if {posixpath.normpath(doc), posixpath.normpath(posixpath.join(here, doc))} & tracked:
            continue
        out.append(("dangling document", doc))
    return out


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p]


_LITERAL = re.compile(r"""(["'])([\w.-]+\.md)\1""")


def _names(root: Path = REPO) -> tuple[frozenset[str], frozenset[str]]:
    """The tracked paths, and the document names that tracked code writes as string literals."""
    tracked = frozenset(_tracked())
    built = set()
    for path in tracked:
        full = root / path
        if path != SELF and not path.endswith(_PROSE) and full.is_file():
            built.update(m.group(2) for m in _LITERAL.finditer(full.read_text("utf-8", "replace")))
    return tracked, frozenset(built)


def dangling_documents(root: Path = REPO) -> list[str]:
    tracked, built = _names(root)
    found = []
    for path in sorted(tracked):
        full = root / path
        if path == SELF or not full.is_file():
            continue
        data = full.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        for no, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            for _, doc in dangling_documents_in_line(line, path, tracked, built):
                found.append(f"{path}:{no}: {doc}: {line.strip()[:140]}")
    return found


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


def test_tracked_files_cite_only_documents_the_repository_holds():
    found = dangling_documents()
    files = {f.split(":", 1)[0] for f in found}
    assert not found, (f"{len(found)} lines in {len(files)} tracked files cite a document the "
                       "repository does not hold (bring it into docs/ and cite that path, name "
                       "the other project before its path, or say the reason itself):\n"
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
    # documents: what the repository holds, or another project's, named with its project
    ("(tests/_rollback_node.py): the story of DESIGN.md, scripted.", "tests/x.py", "dangling document"),
    ("DDTree-style tree verification (research/dflash.md §6)", "trainer/x.py", "dangling document"),
    ('left out ("strict unary top-k", docs/concepts/DFlash2.md)', "docs/x.md", "dangling document"),
    ("Shaped like invoke's Runner (STYLE.md):", "controller/x.py", "dangling document"),
    ("DDTree-style tree verification (docs/research/dflash.md §6)", "trainer/x.py", None),
    ("from public sources (see research/dflash.md)", "docs/x.md", None),
    ("the run directory (docs/design.md: contracts); README.md has the layout", "agent/x.py", None),
    ("the README says so (`z-lab/dflash:README.md`, `SpecForge:docs/concepts/DFlash2.md`)", "docs/x.md", None),
    ("[dstackai/dstack contributing/RUNNER-AND-SHIM.md]", "docs/x.md", None),
    ("https://github.com/NVIDIA/Model-Optimizer/blob/main/examples/doc/dflash.md", "docs/x.md", None),
    ('with open(os.path.join(out, "table.md"), "w") as fh:', "bench/x.py", None),
    ("Writes DIR/results.json and DIR/table.md", "bench/x.py", None),
    ('help="the folder for results.json and table.md"', "bench/x.py", None),
])
def test_the_rules_refuse_private_references_and_pass_public_ones(line, path, rule):
    found = [name for name, _ in offences_in_line(line, path, _machine_rules(REPO))]
    found += [name for name, _ in dangling_documents_in_line(line, path, frozenset(_tracked()),
                                                             frozenset({"table.md"}))]
    assert (rule in found) if rule else not found, found


def test_every_cited_bench_script_exists():
    """A comment or doc that names a benchmark by its path names one the repository holds:
    bench/ moved by question, and a stale path sends a reader nowhere."""
    cited = re.compile(r"(?<![\w/.])bench/[A-Za-z0-9_./-]+\.(?:py|sh|json)\b")
    tracked = _tracked()
    held = set(tracked)
    dangling = []
    for f in tracked:
        if f == "tests/test_references.py":
            continue  # its examples
        try:
            text = (REPO / f).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError, IsADirectoryError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for path in cited.findall(line):
                if path not in held and not os.path.isdir(os.path.join(REPO, path)):
                    dangling.append(f"{f}:{n}: {path}")
    assert not dangling, "\n".join(dangling)
