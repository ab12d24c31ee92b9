"""Peak GPU memory per role, predicted from the configuration before anything runs.

Standard library and math only, so the controller's preflight can import it without torch.
The model describes the fast drafter step of ``trainer/fast_drafter.py`` (anchor-chunked
forward/backward, flex attention, chunked LM head) and the no-grad target forward of
``trainer/fast_target.py`` that stops after the last tapped layer. The structural counts
below, unfitted (every coefficient 1.0), matched 22 measured peaks on H200s within 3.7 %
(docs/benchmarks.md, "Memory known before launch"); re-check when either step changes — the
unchunked ``Drafter`` + loss.py path keeps ~10× more activations and is not modelled here.

Terms (bytes):

drafter role
  params      fp32 master weights of the drafter (layers, norms, fc)          4·P
  grads       fp32 gradients                                                  4·P
  optimizer   AdamW m and v, fp32                                             8·P
  weights16   bf16 working copies of the weights (autocast cache)             2·P
  frozen      target embedding + LM head, bf16                                2·2·V·H
  comm        received tapped features [tokens, n_tapped·H] bf16 (×2: the next batch
              arrives while this one trains)
  context     per token: fc output and its norm, and per layer the context k/v (saved,
              leaves and their fp32 gradients)
  activations one anchor chunk of C positions: per position per layer what backward keeps
  logit_chunk one head chunk: bf16 logits + bf16 logit gradient (+ teacher logits)
  head_grad   the head's stored ∂L/∂hidden for one anchor chunk
target role
  params      bf16 weights of layers 0..last_layer, embedding (+ norm and head when soft
              labels need target logits)
  activations residual stream and the largest per-layer transient (MLP) for the budget
  tapped      the tapped outputs [tokens, n_tapped·H] bf16, gathered, plus the send buffer
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.flops import QWEN3_8B, QWEN3_27B_LIKE, ModelShape

__all__ = ["ModelShape", "QWEN3_8B", "QWEN3_27B_LIKE", "Coefficients", "COEF",
           "worst_case_batch", "drafter_peak_bytes", "target_peak_bytes", "auto_token_budget",
           "GIB"]

GIB = 1024 ** 3


@dataclass(frozen=True)
class Coefficients:
    """Multipliers on the structural counts; 1.0 = the count as written. Fitted values
    replace these after a measurement (docs/gpu-notes.md records each fit)."""

    drafter_act: float = 1.0      # per position per layer activation elements
    drafter_ctx: float = 1.0      # per context token elements
    target_act: float = 1.0       # per token transient elements
    fixed_bytes: float = 0.0      # allocator / workspace constant per process (cuBLAS etc.)


COEF = Coefficients()


def worst_case_batch(token_budget: int, max_seq_len: int, max_batch_size: int = 64):
    """The micro-batch the probe runs: as many full-length sequences as the budget allows."""
    b = max(1, min(max_batch_size, token_budget // max_seq_len))
    return b, max_seq_len


def _drafter_params(shape: ModelShape, n_layers: int, n_tapped: int) -> int:
    return n_layers * (shape.layer_params + shape.layer_norm_params) + n_tapped * shape.hidden * shape.hidden + 2 * shape.hidden


def drafter_act_elems_per_position_layer(shape: ModelShape) -> int:
    """bf16 elements one block position keeps per drafter layer for backward: layer input
    and its norm, q before and after norm/RoPE, attention output, block k/v before and
    after norm, the post-attention residual and its norm, MLP gate, up and the gated
    product."""
    H, q, kv, I = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate
    return 4 * H + 3 * q + 4 * kv + 3 * I


def chunk_geometry(batch: int, n_anchors: int, block_size: int, chunk_positions: int):
    """Anchors per chunk and positions per chunk. fast_drafter chunks one sequence at a
    time: a chunk holds min(n_anchors, chunk_positions // block_size) anchors."""
    n_c = max(1, min(n_anchors, chunk_positions // block_size))
    return n_c, n_c * block_size


def drafter_peak_bytes(shape: ModelShape, *, n_layers: int, block_size: int, max_anchors: int,
                       max_seq_len: int, token_budget: int, n_tapped: int | None = None,
                       max_batch_size: int = 64, chunk_positions: int = 16384,
                       head_chunk_rows: int = 4096, soft_labels: bool = False,
                       double_buffer: bool = True, coef: Coefficients = COEF) -> dict:
    n_tapped = n_layers if n_tapped is None else n_tapped
    b, L = worst_case_batch(token_budget, max_seq_len, max_batch_size)
    tokens = b * L
    n_anchors = min(max_anchors, max(1, L - 1))
    n_c, C = chunk_geometry(b, n_anchors, block_size, chunk_positions)
    P = _drafter_params(shape, n_layers, n_tapped)
    H, V, kv = shape.hidden, shape.vocab, shape.kv_dim
    out = {
        "params": 4 * P,
        "grads": 4 * P,
        "optimizer": 8 * P,
        "weights16": 2 * P,
        "frozen": 2 * 2 * V * H,
        "comm": tokens * n_tapped * H * 2 * (2 if double_buffer else 1),
        # fc out + norm out (bf16) + fp32 rstd; per layer: pre-norm k, k/v leaves, fp32 grads
        "context": int(coef.drafter_ctx * tokens * (4 * H + n_layers * (2 + 4 + 8) * kv)),
        "activations": int(coef.drafter_act * C * n_layers * 2 * drafter_act_elems_per_position_layer(shape)),
        "logit_chunk": int(min(head_chunk_rows, C) * V * (4 + (2 if soft_labels else 0))),
        "head_grad": C * H * 2 * 2,  # final-norm output + stored ∂L/∂hidden
        "fixed": int(coef.fixed_bytes),
    }
    out["total"] = sum(out.values())
    out.update({"batch": b, "seq_len": L, "anchors_per_seq": n_anchors, "chunk_anchors": n_c,
                "chunk_positions": C, "drafted_positions": b * n_anchors * block_size, "trainable_params": P})
    return out


def target_peak_bytes(shape: ModelShape, *, token_budget: int, max_seq_len: int, last_layer: int | None = None,
                      n_tapped: int = 5, max_batch_size: int = 64, soft_labels: bool = False,
                      send_buffers: int = 1, coef: Coefficients = COEF) -> dict:
    b, L = worst_case_batch(token_budget, max_seq_len, max_batch_size)
    tokens = b * L
    n = shape.n_layers if last_layer is None else last_layer + 1
    H, I, q, kv = shape.hidden, shape.intermediate, shape.q_dim, shape.kv_dim
    params = 2 * (n * (shape.layer_params + shape.layer_norm_params) + shape.vocab * H + 2 * H)
    if soft_labels:
        params += 2 * shape.vocab * H
    # residual in + out, plus the largest transient: the MLP (norm out, gate, up, product)
    transient = max(H + q + 2 * kv + q + H, H + 3 * I)
    out = {
        "params": params,
        "activations": int(coef.target_act * tokens * 2 * (2 * H + transient)),
        "tapped": tokens * n_tapped * H * 2 * (1 + send_buffers),
        "fixed": int(coef.fixed_bytes),
    }
    out["total"] = sum(out.values())
    out.update({"batch": b, "seq_len": L, "tokens": tokens})
    return out


RESERVE_FRAC = {"drafter": 0.06, "target": 0.12, "colocated": 0.12}


def device_bytes_needed(allocated_peak: float, *, role: str = "drafter", reserve_frac: float | None = None,
                        context_bytes: float = 0.75 * GIB) -> float:
    """From a peak of allocated tensors (the model's unit) to what the GPU must have free:
    the caching allocator's reserve above the allocated peak (measured on H200: drafter
    3.7-4.8 %, target 5.5-11.2 % — its activations change shape layer to layer) and the
    CUDA context of the process."""
    frac = RESERVE_FRAC.get(role, 0.12) if reserve_frac is None else reserve_frac
    return allocated_peak * (1.0 + frac) + context_bytes


def auto_token_budget(*, capacity_bytes: float, margin_bytes: float, max_seq_len: int,
                      step: int = 1024, upper: int = 1 << 20, **kw) -> int:
    """Largest token budget (a multiple of ``step``, at least max_seq_len) whose predicted
    drafter peak fits under capacity − margin; 0 when not even one full-length sequence
    fits."""
    limit = capacity_bytes - margin_bytes

    def fits(budget: int) -> bool:
        return drafter_peak_bytes(max_seq_len=max_seq_len, token_budget=budget, **kw)["total"] <= limit

    lo = max_seq_len
    if not fits(lo):
        return 0
    hi = lo
    while hi < upper and fits(hi * 2):
        hi *= 2
    hi = min(upper, hi * 2)
    # budgets only change the batch in whole sequences; search multiples of step anyway
    best = lo
    a, z = lo // step, hi // step
    while a <= z:
        m = (a + z) // 2
        if fits(m * step):
            best, a = m * step, m + 1
        else:
            z = m - 1
    return best


def describe(d: dict) -> str:
    keys = [k for k in ("params", "grads", "optimizer", "weights16", "frozen", "comm", "context",
                        "activations", "tapped", "logit_chunk", "head_grad", "fixed", "total") if k in d]
    return ", ".join(f"{k} {d[k] / GIB:.2f}" for k in keys) + " GiB"


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
        d = drafter_peak_bytes(shape, n_layers=5, block_size=32, max_anchors=1024, max_seq_len=8192,
                               token_budget=49152)
        print(shape.name, "drafter:", describe(d), "| per drafted position",
              f"{(d['total']) / d['drafted_positions'] / 1e6:.3f} MB")
        t = target_peak_bytes(shape, token_budget=49152, max_seq_len=8192, last_layer=shape.n_layers - 3)
        print(shape.name, "target:", describe(t))
    print(math.pi and "ok")
