"""A low-precision gradient added into an fp32 accumulator, at the copy rate (CUDA).

The chunked step adds each anchor chunk's bf16 GEMM-weight gradients into the fp32 ``.grad``
of the master weights (model.StepGemmWeights) and its context k/v gradients into fp32
accumulators (fast_drafter.py). PyTorch runs an add whose operands differ in dtype through its
unrolled elementwise kernel, not the vectorised one it uses when they match: on an H200 the
weight-gradient adds of one DFlash step took 44.8 ms, against 30.2 ms for the fp32 + fp32
adds they replaced, though they move a sixth fewer bytes (docs/benchmarks.md, issue 29,
session 2026-12-05 call 8). :func:`add_` is one Triton kernel that reads both operands in wide
loads instead.

The sum is PyTorch's to the last bit: each element is ``dst + float(src)``, one fp32 addition
rounded to nearest, which is what ``dst.add_(src)`` computes for alpha 1. Anything the kernel
does not cover (CPU tensors, other dtypes, layouts that are not one dense run of elements)
goes to ``dst.add_(src)``. Timed on an H100 (session 2026-12-05c): the adds took about 8 ms
less a DFlash step, inside the step's run-to-run spread (1.000×), so it stays off:
DFLASH_ADD_KERNEL=1 turns it on, bench/gpu/roofline.py's ``--before addkernel`` measures it.
"""

from __future__ import annotations

import os

import torch

try:  # the CPU-only trainer image has no triton; only the CUDA path launches the kernel
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the image
    triton = None

__all__ = ["add_", "kernel_add_", "one_run", "KERNEL", "BLOCK", "WARPS"]

KERNEL = os.environ.get("DFLASH_ADD_KERNEL", "0") == "1"

# elements per program and its warps: 16 per thread, two 16-byte bf16 loads and four 16-byte
# fp32 loads each (chosen by the copy kernels' usual shape, not yet tuned on a GPU)
BLOCK = 4096
WARPS = 8

_SOURCES = (torch.bfloat16, torch.float16)


def _covered(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (dst.dtype == torch.float32 and src.dtype in _SOURCES and dst.shape == src.shape
            and dst.device == src.device and one_run(dst) and _same_order(dst, src))


def one_run(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements are one gap-free run of memory from its data pointer (contiguous,
    or a permutation of contiguous: the context k/v are [b, S, nkv, hd] seen as [b, nkv, S, hd])."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _same_order(a: torch.Tensor, b: torch.Tensor) -> bool:
    return all(x == y for size, x, y in zip(a.shape, a.stride(), b.stride()) if size > 1)


def add_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst += src`` in place; returns ``dst``. On CUDA an fp32 ``dst`` and a bf16/fp16 ``src``
    of the same shape and memory order, ``dst`` one run of memory, take the Triton kernel (it
    walks both as flat arrays); everything else ``dst.add_(src)``. The result is the same
    either way."""
    if KERNEL and triton is not None and dst.is_cuda and _covered(dst, src):
        return _launch(dst, src)
    return dst.add_(src)


def kernel_add_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """The kernel itself, on any tensors it covers (CPU ones under TRITON_INTERPRET=1: tests)."""
    if not _covered(dst, src):
        raise ValueError(f"kernel_add_ takes an fp32 dst in one run of memory and a bf16/fp16 src of its shape "
                         f"and memory order, "
                         f"not {dst.dtype} {tuple(dst.shape)} and {src.dtype} {tuple(src.shape)}")
    return _launch(dst, src)


def _launch(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    n = dst.numel()
    if n:
        _add_kernel[(triton.cdiv(n, BLOCK),)](dst, src, n, BLOCK=BLOCK, num_warps=WARPS)
    return dst


if triton is not None:
    @triton.jit
    def _add_kernel(dst_ptr, src_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        d = tl.load(dst_ptr + offs, mask=mask)
        s = tl.load(src_ptr + offs, mask=mask).to(tl.float32)
        tl.store(dst_ptr + offs, d + s, mask=mask)
