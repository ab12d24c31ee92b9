"""The DFlash drafter's attention mask, written once, in the forms both steps use.

Layout (per sequence of the batch, shared by every head):

    Q  = the draft blocks, concatenated:        n_blocks × block_size rows
    KV = [ context (ctx_len) | the same blocks ]: ctx_len + n_blocks × block_size columns

Rule (TRAINER_SPEC.md, "Drafter architecture"): a query in block i (anchor a_i) sees

* context positions kv < a_i — strictly before its anchor, because at inference the
  anchor's own target hidden state is not available yet;
* every position of its own block, both directions;
* nothing else: no other block, no context at or after its anchor.

A sliding-window layer (``window`` W, the drafter's ``sliding_attention`` layers) narrows
both parts as SpecForge's DFlash trainer does (specforge/algorithms/common/
dflash_family_model.py): the query at slot o of a block (position a_i + o) sees context
kv with a_i + o − (W − 1) ≤ kv < a_i (its own slot counts in the window), and the slots
0..o of its own block — causal inside the block.

A block whose ``keep`` flag is False (padding: the sequence had fewer valid anchors) sees
only its own block, so its rows are never fully masked (no NaN path); its loss weight is 0.
Context padding is handled by the rule itself: padded context positions lie at or after
the sequence's length, and every real anchor is below it.

Forms: :func:`dflash_mask_mod` (flex_attention's mask_mod: the reference step's block mask
and each chunk's mask in the chunked step), :func:`dense_dflash_mask` (an explicit boolean
tensor for SDPA: CPU runs and tests, where flex_attention has no backward), and
:func:`visible_pairs` (the work a block-sparse kernel does, for FLOP counts). The tests
check the mask_mod and the dense tensor against each other and against the rule pair by pair.

On CUDA flex_attention is compiled (block-sparse: tiles with no visible pair are skipped, so
the cost follows the visible area — roughly Σ a_i·B for the context plus B² per block — not
Q × KV); on CPU it runs eagerly, forward only.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "dflash_mask_mod",
    "dense_dflash_mask",
    "make_dflash_block_mask",
    "visible_pairs",
    "flex_attention_fn",
]


def dflash_mask_mod(anchors: torch.Tensor, ctx_len: int, block_size: int,
                    keep: Optional[torch.Tensor] = None, window: Optional[int] = None):
    """The mask_mod ``(b, h, q, kv) -> bool`` for flex_attention / create_block_mask.

    anchors: [batch, n_blocks] long, absolute positions of each block's slot 0.
    ctx_len: length of the (possibly padded) context part of KV.
    keep:    [batch, n_blocks] bool, False for padded blocks (optional).
    window:  sliding-window size W of the layer (None: full attention).
    """
    anchors = anchors.long()
    if keep is not None:
        keep = keep.bool()
    B = int(block_size)
    S = int(ctx_len)

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // B
        a = anchors[b, blk]
        ctx_ok = (kv_idx < S) & (kv_idx < a)
        if keep is not None:
            ctx_ok = ctx_ok & keep[b, blk]
        own = (kv_idx >= S) & ((kv_idx - S) // B == blk)
        if window is not None:
            off = q_idx % B
            ctx_ok = ctx_ok & (kv_idx >= a + off - (window - 1))
            own = own & ((kv_idx - S) % B <= off)
        return ctx_ok | own

    return mask_mod


def dense_dflash_mask(anchors: torch.Tensor, ctx_len: int, block_size: int,
                      keep: Optional[torch.Tensor] = None, window: Optional[int] = None) -> torch.Tensor:
    """The same rule as an explicit boolean tensor [batch, Q, KV] on the anchors' device:
    query row r belongs to block i = r // B (anchor a_i) at slot o = r % B; context column
    j is visible iff j < a_i and the block is kept (and, sliding, j ≥ a_i + o − (W − 1));
    block column S + c iff c // B == i (and, sliding, c % B ≤ o)."""
    b, n = anchors.shape
    dev = anchors.device
    rows = torch.arange(n * block_size, device=dev)
    q_blk, q_off = rows // block_size, rows % block_size  # [Q]
    a_q = anchors[:, q_blk]  # [b, Q]
    col = torch.arange(ctx_len, device=dev)[None, None, :]
    ctx_ok = col < a_q[:, :, None]
    if window is not None:
        ctx_ok = ctx_ok & (col >= (a_q + q_off - (window - 1))[:, :, None])
    if keep is not None:
        ctx_ok = ctx_ok & keep.bool()[:, q_blk][:, :, None]
    own = q_blk[:, None] == q_blk[None, :]
    if window is not None:
        own = own & (q_off[None, :] <= q_off[:, None])
    return torch.cat([ctx_ok, own.expand(b, -1, -1)], dim=2)


def make_dflash_block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int,
                           keep: Optional[torch.Tensor] = None, *, window: Optional[int] = None,
                           q_block: int = 128, kv_block: int = 128,
                           compile: Optional[bool] = None):
    """A flex_attention ``BlockMask`` for the DFlash layout (heads broadcast).

    On CUDA ``compile`` defaults to True (create_block_mask builds the sparse tile index
    on the GPU without materialising Q × KV); on CPU it defaults to False.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    bsz, n = anchors.shape
    q_len = n * block_size
    kv_len = ctx_len + n * block_size
    device = anchors.device
    if compile is None:
        compile = device.type == "cuda"
    mod = dflash_mask_mod(anchors, ctx_len, block_size, keep, window)
    return create_block_mask(mod, bsz, None, q_len, kv_len, device=device,
                             BLOCK_SIZE=(q_block, kv_block), _compile=compile)


def visible_pairs(anchors: torch.Tensor, ctx_len: int, block_size: int,
                  keep: Optional[torch.Tensor] = None, window: Optional[int] = None) -> int:
    """Number of (query, key) pairs the mask lets through, summed over the batch: the
    attention work a fused kernel must do (FLOP counts use it; per head
    4·head_dim FLOP per pair forward)."""
    a = anchors.long().clamp(max=ctx_len)
    if window is None:
        ctx = a if keep is None else a * keep.long()
        return int(ctx.sum()) * block_size + anchors.numel() * block_size * block_size
    off = torch.arange(block_size, device=anchors.device)
    seen = torch.minimum(a[..., None], (window - 1 - off).clamp(min=0))  # [b, n, B] context keys per query
    if keep is not None:
        seen = seen * keep.long()[..., None]
    return int(seen.sum()) + anchors.numel() * block_size * (block_size + 1) // 2


_FLEX: dict = {}


def flex_attention_fn(device_type: str, dynamic: bool = False):
    """flex_attention for tensors on ``device_type``: compiled once per ``dynamic`` on CUDA
    (the fused block-sparse kernel; eager flex_attention materialises the scores), eager on
    CPU (tests, forward only)."""
    from torch.nn.attention.flex_attention import flex_attention

    compiled = device_type == "cuda"
    if (compiled, dynamic) not in _FLEX:
        _FLEX[compiled, dynamic] = torch.compile(flex_attention, dynamic=dynamic) if compiled else flex_attention
    return _FLEX[compiled, dynamic]


def direct_block_mask(anchors: torch.Tensor, keep: torch.Tensor, ctx_len: int, block_size: int, mask_mod,
                      tile: int = 128):
    """The BlockMask of one sequence's chunk of blocks under the full-attention DFlash mask,
    computed from the anchors with a few tensor operations instead of evaluating
    ``mask_mod`` over every (q, kv) pair: ``create_block_mask(_compile=True)`` spent ~40 s
    compiling at the operators' shape on an H200 (issue 29's cold launch), the larger part of
    the first step's compile. None where the layout does not tile exactly (block size not a
    divisor of ``tile``, ``ctx_len`` or the query length not a multiple of it): the caller
    falls back to create_block_mask.

    A query tile t holds blocks m·t .. m·t+m−1 (m = tile / block size). Context tile j is
    *full* when every block of the tile is kept and its anchor ≥ tile·(j+1), *partial* when
    some kept block's anchor > tile·j, else empty; the blocks' own columns fall in kv tile
    ctx_len/tile + t, always partial (block diagonal) unless a block fills the tile. The
    result equals create_block_mask's (tests/test_kernel_profile.py compares them)."""
    from torch.nn.attention.flex_attention import BlockMask

    n = anchors.shape[0]
    B = int(block_size)
    if tile % B or ctx_len % tile or (n * B) % tile:
        return None
    m = tile // B
    nq, nctx = n * B // tile, ctx_len // tile
    nk = nctx + nq
    dev = anchors.device
    a = anchors.long().view(nq, m)
    k = keep.bool().view(nq, m)
    all_kept = k.all(-1)
    full = torch.where(all_kept, a.min(-1).values // tile, 0)  # [nq] full context tiles 0..F-1
    reach = torch.where(k, a, 0).max(-1).values  # the largest kept anchor (0: none)
    part_end = (reach + tile - 1) // tile  # context tiles F..P-1 are partial
    pos = torch.arange(nk, device=dev)[None]
    n_part = part_end - full
    own = nctx + torch.arange(nq, device=dev)
    own_full = m == 1  # a block fills the tile: its own tile is full
    if own_full:
        kv_num, kv_idx = n_part, torch.where(pos < n_part[:, None], full[:, None] + pos, 0)
        f_num = full + 1
        f_idx = torch.where(pos < full[:, None], pos, torch.where(pos == full[:, None], own[:, None], 0))
    else:
        kv_num = n_part + 1
        kv_idx = torch.where(pos < n_part[:, None], full[:, None] + pos,
                             torch.where(pos == n_part[:, None], own[:, None], 0))
        f_num, f_idx = full, torch.where(pos < full[:, None], pos, 0)
    as32 = lambda t: t.to(torch.int32)[None, None]  # noqa: E731  [1, 1, nq(, nk)]
    return BlockMask.from_kv_blocks(as32(kv_num), as32(kv_idx), as32(f_num), as32(f_idx), BLOCK_SIZE=tile,
                                    mask_mod=mask_mod, seq_lengths=(n * B, ctx_len + n * B))
