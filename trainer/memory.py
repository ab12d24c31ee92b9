"""What the CUDA caching allocator will hold on each GPU of a run, predicted before anything runs.

Standard library and math only, so the controller's preflight can import it without torch.
It describes the trainer's GPU paths: the target forward of ``trainer/fast_target.py`` (run
in chunks of whole sequences, at most ``TARGET_CHUNK_TOKENS`` tokens each, into outputs
allocated once per micro-batch) and the chunked drafter step of ``trainer/fast_drafter.py``
(anchor chunks, flex attention, chunked LM head), with fp32 master weights, gradients kept
between steps and AdamW state from the first optimizer step on. ``--target-forward hf``
(transformers, unchunked) has its own target term; the unchunked ``Drafter`` + loss.py path
(``--drafter-step reference``, ~10× more activations) is not modelled.

How the prediction is built (bytes; T = tokens of the worst-case micro-batch, i.e. as many
full ``--max-seq-len`` sequences as the budget allows)

persistent        what lives from load to exit
  target_weights  bf16 layers, embedding, final norm, LM head              (family term)
  drafter_state   fp32 weights + fp32 gradients + AdamW m and v: 16 B/param — the AdamW
                  state exists only after the first optimizer step, so a one-step probe
                  under-reads by 8 B/param; the model is the steady state (step 2 on)
  frozen_head     a split drafter's own copy of the target's embedding and LM head
per micro-batch   scale with T (the only terms that do)
  taps            the tapped target states [T, n_tapped·H] bf16 (the noise is added in place)
  final           the target's final normed state [T, H] bf16 (soft labels)
  ids             input ids and loss mask, int64
  context         the drafter's context path kept for its backward: fc output and its norm
                  (4H B/token) and per draft layer the context k/v, their autograd inputs
                  and their fp32 gradient accumulators (14·kv B/token)
per chunk         bounded, whatever the budget
  target_chunk    one chunk of the target forward: residual, norm output, the MLP's gate|up
                  product and the gated product (the largest; family term)
  activations     one anchor chunk of C positions: per position per layer what backward keeps
  chunk_context   the chunk's sequence's context k/v concatenated with the block k/v
  logits          one head chunk: bf16 logits + their gradient (+ teacher logits)
  head_grad       the final-norm output and its stored gradient for one anchor chunk
  weights16       the bf16 working copies of the drafter's weights a chunk's backward needs

Phases (the allocated peak is the largest):
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

Extending to another target family (e.g. a hybrid-attention target): add a ``TargetFamily``
to ``TARGET_FAMILIES`` under its ``ModelShape.family``; the drafter side is the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from trainer.flops import QWEN3_8B, QWEN3_27B_LIKE, ModelShape

__all__ = ["ModelShape", "QWEN3_8B", "QWEN3_27B_LIKE", "RunSpec", "Prediction", "predict", "TargetFamily",
           "TARGET_FAMILIES", "ALLOCATORS", "worst_case_batch", "drafter_peak_bytes", "target_peak_bytes",
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
    """The target's own terms: weights, and the largest transient of a forward over ``tokens``
    tokens at once (bf16). ``hf_tokens_factor``: the transformers forward's extra per-token
    state (it runs unchunked and keeps its hook outputs and their concatenation)."""

    weight_bytes: Callable[[ModelShape, int, bool], int]  # (shape, layers loaded, tied) → bytes
    transient_bytes: Callable[[ModelShape, int], int]  # (shape, tokens in one forward) → bytes


def _qwen3_weights(s: ModelShape, n_layers: int, tied: bool) -> int:
    return 2 * (n_layers * (s.layer_params + s.layer_norm_params) + (1 if tied else 2) * s.vocab * s.hidden + s.hidden)


def _qwen3_transient(s: ModelShape, tokens: int) -> int:
    # the MLP of one layer is the largest moment: residual x, norm output h, gate|up [2I],
    # the gated product [I] (bf16); attention (q|k|v, q, k, v, output) is smaller for Qwen3
    return tokens * 2 * max(2 * s.hidden + 3 * s.intermediate, 2 * s.hidden + 2 * (s.q_dim + 2 * s.kv_dim))


_DENSE = TargetFamily(_qwen3_weights, _qwen3_transient)
# model_type → terms; the dense decoders the trainer's target code runs share Qwen3's
TARGET_FAMILIES: dict[str, TargetFamily] = {"qwen3": _DENSE, "qwen2": _DENSE, "llama": _DENSE}


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
    # pressure. Measured on an H200 (issue 14, docs/benchmarks.md): reserved ran 263-396 MiB
    # above the allocated peak at every one of 10 peaks from 21 to 82 GiB, colocated and
    # split, 49,152 to 196,608 tokens — a constant, not a share of the budget.
    "expandable": Allocator("expandable_segments:True", 0.0, 400 * MIB),
    # The default allocator: one cudaMalloc'd segment per large request, never merged; its
    # cached blocks are split for smaller requests, so the gap grows with the budget
    # (measured 3.7-11.2 % of the whole peak on H200s, 26 GiB at 450,560 tokens, issue 14).
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
    target_forward: str = "fast"  # "fast" (chunked) or "hf" (transformers, unchunked)
    n_drafter_ranks: int = 1
    resident_microbatches: int = 1  # micro-batches whose buffers are alive at the step's peak
    chunk_tokens: int = TARGET_CHUNK_TOKENS
    chunk_anchors: int = DRAFTER_CHUNK_ANCHORS
    head_chunk_rows: int = HEAD_CHUNK_ROWS
    allocator: Allocator = field(default_factory=lambda: ALLOCATORS["expandable"])

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
    d = s.dshape
    return (s.n_draft_layers * (d.layer_params + d.layer_norm_params) + s.taps_count * d.hidden * d.hidden
            + 2 * d.hidden)


def drafter_act_elems_per_position_layer(shape: ModelShape) -> int:
    """bf16 elements one block position keeps per drafter layer for backward: layer input
    and its norm, q before and after norm/RoPE, attention output, block k/v before and
    after norm, the post-attention residual and its norm, MLP gate, up and the gated
    product."""
    H, q, kv, I = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate
    return 4 * H + 3 * q + 4 * kv + 3 * I


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
    terms = {"target_weights": fam.weight_bytes(t, n_loaded, s.tied) if has_t else 0,
             "drafter_state": 16 * P if has_d else 0,
             "frozen_head": (1 if s.tied else 2) * t.vocab * t.hidden * 2 if s.role == "drafter" else 0,
             **{k: v * max(1, s.resident_microbatches) for k, v in buf.items()}}
    persistent = terms["target_weights"] + terms["drafter_state"] + terms["frozen_head"]
    phases = {}
    if has_t:
        if s.target_forward == "hf":
            # unchunked, all tokens at once; hook outputs and their concatenation (2 × taps)
            tgt = fam.transient_bytes(t, T) + buf["taps"]
        else:
            per = max(1, s.chunk_tokens // L)
            tgt = fam.transient_bytes(t, min(b, per) * L)
        terms["target_chunk"] = tgt
        phases["target"] = persistent + buffers + tgt
    if has_d:
        n_c = max(1, min(s.max_anchors, L - 1, s.chunk_anchors))
        C = n_c * s.block_size
        terms["context"] = T * (4 * H + s.n_draft_layers * 14 * kv)
        terms["activations"] = C * s.n_draft_layers * 2 * drafter_act_elems_per_position_layer(d)
        # per layer the sequence's context k/v concatenated with the chunk's block k/v, saved
        # for the attention backward (bf16)
        terms["chunk_context"] = s.n_draft_layers * kv * 2 * 2 * (L + C)
        terms["logits"] = min(s.head_chunk_rows, C) * t.vocab * (4 + (2 if s.soft_labels else 0))
        terms["head_grad"] = C * H * 2 * 2
        terms["weights16"] = 2 * P
        chunk = (terms["activations"] + terms["chunk_context"] + terms["logits"] + terms["head_grad"]
                 + terms["weights16"])
        phases["chunk"] = persistent + buffers + terms["context"] + chunk
        # context backward: every layer's k/v gradient cast to bf16 at once, then one layer's
        # input gradient and the context gradient being accumulated
        terms["ctx_grads"] = T * (4 * kv * s.n_draft_layers + 4 * kv + 4 * H)
        phases["ctx_bwd"] = persistent + buffers + terms["context"] + terms["ctx_grads"] + 2 * P
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
    """A drafter rank alone (bench/gpu/run_all.py, ``python -m trainer.probe``): allocated
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


# ------------------------------------------------------------------ Qwen3.5/3.6 (hybrid) targets
# A target of trainer/family.py's qwen3_5 family differs from the dense shape above in its
# layers (Gated DeltaNet and gated full attention: other parameters and transients) and in
# its drafter, whose attention widths are not the target's (family.drafter_attention). The
# terms below are structural counts like the dense ones, not yet fitted to a measurement
# (docs/benchmarks.md compares them with the H200 run).


def drafter_shape(target_config: dict, attention: str | None = None) -> ModelShape:
    """The drafter's widths as trainer/model.py's DrafterConfig.from_target builds them:
    the language model's hidden/MLP/vocabulary, the family's drafter attention."""
    from trainer import family

    text = family.text_config(target_config)
    heads, kv_heads, head_dim = family.drafter_attention(target_config, attention)
    return ModelShape(int(text["num_hidden_layers"]), int(text["hidden_size"]), heads, kv_heads, head_dim,
                      int(text["intermediate_size"]), int(text["vocab_size"]), str(text.get("_name_or_path", "")))


def hybrid_layer_params(text: dict, layer_type: str) -> int:
    """Parameters of one Qwen3.5 decoder layer (norms, conv and gates included)."""
    H, I = int(text["hidden_size"]), int(text["intermediate_size"])
    mlp = 3 * H * I + 2 * H
    if layer_type == "full_attention":
        hd = int(text.get("head_dim") or H // int(text["num_attention_heads"]))
        q, kv = int(text["num_attention_heads"]) * hd, int(text["num_key_value_heads"]) * hd
        return mlp + H * (2 * q + 2 * kv) + q * H + 2 * hd
    kd = int(text["linear_num_key_heads"]) * int(text["linear_key_head_dim"])
    hv = int(text["linear_num_value_heads"])
    vd = hv * int(text["linear_value_head_dim"])
    conv = (2 * kd + vd) * int(text.get("linear_conv_kernel_dim", 4))
    return mlp + H * (2 * kd + 2 * vd + 2 * hv) + conv + vd * H + 2 * hv + int(text["linear_value_head_dim"])


def hybrid_target_peak_bytes(target_config: dict, *, token_budget: int, max_seq_len: int, n_tapped: int = 5,
                             max_batch_size: int = 64, soft_labels: bool = False, send_buffers: int = 1,
                             last_layer: int | None = None) -> dict:
    """The trainer's target role for a Qwen3.5/3.6 target: bf16 weights of the language
    model (never the vision tower), and per token the residual stream plus the largest
    transient of a layer — the MLP's (norm out, gate|up, product) or the Gated DeltaNet's
    inside the chunk kernel (fused projection, conv output, q/k repeated to the value heads,
    fp32 gates, the WY factors w/u, the per-chunk states at chunk 64, the output) — and the
    tapped outputs with their send buffer."""
    from trainer import family

    text = family.text_config(target_config)
    types = family.target_layer_types(text)
    n = len(types) if last_layer is None else last_layer + 1
    b, L = worst_case_batch(token_budget, max_seq_len, max_batch_size)
    tokens = b * L
    H, I, V = int(text["hidden_size"]), int(text["intermediate_size"]), int(text["vocab_size"])
    params = 2 * (sum(hybrid_layer_params(text, t) for t in types[:n]) + V * H + H)
    if soft_labels:
        params += 2 * V * H
    transient = H + 3 * I
    if "linear_attention" in types[:n]:
        kd = int(text["linear_num_key_heads"]) * int(text["linear_key_head_dim"])
        hv, dk, dv = (int(text["linear_num_value_heads"]), int(text["linear_key_head_dim"]),
                      int(text["linear_value_head_dim"]))
        vd = hv * dv
        gdn = (H + (2 * kd + 2 * vd + 2 * hv) + (2 * kd + vd) + 2 * hv * dk + 2 * 2 * hv
               + hv * (dk + dv) + 2 * hv * 64 + hv * dk * dv // 64 + vd)
        transient = max(transient, gdn)
    # the dense terms for the batch geometry, the taps and the fixed share; weights and
    # activations are this family's
    out = target_peak_bytes(ModelShape(n, H, 1, 1, 1, I, V), token_budget=token_budget, max_seq_len=max_seq_len,
                            n_tapped=n_tapped, max_batch_size=max_batch_size, send_buffers=send_buffers)
    out["params"] = params
    out["activations"] = int(COEF.target_act * tokens * 2 * (2 * H + transient))
    out["total"] = out["params"] + out["activations"] + out["tapped"] + out["fixed"]
    return out


def target_peak_for(target_config: dict, shape: ModelShape, **kw) -> dict:
    """The target role's terms for this config.json: the dense model or the hybrid one."""
    from trainer import family

    if family.unsupported(target_config) is None and family.is_hybrid(target_config):
        return hybrid_target_peak_bytes(target_config, **kw)
    return target_peak_bytes(shape, **kw)


if __name__ == "__main__":  # pragma: no cover
    for shape in (QWEN3_8B, QWEN3_27B_LIKE):
        for role in ("drafter", "target", "colocated"):
            p = predict(RunSpec(shape, role, 49152, 8192, soft_labels=True))
            print(shape.name, role, p.describe())
    print(math.pi and "ok")
