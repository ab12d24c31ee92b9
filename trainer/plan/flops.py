"""FLOP counts per role, from shapes only (standard library: the controller may import it).

Convention (the one the MFU figures in docs/benchmarks.md use): a multiply-add is 2 FLOP;
only matrix work is counted (projections, MLP, attention scores and values, LM head), no
norms, activations or softmax; padding is not counted (it is waste, reported separately as
padding efficiency). Backward of a trainable matmul is 2× its forward (input and weight
gradients); of a frozen one 1× (input gradient only); backward of attention is 2.5× its
forward (the fused kernels recompute scores: 5 matmuls against 2).

* target forward: every real token through layers 0..last_layer (the forward stops after
  the last tapped layer) with causal attention, plus, with soft labels, the final norm + LM
  head at the positions whose logits are shipped.
* drafter step (forward + backward): every block position (anchors × block size) through
  the drafter layers; the context path (fc over the tapped features, per-layer k/v
  projections of the context); attention over exactly the visible (query, key) pairs of
  the DFlash mask (context before the anchor plus the block itself); the frozen LM head over
  the vocabulary at the predicting slots (block size − 1 per block), forward + input
  gradient, plus the teacher logits when soft labels are recomputed on the drafter side.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

from trainer import family

__all__ = ["ModelShape", "LinearAttention", "QWEN3_8B", "QWEN3_27B_LIKE", "H200_BF16_PEAK",
           "target_forward_flops", "drafter_step_flops", "mfu"]

H200_BF16_PEAK = 989e12  # dense bf16, datasheet; the issue counts MFU against it


@dataclass(frozen=True)
class LinearAttention:
    """The Gated DeltaNet widths of a hybrid target's linear-attention layers (Qwen3.5/3.6:
    ``linear_*`` of its language model's config)."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int = 4

    @property
    def key_dim(self) -> int:
        return self.k_heads * self.k_dim

    @property
    def value_dim(self) -> int:
        return self.v_heads * self.v_dim


@dataclass(frozen=True)
class ModelShape:
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int = 151936
    name: str = ""
    family: str = "qwen3"  # the language model's model_type: which per-family terms trainer/plan/memory.py uses
    # a hybrid target's per-layer attention (family.LINEAR / family.FULL) and its Gated
    # DeltaNet widths; () and None for a dense model (every layer full attention)
    layer_types: tuple = ()
    linear: LinearAttention | None = None

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def attn_params(self) -> int:
        return 2 * self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim

    @property
    def mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    @property
    def layer_params(self) -> int:
        """Matrix parameters of one decoder layer (norms excluded: 2·hidden + 2·head_dim)."""
        return self.attn_params + self.mlp_params

    @property
    def layer_norm_params(self) -> int:
        return 2 * self.hidden + 2 * self.head_dim

    def with_layers(self, n: int) -> "ModelShape":
        return replace(self, n_layers=n)

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelShape":
        """From a transformers config object or its dict: the language model's numbers (a
        vision-language Qwen3.5/3.6 config's ``text_config``), with its layer types and
        Gated DeltaNet widths when it is a hybrid."""
        if isinstance(cfg, dict):
            cfg = family.text_config(cfg)
        g = (lambda k, d=None: cfg.get(k, d)) if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        hidden = g("hidden_size")
        heads = g("num_attention_heads")
        mt = str(g("model_type") or "qwen3")
        hybrid = isinstance(cfg, dict) and family.is_hybrid(cfg)
        linear = None
        if hybrid:
            linear = LinearAttention(int(g("linear_num_key_heads")), int(g("linear_num_value_heads")),
                                     int(g("linear_key_head_dim")), int(g("linear_value_head_dim")),
                                     int(g("linear_conv_kernel_dim", 4)))
        return cls(n_layers=g("num_hidden_layers"), hidden=hidden, n_heads=heads,
                   n_kv_heads=g("num_key_value_heads", heads), head_dim=g("head_dim") or hidden // heads,
                   intermediate=g("intermediate_size"), vocab=g("vocab_size"), name=g("_name_or_path", "") or "",
                   family=mt, layer_types=tuple(family.target_layer_types(cfg)) if hybrid else (), linear=linear)


QWEN3_8B = ModelShape(36, 4096, 32, 8, 128, 12288, 151936, "Qwen3-8B")
# Qwen3-32B's widths (hidden 5120, 64/8 heads, head_dim 128, MLP 25600) at 54 layers ≈ 27.9 B
# parameters: the "Qwen3-27B-like" target of docs/benchmarks.md.
QWEN3_27B_LIKE = ModelShape(54, 5120, 64, 8, 128, 25600, 151936, "Qwen3-27B-like")


def _causal_pairs(length: int) -> int:
    return length * (length + 1) // 2


def target_forward_flops(shape: ModelShape, lengths: Iterable[int], *, last_layer: int | None = None,
                         head_positions: int = 0) -> int:
    """Forward FLOP of the target over sequences of the given real lengths, through layers
    0..last_layer (default: all), plus the LM head at ``head_positions`` positions."""
    lengths = list(lengths)
    n = shape.n_layers if last_layer is None else last_layer + 1
    tokens = sum(lengths)
    lin = 2 * shape.layer_params * tokens * n
    attn = 4 * shape.q_dim * sum(_causal_pairs(L) for L in lengths) * n
    head = 2 * shape.hidden * shape.vocab * head_positions
    return lin + attn + head


def drafter_step_flops(shape: ModelShape, *, n_layers: int, block_size: int, n_blocks: int,
                       ctx_tokens: int, visible_ctx_pairs: int, head_positions: int | None = None,
                       n_tapped: int | None = None, teacher_positions: int = 0) -> dict:
    """Forward + backward FLOP of one drafter step.

    n_blocks: real (kept) blocks; ctx_tokens: real context tokens of the batch;
    visible_ctx_pairs: Σ over kept blocks of (anchor position) × block_size, i.e. the
    (query, context key) pairs the mask lets through; in-block pairs are added here.
    head_positions: positions with logits (default n_blocks × (block_size − 1)).
    teacher_positions: positions whose teacher logits are recomputed on the drafter side.
    """
    n_tapped = n_layers if n_tapped is None else n_tapped
    if head_positions is None:
        head_positions = n_blocks * (block_size - 1)
    positions = n_blocks * block_size
    layers = 3 * 2 * shape.layer_params * positions * n_layers
    # context path: fc (forward + weight grad; its input needs no grad) and each layer's k/v
    # projections of the context (forward + input grad + weight grad)
    fc = 2 * 2 * n_tapped * shape.hidden * shape.hidden * ctx_tokens
    ctx_kv = 3 * 2 * 2 * shape.hidden * shape.kv_dim * ctx_tokens * n_layers
    pairs = visible_ctx_pairs + n_blocks * block_size * block_size
    attention = int(3.5 * 4 * shape.q_dim * pairs) * n_layers
    head = 2 * 2 * shape.hidden * shape.vocab * head_positions + 2 * shape.hidden * shape.vocab * teacher_positions
    total = layers + fc + ctx_kv + attention + head
    return {"layers": layers, "context": fc + ctx_kv, "attention": attention, "head": head,
            "total": total, "positions": positions, "head_positions": head_positions}


def mfu(flop: float, seconds: float, peak: float = H200_BF16_PEAK) -> float:
    return flop / seconds / peak if seconds > 0 else 0.0


def gpus_per_role(total_gpus: int, target_tok_s_per_gpu: float, drafter_tok_s_per_gpu: float):
    """Split of ``total_gpus`` into (target GPUs, drafter GPUs) that maximises the pipeline's
    throughput min(n_t·T, n_d·D), with T and D the tokens per second one GPU of each role
    sustains for this target, drafter and configuration (measured, e.g. docs/benchmarks.md,
    or estimated with :func:`role_tok_s`). Returns (n_t, n_d, tokens/s of the pipeline).

    The rule behind it: n_d / n_t ≈ T / D — give the drafter as many GPUs per target GPU
    as the target is faster per token than the drafter."""
    best = (1, max(1, total_gpus - 1), 0.0)
    for n_t in range(1, total_gpus):
        n_d = total_gpus - n_t
        rate = min(n_t * target_tok_s_per_gpu, n_d * drafter_tok_s_per_gpu)
        if rate > best[2]:
            best = (n_t, n_d, rate)
    return best


def role_tok_s(shape: ModelShape, drafter: ModelShape, *, seq_len: int, anchors_per_seq: int, block_size: int,
               n_layers: int = 5, target_mfu: float = 0.62, drafter_mfu: float = 0.53,
               peak: float = H200_BF16_PEAK) -> tuple[float, float]:
    """Estimated tokens/s per GPU of each role from FLOP counts and an MFU per role (defaults:
    what the fast paths measured on an H200 for Qwen3-8B, docs/benchmarks.md)."""
    last = shape.n_layers - 3 if n_layers > 1 else shape.n_layers // 2
    t = target_forward_flops(shape, [seq_len], last_layer=last) / seq_len
    n = min(anchors_per_seq, seq_len - 1)
    d = drafter_step_flops(drafter, n_layers=n_layers, block_size=block_size, n_blocks=n, ctx_tokens=seq_len,
                           visible_ctx_pairs=n * block_size * seq_len // 2)["total"] / seq_len
    return target_mfu * peak / t, drafter_mfu * peak / d


# Per optimizer step, besides the micro-batches: fused AdamW reads weights, gradients and both
# moments and writes three of them back (28 B/param), the clip reads the gradients twice and
# zeroing writes them (12 B/param), at the copy bandwidth measured on an H200 (4.24 TB/s);
# plus the host's share (the step-end sync, events, heartbeats). 40 B/param and 5 ms give
# 15 ms for the 1.05 B-parameter 8B-width drafter; the trainer's colocated steps measured
# 8,898 tok/s at one 8,192-token sequence and 9,057 at 27: 17 ms per step, 9,064 tok/s.
OPTIMIZER_BYTES_PER_PARAM = 40
H200_COPY_BPS = 4.24e12
STEP_HOST_S = 0.005


def step_tok_s(shape: ModelShape, drafter: ModelShape, *, seq_len: int, batch: int, anchors_per_seq: int,
               block_size: int, n_layers: int, drafter_params: int, grad_accum: int = 1, n_target: int = 1,
               n_drafter: int = 1, colocated: bool = True, soft_labels: bool = False, target_last_layer: int | None = None,
               target_mfu: float = 0.62, drafter_mfu: float = 0.53, peak: float = H200_BF16_PEAK,
               copy_bps: float = H200_COPY_BPS) -> float:
    """Modelled tokens/s of the whole run at micro-batches of ``batch`` full sequences: the
    target forward and the drafter step at the MFU measured for them, plus the per-step cost
    above, amortised over ``grad_accum`` micro-batches per drafter rank. Colocated ranks do
    both in turn; split ranks overlap (the slower role sets the pace)."""
    tokens = batch * seq_len
    last = (shape.n_layers - 1) if soft_labels or target_last_layer is None else target_last_layer
    t_target = target_forward_flops(shape, [seq_len] * batch, last_layer=last) / (target_mfu * peak)
    n = min(anchors_per_seq, seq_len - 1)
    t_drafter = drafter_step_flops(drafter, n_layers=n_layers, block_size=block_size, n_blocks=n * batch,
                                   ctx_tokens=tokens, visible_ctx_pairs=n * batch * block_size * seq_len // 2,
                                   teacher_positions=n * batch * (block_size - 1) if soft_labels else 0
                                   )["total"] / (drafter_mfu * peak)
    per_step = OPTIMIZER_BYTES_PER_PARAM * drafter_params / copy_bps + STEP_HOST_S
    if colocated:
        step = grad_accum * (t_target + t_drafter) + per_step
    else:
        step = max(grad_accum * t_drafter + per_step, grad_accum * n_drafter / max(1, n_target) * t_target)
    return grad_accum * n_drafter * tokens / step
