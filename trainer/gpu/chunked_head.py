"""LM head + DFlash loss over drafted positions, in chunks: vocabulary-sized logits never
exist for more than one chunk of positions at a time.

The drafter shares the target's frozen ``lm_head`` (weight [V, H]). For P drafted positions
the naive path holds P × V logits (plus softmax and their gradients): 196,608 positions ×
151,936 × 4 bytes is 119 GB for one fp32 copy. Here the positions go through the head one
chunk of whole blocks at a time; for each chunk the forward pass

1. computes the logits (bf16 matmul, fp32 softmax), the per-position cross-entropy against
   the true token and, with soft labels, the KL to the teacher distribution at temperature T
   (teacher logits are recomputed from the target's final hidden states through the same
   frozen head — given a table of them and each slot's row, once per distinct position of the
   chunk, since overlapping blocks share positions — or taken as given);
2. asks the caller's ``loss_fn`` for the chunk's contribution to the total loss as a
   function of those per-position terms, and differentiates it (tiny autograd graph on
   [blocks, K] tensors) to get ∂L/∂ce and ∂L/∂kl per position;
3. forms ∂L/∂logits = ∂L/∂ce · (softmax(z) − onehot) + ∂L/∂kl · (softmax(z/T) − p_t)/T and
   immediately ∂L/∂hidden = ∂L/∂logits @ W, which it keeps ([P, H], bf16).

Backward then only scales the stored ∂L/∂hidden by the incoming gradient. Two head-sized
matmuls per position (the minimum with a frozen head), no recompute, peak extra memory
≈ chunk × V × 4 bytes on GPU (bf16 logits + bf16 gradient; the fp32 math is fused).

The loss must be a sum of per-chunk terms, each a function of that chunk's per-position
ce/kl only, with global normalisers fixed ahead (Σ weights, number of valid blocks). The
DFlash objective is: weights depend on position and masks (decay) or on the block's own
detached CE (D-PACE), and the CAP term is per block. trainer/loss.py's ``dflash_loss_fn``
builds that function from the spec's formulas.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

__all__ = ["chunk_spans", "chunked_head_loss", "head_ce", "naive_head_loss", "span_plan"]

LossFn = Callable[[torch.Tensor, Optional[torch.Tensor], slice], torch.Tensor]


def _stats(logits: torch.Tensor, targets: torch.Tensor):
    """One pass over bf16/fp32 logits [c, V]: lse, ce, top-1 correct (fp32 math)."""
    z = logits if logits.dtype == torch.float64 else logits.float()
    lse = torch.logsumexp(z, dim=-1)
    ce = lse - z.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    correct = z.argmax(dim=-1) == targets
    return lse, ce, correct


def _stats_soft(logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor, T: float):
    z = logits if logits.dtype == torch.float64 else logits.float()
    lse, ce, correct = _stats(logits, targets)
    zs = z / T
    lse_s = torch.logsumexp(zs, dim=-1)
    zt = teacher_logits.to(z.dtype) / T
    lse_t = torch.logsumexp(zt, dim=-1)
    log_pt = zt - lse_t.unsqueeze(-1)
    kl = (torch.exp(log_pt) * (log_pt - (zs - lse_s.unsqueeze(-1)))).sum(-1)
    return lse, ce, correct, lse_s, lse_t, kl


def _grad(logits, lse, targets, g_ce, out_dtype: torch.dtype):
    """∂L/∂z = g_ce · (softmax(z) − onehot(target)), written once in ``out_dtype``."""
    z = logits if logits.dtype == torch.float64 else logits.float()
    p = torch.exp(z - lse.unsqueeze(-1))
    iota = torch.arange(z.shape[-1], device=z.device)
    onehot = (iota.unsqueeze(0) == targets.unsqueeze(-1)).to(z.dtype)
    return ((p - onehot) * g_ce.unsqueeze(-1)).to(out_dtype)


def _grad_soft(logits, teacher_logits, lse, lse_s, lse_t, targets, g_ce, g_kl, T: float, out_dtype: torch.dtype):
    """… + g_kl · (softmax(z/T) − softmax(z_t/T)) / T."""
    z = logits if logits.dtype == torch.float64 else logits.float()
    p = torch.exp(z - lse.unsqueeze(-1))
    iota = torch.arange(z.shape[-1], device=z.device)
    onehot = (iota.unsqueeze(0) == targets.unsqueeze(-1)).to(z.dtype)
    q = torch.exp(z / T - lse_s.unsqueeze(-1))
    pt = torch.exp(teacher_logits.to(z.dtype) / T - lse_t.unsqueeze(-1))
    g = (p - onehot) * g_ce.unsqueeze(-1) + (q - pt) * (g_kl / T).unsqueeze(-1)
    return g.to(out_dtype)


def balanced_chunk_blocks(n_blocks: int, chunk_rows: int, K: int) -> int:
    """Blocks per head chunk: at most ``chunk_rows`` positions, the blocks split into chunks of
    one size (512 blocks of 31 slots at 4,096 rows: 4 × 128, not 3 × 132 + 116), so the compiled
    passes see one shape and never compile a second one for a remainder chunk."""
    per = max(1, int(chunk_rows) // K)
    n = math.ceil(n_blocks / per)
    return max(1, math.ceil(n_blocks / n))


_FNS = {}


def _gathering(f):
    """A soft pass given a teacher table and each row's index into it, for the paths that
    read the teacher row by row (CPU, compiled): the rows gathered first. The Triton kernels
    take the index and read the table in place."""
    def call(logits, teacher_logits, *rest, teacher_rows=None):
        if teacher_rows is not None:
            teacher_logits = teacher_logits.index_select(0, teacher_rows)
        return f(logits, teacher_logits, *rest)
    return call


def _fns(device: torch.device):
    """The four elementwise passes and DFlash2's top-k: on CUDA trainer/gpu/head_kernels.py's
    Triton kernels (the statistics in one read of each row; the top-k by a threshold from lane
    maxima); on CPU the functions above as they are (the definition the kernels are tested against)."""
    key = device.type
    if key not in _FNS:
        if key == "cuda":
            from trainer.gpu import head_kernels as hk

            def topk(z, k):
                return hk.topk(z, k) if hk.topk_fits(k, z.shape[-1]) else _topk(z, k)
            _FNS[key] = (hk.stats, hk.stats_soft, hk.grad, hk.grad_soft, topk)
        else:
            _FNS[key] = (_stats, _gathering(_stats_soft), _grad, _gathering(_grad_soft), _topk)
    return _FNS[key]


def _teacher_logits(table: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, dtype: torch.dtype, span,
                    fp8_head=None):
    """A chunk's teacher logits from the target states ``table`` [R, H] and each drafted row's
    index into it. With ``span`` (lo, hi), which holds every valid row's index: the logits of
    table[lo:hi] once each and each row's index into them (blocks overlap — 1,024 anchors of
    block 32 in 8,192 tokens cover each position about 4 times — so a chunk of 4,061 rows
    needs ~1,100 distinct positions); rows outside it (padding blocks, weight 0) are clamped
    in. Without: a row of logits per drafted row, index None. ``fp8_head`` (--target-precision
    fp8): ``table`` is then the pair (e4m3 states, per-row scales) and the logits are their scaled
    matmul with the head's e4m3 copy (trainer/gpu/fp8.py)."""
    if fp8_head is not None:
        from trainer.gpu import fp8

        x8, sx = table
        if span is None:
            return fp8.mm(fp8.take_rows(x8, sx, rows), fp8_head), None
        lo, hi = span
        return fp8.mm((x8[lo:hi], sx[lo:hi]), fp8_head), (rows - lo).clamp_(0, hi - lo - 1)
    if span is None:
        return table.index_select(0, rows).to(dtype) @ w.t(), None
    lo, hi = span
    return table[lo:hi].to(dtype) @ w.t(), (rows - lo).clamp_(0, hi - lo - 1)


def chunk_spans(rows: torch.Tensor, block_valid: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """Per head chunk (``chunked_head_loss``'s partition of the blocks), the least and one past
    the largest teacher row of its valid blocks: rows [..., nb, K], block_valid [..., nb] bool →
    [..., n_chunks, 2] on their device (lo ≥ hi where no block is valid). No host read, so a
    caller can fetch every chunk's spans of a step in one."""
    nb, K = rows.shape[-2:]
    cb = balanced_chunk_blocks(nb, chunk_rows, K)
    n = math.ceil(nb / cb)
    big = torch.iinfo(torch.long).max
    pad = rows.new_zeros((*rows.shape[:-2], n * cb - nb, K))  # whole chunks; padded blocks invalid
    rows = torch.cat([rows.long(), pad], -2)
    valid = torch.cat([block_valid, block_valid.new_zeros(pad.shape[:-1])], -1)
    lo = torch.where(valid, rows.amin(-1), big).unflatten(-1, (n, cb)).amin(-1)
    hi = torch.where(valid, rows.amax(-1) + 1, -big).unflatten(-1, (n, cb)).amax(-1)
    return torch.stack([lo, hi], -1)


def span_plan(spans, nb: int, chunk_rows: int, K: int) -> list:
    """``chunk_spans``' values (host lists, [n_chunks][2]) → ``teacher_spans`` for
    ``chunked_head_loss``: a chunk's (lo, hi) where it is shorter than the chunk's rows, else
    None (sparse anchors: the rows themselves are fewer than the positions they span)."""
    cb = balanced_chunk_blocks(nb, chunk_rows, K)
    out = []
    for i, (lo, hi) in enumerate(spans):
        rows = (min(nb, (i + 1) * cb) - i * cb) * K
        out.append((int(lo), int(hi)) if lo < hi and hi - lo < rows else None)
    return out


def _topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    return logits.topk(k, dim=-1).indices


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, teacher, loss_fn, chunk_blocks, temperature,
                teacher_is_logits, top_k, teacher_rows, teacher_spans, teacher_fp8):
        nb, K, H = hidden.shape
        grad_hidden = torch.empty_like(hidden)
        cand_all = torch.empty((nb, K, top_k), dtype=torch.long, device=hidden.device)
        stat_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        ce_all = hidden.new_empty((nb, K), dtype=stat_dtype)
        kl_all = None if teacher is None else hidden.new_empty((nb, K), dtype=stat_dtype)
        correct_all = torch.empty((nb, K), dtype=torch.bool, device=hidden.device)
        total = hidden.new_zeros((), dtype=stat_dtype)
        w = weight.detach()
        for i, start in enumerate(range(0, nb, chunk_blocks)):
            sl = slice(start, min(nb, start + chunk_blocks))
            h = hidden[sl].reshape(-1, H)
            t = targets[sl].reshape(-1)
            logits = h @ w.t()
            tl, trow = None, None
            if teacher is not None and teacher_rows is not None:
                tl, trow = _teacher_logits(teacher, teacher_rows[sl].reshape(-1), w, h.dtype,
                                           teacher_spans[i] if teacher_spans else None, teacher_fp8)
            elif teacher is not None:
                tsrc = teacher[sl]
                tl = tsrc.reshape(-1, tsrc.shape[-1]) if teacher_is_logits else tsrc.reshape(-1, H) @ w.t()
            stats, stats_soft, grad, grad_soft, topk = _fns(h.device)
            if tl is None:
                lse, ce, correct = stats(logits, t)
                kl = None
            else:
                lse, ce, correct, lse_s, lse_t, kl = stats_soft(logits, tl, t, temperature, teacher_rows=trow)
            n = sl.stop - sl.start
            with torch.enable_grad():
                ce_v = ce.detach().view(n, K).requires_grad_(True)
                kl_v = None if kl is None else kl.detach().view(n, K).requires_grad_(True)
                part = loss_fn(ce_v, kl_v, sl)
                leaves = [ce_v] if kl_v is None else [ce_v, kl_v]
                grads = torch.autograd.grad(part, leaves, allow_unused=True)
            g_ce = (grads[0] if grads[0] is not None else torch.zeros_like(ce_v)).reshape(-1).to(ce.dtype)
            gdt = torch.float64 if w.dtype == torch.float64 else w.dtype
            if kl_v is None:
                gz = grad(logits, lse, t, g_ce, gdt)
            else:
                g_kl = (grads[1] if grads[1] is not None else torch.zeros_like(kl_v)).reshape(-1).to(ce.dtype)
                gz = grad_soft(logits, tl, lse, lse_s, lse_t, t, g_ce, g_kl, temperature, gdt, teacher_rows=trow)
            if top_k:  # DFlash2's candidates: the slot's top-k of these same logits
                cand_all[sl] = topk(logits, top_k).view(n, K, top_k)
            del logits, tl, trow
            grad_hidden[sl] = (gz @ w).view(n, K, H).to(hidden.dtype)
            del gz
            total = total + part.detach()
            ce_all[sl] = ce.view(n, K)
            if kl_all is not None:
                kl_all[sl] = kl.view(n, K)
            correct_all[sl] = correct.view(n, K)
        ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(ce_all, correct_all, cand_all)
        if kl_all is not None:
            ctx.mark_non_differentiable(kl_all)
        return total, ce_all, kl_all, correct_all, cand_all

    @staticmethod
    def backward(ctx, g_total, *_):
        (grad_hidden,) = ctx.saved_tensors
        return (grad_hidden * g_total.to(grad_hidden.dtype),) + (None,) * 11


def chunked_head_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      loss_fn: LossFn, *, teacher: Optional[torch.Tensor] = None,
                      teacher_is_logits: bool = False, temperature: float = 1.0,
                      chunk_rows: int = 4096, top_k: int = 0, teacher_rows: Optional[torch.Tensor] = None,
                      teacher_spans: Optional[list] = None, teacher_fp8=None):
    """Total loss (scalar, differentiable w.r.t. ``hidden``) and detached per-position
    ce [nb, K], kl [nb, K] | None, correct (top-1 == target) [nb, K]; with ``top_k`` > 0 a
    fifth value, each position's top-k token ids [nb, K, top_k] (best first: DFlash2's
    candidates, taken from the logits the chunk already forms).

    hidden:  [n_blocks, K, H] drafter outputs after the final norm at the predicting slots
             (slots 1..B-1, so K = B − 1).
    weight:  [V, H] the frozen LM head (no gradient is produced for it).
    targets: [n_blocks, K] long, the true tokens x[a+k].
    teacher: soft labels, [n_blocks, K, H] final-normed target hidden states at positions
             a+k−1 (recomputed through ``weight``), or [n_blocks, K, V] logits when
             ``teacher_is_logits``. None: hard loss only; ``loss_fn`` then gets kl=None.
    loss_fn: (ce [n, K], kl [n, K] | None, blocks: slice) → this chunk's share of the loss.
    chunk_rows: positions per chunk (rounded down to whole blocks, at least one block).
    teacher_rows: [n_blocks, K] long: ``teacher`` is then a table of target states [R, H] and
             each position's teacher is its row of it (the same values as gathering them
             first); teacher_spans: per chunk ``span_plan``'s (lo, hi) or None — with a span the
             chunk's teacher logits are those of table[lo:hi], each position once.
    teacher_fp8: the head's e4m3 copy (trainer/gpu/fp8.py ``Fp8Weight``, --target-precision fp8);
             ``teacher`` is then the table quantized per row, (e4m3 [R, H], scales [R, 1]), and
             needs ``teacher_rows``.
    """
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [n_blocks, K, H], got {tuple(hidden.shape)}")
    if teacher_fp8 is not None and (teacher_rows is None or not isinstance(teacher, tuple)):
        raise ValueError("teacher_fp8 needs teacher as a quantized table (e4m3, scales) and teacher_rows")
    if teacher_rows is not None and teacher_fp8 is None and (teacher is None or teacher_is_logits or teacher.dim() != 2):
        raise ValueError("teacher_rows needs teacher as a [R, H] table of target states")
    K = hidden.shape[1]
    chunk_blocks = balanced_chunk_blocks(hidden.shape[0], chunk_rows, K)
    if teacher_spans is not None and len(teacher_spans) != math.ceil(hidden.shape[0] / chunk_blocks):
        raise ValueError(f"teacher_spans has {len(teacher_spans)} chunks, the head makes "
                         f"{math.ceil(hidden.shape[0] / chunk_blocks)}")
    out = _ChunkedHeadLoss.apply(hidden, weight, targets.long(), teacher, loss_fn, chunk_blocks,
                                 float(temperature), bool(teacher_is_logits), int(top_k),
                                 None if teacher_rows is None else teacher_rows.long(), teacher_spans, teacher_fp8)
    return out if top_k else out[:4]


@torch.no_grad()
def head_ce(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_rows: int = 4096) -> torch.Tensor:
    """Per-position cross-entropy [n_blocks, K] through the frozen head, chunked like
    ``chunked_head_loss`` and with the same statistics pass, no gradient: what D-PACE's
    detached weights need before the loss pass (fast_drafter.step_backward)."""
    nb, K, H = hidden.shape
    chunk_blocks = balanced_chunk_blocks(nb, chunk_rows, K)
    stat_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    out = hidden.new_empty((nb, K), dtype=stat_dtype)
    w = weight.detach()
    stats = _fns(hidden.device)[0]
    for start in range(0, nb, chunk_blocks):
        sl = slice(start, min(nb, start + chunk_blocks))
        _, ce, _ = stats(hidden[sl].reshape(-1, H) @ w.t(), targets[sl].reshape(-1).long())
        out[sl] = ce.view(sl.stop - sl.start, K)
    return out


def naive_head_loss(hidden, weight, targets, loss_fn, *, teacher=None, teacher_is_logits=False,
                    temperature=1.0):
    """Reference: all logits at once, plain autograd. For tests and tiny CPU runs."""
    nb, K, H = hidden.shape
    z = hidden.reshape(-1, H) @ weight.t()
    z = z if z.dtype == torch.float64 else z.float()
    ce = F.cross_entropy(z, targets.reshape(-1).long(), reduction="none").view(nb, K)
    kl = None
    if teacher is not None:
        zt = teacher.reshape(-1, teacher.shape[-1]) if teacher_is_logits else teacher.reshape(-1, H) @ weight.t()
        T = float(temperature)
        log_q = F.log_softmax(z / T, -1)
        log_pt = F.log_softmax(zt.to(z.dtype) / T, -1)
        kl = (log_pt.exp() * (log_pt - log_q)).sum(-1).view(nb, K)
    return loss_fn(ce, kl, slice(0, nb))


def head_logit_bytes(chunk_rows: int, vocab: int, soft_labels: bool) -> int:
    """Transient bytes of one head chunk on GPU (memory model): bf16 logits and the bf16
    gradient of the logits (the compiled passes fuse the fp32 math); with soft labels, the
    teacher's bf16 logits too."""
    return int(chunk_rows) * int(vocab) * (4 + (2 if soft_labels else 0))


def _selfcheck() -> float:  # pragma: no cover - quick manual check
    torch.manual_seed(0)
    h = torch.randn(5, 7, 16, dtype=torch.float64, requires_grad=True)
    W = torch.randn(50, 16, dtype=torch.float64)
    t = torch.randint(0, 50, (5, 7))
    from trainer.loss import dflash_loss_fn

    fn = dflash_loss_fn(torch.rand(5, 7, dtype=torch.float64))
    a = chunked_head_loss(h, W, t, fn, chunk_rows=14)[0]
    b = naive_head_loss(h, W, t, fn)
    return math.fabs(float(a - b))
