"""trainer/layers/flex_mask.direct_block_mask against create_block_mask (eager, CPU): the same
tiles, tensor for tensor, for full-attention and sliding-window DFlash masks over many
layouts, and the same attention output; the chunked step builds no mask through
create_block_mask (its compile was the first step's largest)."""

from __future__ import annotations

import os

import pytest
import torch
from torch.nn.attention import flex_attention as fa

from trainer.gpu import fast_drafter as fd
from trainer.layers import flex_mask as fm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def _layout(seed: int, b: int, n: int, S: int, drop: int, near: str = ""):
    """Sorted anchors [b, n] in 0..S-2 (``near``: "zero" or "end" crowds them there), the
    last ``drop`` blocks of each row padding (anchor 0, keep False, as the step pads)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b):
        if near == "zero":
            pool = torch.arange(min(S - 1, max(n, 8)))
        elif near == "end":
            pool = torch.arange(max(0, S - 1 - max(n, 8)), S - 1)
        else:
            pool = torch.arange(S - 1)
        pick = pool[torch.randperm(len(pool), generator=g)[:n]]
        if len(pick) < n:  # fewer positions than blocks: repeat some (sorted, as sampled)
            pick = torch.cat([pick, pick[torch.randint(len(pick), (n - len(pick),), generator=g)]])
        rows.append(pick.sort().values)
    a = torch.stack(rows)
    keep = torch.ones(b, n, dtype=torch.bool)
    if drop:
        keep[:, n - drop:] = False
        a[:, n - drop:] = 0
    return a, keep


def _assert_same(a, keep, S, B, window, tile):
    mod = fm.dflash_mask_mod(a, S, B, keep, window)
    n = a.shape[1]
    want = fa.create_block_mask(mod, a.shape[0], None, n * B, S + n * B, device="cpu", BLOCK_SIZE=tile,
                                _compile=False)
    got = fm.direct_block_mask(a, keep, S, B, mod, tile=tile, window=window)
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), (name, S, B, n, window, tile)
    assert got.seq_lengths == want.seq_lengths and got.BLOCK_SIZE == want.BLOCK_SIZE
    return got, want


# (S, B, n, drop, window, tile, near): windows below, at and above a tile and W not a
# multiple of it, W = 1 (only the own slot), W below the block, block sizes that do not
# divide the tile or exceed it, context and query lengths that do not tile
CASES = [
    (256, 32, 8, 0, None, 128, ""), (256, 32, 8, 3, None, 128, ""), (384, 16, 16, 5, None, 128, ""),
    (256, 128, 2, 1, None, 128, ""), (128, 32, 4, 4, None, 128, ""), (200, 24, 7, 2, None, 128, ""),
    (256, 32, 8, 0, 64, 128, ""), (256, 32, 8, 2, 128, 128, ""), (256, 32, 8, 0, 129, 128, ""),
    (512, 32, 12, 3, 300, 128, ""), (512, 16, 16, 0, 2048, 128, ""), (512, 32, 8, 0, 200, 128, "zero"),
    (512, 32, 8, 1, 200, 128, "end"), (256, 32, 8, 0, 1, 128, ""), (256, 32, 8, 0, 20, 128, ""),
    (256, 128, 2, 0, 100, 128, ""), (256, 128, 2, 0, 300, 128, "end"), (300, 24, 9, 2, 77, 128, ""),
    (1000, 8, 40, 5, 333, 128, ""), (256, 32, 8, 0, 96, (64, 32), ""), (96, 8, 10, 1, 40, 16, "end"),
    (64, 4, 16, 0, 9, (16, 32), "zero"), (512, 256, 1, 0, 400, 128, ""), (512, 32, 6, 6, 500, 128, ""),
    # flex_mask.Q_TILE's candidate: query tiles of 640 rows (20 blocks of 32), KV tiles of 128
    (1024, 32, 44, 3, None, (640, 128), ""), (1024, 32, 44, 0, 300, (640, 128), "end"),
]


@pytest.mark.parametrize("S,B,n,drop,window,tile,near", CASES)
def test_the_direct_block_mask_equals_create_block_masks(S, B, n, drop, window, tile, near):
    a, keep = _layout(S * 31 + B * 7 + n, 2, n, S, drop, near)
    _assert_same(a, keep, S, B, window, tile)
    _assert_same(a[:1], None if drop else keep[:1], S, B, window, tile)  # no keep flags


def test_random_layouts_give_create_block_masks_tiles():
    """Many random layouts, one per seed: block size, context, blocks, window, tile."""
    g = torch.Generator().manual_seed(29)
    for seed in range(60):
        pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
        B = pick([1, 2, 4, 8, 16, 24, 32, 48])
        tile = pick([16, 32, 64, (16, 64), (64, 16)])
        S = int(torch.randint(2, 400, (1,), generator=g))
        n = int(torch.randint(1, 12, (1,), generator=g))
        drop = int(torch.randint(0, n + 1, (1,), generator=g))
        window = pick([None, 1, 2, 7, 16, 33, 64, 100, 1000])
        a, keep = _layout(seed, 2, n, S, drop, pick(["", "zero", "end"]))
        _assert_same(a, keep, S, B, window, tile)


def test_one_sequence_of_anchors_gives_a_batch_of_one():
    """The chunked step passes one sequence's chunk ([n] anchors): the same mask as [1, n]."""
    a, keep = _layout(5, 1, 8, 256, 2)
    mod = fm.dflash_mask_mod(a, 256, 32, keep, 100)
    one = fm.direct_block_mask(a[0], keep[0], 256, 32, mod, window=100)
    two = fm.direct_block_mask(a, keep, 256, 32, mod, window=100)
    for name in FIELDS:
        assert torch.equal(getattr(one, name), getattr(two, name)), name


@pytest.mark.parametrize("window", [None, 5, 40])
def test_flex_attention_gives_the_same_output_under_both_masks(window):
    torch.manual_seed(3)
    S, B, n, Hq, Hk, D = 70, 8, 6, 4, 2, 16
    a, keep = _layout(11, 2, n, S, 1)
    got, want = (fm.make_dflash_block_mask(a, S, B, keep, window=window, q_block=16, kv_block=16, direct=d)
                 for d in (True, False))
    q = torch.randn(2, Hq, n * B, D, dtype=torch.float64)
    k = torch.randn(2, Hk, S + n * B, D, dtype=torch.float64)
    v = torch.randn(2, Hk, S + n * B, D, dtype=torch.float64)
    out = fa.flex_attention(q, k, v, block_mask=got, enable_gqa=True)
    assert torch.equal(out, fa.flex_attention(q, k, v, block_mask=want, enable_gqa=True))
    dense = fm.dense_dflash_mask(a, S, B, keep, window)[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           attn_mask=dense)
    assert (out - ref).norm() / ref.norm() < 1e-10


def _no_create_block_mask(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("create_block_mask called on the direct path")
    monkeypatch.setattr(fa, "create_block_mask", refuse)


@pytest.mark.parametrize("window", [None, 64])
def test_the_chunked_steps_masks_never_call_create_block_mask(monkeypatch, window):
    """Full and sliding-window layers alike (the sliding ones fell back to a compiled
    create_block_mask before); the reference builder (direct=False) is the one that does."""
    a, keep = _layout(7, 1, 8, 200, 2)
    _no_create_block_mask(monkeypatch)
    bm = fd._chunk_block_mask(a[0], keep[0], 200, 24, window)
    assert bm.kv_indices.shape == (1, 1, 2, 4)  # 192 queries, 392 keys in 128-tiles
    bm = fm.make_dflash_block_mask(a, 200, 24, keep, window=window, direct=True)
    with pytest.raises(AssertionError, match="direct path"):
        fm.make_dflash_block_mask(a, 200, 24, keep, window=window, direct=False)


def test_the_chunked_steps_masks_take_their_query_tile_from_flex_mask(monkeypatch):
    """flex_mask.Q_TILE sets the query side of every chunk's mask, and the direct masks stay
    create_block_mask's at that tile."""
    a, keep = _layout(5, 1, 44, 1024, 3)
    monkeypatch.setattr(fm, "Q_TILE", 640)
    bm = fd._chunk_block_mask(a[0], keep[0], 1024, 32, None)
    assert bm.BLOCK_SIZE == (640, 128)
    assert bm.kv_indices.shape == (1, 1, 3, 19)  # 1,408 queries in 640-row tiles, 2,432 keys in 128s
    want = fm.make_dflash_block_mask(a[:1], 1024, 32, keep[:1], direct=False)
    for name in FIELDS:
        assert torch.equal(getattr(bm, name), getattr(want, name)), name
