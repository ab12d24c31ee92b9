"""A fast no-grad forward of a Qwen3.5/3.6 target (hybrid Gated DeltaNet + gated full
attention), producing what the drafter needs: the tapped decoder-layer outputs and, for
soft labels, the final normed hidden state. trainer/gpu/fast_target.py does the same for dense
Qwen3 targets; this is its hybrid counterpart, over the transformers model's own weights.

Per layer, against transformers' Qwen3_5DecoderLayer (the same math, tested on CPU in
tests/test_trainer_hybrid.py and on an H200 by bench/target_forward/hybrid.py):

* one GEMM per projection group: Gated DeltaNet in_proj_qkv | in_proj_z | in_proj_b |
  in_proj_a; full attention q_proj (query and output gate interleaved per head) | k_proj |
  v_proj; MLP gate | up. The transformers layers' parameters are re-pointed at views of the
  fused tensors (``share_weights``), so memory is not doubled and both forwards stay usable;
* the Gated DeltaNet's short causal convolution, SiLU and the q/k L2 norm as one compiled
  function over the channels-last projection (no transposes) that convolves q, k and v each
  from its own channels and writes them contiguous, the form fla's kernels read (a split
  view would be copied by them): three passes of 75–166 µs a layer at Qwen3.6-27B widths;
  the decay/β gates and the gated RMSNorm each one fused pass (torch.compile on CUDA);
* the gated delta rule through flash-linear-attention's Triton chunk kernel
  (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``) when ``fla`` is importable and the
  tensors are on CUDA, with q/k at their 16 key heads (fla reads value head j's key head as
  j // (Hv / Hk), transformers' repeat_interleave order, so nothing is repeated), else
  transformers' own PyTorch chunk implementation on repeated heads (CPU tests);
* full attention through SDPA (cuDNN / FlashAttention / memory-efficient, first that takes
  head dim 256 with GQA), partial RoPE (the first quarter of each head, Qwen3.5's mrope
  reduces to plain RoPE for text: all three position components are equal);
* Qwen3.5's zero-centred RMSNorm (x̂ · (1 + w), in fp32) fused with the residual add;
* it stops after the last tapped layer unless the final state is wanted, and keeps no
  hidden state but the tapped ones;
* with FP8 weights (trainer/gpu/fp8.py) every projection is an e4m3 GEMM whose input is
  quantized per row by its producer: the zero-centred norms, SiLU·up, the gated attention
  output, the Gated DeltaNet's gated norm (each compiled with its quantization on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from trainer import family
from trainer.gpu import fp8
from trainer.layers import fused_ops as fo
from trainer.gpu.fast_target import TargetLayer  # a gated full-attention layer: wqkv holds query | gate per head, k, v

_COMPILE = fo._COMPILE


def _maybe_compile(fn):
    return torch.compile(fn, dynamic=False) if _COMPILE else fn


def _rms1p(x, w, eps: float):
    """Qwen3.5's RMSNorm: statistics and the (1 + w) scale in fp32, then the input dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).to(x.dtype)


def _add_rms1p(x, y, w, eps: float):
    r = x + y
    return r, _rms1p(r, w, eps)


def _conv_silu(x, w):
    """Causal depthwise conv over time of channels-last x [b, L, C] with w [C, K], then SiLU;
    fp32 accumulation (transformers runs F.conv1d in the weight dtype, then SiLU)."""
    K = w.shape[-1]
    L = x.shape[1]
    xp = F.pad(x, (0, 0, K - 1, 0)).float()
    wf = w.float()
    y = xp[:, 0:L] * wf[:, 0]
    for j in range(1, K):
        y = y + xp[:, j:j + L] * wf[:, j]
    return F.silu(y.to(x.dtype))


def _conv_silu_qkv(x, w, key_dim: int, head_dim: int):
    """The Gated DeltaNet's conv + SiLU (:func:`_conv_silu`) as q, k (each L2-normalised per key
    head in fp32, eps 1e-6 as fla's and transformers' l2norm) and v, contiguous. Each is
    convolved from its own channels, so the compiled pass writes the three directly instead of
    a whole convolved projection that three more passes then split."""
    b, L, C = x.shape
    v_dim = C - 2 * key_dim

    def l2(t):
        tf = t.float().view(b, L, key_dim // head_dim, head_dim)
        return (tf * torch.rsqrt(tf.pow(2).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)

    q = l2(_conv_silu(x[..., :key_dim], w[:key_dim]))
    k = l2(_conv_silu(x[..., key_dim:2 * key_dim], w[key_dim:2 * key_dim]))
    v = _conv_silu(x[..., 2 * key_dim:], w[2 * key_dim:])
    return q, k, v.view(b, L, v_dim)


def _gates(a, b, A_log, dt_bias):
    """Per token and value head: the log-space decay g = −exp(A_log)·softplus(a + dt_bias)
    (fp32) and the write strength β = sigmoid(b)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


def _gated_norm(o, z, w, eps: float):
    """Qwen3_5RMSNormGated over the value head dim: w · x̂ (input dtype) · SiLU(z) (fp32)."""
    dtype = o.dtype
    of = o.float()
    y = w * (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (y * F.silu(z.float())).to(dtype)


def _qk_prep(q, k, qn, kn, cos, sin, eps: float):
    """Full-attention q/k [b, L, h, d]: zero-centred norm over the head dim, then RoPE on the
    first cos.shape[-1] dims (rotate-half inside them), the rest passed through."""
    q, k = _rms1p(q, qn, eps), _rms1p(k, kn, eps)
    rd = cos.shape[-1]
    c, s = cos[None, :, None, :].to(q.dtype), sin[None, :, None, :].to(q.dtype)

    def rope(x):
        xr, xp = x[..., :rd], x[..., rd:]
        half = rd // 2
        rot = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
        return torch.cat((xr * c + rot * s, xp), dim=-1)

    return rope(q).transpose(1, 2), rope(k).transpose(1, 2)


rms1p = _maybe_compile(_rms1p)
add_rms1p = _maybe_compile(_add_rms1p)
conv_silu_qkv = _maybe_compile(_conv_silu_qkv)
gates = _maybe_compile(_gates)
gated_norm = _maybe_compile(_gated_norm)
qk_prep = _maybe_compile(_qk_prep)


def _gated_heads(o, gate):
    """Gated attention's o-projection input: the heads merged, times sigmoid of the gate."""
    b, h, L, d = o.shape
    return o.transpose(1, 2).reshape(b, L, h * d) * torch.sigmoid(gate.reshape(b, L, h * d))


def _merged_norm(o, z, w, eps: float):
    """The Gated DeltaNet's out-projection input [b, L, Hv·dv]."""
    b, L = o.shape[:2]
    return _gated_norm(o, z, w, eps).reshape(b, L, -1)


def _q(fn):
    """``fn`` with its output quantized per row in the same compiled op (fp8.quantize_rows)."""
    def produce(*args):
        return fp8.quantize_rows(fn(*args))
    return _maybe_compile(produce)


def _add_rms1p_q(x, y, w, eps: float):
    r = x + y
    return r, fp8.quantize_rows(_rms1p(r, w, eps))


# What a hybrid layer calls per precision (fp8.BF16/FP8's counterpart for this family's norms
# and gated outputs): a producer gives the next GEMM's input, ``mm`` consumes it.
# The bf16 set is the forward as it was: eager gate, compiled gated norm.
BF16_OPS = SimpleNamespace(name="bf16", norm=rms1p, add_norm=add_rms1p, silu_mul=fo.silu_mul, gated_heads=_gated_heads,
                           merged_norm=lambda o, z, w, eps: gated_norm(o, z, w, eps).reshape(*o.shape[:2], -1),
                           mm=fp8.BF16.mm)
FP8_OPS = SimpleNamespace(name="fp8", norm=_q(_rms1p), add_norm=_maybe_compile(_add_rms1p_q),
                          silu_mul=fp8.FP8.silu_mul, gated_heads=_q(_gated_heads), merged_norm=_q(_merged_norm),
                          mm=fp8.mm)


def chunk_gated_delta_rule(q, k, v, g, beta):
    """o [b, L, Hv, dv] of the gated delta rule on L2-normalised q/k [b, L, Hk, dk] (Hk
    divides Hv: grouped value attention, value head j reads key head j // (Hv / Hk)), q
    scaled by dk^-½, zero initial state. fla's Triton kernel on CUDA when importable (it
    takes the grouped heads as they are), else transformers' PyTorch chunk implementation
    on q/k repeated to the value heads."""
    if q.is_cuda and family.fast_forward_kernels():
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

        o, _ = fla_chunk(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=False)
        return o
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    rep = v.shape[2] // q.shape[2]
    o, _ = torch_chunk_gated_delta_rule(q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2), v,
                                        g=g, beta=beta, use_qk_l2norm_in_kernel=False)
    return o


_SDPA_OK: dict = {}


def causal_attention(q, k, v):
    """Causal SDPA with GQA, q [b, h, L, d], k/v [b, hk, L, d]; on CUDA the first of cuDNN,
    FlashAttention and memory-efficient attention that takes the shape."""
    if not q.is_cuda:
        rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    key = (q.shape[1], k.shape[1], q.shape[-1])
    order = _SDPA_OK.get(key) or [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    for be in order:
        try:
            with sdpa_kernel([be]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            _SDPA_OK[key] = [be]
            return out
        except RuntimeError:
            continue
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)


@dataclass
class DeltaNetLayer:
    ln1: torch.Tensor
    w_in: torch.Tensor  # [2·key_dim + value_dim | value_dim | Hv | Hv, H]: qkv | z | b | a
    conv: torch.Tensor  # [2·key_dim + value_dim, K]
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor  # [dv]
    wo: torch.Tensor
    ln2: torch.Tensor
    wgu: torch.Tensor
    wd: torch.Tensor


@dataclass(frozen=True)
class HybridDims:
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    lin_k_heads: int
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    eps: float
    rope_theta: float

    @classmethod
    def from_text_config(cls, t: dict) -> "HybridDims":
        rp = t.get("rope_parameters") or {}
        hd = int(t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"])
        partial = float(rp.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25)))
        return cls(int(t["num_attention_heads"]), int(t["num_key_value_heads"]), hd, int(hd * partial),
                   int(t["linear_num_key_heads"]), int(t["linear_num_value_heads"]), int(t["linear_key_head_dim"]),
                   int(t["linear_value_head_dim"]), float(t.get("rms_norm_eps", 1e-6)),
                   float(rp.get("rope_theta", t.get("rope_theta", 1e7))))


class FastHybridTarget:
    def __init__(self, dims: HybridDims, embed, layers, layer_ids, final_norm):
        self.dims, self.embed, self.layers = dims, embed, layers
        self.layer_ids = list(layer_ids)
        self.final_norm = final_norm
        self._rope = None
        self.ops = FP8_OPS if layers and isinstance(layers[0].wgu, fp8.Fp8Weight) else BF16_OPS

    def _tables(self, L: int, device):
        if self._rope is None or self._rope[0].shape[0] < L:
            d = self.dims
            inv = 1.0 / (d.rope_theta ** (torch.arange(0, d.rotary_dim, 2, device=device, dtype=torch.float32) / d.rotary_dim))
            f = torch.outer(torch.arange(max(L, 8192), device=device, dtype=torch.float32), inv)
            emb = torch.cat((f, f), dim=-1)
            self._rope = (emb.cos(), emb.sin())
        return self._rope[0][:L], self._rope[1][:L]

    def _mixer(self, w, h, cos, sin):
        """The token mixer's output [b, L, H] of one layer on normed states h (a tensor, or
        FP8's (e4m3, scale))."""
        d, ops = self.dims, self.ops
        b, L = input_shape(h)
        if isinstance(w, TargetLayer):
            q_dim, kv_dim = d.heads * d.head_dim, d.kv_heads * d.head_dim
            qg, k, v = ops.mm(h, w.wqkv).split([2 * q_dim, kv_dim, kv_dim], dim=-1)
            q, gate = qg.view(b, L, d.heads, 2 * d.head_dim).chunk(2, dim=-1)
            q, k = qk_prep(q, k.view(b, L, d.kv_heads, d.head_dim), w.qn, w.kn, cos, sin, d.eps)
            o = causal_attention(q, k, v.view(b, L, d.kv_heads, d.head_dim).transpose(1, 2))
            return ops.mm(ops.gated_heads(o, gate), w.wo)
        key_dim, value_dim = d.lin_k_heads * d.lin_k_dim, d.lin_v_heads * d.lin_v_dim
        qkv, z, bb, a = ops.mm(h, w.w_in).split([2 * key_dim + value_dim, value_dim, d.lin_v_heads, d.lin_v_heads], -1)
        q, k, v = conv_silu_qkv(qkv, w.conv, key_dim, d.lin_k_dim)
        g, beta = gates(a, bb, w.A_log, w.dt_bias)
        o = chunk_gated_delta_rule(q, k, v.view(b, L, d.lin_v_heads, d.lin_v_dim), g, beta)
        return ops.mm(ops.merged_norm(o, z.view(b, L, d.lin_v_heads, d.lin_v_dim), w.norm, d.eps), w.wo)

    @property
    def precision(self) -> str:
        return self.ops.name

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, want_final: bool = False):
        """input_ids [b, S] right-padded → (taps [b, S, n·H], final [b, S, H] or None).
        Causal everywhere (attention and the recurrence), so padding never reaches a real
        position."""
        eps, ops = self.dims.eps, self.ops
        b, L = input_ids.shape
        x = F.embedding(input_ids, self.embed)
        cos, sin = self._tables(L, input_ids.device)
        last = len(self.layers) - 1 if want_final else max(self.layer_ids)
        taps = {}
        h = ops.norm(x, self.layers[0].ln1, eps)
        for i in range(last + 1):
            w = self.layers[i]
            x, h = ops.add_norm(x, self._mixer(w, h, cos, sin), w.ln2, eps)
            m = ops.mm(ops.silu_mul(ops.mm(h, w.wgu)), w.wd)
            nxt = self.layers[i + 1].ln1 if i < last else self.final_norm
            if i < last:
                x, h = ops.add_norm(x, m, nxt, eps)
            elif want_final:
                x, h = add_rms1p(x, m, nxt, eps)  # the final state leaves in the model's dtype
            else:
                x = x + m
            if i in self.layer_ids:
                taps[i] = x
        out = torch.cat([taps[i] for i in self.layer_ids], dim=-1)  # a layer named twice given twice
        return out, (h if want_final else None)

    @classmethod
    def from_hf(cls, hf_model, layer_ids, keep_all_layers: bool = False, share_weights: bool = False):
        """From a transformers Qwen3_5TextModel (``model.model`` of Qwen3_5ForCausalLM)."""
        cfg = hf_model.config
        dims = HybridDims.from_text_config(cfg.to_dict())
        n = cfg.num_hidden_layers if keep_all_layers else max(layer_ids) + 1
        layers = []
        with torch.no_grad():
            for lyr in hf_model.layers[:n]:
                m = lyr.mlp
                wgu = fp8.fuse((m.gate_proj, m.up_proj), share_weights)
                if hasattr(lyr, "linear_attn"):
                    la = lyr.linear_attn
                    w_in = fp8.fuse((la.in_proj_qkv, la.in_proj_z, la.in_proj_b, la.in_proj_a), share_weights)
                    layers.append(DeltaNetLayer(lyr.input_layernorm.weight, w_in, la.conv1d.weight.view(la.conv1d.weight.shape[0], -1),
                                                la.A_log, la.dt_bias, la.norm.weight, fp8.weight_of(la.out_proj),
                                                lyr.post_attention_layernorm.weight, wgu, fp8.weight_of(m.down_proj)))
                else:
                    a = lyr.self_attn
                    wqkv = fp8.fuse((a.q_proj, a.k_proj, a.v_proj), share_weights)
                    layers.append(TargetLayer(lyr.input_layernorm.weight, wqkv, a.q_norm.weight, a.k_norm.weight,
                                              fp8.weight_of(a.o_proj), lyr.post_attention_layernorm.weight, wgu,
                                              fp8.weight_of(m.down_proj)))
        return cls(dims, hf_model.embed_tokens.weight, layers, layer_ids, hf_model.norm.weight)


def input_shape(h) -> tuple[int, int]:
    """(b, L) of a GEMM input: a tensor [b, L, K] or FP8's (e4m3 [b, L, K], scale)."""
    t = h[0] if isinstance(h, tuple) else h
    return t.shape[0], t.shape[1]


def tokens_per_layer_flops(dims: HybridDims, hidden: int, intermediate: int, layer_type: str, seq_len: int) -> float:
    """Matrix FLOP per token of one layer at sequence length ``seq_len`` (trainer/plan/flops.py's
    convention: a multiply-add is 2 FLOP, projections + MLP + attention scores/values; for
    a Gated DeltaNet layer the recurrence's state reads and writes, 3 dk×dv products per
    token and value head, stand in for "attention")."""
    mlp = 2 * 3 * hidden * intermediate
    if layer_type == family.FULL:
        q_dim, kv_dim = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
        proj = 2 * hidden * (2 * q_dim + 2 * kv_dim) + 2 * q_dim * hidden
        attn = 4 * q_dim * (seq_len + 1) / 2
        return proj + mlp + attn
    key_dim, value_dim = dims.lin_k_heads * dims.lin_k_dim, dims.lin_v_heads * dims.lin_v_dim
    proj = 2 * hidden * (2 * key_dim + 2 * value_dim + 2 * dims.lin_v_heads) + 2 * value_dim * hidden
    rec = 3 * 2 * dims.lin_v_heads * dims.lin_k_dim * dims.lin_v_dim
    return proj + mlp + rec


def forward_flops(text_cfg: dict, seq_len: int, batch: int = 1, last_layer: int | None = None) -> float:
    dims = HybridDims.from_text_config(text_cfg)
    types = family.target_layer_types(text_cfg)
    n = len(types) if last_layer is None else last_layer + 1
    per_token = sum(tokens_per_layer_flops(dims, int(text_cfg["hidden_size"]), int(text_cfg["intermediate_size"]), t,
                                           seq_len) for t in types[:n])
    return per_token * seq_len * batch


__all__ = ["FastHybridTarget", "HybridDims", "forward_flops", "chunk_gated_delta_rule"]
