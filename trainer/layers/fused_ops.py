"""Fused elementwise pieces of a Qwen3 decoder layer for the GPU paths (fast target
forward, fast drafter step). On CUDA each is torch.compile'd once with dynamic shapes, so
RMSNorm, q/k-norm + RoPE and SiLU·up are one memory pass each instead of five or six;
on CPU they run eagerly (tests). Numerics follow Qwen3: statistics in fp32, the norm
weight applied in the input dtype, RoPE rotate-half at absolute positions.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

EPS = 1e-6
# The escape hatch from torch.compile for every GPU path (fused pieces, DFlash2's block
# convolution, the selector's pieces): DFLASH_EAGER=1 runs them eagerly, slower but without
# Inductor, for when a compile fails on a new torch or GPU (docs/trainer.md).
EAGER = os.environ.get("DFLASH_EAGER", "0") == "1"
_COMPILE = torch.cuda.is_available() and not EAGER


def compile_once(fn, cache: dict):
    """``fn`` compiled with static shapes, once per ``cache`` (the pieces whose compile depends
    on the device they meet: DFlash2's block convolution, the selector's pieces)."""
    if fn not in cache:
        cache[fn] = torch.compile(fn, dynamic=False)
    return cache[fn]


def _maybe_compile(fn):
    # Static shapes: with dynamic=True Inductor's kernels index with run-time divisions and
    # lose 16-byte vector loads; measured 4-6x under the copy bandwidth on H200 (see
    # docs/gpu-notes.md). The drafter's chunk shapes are fixed, the target's take a few
    # values per run, so specialising costs a few compiles.
    return torch.compile(fn, dynamic=False) if _COMPILE else fn


if _COMPILE:
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    if hasattr(torch._dynamo.config, "accumulated_cache_size_limit"):
        torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 1024)


def _rms(x, w, eps: float = EPS):
    xf = x.float()
    return w.to(x.dtype) * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x, cos, sin):
    # x [b, L, h, d]; cos/sin [L, d] or [b, L, d] (fp32)
    d = x.shape[-1] // 2
    if cos.dim() == 2:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rot = torch.cat((-x[..., d:], x[..., :d]), dim=-1)
    return x * cos + rot * sin


def _norm(x, w, eps: float = EPS):
    return _rms(x, w, eps)


def _qkv_prep(qkv, qn, kn, cos, sin, nh: int, nkv: int, hd: int, eps: float = EPS):
    """qkv [b, L, (nh+2nkv)·hd] → q [b, nh, L, hd], k/v [b, nkv, L, hd] (q/k norm + RoPE)."""
    b, L, _ = qkv.shape
    q = qkv[..., : nh * hd].view(b, L, nh, hd)
    k = qkv[..., nh * hd: (nh + nkv) * hd].view(b, L, nkv, hd)
    v = qkv[..., (nh + nkv) * hd:].view(b, L, nkv, hd)
    q = _rope(_rms(q, qn, eps), cos, sin)
    k = _rope(_rms(k, kn, eps), cos, sin)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _kv_prep(kv, kn, cos, sin, nkv: int, hd: int, eps: float = EPS):
    """kv [b, L, 2·nkv·hd] → k, v [b, nkv, L, hd] (k norm + RoPE)."""
    b, L, _ = kv.shape
    k = kv[..., : nkv * hd].view(b, L, nkv, hd)
    v = kv[..., nkv * hd:].view(b, L, nkv, hd)
    k = _rope(_rms(k, kn, eps), cos, sin)
    return k.transpose(1, 2), v.transpose(1, 2)


def _add_norm(x, y, w, eps: float = EPS):
    """(x + y, rmsnorm(x + y)) in one pass: the residual add fused with the next norm."""
    r = x + y
    return r, _rms(r, w, eps)


def _silu_mul(gu):
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


norm = _maybe_compile(_norm)
qkv_prep = _maybe_compile(_qkv_prep)
kv_prep = _maybe_compile(_kv_prep)
silu_mul = _maybe_compile(_silu_mul)  # SiLU(gate)·up of gu = [gate | up]
add_norm = _maybe_compile(_add_norm)


def rope_tables(max_pos: int, head_dim: int, device, theta: float = 1_000_000.0):
    """cos, sin [max_pos, head_dim] fp32 (Qwen3 default RoPE)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    f = torch.outer(torch.arange(max_pos, device=device, dtype=torch.float32), inv)
    emb = torch.cat((f, f), dim=-1)
    return emb.cos(), emb.sin()
