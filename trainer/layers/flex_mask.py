"""The DFlash drafter's attention mask, written once, in the forms both steps use.

Layout (per sequence of the batch, shared by every head):

    Q  = the draft blocks, concatenated:        n_blocks × block_size rows
    KV = [ context (ctx_len) | the same blocks ]: ctx_len + n_blocks × block_size columns

Rule (docs/trainer-spec.md, "Drafter architecture"): a query in block i (anchor a_i) sees

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
and each chunk's mask in the chunked step), :func:`direct_block_mask` (that mask's
BlockMask from the anchors, no compile), :func:`dense_dflash_mask` (an explicit boolean
tensor for SDPA: CPU runs and tests, where flex_attention has no backward), and
:func:`visible_pairs` (the work a block-sparse kernel does, for FLOP counts). The tests
check the mask_mod and the dense tensor against each other and against the rule pair by pair.

On CUDA flex_attention is compiled (block-sparse: tiles with no visible pair are skipped, so
the cost follows the visible area — roughly Σ a_i·B for the context plus B² per block — not
Q × KV); on CPU it runs eagerly, forward only.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch

# Rows of the block masks' query tile (the KV side stays 128). flash-attn-4's Hopper backward
# uses its wider non-causal 80-row tile only when this is a multiple of 80
# (flash_attn/cute/interface.py, _tile_size_bwd_sm90), which 640 allows at the price of
# coarser tiles (16 % more of Q × KV covered, mostly as partial tiles). On an H100 the DFlash
# step with flash-attn-4 ran 0.942× with 640 (attention backward 420 → 662 ms), the Triton
# kernels' backward 625 → 713 ms, and DFlash2's step with Triton tiles of 640 failed with an
# out-of-bounds index (docs/benchmarks.md). So 128 it stays.
Q_TILE = 128

__all__ = [
    "dflash_mask_mod",
    "dense_dflash_mask",
    "make_dflash_block_mask",
    "direct_block_mask",
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
                           q_block: Optional[int] = None, kv_block: int = 128,
                           compile: Optional[bool] = None, direct: bool = True):
    """A flex_attention ``BlockMask`` for the DFlash layout (heads broadcast).

    ``q_block`` defaults to :data:`Q_TILE`. ``direct`` (what the step uses): the tiles from the anchors
    (:func:`direct_block_mask`, no compile; ``compile`` unused). ``direct=False``: torch's
    create_block_mask, the definition the direct tiles are tested against, ``compile``
    defaulting to True on CUDA (it builds the sparse tile index on the GPU without
    materialising Q × KV, after a compile of tens of seconds) and False on CPU.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    q_block = Q_TILE if q_block is None else q_block
    bsz, n = anchors.shape
    q_len = n * block_size
    kv_len = ctx_len + n * block_size
    device = anchors.device
    mod = dflash_mask_mod(anchors, ctx_len, block_size, keep, window)
    if direct:
        return direct_block_mask(anchors, keep, ctx_len, block_size, mod, tile=(q_block, kv_block), window=window)
    if compile is None:
        compile = device.type == "cuda"
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


def flash_missing() -> str | None:
    """Why flex attention's FLASH backend (flash-attn-4's CuTe DSL kernels) cannot run here,
    one line; None when it can. Asks NVML for the GPU's compute capability, so the caller's
    process never initialises CUDA (the trainer's parent forks its ranks afterwards)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            if pynvml.nvmlDeviceGetCount() == 0:
                return "no CUDA device"
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(pynvml.nvmlDeviceGetHandleByIndex(0))
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 - no NVML, no driver: the GPU is not known
        return f"the GPU's compute capability is unknown ({type(exc).__name__}: {exc})"
    if major < 9:
        return f"the GPU's compute capability is {major}.{minor}: flash-attn-4's kernels need 9.0 (Hopper) or newer"
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn-4 is not installed"
    try:
        import cutlass  # noqa: F401  (nvidia-cutlass-dsl: the DSL the kernels are written in)
        import flash_attn.cute  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a broken install is a reason, not a crash
        return f"flash-attn-4 does not import ({type(exc).__name__}: {str(exc)[:200]})"
    return None


def flex_attention_fn(device_type: str, dynamic: bool = False):
    """flex_attention for tensors on ``device_type``: compiled once per ``dynamic`` on CUDA
    (the fused block-sparse kernel; eager flex_attention materialises the scores), eager on
    CPU (tests, forward only)."""
    from torch.nn.attention.flex_attention import flex_attention

    compiled = device_type == "cuda"
    if (compiled, dynamic) not in _FLEX:
        _FLEX[compiled, dynamic] = torch.compile(flex_attention, dynamic=dynamic) if compiled else flex_attention
    return _FLEX[compiled, dynamic]


def direct_block_mask(anchors: torch.Tensor, keep: Optional[torch.Tensor], ctx_len: int, block_size: int,
                      mask_mod, tile=128, window: Optional[int] = None):
    """The flex ``BlockMask`` of the DFlash mask (full attention, or sliding window ``window``)
    computed from the anchors with a few tensor operations instead of evaluating ``mask_mod``
    over every (q, kv) pair: ``create_block_mask(_compile=True)`` spent ~40 s compiling at the
    operators' shape on an H200 (cold launches), the larger part of the first
    step's compile. No compile, no host sync, any layout (block size, context length and
    query length need not tile).

    anchors/keep: [n] (one sequence's chunk of blocks) or [b, n]. tile: the sparse tile, an
    int or (q_tile, kv_tile).

    Each query row (block i, slot o) sees two intervals of KV (the rule in the module
    docstring): context [lo, a_i) — lo = 0, sliding max(0, a_i + o − (W − 1)); empty for a
    dropped block — and its own block's columns [S + i·B, S + i·B + w) — w = B, sliding o + 1.
    The number of visible columns of a row inside kv tile j is the overlap of those intervals
    with the tile, so per (row, kv tile) we know "any visible" and "all visible" exactly;
    a tile is full when all its rows see all of it and partial when some row sees some of it
    but it is not full — create_block_mask's own classification (padding rows and columns see
    nothing, as its padded mask does). Work: rows × kv tiles, tile² times less than the
    rows × columns create_block_mask evaluates. The tile index is ordered as create_block_mask
    orders it (stable descending sort of the tile flags), so the kernels walk the same tiles in
    the same order (tests/test_flex_mask_direct.py compares every tensor)."""
    from torch.nn.attention.flex_attention import BlockMask

    tq, tk = (tile, tile) if isinstance(tile, int) else tile
    squeeze = anchors.dim() == 1
    i32 = torch.int32  # positions < 2³¹; half the bytes of the [b, rows, kv tiles] overlaps
    a = anchors.to(i32)[None] if squeeze else anchors.to(i32)
    k = None if keep is None else (keep.bool()[None] if squeeze else keep.bool())
    bsz, n = a.shape
    B, S = int(block_size), int(ctx_len)
    Q, KV = n * B, S + n * B
    nq, nk = -(-Q // tq), -(-KV // tk)
    dev = a.device
    r = torch.arange(nq * tq, device=dev, dtype=i32)
    real = r < Q  # rows past Q pad the last query tile: they see nothing
    blk, off = (r // B).clamp(max=n - 1), r % B
    a_r = a[:, blk.long()]  # [b, rows]
    hi = torch.where(real, a_r.clamp(max=S), 0)
    if k is not None:
        hi = torch.where(k[:, blk.long()], hi, 0)
    lo = torch.zeros_like(hi) if window is None else (a_r + off - (int(window) - 1)).clamp(min=0)
    own_lo = S + blk * B
    own_hi = torch.where(real, own_lo + (B if window is None else off + 1), own_lo)
    x0 = torch.arange(nk, device=dev, dtype=i32) * tk  # kv tile j holds columns x0 .. x0 + tk − 1
    x1 = x0 + tk

    def overlap(lo_, hi_):  # [b or 1, rows] intervals against every kv tile: [b, rows, nk]
        return (torch.minimum(hi_[..., None], x1) - torch.maximum(lo_[..., None], x0)).clamp(min=0)

    seen = overlap(lo, hi) + overlap(own_lo[None], own_hi[None])  # the two intervals never overlap
    seen = seen.view(bsz, nq, tq, nk)
    full = (seen == tk).all(2)  # [b, nq, nk]
    part = (seen > 0).any(2) & ~full

    def ordered(flags):  # create_block_mask's order: the set tiles first, ascending, then the rest
        f = flags.to(torch.int32)[:, None]
        idx = torch.argsort(f, dim=-1, descending=True, stable=True)
        return f.sum(-1, dtype=torch.int32), idx.to(torch.int32)

    kv_num, kv_idx = ordered(part)
    f_num, f_idx = ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, f_num, f_idx, BLOCK_SIZE=(tq, tk), mask_mod=mask_mod,
                                    seq_lengths=(Q, KV))
