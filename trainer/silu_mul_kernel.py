"""SiLU(gate)·up of the MLP, forward and backward, as two Triton kernels (CUDA; measured on an
H100 at 0.997× the step with Inductor's, so off unless DFLASH_SILU_KERNEL=1).

The drafter's MLP computes ``silu(g) * u`` on the gate/up GEMM's output ``gu = [g | u]``
(trainer/fused_ops.py). Inductor compiles it to one pointwise kernel each way, but indexes
the flat output with a division and a remainder by the intermediate size (12,288 for
Qwen3-8B) to find g and u, and writes the backward's two halves through a ``cat``: in the
DFlash step's profile on an H200 the backward ran at about half the copy rate
(``triton_poi_fused_cat_mul_silu_silu_backward_split_0``, 58 ms over 60 calls, ~2 GB each;
bench/results/roofline/op_sources_s5_call6/). These kernels walk 2-D tiles (rows × columns of
the intermediate), so g and u of a tile are two strided loads with no index arithmetic, and
the backward writes dg and du into its two halves directly.

Arithmetic in fp32, one rounding to the output dtype, as Inductor's kernels do:
``y = g·σ(g)·u``; ``dg = dy·u·σ(g)·(1 + g·(1 − σ(g)))``, ``du = dy·g·σ(g)``.
"""

from __future__ import annotations

import os

import torch

try:  # the CPU-only trainer image has no triton; only the CUDA path launches the kernels
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the image
    triton = None

__all__ = ["silu_mul", "forward", "backward", "KERNEL", "CONFIG"]

KERNEL = os.environ.get("DFLASH_SILU_KERNEL", "0") == "1"

# (rows, columns, warps) of a tile: not yet tuned on a GPU (bench/gpu/roofline.py ``silu``)
CONFIG = (8, 512, 8)


def _rows(gu: torch.Tensor) -> torch.Tensor:
    if gu.shape[-1] % 2:
        raise ValueError(f"silu_mul takes [..., 2·I] (gate and up side by side), not a last dimension of {gu.shape[-1]}")
    return gu.reshape(-1, gu.shape[-1])


def _grid(M: int, I: int):
    bm, bn, _ = CONFIG
    return (triton.cdiv(M, bm), triton.cdiv(I, bn))


def forward(gu: torch.Tensor) -> torch.Tensor:
    """silu(g)·u of ``gu`` [..., 2·I] → [..., I] in gu's dtype (the kernel; CPU tensors under
    TRITON_INTERPRET=1 in tests)."""
    x = _rows(gu).contiguous()
    M, I = x.shape[0], x.shape[1] // 2
    y = torch.empty(M, I, dtype=gu.dtype, device=gu.device)
    bm, bn, warps = CONFIG
    if M and I:
        _fwd_kernel[_grid(M, I)](x, y, M, I, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
    return y.view(*gu.shape[:-1], I)


def backward(gu: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """∂L/∂gu [..., 2·I] from ``dy`` = ∂L/∂(silu(g)·u) [..., I]."""
    x = _rows(gu).contiguous()
    M, I = x.shape[0], x.shape[1] // 2
    d = dy.reshape(M, I).contiguous()
    dx = torch.empty_like(x)
    bm, bn, warps = CONFIG
    if M and I:
        _bwd_kernel[_grid(M, I)](x, d, dx, M, I, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
    return dx.view(gu.shape)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu):
        ctx.save_for_backward(gu)
        return forward(gu)

    @staticmethod
    def backward(ctx, dy):
        (gu,) = ctx.saved_tensors
        return backward(gu, dy)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(g)·u with autograd through the two kernels."""
    return _SiluMul.apply(gu)


if triton is not None:
    @triton.jit
    def _tile(M, I, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows < M)[:, None] & (cols < I)[None, :]
        return rows[:, None] * (2 * I) + cols[None, :], rows[:, None] * I + cols[None, :], mask

    @triton.jit
    def _fwd_kernel(x_ptr, y_ptr, M, I, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        at_x, at_y, mask = _tile(M, I, BLOCK_M, BLOCK_N)
        g = tl.load(x_ptr + at_x, mask=mask).to(tl.float32)
        u = tl.load(x_ptr + at_x + I, mask=mask).to(tl.float32)
        y = g * tl.sigmoid(g) * u
        tl.store(y_ptr + at_y, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _bwd_kernel(x_ptr, dy_ptr, dx_ptr, M, I, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        at_x, at_y, mask = _tile(M, I, BLOCK_M, BLOCK_N)
        g = tl.load(x_ptr + at_x, mask=mask).to(tl.float32)
        u = tl.load(x_ptr + at_x + I, mask=mask).to(tl.float32)
        dy = tl.load(dy_ptr + at_y, mask=mask).to(tl.float32)
        s = tl.sigmoid(g)
        dg = dy * u * s * (1.0 + g * (1.0 - s))
        du = dy * g * s
        tl.store(dx_ptr + at_x, dg.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_ptr + at_x + I, du.to(dx_ptr.dtype.element_ty), mask=mask)
