"""The DFlash drafter (TRAINER_SPEC.md, "Drafter architecture").

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

Attention is pluggable: ``"sdpa"`` builds the explicit boolean mask (reference; CPU and
tests), ``"flex"`` builds a flex_attention block mask (CUDA; the mask is never
materialised and fully masked tiles are skipped).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from agent import ckptcompat

DEFAULT_MASK_TOKEN_ID = 151669  # Qwen3: a row the embedding has and the tokenizer never emits


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
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_target(cls, target: dict, num_draft_layers: int, block_size: int,
                    mask_token_id: int | None = None, target_layer_ids=None) -> "DrafterConfig":
        """Width, heads and RoPE θ copied from the target's config.json (dict)."""
        L = int(target["num_hidden_layers"])
        vocab = int(target["vocab_size"])
        ids = list(target_layer_ids) if target_layer_ids else build_target_layer_ids(L, num_draft_layers)
        if mask_token_id is None:  # a target may name its reserved id (trainer/tiny.py does)
            mask_token_id = target.get("mask_token_id")
        if mask_token_id is None:
            mask_token_id = DEFAULT_MASK_TOKEN_ID if vocab > DEFAULT_MASK_TOKEN_ID else vocab - 1
        return cls(
            hidden_size=int(target["hidden_size"]),
            intermediate_size=int(target["intermediate_size"]),
            num_attention_heads=int(target["num_attention_heads"]),
            num_key_value_heads=int(target.get("num_key_value_heads") or target["num_attention_heads"]),
            head_dim=int(target.get("head_dim") or target["hidden_size"] // target["num_attention_heads"]),
            rms_norm_eps=float(target.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta_of(target)),
            vocab_size=vocab,
            num_hidden_layers=int(num_draft_layers),
            num_target_layers=L,
            target_layer_ids=ids,
            block_size=int(block_size),
            mask_token_id=int(mask_token_id),
            attention_bias=bool(target.get("attention_bias", False)),
        )

    def to_hf(self) -> dict:
        """config.json in the layout of z-lab's released drafters (Qwen3 config + dflash_config)."""
        return {
            "architectures": ["DFlashDraftModel"],
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
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            **self.extra,
        }

    @classmethod
    def from_hf(cls, d: dict) -> "DrafterConfig":
        fl = d.get("dflash_config", {})
        return cls(
            hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_attention_heads=d["num_attention_heads"], num_key_value_heads=d["num_key_value_heads"],
            head_dim=d["head_dim"], rms_norm_eps=d["rms_norm_eps"], rope_theta=rope_theta_of(d),
            vocab_size=d["vocab_size"], num_hidden_layers=d["num_hidden_layers"],
            num_target_layers=d["num_target_layers"],
            target_layer_ids=list(fl.get("target_layer_ids") or build_target_layer_ids(d["num_target_layers"], d["num_hidden_layers"])),
            block_size=d["block_size"], mask_token_id=fl.get("mask_token_id", DEFAULT_MASK_TOKEN_ID),
            attention_bias=d.get("attention_bias", False),
        )


def rope_theta_of(cfg: dict) -> float:
    # transformers 5 moved rope_theta into rope_parameters; 4.x kept it at the top level.
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rp.get("rope_type") or rp.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"target rope_type {rope_type!r} is not supported by the drafter (default RoPE only)")
    return float(rp.get("rope_theta") or cfg.get("rope_theta") or 10000.0)


# --------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    """Qwen3RMSNorm: statistics in fp32, weight applied in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """cos/sin [b, N, head_dim] (fp32) at absolute integer positions [b, N] (Qwen3 default RoPE)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, N, D]; cos/sin [b, N, D]."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


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
            out = _flex_attention()(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
        else:
            rep = q.shape[1] // k.shape[1]
            if rep > 1:  # GQA by repetition: plain SDPA everywhere (enable_gqa is newer than some torch builds)
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class MLP(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_k, mask, impl):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_k, mask, impl)
        return x + self.mlp(self.post_attention_layernorm(x))


# --------------------------------------------------------------------------- masks


def dense_block_mask(anchors: torch.Tensor, keep: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """Boolean [b, 1, N·B, S + N·B]: True where a query may attend.

    Query row r belongs to block i = r // B (anchor a_i). Context column j is visible iff
    j < a_i and the block is kept; block column S + c is visible iff c // B == i. A padded
    block (keep False) sees only itself, so no row is fully masked (SDPA would give NaN).
    """
    b, n = anchors.shape
    dev = anchors.device
    q_blk = torch.arange(n * block_size, device=dev) // block_size  # [Q]
    a_q = anchors[:, q_blk]  # [b, Q]
    keep_q = keep[:, q_blk]
    ctx_ok = (torch.arange(ctx_len, device=dev)[None, None, :] < a_q[:, :, None]) & keep_q[:, :, None]
    own = (q_blk[:, None] == q_blk[None, :]).expand(b, -1, -1)
    return torch.cat([ctx_ok, own], dim=2).unsqueeze(1)


def flex_block_mask(anchors: torch.Tensor, keep: torch.Tensor, ctx_len: int, block_size: int):
    """The same rule as :func:`dense_block_mask` as a flex_attention BlockMask (never dense)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, S = block_size, ctx_len

    def mask_mod(bi, h, q_idx, kv_idx):
        blk = q_idx // B
        ctx_ok = (kv_idx < S) & (kv_idx < anchors[bi, blk]) & keep[bi, blk]
        own = (kv_idx >= S) & ((kv_idx - S) // B == blk)
        return ctx_ok | own

    b, n = anchors.shape
    return create_block_mask(mask_mod, b, None, n * B, S + n * B, device=anchors.device,
                             _compile=anchors.device.type == "cuda")


_FLEX = None


def _flex_attention():
    # Compiled once on CUDA (the fused block-sparse kernel); eager elsewhere (tests only).
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=True) if torch.cuda.is_available() else flex_attention
    return _FLEX


# --------------------------------------------------------------------------- the drafter


class Drafter(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.config = c
        n = len(c.target_layer_ids)
        self.fc = nn.Linear(n * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList([Layer(c) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.apply(self._init)

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
        if attn_impl == "flex":
            mask = flex_block_mask(anchors, keep, S, B)
        elif attn_impl == "sdpa":
            mask = dense_block_mask(anchors, keep, S, B)
        else:
            raise ValueError(f"attention implementation {attn_impl!r}: expected 'sdpa' or 'flex'")
        x = block_embeds
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_k, mask, attn_impl)
        return self.norm(x)

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

        from trainer import synthetic

        with open(os.path.join(target_dir, "config.json")) as fh:
            cfg = json.load(fh)
        marker = synthetic.random_marker(target_dir)
        if marker is not None:  # a synthetic target: the same two seeded tensors as its target ranks make
            return cls(*synthetic.random_head(cfg, int(marker.get("seed", 0)), device, dtype))
        index = os.path.join(target_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as fh:
                weight_map = json.load(fh)["weight_map"]
        else:
            weight_map = None
        names = {"embed": "model.embed_tokens.weight", "lm_head": "lm_head.weight"}
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
