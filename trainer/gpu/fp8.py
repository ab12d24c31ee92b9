"""The frozen target's linear layers in FP8 (e4m3): weights quantized once at load with a
scale per output channel, activations quantized per row inside the op that produces them.

Why this shape (measured on one H100 at the target's own GEMM shapes, M = 8,192 tokens;
docs/benchmarks.md): ``torch._scaled_mm`` with e4m3 operands and row-wise scales runs 1.59-1.83x
bf16's rate, but quantizing the activations as a pass of their own (absmax, scale, cast in
eager PyTorch: 0.46-2.07 ms a GEMM) made six of nine shapes slower than bf16. Compiled into the
op that makes the activation — RMSNorm → per-row e4m3 before q|k|v and gate|up, SiLU·up →
the same before down, the attention output's head merge → the same before o — the gain came
back (1.31-1.68x). So every producer here returns ``(x8, scale)`` instead of its bf16 output,
and there is no stand-alone quantization pass on the fast forward.

The arithmetic, one definition (tests/test_fp8.py checks it against an fp64 reference):

* a row r of x (or an output channel of W) is stored as ``x8 = clamp(x / s, ±448)`` in e4m3
  with ``s = max(amax(|r|), AMAX_FLOOR) / 448``, so the row's largest magnitude lands on e4m3's
  largest finite value and nothing saturates except by rounding;
* ``y = (x8 @ w8ᵀ) · s_x · s_wᵀ`` with fp32 accumulation, written in the model's dtype.
  e4m3 keeps 3 mantissa bits: an element's rounding error is at most 2⁻⁴ of it (normal
  range) or 2⁻¹⁰·s (subnormal range), which bounds the GEMM's error elementwise
  (:func:`error_bound`).

The one place the GPU op is called is :func:`scaled_mm`; elsewhere (CPU tests) it is emulated
with the same arithmetic: products of e4m3 values are exact in fp32, the sum is fp32.
torchao would do the same through ``torch._scaled_mm`` and compiles the quantization into the
producer only when the whole model is compiled; the target's forward compiles its fused
pieces one by one (trainer/layers/fused_ops.py), so the producers are written here and no
dependency is added.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn as nn

from trainer.layers import fused_ops as fo

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # e4m3fn's largest finite magnitude
# An all-zero row (padding positions, a zero weight row) gets this as its amax: its scale is
# then tiny but not zero, so x / s stays 0 instead of 0/0.
AMAX_FLOOR = 1e-12
# e4m3's rounding, for the documented error: 3 mantissa bits (half an ulp = 2⁻⁴ of the value)
# in the normal range; below 2⁻⁶ the subnormal spacing is 2⁻⁹ (half: 2⁻¹⁰), in units of the scale.
REL_ROUNDING = 2.0 ** -4
SUBNORMAL_HALF_ULP = 2.0 ** -10


# ------------------------------------------------------------------ the arithmetic
def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The fp32 scale that maps ``amax`` onto ±448."""
    return amax.float().clamp(min=AMAX_FLOOR) / E4M3_MAX


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, clamped to e4m3's range (the cast's own overflow behaviour is not relied on)."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] → (x8 [..., K] e4m3, scale [..., 1] fp32): one scale per row (per token for an
    activation, per output channel for a weight [N, K])."""
    s = scale_of(x.abs().amax(-1, keepdim=True))
    return to_e4m3(x, s), s


def dequantize(x8: torch.Tensor, scale: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    return x8.to(dtype) * scale.to(dtype)


def scaled_mm(a8: torch.Tensor, sa: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor, out_dtype) -> torch.Tensor:
    """(a8 [M, K] · sa [M, 1]) @ (w8 [N, K] · sw [N, 1])ᵀ → [M, N] in ``out_dtype``. On CUDA
    ``torch._scaled_mm`` (row-wise scales: compute capability 8.9 or newer; K and N multiples
    of 16; w8 row-major, so w8ᵀ is the column-major operand it wants); elsewhere the same
    arithmetic emulated in fp32."""
    if a8.is_cuda:
        return torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sw.view(1, -1), out_dtype=out_dtype)
    return ((a8.float() @ w8.float().t()) * sa * sw.view(1, -1)).to(out_dtype)


def error_bound(x: torch.Tensor, w: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on |fp8 GEMM − exact GEMM| before the output's own rounding, from
    each operand's worst rounding (fp64): Σ_k |x−x̂|·|ŵ| + |x|·|w−ŵ| with |x−x̂| ≤
    max(2⁻⁴|x|, 2⁻¹⁰·s_x), the same for w. The fp32 accumulation's error is far below it."""
    x, w = x.double(), w.double()
    ex = torch.maximum(REL_ROUNDING * x.abs(), SUBNORMAL_HALF_ULP * sx.double())
    ew = torch.maximum(REL_ROUNDING * w.abs(), SUBNORMAL_HALF_ULP * sw.double())
    w_hat = w.abs() + ew
    return ex @ w_hat.t() + x.abs() @ ew.t()


# ------------------------------------------------------------------ weights
@dataclass
class Fp8Weight:
    """A frozen weight [N, K] as e4m3 values and one fp32 scale per output channel [N, 1];
    ``dtype`` is what its GEMM writes (the model's dtype)."""

    w8: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @classmethod
    def of(cls, w: torch.Tensor) -> "Fp8Weight":
        w8, s = quantize_rows(w)
        return cls(w8, s, w.dtype)

    @property
    def shape(self):
        return self.w8.shape

    def rows(self, lo: int, hi: int) -> "Fp8Weight":
        """Output channels lo..hi as views (a fused weight's parts)."""
        return Fp8Weight(self.w8[lo:hi], self.scale[lo:hi], self.dtype)

    def dequantized(self, dtype=torch.float64) -> torch.Tensor:
        return dequantize(self.w8, self.scale, dtype)


def cat(weights: list[Fp8Weight]) -> Fp8Weight:
    """Stacked along the output channels: per-channel scales make this equal to quantizing the
    stacked bf16 weight."""
    return Fp8Weight(torch.cat([w.w8 for w in weights]), torch.cat([w.scale for w in weights]), weights[0].dtype)


def mm(a, w: Fp8Weight) -> torch.Tensor:
    """A quantized activation ``(x8 [..., K], scale [..., 1])`` through ``w`` → [..., N]."""
    x8, sx = a
    lead = x8.shape[:-1]
    y = scaled_mm(x8.reshape(-1, x8.shape[-1]), sx.reshape(-1, 1), w.w8, w.scale, w.dtype)
    return y.view(*lead, y.shape[-1])


class Fp8Linear(nn.Module):
    """nn.Linear (no bias) over an :class:`Fp8Weight`, for the transformers forward of an FP8
    target (evaluation, ``--target-forward hf``): the activation is quantized here, as a pass
    of its own — that forward is not the fast path."""

    def __init__(self, weight: Fp8Weight):
        super().__init__()
        self.weight8 = weight
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mm(quantize_rows(x), self.weight8)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-channel"


def quantize_linears(module: nn.Module) -> int:
    """Every bias-free nn.Linear under ``module`` replaced by an :class:`Fp8Linear`, one at a
    time (the bf16 weight goes as soon as its FP8 copy exists, so the peak is the bf16 model
    plus one matrix). Returns how many."""
    n = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and child.bias is None:
            with torch.no_grad():
                setattr(module, name, Fp8Linear(Fp8Weight.of(child.weight.detach())))
            n += 1
        else:
            n += quantize_linears(child)
    return n


def weight_of(linear: nn.Module):
    """The weight a fast forward fuses: the bf16 tensor of an nn.Linear, the Fp8Weight of an
    Fp8Linear."""
    return linear.weight8 if isinstance(linear, Fp8Linear) else linear.weight


def fuse(linears, share: bool):
    """The weights of ``linears`` stacked along their outputs (bf16 tensors or Fp8Weights);
    with ``share`` the modules' own weights become views of the stacked one (memory not
    doubled, and both forwards keep computing the same numbers)."""
    parts = [weight_of(m) for m in linears]
    fp8 = isinstance(parts[0], Fp8Weight)
    fused = cat(parts) if fp8 else torch.cat(parts)
    if share:
        row = 0
        for m, p in zip(linears, parts):
            rows = p.shape[0]
            if fp8:
                m.weight8 = fused.rows(row, row + rows)
            else:
                m.weight = nn.Parameter(fused[row:row + rows], requires_grad=False)
            row += rows
    return fused


# ------------------------------------------------------------------ the teacher's logits
# With soft labels the teacher's logits are the target's final states through the frozen LM
# head ([rows, H] @ [V, H]ᵀ, the widest GEMM of the step: 151,936 columns for Qwen3). Under
# --target-precision fp8 the head gets an e4m3 copy with per-channel scales, once at load
# (:func:`Fp8Weight.of`; the bf16 head stays: the drafter's own logits and their gradient use it),
# and the final states are quantized per row once per sequence on the drafter rank, in one
# compiled pass (``quantize_table``), before the head chunks take their rows from them. The
# final state is not quantized in the target's final norm: it travels to the drafter ranks in
# bf16 and the reference loss reads it as such, and the one pass over a sequence's [S, H] states
# costs a few hundredths of the head GEMMs over them.
quantize_table = fo._maybe_compile(quantize_rows)


def take_rows(x8: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor):
    """Rows ``rows`` of a quantized table (e4m3 through its bytes: index_select of a float8
    tensor is not implemented everywhere)."""
    return x8.view(torch.uint8).index_select(0, rows).view(E4M3), scale.index_select(0, rows)


def teacher_logits(states: torch.Tensor, head: Fp8Weight) -> torch.Tensor:
    """The teacher's logits [..., V] of final states [..., H] through the FP8 head, the states
    quantized per row here (the reference step's path: trainer/loss.py)."""
    return mm(quantize_rows(states), head)


# ------------------------------------------------------------------ the producers
def _norm_q(x, w, eps: float = fo.EPS):
    return quantize_rows(fo._rms(x, w, eps))


def _add_norm_q(x, y, w, eps: float = fo.EPS):
    r = x + y
    h8, s = quantize_rows(fo._rms(r, w, eps))
    return r, (h8, s)


def _silu_mul_q(gu):
    return quantize_rows(fo._silu_mul(gu))


def _heads_q(o):
    """Attention's output [b, h, L, d] → its o-projection input [b, L, h·d], quantized in the
    copy that merges the heads (the bf16 path makes that copy too)."""
    b, h, L, d = o.shape
    return quantize_rows(o.transpose(1, 2).reshape(b, L, h * d))


def _heads(o):
    b, h, L, d = o.shape
    return o.transpose(1, 2).reshape(b, L, h * d)


def _mm_bf16(a, w):
    return a @ w.t()


# What a decoder layer of the fast forward calls, per precision: a producer gives the next
# GEMM's input (a bf16 tensor, or (e4m3, scale)) and ``mm`` consumes it. The bf16 set is
# fused_ops as the forward always used them.
BF16 = SimpleNamespace(name="bf16", norm=fo.norm, add_norm=fo.add_norm, silu_mul=fo.silu_mul, heads=_heads,
                       mm=_mm_bf16)
FP8 = SimpleNamespace(name="fp8", norm=fo._maybe_compile(_norm_q), add_norm=fo._maybe_compile(_add_norm_q),
                      silu_mul=fo._maybe_compile(_silu_mul_q), heads=fo._maybe_compile(_heads_q), mm=mm)


def ops_for(weight) -> SimpleNamespace:
    """The producer/GEMM set a layer with this weight takes."""
    return FP8 if isinstance(weight, Fp8Weight) else BF16


def runs_here(device: torch.device) -> str | None:
    """Why ``torch._scaled_mm`` with row-wise scales cannot run on ``device``, None when it
    can (one tiny GEMM tried: the capability alone does not say whether this torch build
    has the kernel). CPU: None — the emulation runs there."""
    if device.type != "cuda":
        return None
    try:
        a = torch.ones(16, 16, device=device).to(E4M3)
        s = torch.ones(16, 1, device=device)
        torch._scaled_mm(a, a.t(), scale_a=s, scale_b=s.view(1, -1), out_dtype=torch.bfloat16)
    except Exception as exc:  # noqa: BLE001 - the reason is the answer
        return f"torch._scaled_mm with row-wise scales fails here ({type(exc).__name__}: {str(exc)[:160]})"
    return None
