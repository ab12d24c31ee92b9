"""DFlash2's within-block dynamic convolution for the chunked step, keeping only its inputs
for backward.

The forward is trainer/layers/hf_dflash.py's ``grouped_conv`` (the export's modeling file: one
formula). Through plain autograd that formula keeps, per position, the broadcast kernel
(taps × H), each shifted copy of the input and each partial sum, about six times what the
memory model counts for it; on an H200 at the operators' config the DFlash2 step held
11.9 GiB more than DFlash's where the model had 4.8 (docs/benchmarks.md, "DFlash2 against
DFlash"). Here backward recomputes the per-tap kernel from the saved input, the dynamic taps
and the base kernel, one tap at a time, so what stays between forward and backward is what
trainer/plan/memory.py counts: the input and the dynamic taps.

On CUDA the forward formula and the backward's per-tap arithmetic are each one compiled
function (static shapes, as trainer/layers/fused_ops.py's): eager, they were ~30 small kernels per
convolution and ~16,000 launches per DFlash2 step at the operators' config, the largest
share of the step's elementwise time and of its host gaps (the step's kernel profile,
docs/benchmarks.md). ``DFLASH_EAGER=1`` (trainer/layers/fused_ops.py) keeps them eager;
CPU runs are eager.
"""

from __future__ import annotations

import torch

from trainer.layers.fused_ops import EAGER, compile_once
from trainer.layers.hf_dflash import grouped_conv as _grouped_conv_formula

_COMPILED: dict = {}
_COMPILED_ON = {"cuda"}  # tests add "cpu" to check the compiled functions against the eager ones


def _on_device(fn, device: torch.device):
    return fn if device.type not in _COMPILED_ON or EAGER else compile_once(fn, _COMPILED)


class _GroupedConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dynamic, base, group_size: int, block_size: int):
        ctx.save_for_backward(x, dynamic, base)
        ctx.group_size, ctx.block_size = group_size, block_size
        # (autograd is off in here)
        return _on_device(_grouped_conv_formula, x.device)(x, dynamic, base, group_size, block_size)

    @staticmethod
    def backward(ctx, grad_out):
        x, dynamic, base = ctx.saved_tensors
        need_x, need_dyn, need_base = ctx.needs_input_grad[:3]
        return (*_on_device(_backward, x.device)(x, dynamic, base, grad_out, ctx.group_size, ctx.block_size,
                                                 need_x, need_dyn, need_base), None, None)


def _backward(x, dynamic, base, grad_out, gs: int, B: int, need_x: bool, need_dyn: bool, need_base: bool):
    b, n, H = x.shape
    taps, G = base.shape[0], H // gs
    xb = x.view(b, n // B, B, G, gs)
    gb = grad_out.reshape(b, n // B, B, G, gs).to(x.dtype)
    dyn = dynamic.reshape(b, n // B, B, taps, G)
    base_c = base.to(x.dtype).view(taps, G, gs)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    grad_x = torch.zeros_like(xb) if need_x else None
    grad_dyn = torch.zeros((b, n // B, B, taps, G), dtype=dynamic.dtype, device=x.device) if need_dyn else None
    grad_base = torch.zeros((taps, G, gs), dtype=acc, device=x.device) if need_base else None
    for tap in range(taps):
        # out[t] += (base[tap] + dyn[t, tap]) · x[t − tap] for t ≥ tap (within a block)
        if need_x:
            coef = base_c[tap] + dyn[:, :, tap:, tap, :, None]
            grad_x[:, :, :B - tap] += coef * gb[:, :, tap:]
        if need_dyn or need_base:
            prod = (gb[:, :, tap:] * xb[:, :, :B - tap]).to(acc)
            if need_dyn:
                grad_dyn[:, :, tap:, tap] = prod.sum(-1).to(dynamic.dtype)
            if need_base:
                grad_base[tap] = prod.sum((0, 1, 2))
    return (None if grad_x is None else grad_x.view(b, n, H),
            None if grad_dyn is None else grad_dyn.view(dynamic.shape),
            None if grad_base is None else grad_base.view(taps, H).to(base.dtype))


def grouped_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int,
                 block_size: int) -> torch.Tensor:
    """trainer/layers/hf_dflash.grouped_conv (x [b, n·B, H], dynamic [b, n·B, taps, H/group], base
    [taps, H]) with a backward that keeps only x, dynamic and base."""
    return _GroupedConv.apply(x, dynamic, base, int(group_size), int(block_size))

