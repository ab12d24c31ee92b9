"""The drafter's training step on GPU, memory-bounded: forward + backward in anchor chunks.

Blocks never see each other (flex_mask.py), so the drafter's work over the blocks of a
micro-batch splits exactly into chunks of anchors that share only the context path (fc →
hidden_norm → each layer's context k/v). This module runs, for one micro-batch:

1. the context path once, with autograd: ``ctx = hidden_norm(fc(taps))`` and, per layer,
   k/v of the context (k-norm + RoPE at 0..S-1);
2. for each sequence and each chunk of ``chunk_anchors`` of its anchors: the block forward
   through every layer (q from the block; k/v = [context k/v | block k/v]; flex attention
   under the DFlash block mask), the final norm, and the chunked LM head + loss
   (chunked_head.py), then the chunk's backward at once — parameter gradients accumulate
   (fp32, through the bf16 casts) and the context k/v gradients go to fp32 accumulators
   (the context k/v enter each chunk as fresh leaves);
3. one backward through the context path with the accumulated k/v gradients.

Activation memory is therefore one chunk's, whatever the token budget: peak ≈ weights,
gradients and AdamW state + the micro-batch's context (per token) + one chunk of positions ×
(per-layer activations) + one head chunk of logits (trainer/memory.py models it). The
result equals the unchunked step (tests/test_gpu_blocks.py checks loss and every gradient
against a dense reference).

Parameters stay fp32 (master weights); each chunk casts them to the compute dtype (bf16),
which is autocast's behaviour without its cache. Nothing here reads a GPU value on the host.

It works on any module with the z-lab drafter's names (trainer/model.py's ``Drafter``, or
:class:`MiniDrafter` below): ``fc``, ``hidden_norm``, ``layers[i].input_layernorm``,
``.self_attn.{q,k,v,o}_proj``, ``.self_attn.{q,k}_norm``, ``.post_attention_layernorm``,
``.mlp.{gate,up,down}_proj``, ``norm``; config fields ``head_dim``, ``num_attention_heads``,
``num_key_value_heads``, ``rope_theta``, ``rms_norm_eps``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer import fused_ops as fo
from trainer.chunked_head import chunked_head_loss, dflash_loss_fn, head_ce
from trainer.flex_mask import dense_dflash_mask
from trainer.loss import decay_weights, dpace_weights

_FLEX = {}


def flex_fn(compiled: Optional[bool] = None, dynamic: bool = False):
    from torch.nn.attention.flex_attention import flex_attention

    if compiled is None:
        compiled = torch.cuda.is_available()
    k = (compiled, dynamic)
    if k not in _FLEX:
        _FLEX[k] = torch.compile(flex_attention, dynamic=dynamic) if compiled else flex_attention
    return _FLEX[k]


class MiniDrafter(nn.Module):
    """The reference drafter architecture with z-lab's parameter names (bench and tests)."""

    def __init__(self, hidden, n_heads, n_kv_heads, head_dim, intermediate, n_layers, n_tapped,
                 rope_theta=1e6, eps=1e-6, block_size=16, device=None, dtype=torch.float32):
        super().__init__()
        self.config = SimpleNamespace(hidden_size=hidden, num_attention_heads=n_heads, num_key_value_heads=n_kv_heads,
                                      head_dim=head_dim, intermediate_size=intermediate, rope_theta=rope_theta,
                                      rms_norm_eps=eps, block_size=block_size, num_hidden_layers=n_layers)
        kw = dict(device=device, dtype=dtype)

        def lin(i, o):
            m = nn.Linear(i, o, bias=False, **kw)
            nn.init.normal_(m.weight, std=0.02)
            return m

        def nrm(d):
            m = nn.Module()
            m.weight = nn.Parameter(torch.ones(d, **kw))
            return m

        self.fc = lin(n_tapped * hidden, hidden)
        self.hidden_norm = nrm(hidden)
        self.layers = nn.ModuleList()
        for _ in range(n_layers):
            L = nn.Module()
            L.input_layernorm, L.post_attention_layernorm = nrm(hidden), nrm(hidden)
            a = nn.Module()
            a.q_proj, a.k_proj = lin(hidden, n_heads * head_dim), lin(hidden, n_kv_heads * head_dim)
            a.v_proj, a.o_proj = lin(hidden, n_kv_heads * head_dim), lin(n_heads * head_dim, hidden)
            a.q_norm, a.k_norm = nrm(head_dim), nrm(head_dim)
            m = nn.Module()
            m.gate_proj, m.up_proj, m.down_proj = lin(hidden, intermediate), lin(hidden, intermediate), lin(intermediate, hidden)
            L.self_attn, L.mlp = a, m
            self.layers.append(L)
        self.norm = nrm(hidden)


_MASKS: dict = {}


def _chunk_block_mask(a, kp, S_pad: int, B: int):
    """BlockMask for one chunk. The mask_mod closes over persistent buffers (one set per
    shape) that are refilled per chunk, so the compiled flex kernel sees the same mask
    function every time and never recompiles for new anchors."""
    from torch.nn.attention.flex_attention import create_block_mask

    from trainer.flex_mask import dflash_mask_mod

    n = a.shape[0]
    key = (n, S_pad, B, a.device)
    if key not in _MASKS:
        a_buf = torch.zeros(1, n, dtype=torch.long, device=a.device)
        k_buf = torch.zeros(1, n, dtype=torch.bool, device=a.device)
        _MASKS[key] = (a_buf, k_buf, dflash_mask_mod(a_buf, S_pad, B, k_buf))
    a_buf, k_buf, mod = _MASKS[key]
    a_buf.copy_(a[None])
    k_buf.copy_(kp[None])
    return create_block_mask(mod, 1, None, n * B, S_pad + n * B, device=a.device,
                             _compile=a.device.type == "cuda")


def _cast(p, dtype):
    return p if p.dtype == dtype else p.to(dtype)


def context_kv(drafter, taps, cos, sin, dtype):
    """Context path with autograd: per layer (k, v) [b, nkv, S, hd] in ``dtype``."""
    c = drafter.config
    eps = getattr(c, "rms_norm_eps", 1e-6)
    ctx = fo.norm(taps.to(dtype) @ _cast(drafter.fc.weight, dtype).t(), _cast(drafter.hidden_norm.weight, dtype), eps)
    out = []
    for lyr in drafter.layers:
        a = lyr.self_attn
        wkv = torch.cat([_cast(a.k_proj.weight, dtype), _cast(a.v_proj.weight, dtype)])
        out.append(fo.kv_prep(ctx @ wkv.t(), _cast(a.k_norm.weight, dtype), cos, sin,
                              c.num_key_value_heads, c.head_dim, eps))
    return out


def block_forward(drafter, x, ctx_kv_leaves, cos_b, sin_b, attend, dtype):
    """x [1, Q, H] embedded blocks → final-normed states [1, Q, H]. ``attend(q, k, v)``
    applies the DFlash mask; ctx_kv_leaves: per layer (k, v) [1, nkv, S, hd]."""
    c = drafter.config
    eps = getattr(c, "rms_norm_eps", 1e-6)
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    _, Q, H = x.shape
    for lyr, (kc, vc) in zip(drafter.layers, ctx_kv_leaves):
        a, m = lyr.self_attn, lyr.mlp
        wqkv = torch.cat([_cast(a.q_proj.weight, dtype), _cast(a.k_proj.weight, dtype), _cast(a.v_proj.weight, dtype)])
        h = fo.norm(x, _cast(lyr.input_layernorm.weight, dtype), eps)
        q, k, v = fo.qkv_prep(h @ wqkv.t(), _cast(a.q_norm.weight, dtype), _cast(a.k_norm.weight, dtype),
                              cos_b, sin_b, nh, nkv, hd, eps)
        o = attend(q, torch.cat([kc.to(dtype), k], dim=2), torch.cat([vc.to(dtype), v], dim=2))
        x, h = fo.add_norm(x, o.transpose(1, 2).reshape(1, Q, nh * hd) @ _cast(a.o_proj.weight, dtype).t(),
                           _cast(lyr.post_attention_layernorm.weight, dtype), eps)
        wgu = torch.cat([_cast(m.gate_proj.weight, dtype), _cast(m.up_proj.weight, dtype)])
        x = x + fo.silu_mul(h @ wgu.t()) @ _cast(m.down_proj.weight, dtype).t()
    return fo.norm(x, _cast(drafter.norm.weight, dtype), eps)


def step_backward(drafter, embed, lm_head, input_ids, taps, loss_mask, lengths, anchors, keep, *,
                  block_size: int, mask_token_id: int, gamma: float = 10.0, kl_weight: float = 0.0,
                  temperature: float = 1.0, cap_lambda: float = 0.0, teacher_final=None,
                  position_weights: str = "decay", dpace_alpha: float = 0.5,
                  chunk_anchors: int = 512, head_chunk_rows: int = 4096, dtype=torch.bfloat16,
                  attn: str = "flex", ctx_multiple: int = 1, loss_scale: float = 1.0,
                  n_anchors_host=None) -> dict:
    """Forward + backward of the DFlash loss for one micro-batch; gradients land in the
    drafter's parameters (accumulating, as ``loss.backward()`` would — scale with
    ``loss_scale`` for gradient accumulation). Returns detached metrics (tensors).

    input_ids/loss_mask [b, S]; lengths [b]; taps [b, S, n·H]; anchors/keep [b, N] (sorted,
    padded with keep False); teacher_final [b, S, H] final-normed target states (soft labels).
    attn: "flex" (block-sparse, CUDA compiled / CPU eager) or "sdpa" (dense mask; tests).
    ctx_multiple: pad the context length to a multiple of this (fewer distinct shapes for
    the compiled kernels). n_anchors_host: optional host list of real anchors per sequence,
    so chunks that hold only padding are skipped without reading the GPU.
    position_weights: "decay" (exp(−(k−1)/γ)) or "dpace" (trainer.loss.dpace_weights of the
    drafter's own detached CE). D-PACE's normaliser Σw spans the whole micro-batch, and each
    chunk's backward needs it, so dpace first runs every chunk forward without gradient
    (drafter + head statistics, no logits kept) to get the CE: a gradient-free forward is
    roughly a third of forward + backward (estimate; not measured on GPU).
    """
    c = drafter.config
    B = int(block_size)
    b, S = input_ids.shape
    dev = input_ids.device
    N = anchors.shape[1]
    n_c = max(1, min(int(chunk_anchors), N))
    n_chunks = math.ceil(N / n_c)
    if n_chunks * n_c != N:  # pad anchors to whole chunks (padding blocks are masked out)
        pad = n_chunks * n_c - N
        anchors = F.pad(anchors, (0, pad))
        keep = F.pad(keep, (0, pad), value=False)
    S_pad = int(math.ceil(S / ctx_multiple) * ctx_multiple)
    theta = float(getattr(c, "rope_theta", 1e6))
    cos, sin = fo.rope_tables(S_pad + B + 1, c.head_dim, dev, theta)

    # weights and labels for every block, computed once (global normalisers)
    k_idx = torch.arange(1, B, device=dev)
    pos = anchors[:, :, None] + k_idx  # [b, N', B-1] = a+k
    posc = pos.clamp(max=S - 1)
    valid = (pos < lengths.view(b, 1, 1)) & loss_mask.gather(1, posc.reshape(b, -1)).view(posc.shape).bool() & keep[:, :, None]
    wdt = torch.float64 if dtype == torch.float64 else torch.float32
    labels = input_ids.gather(1, posc.reshape(b, -1)).view(posc.shape)
    n_valid_blocks = keep.sum().clamp_min(1)
    soft = teacher_final is not None and kl_weight > 0

    # 1. context path (graph kept until the end)
    ctx = context_kv(drafter, taps, cos[:S], sin[:S], dtype)
    leaves_src = [(k.detach(), v.detach()) for k, v in ctx]
    gacc = [(torch.zeros_like(k, dtype=wdt), torch.zeros_like(v, dtype=wdt)) for k, v in leaves_src]

    flex = flex_fn(compiled=dev.type == "cuda") if attn == "flex" else None
    block_ids = torch.full((n_c, B), int(mask_token_id), device=dev, dtype=torch.long)
    kB = torch.arange(B, device=dev)

    def chunks():
        for s in range(b):
            for j in range(n_chunks):
                if n_anchors_host is None or j * n_c < int(n_anchors_host[s]):
                    yield s, slice(j * n_c, (j + 1) * n_c)

    def chunk_hidden(s: int, sl: slice, kv) -> torch.Tensor:
        """Drafter outputs [n_c, B-1, H] at the predicting slots of one anchor chunk of
        sequence ``s``, attending to the context k/v ``kv`` ([(k, v)] per layer, batch 1)."""
        a, kp = anchors[s, sl], keep[s, sl]
        ids = block_ids.clone()
        ids[:, 0] = input_ids[s].gather(0, a)
        x = F.embedding(ids.view(1, -1), embed).to(dtype)
        bpos = (a[:, None] + kB).view(-1)
        if S_pad != S:
            kv = [(F.pad(k, (0, 0, 0, S_pad - S)), F.pad(v, (0, 0, 0, S_pad - S))) for k, v in kv]
        if attn == "flex":
            bm = _chunk_block_mask(a, kp, S_pad, B)

            def attend(q, k, v):
                return flex(q, k, v, block_mask=bm, enable_gqa=k.shape[1] != q.shape[1])
        else:
            m = dense_dflash_mask(a[None].cpu(), S_pad, B, kp[None].cpu()).to(dev)[:, None]

            def attend(q, k, v):
                rep = q.shape[1] // k.shape[1]
                return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=m)
        return block_forward(drafter, x, kv, cos[bpos], sin[bpos], attend, dtype).view(n_c, B, -1)[:, 1:]

    # 2. weights for every block (global normaliser, fixed before any chunk's backward)
    if position_weights == "dpace":
        ce = torch.zeros(valid.shape, device=dev, dtype=wdt)  # chunks of padding only: weight 0 anyway
        with torch.no_grad():
            for s, sl in chunks():
                h = chunk_hidden(s, sl, [(k[s:s + 1], v[s:s + 1]) for k, v in leaves_src])
                ce[s, sl] = head_ce(h, lm_head, labels[s, sl], head_chunk_rows).to(wdt)
        weights = dpace_weights(ce, valid.to(wdt), float(dpace_alpha))
        del ce
    elif position_weights == "decay":
        weights = decay_weights(valid.to(wdt), float(gamma))
    else:
        raise ValueError(f"position_weights must be decay or dpace, not {position_weights!r}")
    denom = weights.sum().clamp_min(1e-12)

    # 3. per chunk: forward, head + loss, backward into the drafter and the context k/v leaves
    total = torch.zeros((), device=dev, dtype=torch.float32)
    n_correct = torch.zeros((), device=dev, dtype=torch.float32)
    for s, sl in chunks():
        kp = keep[s, sl]
        leaves = [(k[s:s + 1].detach().requires_grad_(True), v[s:s + 1].detach().requires_grad_(True))
                  for k, v in leaves_src]
        h = chunk_hidden(s, sl, leaves)
        teacher = None
        if soft:
            tpos = (posc[s, sl] - 1).clamp(min=0)
            teacher = teacher_final[s].index_select(0, tpos.reshape(-1)).view(n_c, B - 1, -1).to(dtype)
        fn = dflash_loss_fn(weights[s, sl], kl_weight=kl_weight if soft else 0.0, temperature=temperature,
                            cap_lambda=cap_lambda, block_valid=kp, denom=denom, n_valid_blocks=n_valid_blocks)
        loss, ce, kl, correct = chunked_head_loss(h, lm_head, labels[s, sl], fn, teacher=teacher,
                                                  temperature=temperature, chunk_rows=head_chunk_rows)
        (loss * loss_scale).backward()
        for (kl_, vl_), (gk, gv) in zip(leaves, gacc):
            if kl_.grad is not None:
                gk[s:s + 1].add_(kl_.grad)
            if vl_.grad is not None:
                gv[s:s + 1].add_(vl_.grad)
        total = total + loss.detach()
        n_correct = n_correct + (correct & valid[s, sl]).sum()
    # 4. context path backward with the accumulated k/v gradients
    outs, grads = [], []
    for (k, v), (gk, gv) in zip(ctx, gacc):
        outs += [k, v]
        grads += [gk.to(k.dtype), gv.to(v.dtype)]
    torch.autograd.backward(outs, grads)
    return {"loss": total, "correct": n_correct, "valid": valid.sum(), "weight_sum": denom,
            "blocks": keep.sum(), "positions": keep.sum() * B}


def reference_loss(drafter, embed, lm_head, input_ids, taps, loss_mask, lengths, anchors, keep, *,
                   block_size, mask_token_id, gamma=10.0, dtype=torch.float64, cap_lambda=0.0,
                   kl_weight=0.0, temperature=1.0, teacher_final=None, position_weights="decay",
                   dpace_alpha=0.5):
    """Unchunked dense-mask forward of the same objective, plain autograd (tests only)."""
    c = drafter.config
    B = block_size
    b, S = input_ids.shape
    N = anchors.shape[1]
    dev = input_ids.device
    cos, sin = fo.rope_tables(S + B + 1, c.head_dim, dev, float(getattr(c, "rope_theta", 1e6)))
    ctx = context_kv(drafter, taps, cos[:S], sin[:S], dtype)
    ids = torch.full((b, N, B), mask_token_id, device=dev, dtype=torch.long)
    ids[:, :, 0] = input_ids.gather(1, anchors)
    k_idx = torch.arange(1, B, device=dev)
    pos = anchors[:, :, None] + k_idx
    posc = pos.clamp(max=S - 1)
    valid = (pos < lengths.view(b, 1, 1)) & loss_mask.gather(1, posc.reshape(b, -1)).view(posc.shape).bool() & keep[:, :, None]
    weights = decay_weights(valid.to(dtype), float(gamma))
    labels = input_ids.gather(1, posc.reshape(b, -1)).view(posc.shape)
    soft = teacher_final is not None and kl_weight > 0
    from trainer.chunked_head import naive_head_loss
    hs, ts = [], []
    for s in range(b):
        x = F.embedding(ids[s].view(1, -1), embed).to(dtype)
        bpos = (anchors[s][:, None] + torch.arange(B, device=dev)).view(-1)
        m = dense_dflash_mask(anchors[s][None].cpu(), S, B, keep[s][None].cpu()).to(dev)[:, None]

        def attend(q, k, v, m=m):
            rep = q.shape[1] // k.shape[1]
            return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=m)

        out = block_forward(drafter, x, [(k[s:s + 1], v[s:s + 1]) for k, v in ctx], cos[bpos], sin[bpos], attend, dtype)
        hs.append(out.view(N, B, -1)[:, 1:])
        if soft:
            ts.append(teacher_final[s].index_select(0, (posc[s] - 1).clamp(min=0).reshape(-1)).view(N, B - 1, -1).to(dtype))
    h = torch.cat(hs)
    if position_weights == "dpace":  # all logits at once, plain cross-entropy: independent of head_ce
        z = h.detach().reshape(-1, h.shape[-1]) @ lm_head.to(dtype).t()
        ce = F.cross_entropy(z, labels.reshape(-1), reduction="none").view(b, N, B - 1)
        weights = dpace_weights(ce, valid.to(dtype), float(dpace_alpha))
    fn = dflash_loss_fn(weights.view(b * N, B - 1), kl_weight=kl_weight if soft else 0.0, temperature=temperature,
                        cap_lambda=cap_lambda, block_valid=keep.reshape(-1))
    return naive_head_loss(h, lm_head.to(dtype), labels.view(b * N, B - 1), fn,
                           teacher=torch.cat(ts) if soft else None, temperature=temperature)
