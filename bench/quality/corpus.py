"""Text already on the machine, as chat conversations in three categories, as bytes.

Every Python install has its standard library's sources, so a clean GPU machine needs no
download; a chat mix is made from them and from arithmetic generated here:

* ``code``: each stdlib ``.py`` file cut into chunks of lines, one chunk per assistant turn
  ("Continue NAME." → the next lines);
* ``prose``: the docstrings of those files (module, class, function), one per assistant turn
  ("What does NAME do?" → the docstring): English documentation;
* ``math``: arithmetic and word problems drawn from a seeded generator, answered with the
  working ("Ann has 12 apples and buys 7 more … 12 + 7 = 19. She has 19 apples.").

A conversation is ``BOS (USER question ASSISTANT answer)*``; USER and ASSISTANT are ids of
their own, never bytes of any text. The tokenizer is byte-level: ids 0–255 are the bytes,
then the specials (below). Code and prose files are split by a hash of their path relative
to the stdlib root, the same split for both (a held-out file's docstrings are never in the
training code either), so the split does not depend on file order or on the machine;
held-out math problems come from another seed's generator. Held-out conversations are never
seen by the target or in the drafter's data.
"""

from __future__ import annotations

import ast
import glob
import hashlib
import os
import sysconfig

import numpy as np

BOS = 256  # conversation start: the target sees document boundaries
MASK = 257  # the drafter's mask token: never in any text, so the target never emits it
USER = 258  # a user turn starts
ASSISTANT = 259  # the assistant's answer starts (a prompt ends here or at a line inside the answer)
VOCAB = 264  # 260 used; padded to a multiple of 8
HELD_OUT_PERCENT = 5
DEFAULT_MAX_BYTES = 64_000_000  # binds only on the site-packages fallback
# The mix, by bytes of the training split (a tenth of each for the held-out split): code is
# what the stdlib has most of; prose is bounded by the docstrings there are (a few MB).
CATEGORIES = ("code", "prose", "math")
SHARE = {"code": 0.5, "prose": 0.3, "math": 0.2}
CODE_LINES = 12  # lines per assistant turn of a code conversation
TURNS_PER_CONVERSATION = 8  # prose and math: a file's docstrings / problems, this many per conversation


MIN_STDLIB_BYTES = 5_000_000  # below this the install ships few sources (e.g. .pyc only)


def stdlib_files(root: str | None = None) -> list[tuple[str, str]]:
    """(relative path, absolute path) of every stdlib .py file, sorted; site-packages excluded.

    Where the stdlib holds under MIN_STDLIB_BYTES of sources (a slimmed image), the .py files
    of the installed packages (purelib: transformers, torch, …) are added, named
    ``site-packages/…``: still text already on the machine."""
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
        rel = os.path.relpath(path, root)
        if rel.split(os.sep)[0] in ("site-packages", "dist-packages"):
            continue
        out.append((rel, path))
    if sum(os.path.getsize(p) for _, p in out) < MIN_STDLIB_BYTES:
        site = sysconfig.get_paths()["purelib"]
        out += [(os.path.join("site-packages", os.path.relpath(p, site)), p)
                for p in glob.glob(os.path.join(site, "**", "*.py"), recursive=True)]
    return sorted(out)


def is_held_out(rel: str) -> bool:
    h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:4], "little")
    return h % 100 < HELD_OUT_PERCENT


def encode(text: bytes | str) -> np.ndarray:
    if isinstance(text, str):
        text = text.encode("utf-8", errors="replace")
    return np.frombuffer(text, dtype=np.uint8).astype(np.int64)


def decode(ids) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def conversation(turns: list[tuple[str | bytes, str | bytes]]) -> np.ndarray:
    """BOS, then USER question ASSISTANT answer for each turn; every answer ends in a newline."""
    parts = [np.array([BOS], dtype=np.int64)]
    for question, answer in turns:
        answer = answer if isinstance(answer, bytes) else answer.encode("utf-8", errors="replace")
        if not answer.endswith(b"\n"):
            answer += b"\n"
        parts += [np.array([USER]), encode(question), np.array([ASSISTANT]), encode(answer)]
    return np.concatenate(parts)


def _module(rel: str) -> str:
    return os.path.splitext(rel)[0].replace(os.sep, ".").removesuffix(".__init__")


def code_conversation(rel: str, raw: bytes) -> np.ndarray | None:
    lines = raw.splitlines(keepends=True)
    turns = []
    for i in range(0, len(lines), CODE_LINES):
        ask = f"Write the beginning of {rel}." if i == 0 else f"Continue {rel} from line {i + 1}."
        turns.append((ask, b"".join(lines[i:i + CODE_LINES])))
    return conversation(turns) if turns else None


def prose_conversations(rel: str, raw: bytes) -> list[np.ndarray]:
    """The file's docstrings (module, classes, functions) as question/answer turns."""
    try:
        tree = ast.parse(raw)
    except (SyntaxError, ValueError):
        return []
    mod = _module(rel)
    turns = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 40:  # "Return x." says nothing to learn from
            continue
        if isinstance(node, ast.Module):
            ask = f"What is the module {mod} for?"
        elif isinstance(node, ast.ClassDef):
            ask = f"What is the class {node.name} in {mod}?"
        else:
            ask = f"What does {node.name}() in {mod} do?"
        turns.append((ask, doc))
    return [conversation(turns[i:i + TURNS_PER_CONVERSATION]) for i in range(0, len(turns), TURNS_PER_CONVERSATION)]


NAMES = ("Ann", "Bo", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun")
THINGS = ("apples", "books", "coins", "stamps", "marbles", "cards", "pencils", "shells")


def math_problem(rng: np.random.Generator) -> tuple[str, str]:
    """One problem and its worked answer; every number comes from ``rng``."""
    kind = int(rng.integers(0, 6))
    a, b = int(rng.integers(2, 100)), int(rng.integers(2, 100))
    who, what = NAMES[int(rng.integers(len(NAMES)))], THINGS[int(rng.integers(len(THINGS)))]
    if kind == 0:
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
    if kind == 1:
        a, b = max(a, b), min(a, b)
        return f"What is {a} - {b}?", f"{a} - {b} = {a - b}."
    if kind == 2:
        a, b = a % 13 + 2, b % 13 + 2
        return f"What is {a} times {b}?", f"{a} × {b} = {a * b}."
    if kind == 3:
        return (f"{who} has {a} {what} and gets {b} more. How many {what} does {who} have now?",
                f"{a} + {b} = {a + b}. {who} has {a + b} {what}.")
    if kind == 4:
        a, b = max(a, b), min(a, b)
        return (f"{who} had {a} {what} and gave away {b}. How many are left?",
                f"{a} - {b} = {a - b}. {a - b} {what} are left.")
    n, k = a % 9 + 2, b % 12 + 2
    return (f"{who} buys {n} boxes of {what} with {k} in each box. How many {what} is that?",
            f"{n} × {k} = {n * k}. That is {n * k} {what}.")


def math_conversations(total_bytes: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out, size = [], 0
    while size < total_bytes:
        conv = conversation([math_problem(rng) for _ in range(TURNS_PER_CONVERSATION)])
        out.append(conv)
        size += len(conv)
    return out


def load_split(max_bytes: int | None = None, root: str | None = None) -> dict:
    """{"train": [np.ndarray ids per conversation], "held_out": [...], "names": {split: [name
    per conversation]}, "categories": {split: [category per conversation]}}.

    ``max_bytes`` (default DEFAULT_MAX_BYTES, above the stdlib's size) caps the training
    split's total, SHARE of it per category, and a tenth of that the held-out split's. Files
    are taken in a fixed pseudo-random order, so a small cap still mixes many modules instead
    of taking one package alphabetically. Names: ``code/REL``, ``prose/REL``, ``math/N``."""
    cap_total = max_bytes or DEFAULT_MAX_BYTES
    files = stdlib_files(root)
    files.sort(key=lambda f: hashlib.sha256(f[0].encode()).digest())
    out = {"train": [], "held_out": []}
    names: dict[str, list[str]] = {"train": [], "held_out": []}
    cats: dict[str, list[str]] = {"train": [], "held_out": []}

    def cap(cat: str, part: str) -> int:
        c = int(cap_total * SHARE[cat])
        return c if part == "train" else c // 10

    size = {(c, p): 0 for c in CATEGORIES for p in out}

    def add(cat: str, part: str, name: str, conv: np.ndarray) -> None:
        out[part].append(conv)
        names[part].append(f"{cat}/{name}")
        cats[part].append(cat)
        size[cat, part] += len(conv)

    for rel, path in files:
        part = "held_out" if is_held_out(rel) else "train"
        want_code, want_prose = size["code", part] < cap("code", part), size["prose", part] < cap("prose", part)
        if not (want_code or want_prose):
            continue
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
        except OSError:
            continue
        if len(raw) < 256:
            continue
        if want_code:
            add("code", part, rel, code_conversation(rel, raw))
        if want_prose:
            for conv in prose_conversations(rel, raw):
                add("prose", part, rel, conv)
    for part, seed in (("train", 11), ("held_out", 12)):  # another seed: other problems held out
        for i, conv in enumerate(math_conversations(cap("math", part), seed)):
            add("math", part, str(i), conv)
    for part in out:
        missing = [c for c in CATEGORIES if c not in cats[part]]
        if missing:
            raise RuntimeError(f"no {', '.join(missing)} conversations for the {part} split from the stdlib sources "
                               f"under {root or sysconfig.get_paths()['stdlib']}")
    return {**out, "names": names, "categories": cats}


def by_category(docs: list[np.ndarray], categories: list[str]) -> dict[str, list[np.ndarray]]:
    out: dict[str, list[np.ndarray]] = {}
    for d, c in zip(docs, categories):
        out.setdefault(c, []).append(d)
    return {c: out[c] for c in CATEGORIES if c in out}


def prompt_windows(docs: list[np.ndarray], n: int, length: int, seed: int) -> np.ndarray:
    """``n`` windows of ``length`` ids, each ending where an answer is to be written: right
    after an ASSISTANT marker or at a line start inside an assistant turn (a chat prompt: the
    conversation so far, cut to ``length`` on the left). Conversations are chosen with
    probability ∝ their length. [n, length] int64."""
    rng = np.random.default_rng(seed)
    ends = []
    for d in docs:
        marker = np.where((d == USER) | (d == ASSISTANT), np.arange(len(d)), 0)
        in_answer = d[np.maximum.accumulate(marker)] == ASSISTANT  # the last marker so far is ASSISTANT's
        point = (d == ASSISTANT) | ((d == ord("\n")) & in_answer)
        point[:-1] &= d[1:] != USER  # the answer's end is not a place to start one
        after = np.flatnonzero(point[:-1]) + 1
        ends.append(after[after >= length])
    weights = np.array([len(d) if len(e) else 0 for d, e in zip(docs, ends)], dtype=np.float64)
    if not weights.any():
        raise RuntimeError(f"no conversation is longer than {length} ids before an answer point")
    p = weights / weights.sum()
    out = np.zeros((n, length), dtype=np.int64)
    for i in range(n):
        k = int(rng.choice(len(docs), p=p))
        end = int(rng.choice(ends[k]))
        out[i] = docs[k][end - length:end]
    return out
