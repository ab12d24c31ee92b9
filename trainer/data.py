"""Prepared training data: the memory-mapped shard format, and token-budget batching.

A prepared dataset is flat binary shards plus ``meta.json`` (format in docs/data.md), written by
:class:`ShardWriter` (``python -m trainer prepare``, trainer/chat/prepare.py, fills it). The trainer
opens them read-only with :class:`PreparedData` and groups samples into micro-batches with
:func:`make_batches`.

numpy + standard library only: no torch here, so preparing data and testing the batcher
need no GPU stack.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from array import array
from typing import Any, Iterable, Sequence

import numpy as np


FORMAT = "dflash-prepared-data"
FORMAT_VERSION = 1
META = "meta.json"
IDS_DTYPE = np.dtype("<i4")
MASK_DTYPE = np.dtype("u1")
OFFSETS_DTYPE = np.dtype("<i8")
SUFFIX = {"ids": ".ids.int32", "mask": ".mask.uint8", "offsets": ".offsets.int64"}
DEFAULT_SHARD_TOKENS = 1 << 27  # 134M tokens: a 512 MiB ids file per shard
DEFAULT_PROGRESS_EVERY = 100_000
MAX_TOKEN_ID = (1 << 31) - 1  # ids are stored as int32


class DataError(ValueError):
    """Bad input or a bad prepared directory. The message is one line naming the file
    (and line) and what to do about it."""


# --------------------------------------------------------------------------- reading


class PreparedData:
    """A prepared data directory, opened read-only through ``np.memmap``.

    Nothing is read into memory except the offsets (8 bytes per sample); ``sample(i)``
    copies one sample out of the mapped shards.
    """

    def __init__(self, data_dir: str):
        self.data_dir = os.fspath(data_dir)
        meta_path = os.path.join(self.data_dir, META)
        try:
            with open(meta_path, encoding="utf-8") as fh:
                self.meta: dict = json.load(fh)
        except FileNotFoundError:
            raise DataError(
                f"{meta_path}: not found — {self.data_dir} is not a prepared data directory; "
                f"create it with `python -m trainer prepare --input FILE.jsonl --out {self.data_dir}`"
            ) from None
        except (OSError, json.JSONDecodeError) as exc:
            raise DataError(f"{meta_path}: unreadable ({exc}); re-run `python -m trainer prepare`") from None
        if self.meta.get("format") != FORMAT or self.meta.get("format_version") != FORMAT_VERSION:
            raise DataError(
                f"{meta_path}: format {self.meta.get('format')!r} version {self.meta.get('format_version')!r} "
                f"is not {FORMAT!r} version {FORMAT_VERSION}; re-run `python -m trainer prepare` with this version"
            )
        self.fingerprint: str = self.meta["fingerprint"]
        self._ids: list[np.memmap] = []
        self._mask: list[np.memmap] = []
        offsets: list[np.ndarray] = []
        for shard in self.meta["shards"]:
            n, t = int(shard["samples"]), int(shard["tokens"])
            off = self._map(shard["name"], "offsets", OFFSETS_DTYPE, n + 1)
            if int(off[0]) != 0 or int(off[-1]) != t or (n and np.any(np.diff(off) < 0)):
                raise DataError(
                    f"{self._path(shard['name'], 'offsets')}: offsets do not match meta.json; "
                    "the directory is damaged — re-run `python -m trainer prepare`"
                )
            offsets.append(np.asarray(off))
            self._ids.append(self._map(shard["name"], "ids", IDS_DTYPE, t))
            self._mask.append(self._map(shard["name"], "mask", MASK_DTYPE, t))
        self._offsets = offsets
        counts = np.array([len(o) - 1 for o in offsets], dtype=np.int64)
        # first global index of each shard, for global index → (shard, local index)
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.lengths: np.ndarray = (
            np.concatenate([np.diff(o) for o in offsets]).astype(np.int64) if offsets else np.zeros(0, np.int64)
        )
        if len(self.lengths) != int(self.meta["samples"]):
            raise DataError(f"{meta_path}: shards hold {len(self.lengths)} samples, meta.json says {self.meta['samples']}")

    def _path(self, name: str, part: str) -> str:
        return os.path.join(self.data_dir, name + SUFFIX[part])

    def _map(self, name: str, part: str, dtype: np.dtype, count: int) -> np.ndarray:
        path = self._path(name, part)
        try:
            size = os.path.getsize(path)
        except OSError:
            raise DataError(f"{path}: missing; the directory is damaged — re-run `python -m trainer prepare`") from None
        if size != count * dtype.itemsize:
            raise DataError(
                f"{path}: {size} bytes, expected {count * dtype.itemsize} from meta.json; "
                "the directory is damaged — re-run `python -m trainer prepare`"
            )
        if count == 0:  # np.memmap refuses empty files
            return np.zeros(0, dtype)
        return np.memmap(path, dtype=dtype, mode="r", shape=(count,))

    def __len__(self) -> int:
        return len(self.lengths)

    def category(self, i: int) -> str | None:
        """The source a sample came from (its input file's name without the extension: chat,
        code, math ...), from meta.json's per-source sample counts (samples are written in input
        order); None for data prepared before those counts were kept."""
        start = 0
        for src in self.meta.get("sources") or []:
            if not isinstance(src.get("samples"), int):
                return None
            if start <= i < start + src["samples"]:
                return os.path.splitext(str(src.get("file") or "?"))[0]
            start += src["samples"]
        return None

    def held_out(self, n: int) -> list[int]:
        """The ``n`` samples --eval-prompts holds out of training (ascending): the last ``n``;
        with several sources (meta.json's per-source counts), the last of each source in turn,
        so τ at save covers every category — the last ``n`` of data written in input order
        would be the last file's alone."""
        n = max(0, min(int(n), len(self)))
        counts = [src.get("samples") for src in self.meta.get("sources") or []]
        if n == 0 or len(counts) < 2 or not all(isinstance(c, int) for c in counts) or sum(counts) != len(self):
            return list(range(len(self) - n, len(self)))
        ends = np.cumsum(counts).tolist()
        taken = [0] * len(counts)
        while sum(taken) < n:
            for k, c in enumerate(counts):
                if taken[k] < c and sum(taken) < n:
                    taken[k] += 1
        return sorted(i for k, t in enumerate(taken) for i in range(ends[k] - t, ends[k]))

    def trained(self, n_held: int) -> list[int]:
        """The samples training sees: every one but :meth:`held_out`."""
        held = set(self.held_out(n_held))
        return [i for i in range(len(self)) if i not in held]

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int32, loss_mask uint8) of sample ``i``, copied (writable, and safe to
        hand to torch.from_numpy)."""
        n = len(self.lengths)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for {n} samples in {self.data_dir}")
        i = int(i) % n
        s = int(np.searchsorted(self._starts, i, side="right")) - 1
        j = i - int(self._starts[s])
        a, b = int(self._offsets[s][j]), int(self._offsets[s][j + 1])
        return np.array(self._ids[s][a:b]), np.array(self._mask[s][a:b])

    def verify(self) -> None:
        """Recompute the fingerprint from the shard contents (reads everything)."""
        h = Fingerprint()
        for i in range(len(self)):
            h.add(*self.sample(i))
        if h.hexdigest() != self.fingerprint:
            raise DataError(
                f"{self.data_dir}: contents hash to {h.hexdigest()}, meta.json says {self.fingerprint}; "
                "the shards were changed after prepare — re-run `python -m trainer prepare`"
            )


class Fingerprint:
    """Content hash of the sample sequence: the same samples in the same order give the same
    fingerprint whatever the shard size or the JSONL formatting."""

    def __init__(self):
        self._h = hashlib.sha256(f"{FORMAT}/{FORMAT_VERSION}\n".encode())

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        self._h.update(struct.pack("<q", len(ids)))
        self._h.update(np.ascontiguousarray(ids, IDS_DTYPE).tobytes())
        self._h.update(np.ascontiguousarray(mask, MASK_DTYPE).tobytes())

    def hexdigest(self) -> str:
        return self._h.hexdigest()


# --------------------------------------------------------------------------- batching


def make_batches(
    lengths: Sequence[int] | np.ndarray,
    token_budget: int,
    max_seq_len: int,
    max_batch_size: int,
    seed: int,
    epoch: int,
    window: int | None = None,
) -> list[list[int]]:
    """Group sample indices into micro-batches; every index appears exactly once.

    Tokens are counted the way memory is spent: (longest truncated length in the batch) ×
    (batch size) ≤ ``token_budget``, with each length truncated to ``max_seq_len``, and at
    most ``max_batch_size`` samples per batch.

    Padding is kept low by sorting by length inside windows of the shuffled indices, so a
    batch holds samples of nearly equal length; randomness comes from the per-epoch shuffle
    that decides which samples share a window, and from shuffling the order of the batches.
    Deterministic for (seed, epoch): a resumed run sees the same batches in the same order.
    ``window`` (samples per sorting window) defaults to 256 × max_batch_size, at least 16,384.
    """
    if token_budget < 1 or max_seq_len < 1 or max_batch_size < 1:
        raise ValueError(
            f"token_budget {token_budget}, max_seq_len {max_seq_len} and max_batch_size {max_batch_size} must all be >= 1"
        )
    lens = np.minimum(np.asarray(lengths, dtype=np.int64), max_seq_len)
    n = len(lens)
    if n == 0:
        return []
    # An empty sample still occupies a batch row; count it as one token so the arithmetic
    # never divides by zero.
    cost = np.maximum(lens, 1)
    longest = int(cost.max())
    if longest > token_budget:
        raise ValueError(
            f"a sequence of {longest} tokens (after truncation to max_seq_len {max_seq_len}) exceeds "
            f"token_budget {token_budget}; raise --token-budget to at least {longest} or lower --max-seq-len"
        )
    if window is None:
        window = max(16_384, 256 * max_batch_size)
    rng = np.random.default_rng(_seed_entropy(seed, epoch))
    order = rng.permutation(n)
    batches: list[np.ndarray] = []
    for start in range(0, n, window):
        idx = order[start:start + window]
        # longest first: the first sample of each batch sets the padded length, so the batch
        # can take budget // that length samples. Stable sort keeps ties in shuffled order.
        idx = idx[np.argsort(-cost[idx], kind="stable")]
        c = cost[idx]
        pos, m = 0, len(idx)
        while pos < m:
            k = min(max_batch_size, token_budget // int(c[pos]), m - pos)
            batches.append(idx[pos:pos + k])
            pos += k
    perm = rng.permutation(len(batches))
    return [batches[j].tolist() for j in perm]


def random_batches(
    lengths: Sequence[int] | np.ndarray, token_budget: int, max_seq_len: int, max_batch_size: int, seed: int, epoch: int
) -> list[list[int]]:
    """Naive baseline for benchmarks and tests: shuffle, then fill each batch in that order
    until the next sample would break the budget or size limit. Not used for training."""
    cost = np.maximum(np.minimum(np.asarray(lengths, dtype=np.int64), max_seq_len), 1)
    order = np.random.default_rng(_seed_entropy(seed, epoch)).permutation(len(cost))
    batches: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in order.tolist():
        c = int(cost[i])
        if cur and (len(cur) + 1 > max_batch_size or max(longest, c) * (len(cur) + 1) > token_budget):
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, c)
    if cur:
        batches.append(cur)
    return batches


def _seed_entropy(seed: int, epoch: int) -> list[int]:
    # SeedSequence wants non-negative ints; keep negative seeds distinct from positive ones.
    return [0x64666C61, int(seed) % (1 << 64), int(epoch) % (1 << 64)]


def batch_stats(
    lengths: Sequence[int] | np.ndarray, batches: Iterable[Sequence[int]], max_seq_len: int, token_budget: int | None = None
) -> dict[str, float]:
    """Padding figures for a batching: useful tokens (truncated lengths), padded tokens
    (longest × size per batch), padding efficiency = useful / padded, and budget fill =
    padded / (batches × token_budget) when a budget is given."""
    lens = np.minimum(np.asarray(lengths, dtype=np.int64), max_seq_len)
    useful = padded = count = 0
    for b in batches:
        bl = lens[np.asarray(b, dtype=np.int64)]
        useful += int(bl.sum())
        padded += int(bl.max()) * len(bl) if len(bl) else 0
        count += 1
    out = {"batches": count, "useful_tokens": useful, "padded_tokens": padded,
           "efficiency": useful / padded if padded else 1.0}
    if token_budget:
        out["budget_fill"] = padded / (count * token_budget) if count else 1.0
    return out


# --------------------------------------------------------------------------- writing


class ShardWriter:
    """Appends samples to shard files in ``directory``, starting a new shard when the
    current one would pass ``shard_tokens``."""

    def __init__(self, directory: str, shard_tokens: int):
        self.directory = directory
        self.shard_tokens = shard_tokens
        self.shards: list[dict] = []
        self._files: dict[str, Any] = {}
        self._offsets: array = array("q", [0])

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        tokens = self._offsets[-1]
        if not self._files or (tokens > 0 and tokens + len(ids) > self.shard_tokens):
            self._close_shard()
            self._open_shard()
        self._files["ids"].write(ids.tobytes())
        self._files["mask"].write(mask.tobytes())
        self._offsets.append(self._offsets[-1] + len(ids))

    def _open_shard(self) -> None:
        name = f"shard-{len(self.shards):05d}"
        self.shards.append({"name": name})
        for part in ("ids", "mask"):
            self._files[part] = open(os.path.join(self.directory, name + SUFFIX[part]), "wb", buffering=1 << 20)
        self._offsets = array("q", [0])

    def _close_shard(self) -> None:
        if not self._files:
            return
        shard = self.shards[-1]
        for fh in self._files.values():
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()
        self._files = {}
        with open(os.path.join(self.directory, shard["name"] + SUFFIX["offsets"]), "wb") as fh:
            fh.write(np.frombuffer(self._offsets, dtype=np.int64).astype(OFFSETS_DTYPE).tobytes())
            fh.flush()
            os.fsync(fh.fileno())
        shard["samples"] = len(self._offsets) - 1
        shard["tokens"] = int(self._offsets[-1])

    def close(self) -> list[dict]:
        self._close_shard()
        return self.shards

    def abort(self) -> None:
        for fh in self._files.values():
            fh.close()
        self._files = {}
