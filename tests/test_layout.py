"""The shape of the code, held: no import cycle between files, the layering docs/design.md fixes
(the agent imports nothing of the project but itself; the trainer only the agent's protocol
side; the sim nothing of the controller), and no one-letter alias for a project module
(`R`, `J`, `D`, `F` once meant four different things across controller/ and trainer/).
Function-local imports count: they hide a cycle, they do not remove it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("controller", "agent", "trainer", "sim", "templates")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(path: Path, mods: dict[str, Path]) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in mods else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in mods}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_files():
    mods = _modules()
    graph = {m: _imports(p, mods) - {m} for m, p in mods.items()}
    assert _cycles(graph) == []


def test_the_layers_import_downwards_only():
    mods = _modules()
    allowed = {"agent": ("agent",), "trainer": ("trainer", "agent"), "sim": ("sim", "agent")}
    wrong = []
    for m, path in mods.items():
        top = m.split(".")[0]
        for dep in _imports(path, mods):
            if top in allowed and dep.split(".")[0] not in allowed[top]:
                wrong.append(f"{m} imports {dep}")
    assert wrong == []


def test_no_one_letter_alias_for_a_project_module():
    pattern = re.compile(r"^(?:from (\w[\w.]*) )?import ([\w.]+) as ([A-Za-z])$", re.M)
    found = []
    for m, path in _modules().items():
        for frm, name, alias in pattern.findall(path.read_text()):
            target = f"{frm}.{name}" if frm else name
            if target.split(".")[0] in PACKAGES:
                found.append(f"{m}: {target} as {alias}")
    assert found == []


def test_no_file_holds_a_merge_conflict_marker():
    # A merge once committed `<<<<<<< HEAD` into controller/commands/export.py: `ctl export`
    # was a SyntaxError and only the sim tests that export noticed.
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    marker = re.compile(r"^(<{7} |>{7} |={7}$)", re.M)
    hits = []
    for name in tracked:
        path = REPO / name
        if path.suffix in (".py", ".md", ".toml", ".sh", ".j2", ".txt", ".json", ".cfg") and path.is_file():
            if marker.search(path.read_text(errors="replace")):
                hits.append(name)
    assert hits == []


def test_no_symlink_is_tracked_and_the_venvs_are_ignored_as_links_too(tmp_path):
    # A helper's worktree links .venv to the shared venv; `.venv/` in .gitignore matched only a
    # directory, so the link was committed, and merging it replaced main's venv directory (git
    # overwrites ignored files freely). Nothing in the tree needs a symlink.
    import subprocess

    staged = subprocess.run(["git", "ls-files", "-s"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    links = [line.split("\t", 1)[1] for line in staged.splitlines() if line.startswith("120000 ")]
    assert links == []
    # this checkout's .gitignore, in a repository where the venvs are links as in a worktree
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text((REPO / ".gitignore").read_text())
    for name in (".venv", ".venv-vllm"):
        (tmp_path / name).symlink_to("/nonexistent")
        ignored = subprocess.run(["git", "check-ignore", "-q", name], cwd=tmp_path)
        assert ignored.returncode == 0, f"{name} as a link (not only as a directory) is not ignored"
