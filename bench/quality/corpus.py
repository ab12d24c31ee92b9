"""Text already on the machine, as bytes: the Python standard library's own sources.

Every Python install has them, so a clean GPU machine needs no download. The tokenizer is
byte-level: ids 0–255 are the bytes, then a few specials (below). Files are split by a hash
of their path relative to the stdlib root, so the split does not depend on file order or on
the machine; held-out files are never seen by the target or by the drafter's data.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig

import numpy as np

BOS = 256  # document start: the target sees file boundaries
MASK = 257  # the drafter's mask token: never in any text, so the target never emits it
VOCAB = 264  # 258 used; padded to a multiple of 8
HELD_OUT_PERCENT = 5
DEFAULT_MAX_BYTES = 64_000_000  # binds only on the site-packages fallback


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


def encode(text: bytes) -> np.ndarray:
    return np.frombuffer(text, dtype=np.uint8).astype(np.int64)


def decode(ids) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def load_split(max_bytes: int | None = None, root: str | None = None) -> dict:
    """{"train": [np.ndarray ids per file], "held_out": [...], "names": {split: [rel paths]}},
    each file prefixed with BOS.

    ``max_bytes`` (default DEFAULT_MAX_BYTES, above the stdlib's size) caps the training
    split's total, and a tenth of it the held-out split's. Files are taken in a fixed
    pseudo-random order, so a small cap still mixes many modules instead of taking one
    package alphabetically."""
    files = stdlib_files(root)
    files.sort(key=lambda f: hashlib.sha256(f[0].encode()).digest())
    split: dict[str, list[np.ndarray]] = {"train": [], "held_out": []}
    size = {"train": 0, "held_out": 0}
    names: dict[str, list[str]] = {"train": [], "held_out": []}
    for rel, path in files:
        part = "held_out" if is_held_out(rel) else "train"
        cap = max_bytes or DEFAULT_MAX_BYTES
        cap = cap if part == "train" else cap // 10
        if size[part] >= cap:
            continue
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
        except OSError:
            continue
        if len(raw) < 256:
            continue
        split[part].append(np.concatenate([[BOS], encode(raw)]))
        names[part].append(rel)
        size[part] += len(raw)
    if not split["train"] or not split["held_out"]:
        raise RuntimeError(f"no stdlib sources found under {root or sysconfig.get_paths()['stdlib']}")
    return {**split, "names": names}


def line_start_windows(docs: list[np.ndarray], n: int, length: int, seed: int) -> np.ndarray:
    """``n`` windows of ``length`` ids, each starting at a line start (a natural prompt
    boundary), from documents chosen with probability ∝ their length. [n, length] int64."""
    rng = np.random.default_rng(seed)
    lens = np.array([len(d) for d in docs], dtype=np.float64)
    ok = lens > length + 1
    if not ok.any():
        raise RuntimeError(f"no document is longer than {length} bytes")
    p = np.where(ok, lens, 0) / np.where(ok, lens, 0).sum()
    out = np.zeros((n, length), dtype=np.int64)
    for i in range(n):
        d = docs[int(rng.choice(len(docs), p=p))]
        starts = np.flatnonzero(d[: len(d) - length] == ord("\n")) + 1
        s = int(rng.choice(starts)) if len(starts) else int(rng.integers(0, len(d) - length))
        out[i] = d[s:s + length]
    return out
