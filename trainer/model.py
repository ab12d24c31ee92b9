"""The DFlash drafter (docs/trainer-spec.md, "Drafter architecture").

A few Qwen3-style decoder layers that draft a block of B tokens in one pass::

    taps  = cat[target layer l_0 out, …, l_{n-1} out]         [b, S, n·H]   (frozen target)
    ctx   = hidden_norm(fc(taps))                              [b, S, H]
    block = embed([x[a], MASK, …, MASK]) at positions a..a+B-1 [b, N·B, H]   (N blocks)
    every layer:  q = q_proj(norm(block)),  k/v = k/v_proj(cat[ctx, norm(block)])
                  q/k norm, RoPE at absolute positions, then attention under the mask:
                  a block sees context positions < its anchor and its own block (both
                  directions) — never its own future hidden states, never another block.
    out   = norm(block)                                        → the target's lm_head (loss.py)

The drafter owns no embedding and no LM head: the target's ``embed_tokens`` and ``lm_head``
are used frozen and live outside this module (:class:`FrozenHead`), so they are neither in
the optimizer nor in checkpoints. Parameter names follow z-lab's ``DFlashDraftModel``, so an
exported ``drafter/`` directory loads in their inference code.

Two forward paths over the same parameters, one per drafter step (trainer/step.py):

* :meth:`Drafter.forward`, the reference: the whole micro-batch as ``nn.Module`` calls
  under the DFlash mask (flex_mask.py), ``"sdpa"`` with the explicit boolean mask (CPU and
  tests) or ``"flex"`` with a flex_attention block mask (CUDA; never materialised, fully
  masked tiles skipped);
* :meth:`Drafter.context_kv` + :meth:`Drafter.block_forward`, the chunked step's pieces
  (trainer/gpu/fast_drafter.py): the context path once, then blocks chunk by chunk through
  fused q|k|v and gate|up GEMMs and the fused elementwise ops of fused_ops.py, with the
  weights cast to the compute dtype per call (the fp32 master weights stay the parameters).
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from agent import ckptcompat
from trainer import arch as archs
from trainer.layers import block_conv
from trainer import family
from trainer.gpu import fp8_train  # torch only; torchao is imported by a run that converts
from trainer.layers import fused_ops as fo
from trainer.layers.flex_mask import dense_dflash_mask, flex_attention_fn, make_dflash_block_mask
# One implementation of the norm, RoPE and MLP: the export's modeling file (trainer/layers/hf_dflash.py,
# written into every drafter/ so transformers loads it without this package) must compute
# exactly what the trainer computes, so the trainer uses its pieces.
from trainer.layers.hf_dflash import DFlashCandidateSelector as CandidateSelector
from trainer.layers.hf_dflash import DFlashGroupedConv as GroupedConv
from trainer.layers.hf_dflash import DFlashMLP as MLP
from trainer.layers.hf_dflash import DFlashRMSNorm as RMSNorm
from trainer.layers.hf_dflash import apply_rope, conv_prepare, layer_forward, propose, rope_cos_sin, selector_scores

DEFAULT_MASK_TOKEN_ID = family.QWEN3_MASK_TOKEN_ID  # a drafter export that names none (z-lab's Qwen3 ones)


# The reference drafter's tap choice, [L//2] for one layer, else evenly spaced 1..L-3: one
# rule with the checkpoint compatibility check that the launch preflight runs without torch.
build_target_layer_ids = ckptcompat.default_target_layer_ids


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    num_hidden_layers: int
    num_target_layers: int
    target_layer_ids: list[int]
    block_size: int
    mask_token_id: int
    attention_bias: bool = False
    # per drafter layer "full_attention" or "sliding_attention" (window ``sliding_window``,
    # flex_mask.py's sliding rule); None = every layer full
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    # trainer/arch.py: "dflash", or "dflash2" (in-block convolutions and a path selector of
    # the shape below; docs/dflash2.md)
    arch: str = archs.DFLASH
    conv_kernel_size: int = archs.CONV_KERNEL_SIZE
    conv_group_size: int = archs.CONV_GROUP_SIZE
    selector_rank: int = archs.SELECTOR_RANK
    selector_top_k: int = archs.SELECTOR_TOP_K
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.layer_types is None:
            self.layer_types = [family.FULL] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        if family.SLIDING not in self.layer_types:
            self.sliding_window = None
        if self.arch not in archs.ARCHS:
            raise ValueError(f"--drafter-arch {self.arch!r}: expected one of {', '.join(archs.ARCHS)}")
        if self.dflash2:
            problems = archs.shape_problems(self.hidden_size, self.vocab_size, self.block_size, self.dflash2_shape)
            if problems:
                raise ValueError(problems[0])

    @property
    def dflash2(self) -> bool:
        return self.arch == archs.DFLASH2

    @property
    def dflash2_shape(self) -> dict:
        return {k: getattr(self, k) for k in archs.DFLASH2_FIELDS}

    def window_of(self, layer_type: str) -> int | None:
        return self.sliding_window if layer_type == family.SLIDING else None

    @classmethod
    def from_target(cls, target: dict, num_draft_layers: int, block_size: int,
                    mask_token_id: int | None = None, target_layer_ids=None, *, target_dir: str | None = None,
                    layer_types: str | None = None, attention: str | None = None,
                    sliding_window: int = family.SLIDING_WINDOW, drafter_arch: str = archs.DFLASH) -> "DrafterConfig":
        """The drafter for the target's config.json (dict; either layout of its family,
        trainer/family.py): hidden and MLP widths, RoPE θ and vocabulary from the language
        model; attention widths and per-layer types as the family's public drafters build
        them unless ``attention`` ("Q/KV/D") or ``layer_types`` (full/sliding list) say
        otherwise; the mask token from the flag, the config or the tokenizer."""
        text = family.text_config(target)
        L = int(text["num_hidden_layers"])
        ids = list(target_layer_ids) if target_layer_ids else build_target_layer_ids(L, num_draft_layers)
        mask, _ = family.mask_token_id(target, target_dir, mask_token_id)
        heads, kv_heads, head_dim = family.drafter_attention(target, attention)
        types = family.drafter_layer_types(target, num_draft_layers, layer_types)
        return cls(
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta_of(text)),
            vocab_size=int(text["vocab_size"]),
            num_hidden_layers=int(num_draft_layers),
            num_target_layers=L,
            target_layer_ids=ids,
            block_size=int(block_size),
            mask_token_id=int(mask),
            attention_bias=bool(text.get("attention_bias", False)),
            layer_types=types,
            sliding_window=int(sliding_window),
            arch=drafter_arch or archs.DFLASH,
        )

    @classmethod
    def for_shape(cls, shape, num_draft_layers: int, block_size: int, n_tapped: int | None = None,
                  rope_theta: float = 1e6, drafter_arch: str = archs.DFLASH) -> "DrafterConfig":
        """A drafter of a benchmark shape (trainer/plan/flops.py ``ModelShape``) without a target
        directory: the probe's measured run and bench/gpu."""
        n_tapped = num_draft_layers if n_tapped is None else n_tapped
        return cls(hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_attention_heads=shape.n_heads,
                   num_key_value_heads=shape.n_kv_heads, head_dim=shape.head_dim, rms_norm_eps=1e-6,
                   rope_theta=float(rope_theta), vocab_size=shape.vocab, num_hidden_layers=num_draft_layers,
                   num_target_layers=shape.n_layers, target_layer_ids=build_target_layer_ids(shape.n_layers, n_tapped),
                   block_size=block_size, mask_token_id=shape.vocab - 1, arch=drafter_arch)

    def to_hf(self) -> dict:
        """config.json in the layout of z-lab's released drafters (Qwen3 config + dflash_config);
        a DFlash2 drafter's also names its architecture DFlash2DraftModel and carries its
        shape and block size in dflash_config, where its loaders read them (docs/dflash2.md)."""
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        if self.dflash2:
            dflash.update(block_size=self.block_size, **self.dflash2_shape)
        return {
            "architectures": [archs.ARCHITECTURES[self.arch]],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "vocab_size": self.vocab_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "dflash_config": dflash,
            # the per-layer attention of SpecForge's and z-lab's drafter configs (Qwen3Config keys)
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            "max_window_layers": self.num_hidden_layers,
            **self.extra,
        }

    @classmethod
    def from_hf(cls, d: dict) -> "DrafterConfig":
        """A drafter's config.json (this trainer's, or a release's: z-lab's DFlash2 configs keep
        block_size in dflash_config only)."""
        fl = d.get("dflash_config", {})
        kind = archs.of_config(d)
        top, inner = d.get("block_size"), fl.get("block_size")
        if top is not None and inner is not None and int(top) != int(inner):
            raise ValueError(f"config.json: block_size {top} and dflash_config.block_size {inner} disagree")
        shape = {k: int(fl[k]) for k in archs.DFLASH2_FIELDS if k in fl} if kind == archs.DFLASH2 else {}
        return cls(
            hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_attention_heads=d["num_attention_heads"], num_key_value_heads=d["num_key_value_heads"],
            head_dim=d["head_dim"], rms_norm_eps=d["rms_norm_eps"], rope_theta=rope_theta_of(d),
            vocab_size=d["vocab_size"], num_hidden_layers=d["num_hidden_layers"],
            num_target_layers=d["num_target_layers"],
            target_layer_ids=list(fl.get("target_layer_ids") or build_target_layer_ids(d["num_target_layers"], d["num_hidden_layers"])),
            block_size=int(top if top is not None else inner), mask_token_id=fl.get("mask_token_id", DEFAULT_MASK_TOKEN_ID),
            attention_bias=d.get("attention_bias", False),
            layer_types=d.get("layer_types"),
            sliding_window=d.get("sliding_window") if d.get("use_sliding_window", d.get("sliding_window") is not None) else None,
            arch=kind, **shape,
        )


def rope_theta_of(cfg: dict) -> float:
    # transformers 5 moved rope_theta into rope_parameters; 4.x kept it at the top level.
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rp.get("rope_type") or rp.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"target rope_type {rope_type!r} is not supported by the drafter (default RoPE only)")
    return float(rp.get("rope_theta") or cfg.get("rope_theta") or 10000.0)


# --------------------------------------------------------------------------- layers


class Attention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        hd, nh, nkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        self.q_proj = nn.Linear(c.hidden_size, nh * hd, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, nkv * hd, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, nkv * hd, bias=c.attention_bias)
        self.o_proj = nn.Linear(nh * hd, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_k, mask, impl: str):
        b, q_len, _ = x.shape
        hd = self.c.head_dim
        kv_in = torch.cat([ctx, x], dim=1)  # context K/V injected in front of the block's own
        q = self.q_norm(self.q_proj(x).view(b, q_len, -1, hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(b, kv_in.shape[1], -1, hd)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, kv_in.shape[1], -1, hd).transpose(1, 2)
        q, k = apply_rope(q, *rope_q), apply_rope(k, *rope_k)
        if impl == "flex":
            out = flex_attention_fn(q.device.type, dynamic=True)(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
        else:
            rep = q.shape[1] // k.shape[1]
            if rep > 1:  # GQA by repetition: plain SDPA everywhere (enable_gqa is newer than some torch builds)
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))

    # -- the chunked step's pieces: fused GEMMs, weights cast to ``dtype`` per call
    def context_kv(self, ctx, cos, sin, dtype):
        """k, v [b, nkv, S, hd] of the context states ctx [b, S, H] (k-norm + RoPE at the
        positions of cos/sin)."""
        c = self.c
        linears = (self.k_proj, self.v_proj)
        return fo.kv_prep(_mm(ctx, *_fused(linears, dtype), _fp8_of(linears)), _cast(self.k_norm.weight, dtype), cos, sin,
                          c.num_key_value_heads, c.head_dim, c.rms_norm_eps)

    def block_attention(self, h, ctx_kv, cos, sin, attend, dtype, gemm=None):
        """Attention output [1, Q, H] of normed block states h [1, Q, H]: q from the block,
        k/v = [context k/v | block k/v]; ``attend(q, k, v)`` applies the DFlash mask.
        ``gemm``: this layer's GEMM weights already in ``dtype`` (StepGemmWeights), else cast here."""
        c = self.c
        Q = h.shape[1]
        qkv_l = (self.q_proj, self.k_proj, self.v_proj)
        qkv = gemm["qkv"](h) if gemm else _mm(h, *_fused(qkv_l, dtype), _fp8_of(qkv_l))
        q, k, v = fo.qkv_prep(qkv, _cast(self.q_norm.weight, dtype), _cast(self.k_norm.weight, dtype),
                              cos, sin, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps)
        kc, vc = ctx_kv
        o = attend(q, torch.cat([kc.to(dtype), k], dim=2), torch.cat([vc.to(dtype), v], dim=2))
        o = o.transpose(1, 2).reshape(1, Q, -1)
        return gemm["o"](o) if gemm else _mm(o, *_fused((self.o_proj,), dtype), _fp8_of((self.o_proj,)))


class Layer(nn.Module):
    def __init__(self, c: DrafterConfig, layer_type: str = family.FULL):
        super().__init__()
        self.layer_type = layer_type  # picks the mask: full or sliding-window (flex_mask.py)
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def add_convolutions(self, c: DrafterConfig) -> None:
        """DFlash2: a convolution within each block around both sublayers (identity start)."""
        self.attention_conv = GroupedConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)
        self.mlp_conv = GroupedConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)

    def forward(self, x, ctx, rope_q, rope_k, masks, impl, block_size: int):
        mask = masks[self.layer_type]
        return layer_forward(self, x, lambda h: self.self_attn(h, ctx, rope_q, rope_k, mask, impl), block_size)

    def block_forward(self, x, ctx_kv, cos, sin, attends, dtype, block_size: int, gemm=None):
        """The chunked step's layer: x [1, Q, H] → [1, Q, H], the residual add fused with the
        post-attention norm; ``attends[layer type](q, k, v)`` applies the layer's mask. A
        DFlash2 layer's convolutions run with their weights cast to ``dtype``, as the GEMMs'.
        ``gemm``: the layer's GEMM weights already in ``dtype`` (StepGemmWeights), else cast here."""
        attend = attends[self.layer_type]
        eps = self.input_layernorm.eps
        h = fo.norm(x, _cast(self.input_layernorm.weight, dtype), eps)
        conv = getattr(self, "attention_conv", None)
        if conv is not None:
            h, dyn = _conv_prepare(conv, h, dtype, block_size)
        o = self.self_attn.block_attention(h, ctx_kv, cos, sin, attend, dtype, gemm)
        if conv is not None:
            o = block_conv.grouped_conv(o, dyn, _cast(conv.base_kernel, dtype)[1], conv.group_size, block_size)
        x, h = fo.add_norm(x, o, _cast(self.post_attention_layernorm.weight, dtype), eps)
        conv = getattr(self, "mlp_conv", None)
        if conv is not None:
            h, dyn = _conv_prepare(conv, h, dtype, block_size)
        m = self.mlp
        if gemm:
            out = gemm["down"](fo.silu_mul(gemm["gate_up"](h)))
        else:
            gu_l = (m.gate_proj, m.up_proj)
            gu = _mm(h, *_fused(gu_l, dtype), _fp8_of(gu_l))
            out = _mm(fo.silu_mul(gu), *_fused((m.down_proj,), dtype), _fp8_of((m.down_proj,)))
        if conv is not None:
            out = block_conv.grouped_conv(out, dyn, _cast(conv.base_kernel, dtype)[1], conv.group_size, block_size)
        return x + out


def _conv_prepare(conv, h, dtype, block_size: int):
    return conv_prepare(h, _cast(conv.kernel_projection.weight, dtype), _cast(conv.base_kernel, dtype),
                        conv.group_size, block_size, conv=block_conv.grouped_conv)


def _cast(p: torch.Tensor, dtype) -> torch.Tensor:
    return p if p.dtype == dtype else p.to(dtype)


class StepGemmWeights:
    """The chunked step's block GEMM weights (fused q/k/v, o, fused gate/up, down of every
    layer) cast to the compute dtype once per step instead of once per anchor chunk.

    Cast per chunk, each weight cost a cast (and, for the fused ones, a concatenation) in
    every chunk's forward and a bf16 → fp32 copy before its gradient was added in every
    chunk's backward (the step's op profile found them); once per step the DFlash step at
    the operators' shape went 3.639 → 3.593 s on an H200 (docs/benchmarks.md).
    ``self.layers[i][name](x)`` is that GEMM (:class:`StepLinear`).

    Each cast is a leaf of its own, and a hook adds its gradient into the parameters' fp32
    ``.grad`` as soon as a chunk's backward has produced it (one mixed-dtype add, the same fp32
    sums as per-chunk casts, bit for bit) and drops it; each leaf is used once per chunk, so
    its bf16 gradient is never a sum. A chunk's forward kept all these casts for its backward
    anyway, so casting once costs no memory.
    """

    def __init__(self, drafter: nn.Module, dtype: torch.dtype):
        self.layers = []
        for layer in drafter.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append({"qkv": StepLinear((a.q_proj, a.k_proj, a.v_proj), dtype),
                                "o": StepLinear((a.o_proj,), dtype),
                                "gate_up": StepLinear((m.gate_proj, m.up_proj), dtype),
                                "down": StepLinear((m.down_proj,), dtype)})


class StepLinear:
    """One fused GEMM of StepGemmWeights: ``linears``' weights (and biases) stacked along their
    outputs, cast to ``dtype`` once; calling it computes ``x @ w.t() (+ bias)``, its weight
    gradient reaching the parameters' ``.grad`` through a leaf and its hook."""

    def __init__(self, linears, dtype: torch.dtype):
        with torch.no_grad():
            w, b = _fused(linears, dtype)
        self.weight = _grad_leaf(w, [m.weight for m in linears])
        self.bias = None if b is None else _grad_leaf(b, [m.bias for m in linears])
        self.fp8 = _fp8_of(linears)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _mm(x, self.weight, self.bias, self.fp8)


def _grad_leaf(t: torch.Tensor, params: list) -> torch.Tensor:
    leaf = t.detach()
    if leaf.data_ptr() == params[0].data_ptr():  # _cast returned the parameter itself
        leaf = leaf.clone()
    if any(p.requires_grad for p in params):
        ends = list(itertools.accumulate(p.shape[0] for p in params))
        bounds = [(p, end - p.shape[0], end) for p, end in zip(params, ends)]
        leaf.requires_grad_(True)
        leaf.register_post_accumulate_grad_hook(lambda leaf_: _scatter_grad(leaf_, bounds))
    return leaf


def _scatter_grad(leaf: torch.Tensor, bounds) -> None:
    """A StepGemmWeights leaf's gradient into its parameters' ``.grad`` (row ranges), as
    AccumulateGrad would after the cast's backward: a copy in the parameter's dtype the first
    time, an add after."""
    g = leaf.grad
    leaf.grad = None
    with torch.no_grad():
        for p, lo, hi in bounds:
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = g[lo:hi].to(p.dtype, copy=True)
            else:
                p.grad.add_(g[lo:hi])


def _fused(linears, dtype):
    """The weights of ``linears`` stacked along their outputs (one GEMM), and their biases
    (None when the layers have none), in ``dtype``."""
    w = torch.cat([_cast(m.weight, dtype) for m in linears]) if len(linears) > 1 else _cast(linears[0].weight, dtype)
    if linears[0].bias is None:
        return w, None
    return w, torch.cat([_cast(m.bias, dtype) for m in linears])


def _fp8_of(linears):
    """The linear whose FP8 training GEMM (--drafter-precision fp8, trainer/gpu/fp8_train.py) a
    fused GEMM of ``linears`` runs: the first, when every one of them is converted; else None
    (the GEMM runs in the compute dtype)."""
    return linears[0] if all(fp8_train.is_fp8(m) for m in linears) else None


def _mm(x, w, bias, fp8=None):
    """``x @ wᵀ (+ bias)``; through ``fp8``'s FP8 training GEMM when given (``_fp8_of``)."""
    y = fp8_train.mm(x, w, fp8) if fp8 is not None else x @ w.t()
    return y if bias is None else y + bias.to(y.dtype)


# --------------------------------------------------------------------------- the drafter


class Drafter(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.config = c
        n = len(c.target_layer_ids)
        self.fc = nn.Linear(n * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList([Layer(c, t) for t in c.layer_types])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.apply(self._init)
        if c.dflash2:
            # made after DFlash's weights are drawn, so a DFlash and a DFlash2 drafter of one
            # --seed share those; they start as the identity (hf_dflash.py), so the DFlash2
            # drafter first drafts exactly what that DFlash drafter drafts
            for layer in self.layers:
                layer.add_convolutions(c)
            self.candidate_selector = CandidateSelector(c.vocab_size, c.hidden_size, c.selector_rank, c.selector_top_k)

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):  # Qwen3's initializer_range
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, taps: torch.Tensor, block_embeds: torch.Tensor, anchors: torch.Tensor,
                keep: torch.Tensor, attn_impl: str = "sdpa") -> torch.Tensor:
        """taps [b, S, n·H] (tapped target states, noise already added); block_embeds
        [b, N·B, H] (embedded [anchor, MASK…] per block); anchors/keep [b, N].
        Returns the final-normed block states [b, N·B, H]."""
        c = self.config
        b, S, _ = taps.shape
        n = anchors.shape[1]
        B = c.block_size
        ctx = self.hidden_norm(self.fc(taps))
        # Absolute positions: context 0..S-1; block i at a_i .. a_i+B-1.
        ctx_pos = torch.arange(S, device=taps.device).expand(b, S)
        blk_pos = (anchors[:, :, None] + torch.arange(B, device=taps.device)).reshape(b, n * B)
        rope_q = rope_cos_sin(blk_pos, c.head_dim, c.rope_theta)
        rope_k = rope_cos_sin(torch.cat([ctx_pos, blk_pos], dim=1), c.head_dim, c.rope_theta)
        if attn_impl not in ("sdpa", "flex"):
            raise ValueError(f"attention implementation {attn_impl!r}: expected 'sdpa' or 'flex'")
        masks = {}  # one mask per layer type present (full, sliding-window)
        for t in set(c.layer_types):
            w = c.window_of(t)
            masks[t] = (make_dflash_block_mask(anchors, S, B, keep, window=w) if attn_impl == "flex"
                        else dense_dflash_mask(anchors, S, B, keep, window=w).unsqueeze(1))
        x = block_embeds
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_k, masks, attn_impl, B)
        return self.norm(x)

    @property
    def selector(self):
        """DFlash2's path selector (None for a DFlash drafter)."""
        return getattr(self, "candidate_selector", None)

    def propose(self, hidden: torch.Tensor, lm_head: torch.Tensor, anchor: int) -> list[int]:
        """The drafts of one block from its drafting slots' final-normed states hidden [B−1, H]
        (trainer/layers/hf_dflash.py propose: the export's modeling file drafts the same way)."""
        return propose(hidden, lm_head, anchor, self.selector)

    def selector_scores(self, hidden, unary, candidates, predecessors, dtype=None) -> torch.Tensor:
        """DFlash2's pair scores S(a, b) [.., k] (hf_dflash.selector_scores) with the selector's
        weights cast to ``dtype`` (the chunked step's compute dtype; None: as they are)."""
        w = self.selector_weights()
        if dtype is not None:
            w = [_cast(t, dtype) for t in w]
        return selector_scores(hidden, unary, candidates, predecessors, *w)

    def selector_weights(self) -> list[torch.Tensor]:
        """The selector's parameters in ``selector_scores``' order: predecessor codebook,
        successor codebook, hidden projection (trainer/gpu/selector_fused.py takes them so)."""
        sel = self.candidate_selector
        return [sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight]

    # -- the chunked step (trainer/gpu/fast_drafter.py): context once, blocks chunk by chunk
    def context_kv(self, taps: torch.Tensor, cos, sin, dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The context path with autograd: ctx = hidden_norm(fc(taps)), then per layer the
        context (k, v) [b, nkv, S, hd] in ``dtype``."""
        ctx = fo.norm(_mm(taps.to(dtype), _cast(self.fc.weight, dtype), None, _fp8_of((self.fc,))),
                      _cast(self.hidden_norm.weight, dtype), self.hidden_norm.eps)
        return [layer.self_attn.context_kv(ctx, cos, sin, dtype) for layer in self.layers]

    def block_forward(self, x: torch.Tensor, ctx_kv, cos, sin, attends, dtype, gemm=None) -> torch.Tensor:
        """Embedded blocks x [1, Q, H] → final-normed states [1, Q, H]; ctx_kv: per layer the
        context (k, v) [1, nkv, S, hd]; ``attends[layer type](q, k, v)`` applies the DFlash
        mask of that layer type. ``gemm``: a StepGemmWeights of this drafter (the layers' GEMM
        weights cast once per step), else each call casts them."""
        for i, (layer, kv) in enumerate(zip(self.layers, ctx_kv)):
            x = layer.block_forward(x, kv, cos, sin, attends, dtype, self.config.block_size,
                                    gemm.layers[i] if gemm else None)
        return fo.norm(x, _cast(self.norm.weight, dtype), self.norm.eps)

    # -- inference export (z-lab layout)
    def save_pretrained(self, directory: str) -> None:
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "config.json"), "w") as fh:
            json.dump(self.config.to_hf(), fh, indent=1, sort_keys=True)
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, directory: str, device="cpu") -> "Drafter":
        from safetensors.torch import load_file

        with open(os.path.join(directory, "config.json")) as fh:
            cfg = DrafterConfig.from_hf(json.load(fh))
        model = cls(cfg)
        model.load_state_dict(load_file(os.path.join(directory, "model.safetensors")))
        return model.to(device)


# --------------------------------------------------------------------------- frozen head


class FrozenHead:
    """The target's ``embed_tokens`` and ``lm_head`` weights, frozen, shared with the
    drafter. Kept outside the drafter module: never trained, never checkpointed, and DDP
    does not broadcast them."""

    def __init__(self, embed: torch.Tensor, lm_head: torch.Tensor):
        self.embed = embed.detach().requires_grad_(False)
        self.lm_head = lm_head.detach().requires_grad_(False)
        self.lm_head8 = None  # the head's e4m3 copy for the teacher's logits (quantize_teacher)

    def quantize_teacher(self) -> None:
        """--target-precision fp8 with soft labels: the teacher's logits through an e4m3 copy of
        the head with a scale per output channel, made once here (trainer/gpu/fp8.py); the bf16
        head stays for the drafter's own logits and their gradient."""
        from trainer.gpu import fp8

        self.lm_head8 = fp8.Fp8Weight.of(self.lm_head)

    def teacher_head(self):
        """What forms the teacher's logits from final states in the reference loss: None (the
        bf16 head) or the FP8 head."""
        if self.lm_head8 is None:
            return None
        from functools import partial

        from trainer.gpu import fp8

        return partial(fp8.teacher_logits, head=self.lm_head8)

    def embed_blocks(self, input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
        """[b, N·B, H]: each block is [x[a], MASK × (B-1)] embedded with the target's table."""
        b, n = anchors.shape
        ids = torch.full((b, n, block_size), mask_token_id, dtype=torch.long, device=input_ids.device)
        ids[:, :, 0] = input_ids.gather(1, anchors)
        return F.embedding(ids.reshape(b, n * block_size), self.embed)

    @classmethod
    def from_target_dir(cls, target_dir: str, device="cpu", dtype=torch.float32) -> "FrozenHead":
        """Read only the two tensors from the target's safetensors, so a drafter-only rank
        never loads the target's layers."""
        from safetensors import safe_open

        from trainer.synth import synthetic

        cfg = family.read_config(target_dir)
        marker = synthetic.random_marker(target_dir)
        if marker is not None:  # a synthetic target: the same two seeded tensors as its target ranks make
            return cls(*synthetic.random_head(family.text_config(cfg), int(marker.get("seed", 0)), device, dtype))
        index = os.path.join(target_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as fh:
                weight_map = json.load(fh)["weight_map"]
        else:
            weight_map = None
        names = {"embed": family.weight_prefix(cfg) + "embed_tokens.weight", "lm_head": "lm_head.weight"}
        if cfg.get("tie_word_embeddings") or (weight_map is not None and names["lm_head"] not in weight_map):
            names["lm_head"] = names["embed"]
        out = {}
        for key, name in names.items():
            file = weight_map[name] if weight_map else "model.safetensors"
            with safe_open(os.path.join(target_dir, file), framework="pt") as f:
                if name not in f.keys() and key == "lm_head":
                    name = names["embed"]  # tied weights saved once
                out[key] = f.get_tensor(name).to(device=device, dtype=dtype)
        return cls(out["embed"], out["lm_head"])
