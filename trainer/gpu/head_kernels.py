"""The LM head's two passes over a chunk's logits as hand-written Triton kernels (CUDA only;
trainer/gpu/chunked_head.py's reference functions stay the CPU path and the definition).

The step's kernel profile put the head's elementwise passes at 1.14 TB/s against 4.21: Inductor's
statistics reduction (logsumexp of z, of z/T and of the teacher's z_t/T, the KL, the argmax and
the target's logit) walked each 151,936-wide row several times (a max pass, then a sum pass
per logsumexp, then the KL's pass after both) — 3.7 ms per head chunk for 2.4 GB.

:func:`stats` reads each row of the logits (and of the teacher's logits) once, with online
logsumexps: per block of the row the block's maximum, the running sums (kept per lane, reduced
once at the end) rescaled by exp(m_old − m_new), the next block's load issued before this one's
arithmetic. Three facts keep it to one pass and few
transcendentals:

* max(z/T) = max(z)/T for T > 0, so z/T's running maximum is z's over T (no second max);
* KL(p_t‖q) = Σ p_t·(z_t/T − z/T) − lse_t + lse_s, and Σ p_t·(z_t/T − z/T) is one more running
  sum rescaled with the teacher's maximum (no pass after the logsumexps are known);
* at T = 2, exp(z − m) = exp((z − m)/2)² (one exponential per student logit instead of two).

:func:`grad` is the gradient pass, elementwise over (row, block) tiles: it reads the logits
(and the teacher's) once more and writes ∂L/∂z in the GEMM's dtype. Same formulas as
chunked_head's ``_grad`` / ``_grad_soft``; fp32 arithmetic throughout. The vocabulary size is a
compile-time constant (one per head: the loop's trip count and the last block's mask are
static).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["stats", "stats_soft", "grad", "grad_soft", "topk", "topk_fits", "STATS_CONFIG", "GRAD_CONFIG"]

# (BLOCK, num_warps): the fastest on an H200 at the operators' chunk (3,968 × 151,936 bf16 rows),
# what the step's "after" ran (bench/drafter_step/roofline.py's ``head`` phase; docs/benchmarks.md,
# statistics 1.21 ms, gradient 0.94 ms)
STATS_CONFIG = (2048, 4)
GRAD_CONFIG = (8192, 8)


@triton.jit
def _teacher_row(trow_ptr, row, INDIRECT: tl.constexpr):
    # the teacher's logits are one row per distinct target position of the chunk (blocks
    # overlap), indexed per drafted row; or one row per drafted row
    if INDIRECT:
        return tl.load(trow_ptr + row).to(tl.int64)
    return row


@triton.jit
def _stats_kernel(z_ptr, zt_ptr, trow_ptr, tgt_ptr, lse_ptr, ce_ptr, ok_ptr, lse_s_ptr, lse_t_ptr, kl_ptr,
                  stride_z, stride_t, inv_T, V: tl.constexpr,
                  SOFT: tl.constexpr, SQUARE: tl.constexpr, BLOCK: tl.constexpr, INDIRECT: tl.constexpr):
    # One program a row, walking it block by block. The running maxima are the row's (one block
    # reduction each, the student's with its argmax); the sums stay per lane (vectors of BLOCK)
    # and are reduced once after the loop. The next block is loaded before this one is
    # worked on: a program's loop is otherwise a chain of (load latency + arithmetic) per block,
    # and with the few programs an SM holds that capped the pass at ~1.5 TB/s (measured).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    z_row = z_ptr + row * stride_z
    t_row = zt_ptr + _teacher_row(trow_ptr, row, INDIRECT) * stride_t
    neg_inf = float("-inf")
    m = tl.full((), neg_inf, tl.float32)  # running max of z (of the row)
    mt = tl.full((), neg_inf, tl.float32)  # running max of z_t/T
    s = tl.zeros((BLOCK,), tl.float32)  # per lane Σ exp(z − m)
    ss = tl.zeros((BLOCK,), tl.float32)  # Σ exp((z − m)/T)
    st = tl.zeros((BLOCK,), tl.float32)  # Σ exp(z_t/T − mt)
    at = tl.zeros((BLOCK,), tl.float32)  # Σ exp(z_t/T − mt)·(z_t/T − z/T)
    best_i = tl.zeros((), tl.int32)  # the row's first maximum so far
    x_next = tl.load(z_row + cols, mask=cols < V, other=neg_inf)
    if SOFT:
        y_next = tl.load(t_row + cols, mask=cols < V, other=neg_inf)
    for off in range(0, V, BLOCK):
        idx = off + cols
        mask = idx < V
        x = x_next.to(tl.float32)
        nxt = idx + BLOCK
        x_next = tl.load(z_row + nxt, mask=nxt < V, other=neg_inf)  # the last round loads nothing
        bm, bi = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        best_i = tl.where(bm > m, off + bi, best_i)  # strictly: the first maximum wins, as torch.argmax
        m_new = tl.maximum(m, bm)
        if SOFT:
            y = y_next.to(tl.float32) * inv_T
            y_next = tl.load(t_row + nxt, mask=nxt < V, other=neg_inf)
            es = tl.exp((x - m_new) * inv_T)
            r_s = tl.exp((m - m_new) * inv_T)
            if SQUARE:
                e = es * es
                r = r_s * r_s
            else:
                e = tl.exp(x - m_new)
                r = tl.exp(m - m_new)
            ss = ss * r_s + es
            mt_new = tl.maximum(mt, tl.max(y, 0))
            et = tl.exp(y - mt_new)
            alpha = tl.exp(mt - mt_new)
            st = st * alpha + et
            at = at * alpha + tl.where(mask, et * (y - x * inv_T), 0.0)
            mt = mt_new
        else:
            e = tl.exp(x - m_new)
            r = tl.exp(m - m_new)
        s = s * r + e
        m = m_new
    lse = m + tl.log(tl.sum(s, 0))
    tgt = tl.load(tgt_ptr + row)
    zy = tl.load(z_row + tgt).to(tl.float32)
    tl.store(lse_ptr + row, lse)
    tl.store(ce_ptr + row, lse - zy)
    tl.store(ok_ptr + row, (best_i == tgt).to(tl.int8))
    if SOFT:
        sum_t = tl.sum(st, 0)
        lse_s = m * inv_T + tl.log(tl.sum(ss, 0))
        lse_t = mt + tl.log(sum_t)
        tl.store(lse_s_ptr + row, lse_s)
        tl.store(lse_t_ptr + row, lse_t)
        tl.store(kl_ptr + row, tl.sum(at, 0) / sum_t - lse_t + lse_s)


@triton.jit
def _grad_kernel(z_ptr, zt_ptr, trow_ptr, tgt_ptr, lse_ptr, lse_s_ptr, lse_t_ptr, g_ce_ptr, g_kl_ptr, out_ptr,
                 stride_z, stride_t, stride_o, inv_T, V: tl.constexpr,
                 SOFT: tl.constexpr, BLOCK: tl.constexpr, INDIRECT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < V
    x = tl.load(z_ptr + row * stride_z + idx, mask=mask, other=0.0).to(tl.float32)
    tgt = tl.load(tgt_ptr + row)
    g_ce = tl.load(g_ce_ptr + row)
    g = (tl.exp(x - tl.load(lse_ptr + row)) - (idx == tgt).to(tl.float32)) * g_ce
    if SOFT:
        y = tl.load(zt_ptr + _teacher_row(trow_ptr, row, INDIRECT) * stride_t + idx, mask=mask,
                    other=0.0).to(tl.float32)
        q = tl.exp(x * inv_T - tl.load(lse_s_ptr + row))
        pt = tl.exp(y * inv_T - tl.load(lse_t_ptr + row))
        g += (q - pt) * (tl.load(g_kl_ptr + row) * inv_T)
    tl.store(out_ptr + row * stride_o + idx, g.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _stats(logits, teacher_logits, targets, T: float, teacher_rows=None):
    z = _rows(logits)
    R, V = z.shape
    soft = teacher_logits is not None
    zt = _rows(teacher_logits) if soft else z
    f32 = dict(dtype=torch.float32, device=z.device)
    lse, ce = torch.empty(R, **f32), torch.empty(R, **f32)
    ok = torch.empty(R, dtype=torch.int8, device=z.device)
    lse_s, lse_t, kl = (torch.empty(R, **f32) for _ in range(3)) if soft else (lse, lse, lse)
    block, warps = STATS_CONFIG
    trow = targets if teacher_rows is None else teacher_rows.contiguous()
    _stats_kernel[(R,)](z, zt, trow, targets.contiguous(), lse, ce, ok, lse_s, lse_t, kl, z.stride(0), zt.stride(0),
                        1.0 / float(T), V=V, SOFT=soft, SQUARE=float(T) == 2.0, BLOCK=block,
                        INDIRECT=teacher_rows is not None, num_warps=warps)
    correct = ok.view(torch.bool)
    return (lse, ce, correct, lse_s, lse_t, kl) if soft else (lse, ce, correct)


def stats(logits: torch.Tensor, targets: torch.Tensor):
    """chunked_head._stats: per row lse, ce, top-1 correct (fp32; correct as bool)."""
    return _stats(logits, None, targets, 1.0)


def stats_soft(logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor, T: float,
               teacher_rows: torch.Tensor | None = None):
    """chunked_head._stats_soft: lse, ce, correct, lse_s (of z/T), lse_t (of z_t/T), KL(p_t‖q).
    teacher_rows [R]: row r's teacher is teacher_logits[teacher_rows[r]] (read in place)."""
    return _stats(logits, teacher_logits, targets, T, teacher_rows)


def _grad(logits, teacher_logits, lse, lse_s, lse_t, targets, g_ce, g_kl, T: float, out_dtype, teacher_rows=None):
    z = _rows(logits)
    R, V = z.shape
    soft = teacher_logits is not None
    zt = _rows(teacher_logits) if soft else z
    out = torch.empty((R, V), dtype=out_dtype, device=z.device)
    block, warps = GRAD_CONFIG
    f = lambda t: t.contiguous().float()  # noqa: E731  (per-row scalars: tiny)
    _grad_kernel[(R, triton.cdiv(V, block))](
        z, zt, targets if teacher_rows is None else teacher_rows.contiguous(), targets.contiguous(), f(lse), f(lse_s if soft else lse), f(lse_t if soft else lse), f(g_ce),
        f(g_kl if soft else g_ce), out, z.stride(0), zt.stride(0), out.stride(0), 1.0 / float(T), V=V,
        SOFT=soft, BLOCK=block, INDIRECT=teacher_rows is not None, num_warps=warps)
    return out


def grad(logits, lse, targets, g_ce, out_dtype: torch.dtype):
    """chunked_head._grad: g_ce · (softmax(z) − onehot(target)) in ``out_dtype``."""
    return _grad(logits, None, lse, None, None, targets, g_ce, None, 1.0, out_dtype)


def grad_soft(logits, teacher_logits, lse, lse_s, lse_t, targets, g_ce, g_kl, T: float, out_dtype: torch.dtype,
              teacher_rows: torch.Tensor | None = None):
    """chunked_head._grad_soft: … + g_kl · (softmax(z/T) − softmax(z_t/T)) / T (teacher_rows as
    in :func:`stats_soft`)."""
    return _grad(logits, teacher_logits, lse, lse_s, lse_t, targets, g_ce, g_kl, T, out_dtype, teacher_rows)


# ------------------------------------------------------------------------- top-k (DFlash2)
# torch.topk(16) over a chunk's 151,936-wide rows took 4.3 ms a chunk (radix select, several
# passes, in the step's kernel profile). Here: (1) per row the maxima of BLOCK lanes and τ, the k-th
# largest of them — at least k elements of the row are ≥ τ (k distinct lanes' maxima), and few
# more (the row's top elements rarely share a lane); (2) every element ≥ τ appended to a
# per-row buffer of TOPK_CAP slots (an atomic counter per row); (3) the buffer sorted by index,
# then stably by value, descending: the k largest, ties to the lower index (deterministic,
# whatever order the atomics appended in). Rows whose count passes the buffer (ties at τ over
# TOPK_CAP elements) take torch.topk.
TOPK_CAP = 128
TOPK_CONFIG = (1024, 4)  # the lane-maxima pass: BLOCK lanes (≥ k), warps
SELECT_CONFIG = (2048, 4)


@triton.jit
def _tau_kernel(z_ptr, tau_ptr, stride_z, V: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    z_row = z_ptr + row * stride_z
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    for off in range(0, V, BLOCK):
        idx = off + cols
        best = tl.maximum(best, tl.load(z_row + idx, mask=idx < V, other=float("-inf")).to(tl.float32))
    tl.store(tau_ptr + row, tl.min(tl.topk(best, K), 0))


@triton.jit
def _select_kernel(z_ptr, tau_ptr, cnt_ptr, val_ptr, idx_ptr, stride_z, V: tl.constexpr, CAP: tl.constexpr,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < V
    x = tl.load(z_ptr + row * stride_z + idx, mask=mask, other=float("-inf")).to(tl.float32)
    sel = (x >= tl.load(tau_ptr + row)) & mask
    n = tl.sum(sel.to(tl.int32), 0)
    if n > 0:
        base = tl.atomic_add(cnt_ptr + row, n)
        pos = base + tl.cumsum(sel.to(tl.int32), 0) - 1
        keep = sel & (pos < CAP)
        tl.store(val_ptr + row * CAP + pos, x, mask=keep)
        tl.store(idx_ptr + row * CAP + pos, idx, mask=keep)


def topk_fits(k: int, V: int) -> bool:
    """Whether :func:`topk` takes this k (a power of two, at most the lanes and the buffer)."""
    return 0 < k <= min(TOPK_CONFIG[0], TOPK_CAP) and k & (k - 1) == 0 and V >= k


def topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The indices [R, k] of each row's k largest logits, largest first (ties: the lower index):
    the set torch.topk(k) gives, up to the choice among equal values at the k-th place."""
    z = _rows(logits)
    R, V = z.shape
    dev = z.device
    tau = torch.empty(R, dtype=torch.float32, device=dev)
    block, warps = TOPK_CONFIG
    _tau_kernel[(R,)](z, tau, z.stride(0), V=V, K=k, BLOCK=block, num_warps=warps)
    cnt = torch.zeros(R, dtype=torch.int32, device=dev)
    vals = torch.full((R, TOPK_CAP), float("-inf"), dtype=torch.float32, device=dev)
    idx = torch.full((R, TOPK_CAP), V, dtype=torch.int32, device=dev)  # empty slots sort last
    sblock, swarps = SELECT_CONFIG
    _select_kernel[(R, triton.cdiv(V, sblock))](z, tau, cnt, vals, idx, z.stride(0), V=V, CAP=TOPK_CAP,
                                                BLOCK=sblock, num_warps=swarps)
    idx, perm = idx.sort(dim=-1)
    _, order = vals.gather(-1, perm).sort(dim=-1, descending=True, stable=True)
    out = idx.gather(-1, order[:, :k]).long()
    over = cnt > TOPK_CAP
    if bool(over.any()):  # one host sync a chunk; rare: ties at τ past the buffer
        rows = over.nonzero().squeeze(-1)
        out[rows] = z[rows].topk(k, dim=-1).indices
    return out
