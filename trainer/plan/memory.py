"""What the CUDA caching allocator will hold on each GPU of a run, predicted before anything runs.

Standard library and math only, so the controller's preflight can import it without torch.
It describes the trainer's GPU paths: the target forward of ``trainer/gpu/fast_target.py`` (run
in chunks of whole sequences, at most ``TARGET_CHUNK_TOKENS`` tokens each, into outputs
allocated once per micro-batch) or, for a Qwen3.5/3.6 (hybrid Gated DeltaNet) target, of
``trainer/gpu/fast_hybrid.py`` (the whole micro-batch at once), and the chunked drafter step of
``trainer/gpu/fast_drafter.py`` (anchor chunks, flex attention, chunked LM head), with fp32
master weights, gradients kept between steps and AdamW state from the first optimizer step
on. ``--target-forward hf`` (transformers, unchunked) has its own target term; the
unchunked ``Drafter`` + loss.py path (``--drafter-step reference``, ~10× more activations)
is not modelled. The drafter has the target's hidden, MLP and vocabulary widths and its own
attention widths (``RunSpec.drafter``: a Qwen3.5/3.6 target's public drafters have 32/8 ×
128 heads, trainer/family.py); its sliding-window layers change the attention mask only,
not what is stored.

How the prediction is built (bytes; T = tokens of the worst-case micro-batch, i.e. as many
full ``--max-seq-len`` sequences as the budget allows)

persistent        what lives from load to exit
  target_weights  bf16 layers, embedding, final norm, LM head of the language model (never
                  a vision tower)                                            (family term);
                  with ``--target-precision fp8`` the decoder's linear layers at 1 B/param
                  plus an fp32 scale per output channel (embedding, norms, head stay bf16)
  drafter_state   fp32 weights + fp32 gradients + AdamW m and v: 16 B/param — the AdamW
                  state exists only after the first optimizer step, so a one-step probe
                  under-reads by 8 B/param; the model is the steady state (step 2 on)
  frozen_head     a split drafter's own copy of the target's embedding and LM head
  teacher_head8   --target-precision fp8 with soft labels: the head's e4m3 copy for the
                  teacher's logits (1 B per weight + an fp32 scale per row), beside the bf16 one
per micro-batch   scale with T (the only terms that do)
  taps            the tapped target states [T, n_tapped·H] bf16 (the noise is added in place)
  final           the target's final normed state [T, H] bf16 (soft labels)
  ids             input ids and loss mask, int64
  context         the drafter's context path kept for its backward: fc output and its norm
                  (4H B/token) and per draft layer the context k/v, their autograd inputs
                  and their fp32 gradient accumulators (14·kv B/token)
per chunk         bounded, whatever the budget
  target_chunk    one chunk of the target forward: the largest moment of one layer — for
                  Qwen3 the MLP's residual, norm output, gate|up and product, for a hybrid
                  target a Gated DeltaNet layer inside its chunk kernel (family term). An
                  unchunked forward (hf; the hybrid fast one) takes the whole micro-batch and
                  keeps its taps as it goes: this term then grows with T
  activations     one anchor chunk of C positions: per position per layer what backward keeps
  chunk_context   the chunk's sequence's context k/v concatenated with the block k/v
  logits          one head chunk: bf16 logits + their gradient (+ teacher logits, one row
                  per slot: the trainer forms them once per distinct target position, but a
                  chunk's blocks need not overlap — sparse anchors, short sequences — so a
                  row per slot is the bound; dense anchors measure up to 3 % under it)
  head_grad       the final-norm output and its stored gradient for one anchor chunk
  weights16       the bf16 working copies of the drafter's weights a chunk's backward needs
  teacher_table8  --target-precision fp8 with soft labels: one sequence's final states in e4m3
                  with their row scales (the teacher's logits read their rows from it)
  fp8_casts       --drafter-precision fp8: the e4m3 operands of the largest block GEMM's
                  backward (torchao's row-wise recipe casts the output gradient along both axes,
                  the input along its second, the weight once per product); what the forward
                  saves is unchanged — torchao keeps the bf16 input and weight for the backward,
                  as the bf16 GEMM does — so the activations term is the same. The context
                  backward adds fc's and the context k/v's weight-gradient operands (fc forms
                  no input gradient: trainer/gpu/fp8_train.py). An assumption until a GPU probe
                  measures it

Phases (the allocated peak is the largest):
  load       an FP8 target only: the bf16 model as loaded, before its linear layers are
             quantized one by one (the drafter is built after the target)
  target     the target forward of a micro-batch: persistent + its output buffers + one chunk
  chunk      an anchor chunk's forward + backward: persistent + buffers + context + chunk terms
  ctx_bwd    the context path's backward: persistent + buffers + context + its gradients
  allreduce  several drafter ranks: the flat gradient copy all-reduced after the last backward

Reserved = allocated peak + what the allocator keeps beside it (``ALLOCATORS``): with
expandable segments (the trainer's setting, trainer/cuda_env.py) one mapped range per stream
that grows in 2 MiB pages, whose holes are reusable by any request that fits and are
unmapped again under memory pressure; fragmentation is then a fraction of the *dynamic* part
of the peak (what is allocated and freed each step), not of the budget's whole footprint.
nvidia-smi shows reserved + the CUDA context (``CONTEXT_MIB``).

Extending to another target family: add a ``TargetFamily`` to ``TARGET_FAMILIES`` under its
``ModelShape.family`` (the language model's model_type); the drafter side is the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from trainer import family
from trainer.plan.flops import QWEN3_8B, QWEN3_27B_LIKE, ModelShape

__all__ = ["ModelShape", "QWEN3_8B", "QWEN3_27B_LIKE", "RunSpec", "Prediction", "predict", "TargetFamily",
           "TARGET_FAMILIES", "hybrid_layer_params", "ALLOCATORS", "worst_case_batch", "drafter_peak_bytes", "target_peak_bytes",
           "GIB", "MIB", "TARGET_CHUNK_TOKENS", "DRAFTER_CHUNK_ANCHORS", "HEAD_CHUNK_ROWS", "CONTEXT_MIB"]

GIB = 1024 ** 3
MIB = 1024 ** 2
TARGET_CHUNK_TOKENS = 8192  # fast_target: tokens per target-forward chunk (whole sequences, at least one)
DRAFTER_CHUNK_ANCHORS = 512  # fast_drafter.step_backward's default; the trainer passes none
HEAD_CHUNK_ROWS = 4096  # chunked_head's rows of logits at a time
CONTEXT_MIB = 768  # CUDA context + libraries outside the caching allocator (nvidia-smi − reserved)


def worst_case_batch(token_budget: int, max_seq_len: int, max_batch_size: int = 64):
    """The micro-batch the model and the probe take: as many full-length sequences as fit."""
    b = max(1, min(max_batch_size, token_budget // max_seq_len))
    return b, max_seq_len


# ------------------------------------------------------------------ target families
@dataclass(frozen=True)
class TargetFamily:
    """The target's own terms (bytes, bf16). ``weight_bytes``: what it loads — the language
    model's layers, embedding, final norm and LM head. ``transient_bytes``: the largest
    moment of one layer in a forward over ``tokens`` tokens at once, residual and norm output
    included, for ``forward`` "fast" or "hf" (where the two differ). ``chunked``: its fast
    forward runs in chunks of whole sequences (trainer/gpu/fast_target.py); otherwise every
    forward takes the whole micro-batch at once."""

    weight_bytes: Callable[..., int]  # (shape, layers loaded, tied, precision="bf16") → bytes
    transient_bytes: Callable[..., int]  # (shape, tokens in one forward, forward, precision="bf16") → bytes
    chunked: bool


def fp8_saving(linear_params: int, out_channels: int) -> int:
    """Bytes an FP8 copy saves against bf16: 1 of 2 bytes per weight, less an fp32 scale per
    output channel (trainer/gpu/fp8.py)."""
    return linear_params - 4 * out_channels


def _dense_linear(s: ModelShape) -> tuple[int, int]:
    """(weights, output channels) of one dense layer's linear layers: q|k|v, o, gate|up, down."""
    return s.layer_params, s.q_dim + 2 * s.kv_dim + 2 * s.hidden + 2 * s.intermediate


def _dense_weights(s: ModelShape, n_layers: int, tied: bool, precision: str = "bf16") -> int:
    bf16 = 2 * (n_layers * (s.layer_params + s.layer_norm_params) + (1 if tied else 2) * s.vocab * s.hidden + s.hidden)
    return bf16 - (n_layers * fp8_saving(*_dense_linear(s)) if precision == "fp8" else 0)


def _dense_transient(s: ModelShape, tokens: int, forward: str, precision: str = "bf16") -> int:
    # the MLP of one layer is the largest moment: residual x, norm output h, gate|up [2I],
    # the gated product [I]; attention (q|k|v, q, k, v, output) is smaller for Qwen3; the
    # transformers forward's layers hold the same. FP8: h and the product are e4m3 (1 B; their
    # per-row scales are 4 B a token)
    if precision == "fp8":
        return tokens * (max(3 * s.hidden + 5 * s.intermediate, 3 * s.hidden + 4 * (s.q_dim + 2 * s.kv_dim)) + 8)
    return tokens * 2 * max(2 * s.hidden + 3 * s.intermediate, 2 * s.hidden + 2 * (s.q_dim + 2 * s.kv_dim))


def hybrid_layer_params(s: ModelShape, layer_type: str) -> int:
    """Parameters of one Qwen3.5/3.6 decoder layer, norms, conv and gates included: the MLP
    and both norms, then a gated full-attention mixer (q_proj gives the query and its output
    gate per head; q/k norms over the head dim) or a Gated DeltaNet one (q|k|v, z, β and
    decay projections, the short conv, A_log and dt_bias per value head, the gated norm)."""
    H = s.hidden
    mlp = s.mlp_params + 2 * H
    if layer_type == family.FULL:
        return mlp + H * (2 * s.q_dim + 2 * s.kv_dim) + s.q_dim * H + 2 * s.head_dim
    la = s.linear
    conv = (2 * la.key_dim + la.value_dim) * la.conv_kernel
    return (mlp + H * (2 * la.key_dim + 2 * la.value_dim + 2 * la.v_heads) + conv + la.value_dim * H
            + 2 * la.v_heads + la.v_dim)


def hybrid_linear(s: ModelShape, layer_type: str) -> tuple[int, int]:
    """(weights, output channels) of one Qwen3.5/3.6 layer's linear layers: the MLP, and the
    gated attention's q (query and gate) | k | v and o, or the Gated DeltaNet's
    q|k|v | z | β | a and out projections."""
    H, I = s.hidden, s.intermediate
    if layer_type == family.FULL:
        out = 2 * s.q_dim + 2 * s.kv_dim
        return s.mlp_params + H * out + s.q_dim * H, out + H + 2 * I + H
    la = s.linear
    out = 2 * la.key_dim + 2 * la.value_dim + 2 * la.v_heads
    return s.mlp_params + H * out + la.value_dim * H, out + H + 2 * I + H


def _hybrid_weights(s: ModelShape, n_layers: int, tied: bool, precision: str = "bf16") -> int:
    layers = sum(hybrid_layer_params(s, t) for t in s.layer_types[:n_layers])
    bf16 = 2 * (layers + (1 if tied else 2) * s.vocab * s.hidden + s.hidden)
    if precision != "fp8":
        return bf16
    return bf16 - sum(fp8_saving(*hybrid_linear(s, t)) for t in s.layer_types[:n_layers])


GDN_CHUNK = 64  # flash-linear-attention's chunk of the gated delta rule


def _hybrid_transient(s: ModelShape, tokens: int, forward: str, precision: str = "bf16") -> int:
    """A Gated DeltaNet layer is the largest moment (bf16 elements per token, fp32 as two):
    beside x and h, the fused projection q|k|v|z|β|a, the conv output, q and k repeated to
    the value heads, v made contiguous for the kernel, the decay (fp32) and β; inside fla's
    chunk kernel its L2-normed q and k, the cumulative decay (fp32), the solved chunk matrix,
    the WY factors w and u, every chunk's [dk, dv] state, the corrected v and the output.
    transformers' forward runs the conv and the SiLU as two passes (one more conv-sized
    tensor). The MLP (x, h, gate|up, product) is smaller for Qwen3.6-27B, the gated full
    attention smaller still; both stay in the max for other widths. FP8 makes a few of these
    e4m3 (the norm outputs); the bf16 count is kept as its bound."""
    H, I, la = s.hidden, s.intermediate, s.linear
    kd, vd, hv = la.key_dim, la.value_dim, la.v_heads
    qk = 2 * hv * la.k_dim
    conv = 2 * kd + vd
    outside = 2 * H + (conv + vd + 2 * hv) + conv + qk + vd + 3 * hv
    kernel = qk + 2 * hv + hv * GDN_CHUNK + hv * (la.k_dim + la.v_dim) + hv * la.k_dim * la.v_dim // GDN_CHUNK + 2 * vd
    gdn = outside + kernel + (conv if forward == "hf" else 0)
    return tokens * 2 * max(2 * H + 3 * I, gdn)


_DENSE = TargetFamily(_dense_weights, _dense_transient, chunked=True)
# model_type of the language model → terms. The dense decoders the trainer's target code runs
# share Qwen3's; Qwen3.5/3.6 (either layout: a vision-language config's text_config is
# qwen3_5_text, trainer/family.py) its hybrid layers, whose fast forward is not chunked
TARGET_FAMILIES: dict[str, TargetFamily] = {
    "qwen3": _DENSE, "qwen2": _DENSE, "llama": _DENSE,
    "qwen3_5_text": TargetFamily(_hybrid_weights, _hybrid_transient, chunked=False),
}


def family_of(shape: ModelShape) -> TargetFamily:
    fam = TARGET_FAMILIES.get(shape.family)
    if fam is None:
        raise ValueError(f"no memory model for target family {shape.family!r} (known: {', '.join(TARGET_FAMILIES)})")
    return fam


# ------------------------------------------------------------------ the allocator
@dataclass(frozen=True)
class Allocator:
    """Reserved above allocated, as a fraction of the dynamic part of the peak, plus a fixed
    workspace (cuBLAS/cuDNN workspaces, the small-block pool)."""

    name: str
    dynamic_frac: float
    fixed_bytes: float


ALLOCATORS = {
    # Expandable segments: holes are reused by any request that fits and unmapped under
    # pressure. Measured on an H200 (docs/benchmarks.md): reserved ran 263-396 MiB
    # above the allocated peak at every one of 10 peaks from 21 to 82 GiB, colocated and
    # split, 49,152 to 196,608 tokens — a constant, not a share of the budget.
    "expandable": Allocator("expandable_segments:True", 0.0, 400 * MIB),
    # The default allocator: one cudaMalloc'd segment per large request, never merged; its
    # cached blocks are split for smaller requests, so the gap grows with the budget
    # (measured 3.7-11.2 % of the whole peak on H200s, 26 GiB at 450,560 tokens).
    "default": Allocator("default", 0.12, 256 * MIB),
}


def allocator_of(alloc_conf: str | None) -> Allocator:
    """The model for a PYTORCH_CUDA_ALLOC_CONF value (None/empty = torch's default)."""
    conf = (alloc_conf or "").replace(" ", "").lower()
    return ALLOCATORS["expandable" if "expandable_segments:true" in conf else "default"]


# ------------------------------------------------------------------ the run on one GPU
@dataclass(frozen=True)
class RunSpec:
    """One GPU's share of a run as the memory model sees it. ``role``: "target", "drafter" or
    "colocated" (one process does both, in turn)."""

    target: ModelShape
    role: str
    token_budget: int
    seq_len: int
    max_batch_size: int = 64
    n_draft_layers: int = 5
    n_tapped: int | None = None
    block_size: int = 32
    max_anchors: int = 1024
    soft_labels: bool = False
    tied: bool = False
    drafter: ModelShape | None = None  # drafter widths, when not the target's
    target_layers: int | None = None  # layers the target loads (None: all)
    target_forward: str = "fast"  # "fast" (trainer/gpu/fast_target.py, fast_hybrid.py) or "hf" (transformers)
    n_drafter_ranks: int = 1
    resident_microbatches: int = 1  # micro-batches whose buffers are alive at the step's peak
    chunk_tokens: int = TARGET_CHUNK_TOKENS
    chunk_anchors: int = DRAFTER_CHUNK_ANCHORS
    head_chunk_rows: int = HEAD_CHUNK_ROWS
    allocator: Allocator = field(default_factory=lambda: ALLOCATORS["expandable"])
    drafter_arch: str = "dflash"  # trainer/arch.py; dflash2 adds its convolutions and selector
    target_precision: str = "bf16"  # "bf16" or "fp8" (--target-precision, resolved)
    drafter_precision: str = "bf16"  # "bf16" or "fp8" (--drafter-precision)

    @property
    def batch(self) -> int:
        return worst_case_batch(self.token_budget, self.seq_len, self.max_batch_size)[0]

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    @property
    def dshape(self) -> ModelShape:
        return self.drafter or self.target

    @property
    def taps_count(self) -> int:
        return self.n_draft_layers if self.n_tapped is None else self.n_tapped


def drafter_params(s: RunSpec) -> int:
    from trainer import arch

    d = s.dshape
    extra = arch.extra_params(d.hidden, d.vocab, s.n_draft_layers)[0] if s.drafter_arch == arch.DFLASH2 else 0
    return (s.n_draft_layers * (d.layer_params + d.layer_norm_params) + s.taps_count * d.hidden * d.hidden
            + 2 * d.hidden + extra)


def drafter_act_elems_per_position_layer(shape: ModelShape, drafter_arch: str = "dflash") -> int:
    """bf16 elements one block position keeps per drafter layer for backward: layer input
    and its norm, q before and after norm/RoPE, attention output, block k/v before and
    after norm, the post-attention residual and its norm, MLP gate, up and the gated
    product. DFlash2 (a structural count, not measured): per sublayer the convolved input
    and the sublayer output before its convolution, and both sides' dynamic taps."""
    H, q, kv, I = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate
    conv = 2 * (2 * H + 4 * H // 16) if drafter_arch == "dflash2" else 0
    return 4 * H + 3 * q + 4 * kv + 3 * I + conv


@dataclass
class Prediction:
    spec: RunSpec
    terms: dict  # name → bytes
    phases: dict  # phase → allocated bytes at its peak
    persistent: int

    @property
    def allocated(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def fragmentation(self) -> float:
        a = self.spec.allocator
        return a.dynamic_frac * (self.allocated - self.persistent) + a.fixed_bytes

    @property
    def reserved(self) -> float:
        """What torch.cuda.max_memory_reserved() should read at steady state (step 2 on)."""
        return self.allocated + self.fragmentation

    def nvidia_smi(self, context_mib: float = CONTEXT_MIB) -> float:
        return self.reserved + context_mib * MIB

    def describe(self) -> str:
        parts = [f"{k} {v / GIB:.2f}" for k, v in self.terms.items() if v]
        return (", ".join(parts) + f" GiB; peak phase {self.peak_phase}: allocated {self.allocated / GIB:.2f}, "
                f"reserved {self.reserved / GIB:.2f} GiB")


def predict(s: RunSpec) -> Prediction:
    """Terms and phase peaks for one GPU of the run ``s`` (see the module docstring)."""
    if s.role not in ("target", "drafter", "colocated"):
        raise ValueError(f"role must be target, drafter or colocated, not {s.role!r}")
    t, d = s.target, s.dshape
    fam = family_of(t)
    T, L, b = s.tokens, s.seq_len, s.batch
    H, kv = d.hidden, d.kv_dim
    has_t, has_d = s.role in ("target", "colocated"), s.role in ("drafter", "colocated")
    P = drafter_params(s)
    n_loaded = t.n_layers if s.target_layers is None else s.target_layers

    buf = {"taps": T * s.taps_count * t.hidden * 2, "final": T * t.hidden * 2 if s.soft_labels else 0,
           "ids": T * 16}
    buffers = sum(buf.values()) * max(1, s.resident_microbatches)
    fp8 = s.target_precision == "fp8"
    terms = {"target_weights": fam.weight_bytes(t, n_loaded, s.tied, s.target_precision) if has_t else 0,
             "drafter_state": 16 * P if has_d else 0,
             "frozen_head": (1 if s.tied else 2) * t.vocab * t.hidden * 2 if s.role == "drafter" else 0,
             **{k: v * max(1, s.resident_microbatches) for k, v in buf.items()}}
    terms["teacher_head8"] = t.vocab * (t.hidden + 4) if has_d and fp8 and s.soft_labels else 0
    persistent = terms["target_weights"] + terms["drafter_state"] + terms["frozen_head"] + terms["teacher_head8"]
    phases = {}
    if has_t:
        if s.target_forward == "fast" and fam.chunked:
            per = max(1, s.chunk_tokens // L)
            tgt = fam.transient_bytes(t, min(b, per) * L, "fast", s.target_precision)
        else:
            # the whole micro-batch at once, keeping each tapped layer's output as it goes and
            # concatenating them at the end: the larger of one layer's transient beside the
            # kept taps and of the concatenation (kept taps, their copy, x and h). Its final
            # state is the last h, not a separate buffer.
            tgt = max(fam.transient_bytes(t, T, s.target_forward, s.target_precision),
                      buf["taps"] + 2 * T * t.hidden * 2) - buf["final"]
        terms["target_chunk"] = tgt
        phases["target"] = persistent + buffers + tgt
        if fp8:
            # loaded in bf16, then quantized layer by layer; nothing else is on the GPU yet
            phases["load"] = fam.weight_bytes(t, n_loaded, s.tied, "bf16")
    if has_d:
        n_c = max(1, min(s.max_anchors, L - 1, s.chunk_anchors))
        C = n_c * s.block_size
        terms["context"] = T * (4 * H + s.n_draft_layers * 14 * kv)
        terms["activations"] = C * s.n_draft_layers * 2 * drafter_act_elems_per_position_layer(d, s.drafter_arch)
        # per layer the sequence's context k/v concatenated with the chunk's block k/v, saved
        # for the attention backward (bf16)
        terms["chunk_context"] = s.n_draft_layers * kv * 2 * 2 * (L + C)
        terms["logits"] = min(s.head_chunk_rows, C) * t.vocab * (4 + (2 if s.soft_labels else 0))
        terms["head_grad"] = C * H * 2 * 2
        terms["weights16"] = 2 * P
        if terms["teacher_head8"]:
            terms["teacher_table8"] = L * (t.hidden + 4)
        ctx_fp8 = 0
        if s.drafter_precision == "fp8":
            q, I = d.q_dim, d.intermediate
            gemms = [(q + 2 * kv, H), (H, q), (2 * I, H), (H, I)]  # (N, K): q|k|v, o, gate|up, down
            terms["fp8_casts"] = max(2 * C * N + C * K + 2 * N * K for N, K in gemms)
            nH = s.taps_count * t.hidden
            ctx_fp8 = max(T * (2 * H + nH) + H * nH, T * (4 * kv + H) + 2 * kv * H)
        chunk = (terms["activations"] + terms["chunk_context"] + terms["logits"] + terms["head_grad"]
                 + terms["weights16"] + terms.get("teacher_table8", 0) + terms.get("fp8_casts", 0))
        phases["chunk"] = persistent + buffers + terms["context"] + chunk
        # context backward: every layer's k/v gradient cast to bf16 at once, then one layer's
        # input gradient and the context gradient being accumulated
        terms["ctx_grads"] = T * (4 * kv * s.n_draft_layers + 4 * kv + 4 * H)
        if ctx_fp8:
            terms["fp8_ctx_casts"] = ctx_fp8
        phases["ctx_bwd"] = persistent + buffers + terms["context"] + terms["ctx_grads"] + 2 * P + ctx_fp8
        if s.n_drafter_ranks > 1:
            terms["allreduce"] = 4 * P
            phases["allreduce"] = persistent + buffers + 4 * P
    return Prediction(s, terms, phases, persistent)


# ------------------------------------------------------------------ benchmark-harness views
def drafter_peak_bytes(shape: ModelShape, *, n_layers: int, block_size: int, max_anchors: int,
                       max_seq_len: int, token_budget: int, n_tapped: int | None = None,
                       max_batch_size: int = 64, chunk_positions: int = 16384,
                       head_chunk_rows: int = HEAD_CHUNK_ROWS, soft_labels: bool = False,
                       double_buffer: bool = True, **_ignored) -> dict:
    """A drafter rank alone (``python -m trainer.gpu.probe``): allocated
    peak and its terms. ``double_buffer``: two micro-batches' buffers resident."""
    s = RunSpec(shape, "drafter", token_budget, max_seq_len, max_batch_size, n_layers, n_tapped, block_size,
                max_anchors, soft_labels, chunk_anchors=max(1, chunk_positions // block_size),
                head_chunk_rows=head_chunk_rows, resident_microbatches=2 if double_buffer else 1)
    p = predict(s)
    n_anchors = min(max_anchors, max(1, max_seq_len - 1))
    return {**p.terms, "total": p.allocated, "reserved": p.reserved, "batch": s.batch, "seq_len": max_seq_len,
            "anchors_per_seq": n_anchors, "drafted_positions": s.batch * n_anchors * block_size,
            "trainable_params": drafter_params(s)}


def target_peak_bytes(shape: ModelShape, *, token_budget: int, max_seq_len: int, last_layer: int | None = None,
                      n_tapped: int = 5, max_batch_size: int = 64, soft_labels: bool = False,
                      send_buffers: int = 1, **_ignored) -> dict:
    """A target rank alone as the benchmark harness builds it (FastTarget.random): layers
    0..last_layer and the embedding, no LM head."""
    n = shape.n_layers if last_layer is None else last_layer + 1
    s = RunSpec(shape, "target", token_budget, max_seq_len, max_batch_size, n_tapped, n_tapped,
                soft_labels=soft_labels, tied=True, target_layers=n, resident_microbatches=send_buffers)
    p = predict(s)
    return {**p.terms, "total": p.allocated, "reserved": p.reserved, "batch": s.batch, "seq_len": max_seq_len,
            "tokens": s.tokens}


if __name__ == "__main__":  # pragma: no cover
    for shape in (QWEN3_8B, QWEN3_27B_LIKE):
        for role in ("drafter", "target", "colocated"):
            p = predict(RunSpec(shape, role, 49152, 8192, soft_labels=True))
            print(shape.name, role, p.describe())
    print(math.pi and "ok")
