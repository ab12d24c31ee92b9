"""A GEMM whose weight gradient the backward GEMM itself adds into the fp32 master ``.grad``.

The chunked step (fast_drafter.py) computes with the layers' GEMM weights cast to bf16 once per
step (model.StepGemmWeights). Through autograd, each anchor chunk's backward writes every
weight's gradient as a bf16 tensor (the GEMM's fp32 sums rounded), and a hook then adds it into
the fp32 parameter's ``.grad``: about 1 G parameters × (2 bytes written, then 2 + 4 read and 4
written) per chunk, 12 chunks a step at the operators' shape. On an H200 those adds alone took
44.8 ms of a 3.59 s DFlash step (docs/benchmarks.md, issue 29, session 2026-12-05 call 8).

:func:`linear` is ``x @ w.t() + bias`` whose backward instead asks cuBLAS for
``grad += dy[:, rows].t() @ x`` with bf16 operands and an fp32 output, beta 1 (``torch.addmm``
with ``out_dtype=float32`` into the ``.grad`` itself): the add happens in the GEMM's epilogue
and no bf16 gradient exists. Megatron-LM's ``gradient_accumulation_fusion`` does the same
with its own CUDA extension. The sums are the GEMM's fp32 ones without the bf16 rounding in
between, so the gradients are more exact than the hook's, not bit-equal to them.

The first chunk of a step finds ``.grad`` None and writes it (``mm`` with the fp32 output).
A fused weight (q|k|v, gate|up) keeps one fp32 gradient matrix whose row ranges are its
parameters' ``.grad``, so each chunk adds into it with one GEMM. Where PyTorch's build
cannot run an fp32-output GEMM of bf16 operands (the check runs once per device, on 2 × 2
matrices), or on CPU, the same function computes the product in the master dtype: slower,
still exact. Timed on an H100 (docs/benchmarks.md, session 2026-12-05d): the add's 46 ms
went away, but the GEMMs' fp32 epilogue took 16 ms more and the GPU idled 20 ms more, so the
step was the same (0.999× with flash-attn-4, 1.001× with the Triton kernels) and it stays
off: DFLASH_WGRAD_INTO_GRAD=1 turns it on, bench/gpu/roofline.py's ``--before wgrad``
measures it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["ENABLED", "MasterRows", "rows_of", "linear", "accumulate", "fused_gemm_supported"]

ENABLED = os.environ.get("DFLASH_WGRAD_INTO_GRAD", "0") == "1"

_LOW = (torch.bfloat16, torch.float16)
_PROBED: dict = {}


@dataclass(frozen=True)
class MasterRows:
    """Rows ``lo:hi`` of a fused weight (or bias) that belong to parameter ``param``."""

    param: torch.Tensor
    lo: int
    hi: int


def rows_of(params: list) -> list[MasterRows]:
    """The row ranges of ``params`` stacked along their first dimension, in order."""
    out, lo = [], 0
    for p in params:
        out.append(MasterRows(p, lo, lo + p.shape[0]))
        lo += p.shape[0]
    return out


def fused_gemm_supported(device: torch.device) -> bool:
    """Whether this build runs ``addmm`` of bf16 matrices into an fp32 matrix (beta 1) on
    ``device``: CUDA only, and only builds whose ``_addmm_dtype_out_cuda`` takes an fp32 input
    (older ones require it in the operands' dtype). Checked once per device on 2 × 2 values."""
    if device.type != "cuda":
        return False
    key = str(device)
    if key not in _PROBED:
        try:
            a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device, dtype=torch.bfloat16)
            c = torch.ones(2, 2, device=device, dtype=torch.float32)
            torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
            m = torch.mm(a, a, out_dtype=torch.float32)
            want = torch.tensor([[7.0, 10.0], [15.0, 22.0]], device=device)
            _PROBED[key] = bool(torch.equal(c, want + 1) and torch.equal(m, want))
        except (RuntimeError, TypeError, NotImplementedError):
            _PROBED[key] = False
    return _PROBED[key]


def accumulate(weight_rows: list[MasterRows], bias_rows: list[MasterRows] | None,
               dy: torch.Tensor, x: torch.Tensor) -> None:
    """``param.grad += dy[:, lo:hi].t() @ x`` (and the bias's ``+= dy[:, lo:hi].sum(0)``) for each
    row range; a ``.grad`` that is None is written. ``dy`` [N, out] and ``x`` [N, in].

    Parameters that share a fused weight get one GEMM into one matrix whose row ranges are
    their ``.grad`` (views): split into a GEMM per parameter, the drafter's matmuls took 28 ms
    more a DFlash step on an H100 (docs/benchmarks.md, issue 29, session 2026-12-05d)."""
    fused = dy.dtype in _LOW and x.dtype == dy.dtype and fused_gemm_supported(dy.device)
    if all(r.param.requires_grad for r in weight_rows):
        _gemm_into(_stacked_grad(weight_rows, x.shape[1]), weight_rows, dy.t(), x, fused)
    else:  # a frozen parameter in the group: its rows are skipped, one GEMM per trained one
        for r in weight_rows:
            if r.param.requires_grad:
                _gemm_into(_stacked_grad([r], x.shape[1]), [r], dy[:, r.lo:r.hi].t(), x, fused)
    for r in bias_rows or ():
        p = r.param
        if not p.requires_grad:
            continue
        g = dy[:, r.lo:r.hi].sum(0, dtype=p.dtype)
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)


def _gemm_into(grad: torch.Tensor | None, rows: list[MasterRows], a: torch.Tensor, b: torch.Tensor,
               fused: bool) -> None:
    """``grad += a @ b`` (``grad`` None: written), then each parameter's ``.grad`` its rows of it."""
    master = rows[0].param.dtype
    if fused and master == torch.float32:
        if grad is None:
            grad = torch.mm(a, b, out_dtype=torch.float32)
        else:
            torch.addmm(grad, a, b, out_dtype=torch.float32, out=grad)
    elif grad is None:
        grad = torch.mm(a.to(master), b.to(master))
    else:
        grad.addmm_(a.to(master), b.to(master))
    base = rows[0].lo
    for r in rows:
        if r.param.grad is None or r.param.grad.data_ptr() != grad[r.lo - base].data_ptr():
            r.param.grad = grad[r.lo - base:r.hi - base]


def _stacked_grad(rows: list[MasterRows], cols: int) -> torch.Tensor | None:
    """The parameters' ``.grad`` as one [rows, cols] matrix: the one they are views of when they
    still are (an earlier chunk's GEMM made it), else a new one with their sums so far; None when no
    parameter has a gradient yet."""
    grads = [r.param.grad for r in rows]
    if all(g is None for g in grads):
        return None
    n = rows[-1].hi - rows[0].lo
    if len(rows) == 1:
        return grads[0]
    g0 = grads[0]
    if all(g is not None and g.is_contiguous() for g in grads):
        storage, off = g0.untyped_storage(), g0.storage_offset()
        if (all(g.untyped_storage().data_ptr() == storage.data_ptr()
                and g.storage_offset() == off + (r.lo - rows[0].lo) * cols for g, r in zip(grads, rows))
                and storage.nbytes() >= (off + n * cols) * g0.element_size()):
            return g0.as_strided((n, cols), (cols, 1), off)
    # not (or no longer) one matrix: something replaced a .grad (AccumulateGrad adding out of
    # place, a zero_grad that kept some): start one from the sums so far
    dtype, device = rows[0].param.dtype, rows[0].param.device
    return torch.cat([torch.zeros(r.param.shape, dtype=dtype, device=device) if g is None else g
                      for g, r in zip(grads, rows)])


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, weight_rows, bias_rows):
        ctx.save_for_backward(x, w)
        ctx.rows = weight_rows, bias_rows
        y = x @ w.t()
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = dy @ w if ctx.needs_input_grad[0] else None
        accumulate(*ctx.rows, dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1]))
        return dx, None, None, None, None


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, weight_rows: list[MasterRows],
           bias_rows: list[MasterRows] | None = None) -> torch.Tensor:
    """``x @ w.t() (+ bias)`` for a ``w`` (and ``bias``) that do not require grad, being casts of
    the master parameters in ``weight_rows`` (``bias_rows``): the backward returns x's gradient
    and adds the weight's into those parameters' ``.grad`` directly (:func:`accumulate`)."""
    return _Linear.apply(x, w, bias, weight_rows, bias_rows)
