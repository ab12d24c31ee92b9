"""A fast no-grad forward of a Qwen3-family target that produces what the drafter needs:
the tapped decoder-layer outputs (and, for soft labels, the final normed hidden state).

Against the plain Hugging Face forward it (1) stops after the last tapped layer unless the
final state is wanted (34 of 36 layers for Qwen3-8B with 5 taps); (2) uses fused q|k|v and
gate|up weights (one GEMM each); (3) fuses the elementwise work (fused_ops); (4) picks the
SDPA backend (cuDNN by default on Hopper, FlashAttention-2 as fallback); (5) keeps no
hidden states but the tapped ones; (6) runs a micro-batch in chunks of whole sequences
(at most ``chunk_tokens`` tokens, at least one sequence), writing each chunk's taps and
final state into the outputs allocated once: its transient memory is one chunk's whatever
the token budget (an unchunked forward of 450,560 tokens asked for 10.3 GiB at once for
one MLP product and ran out of memory), and the chunk shapes do not depend on the
budget, so the compiled kernels of one budget serve every other.

Build it from an HF model (``FastTarget.from_hf(model.model, layer_ids)``) or with random
weights directly on the device (``FastTarget.random(shape, …)``, benchmarks).

Precision follows the weights: bf16 tensors, or FP8 (trainer/gpu/fp8.py: ``Fp8Weight`` with
per-channel scales, given by an HF model whose linears were quantized at load, or
``random(..., precision="fp8")``), in which case each GEMM's input is quantized per row by the
compiled op that produces it (the norms, SiLU·up, the attention heads' merge). The taps (the
residual stream) and the final normed state stay in the model's dtype either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.gpu import fp8
from trainer.layers import fused_ops as fo
from trainer.plan.flops import ModelShape
from trainer.plan.memory import TARGET_CHUNK_TOKENS


@dataclass
class TargetLayer:
    ln1: torch.Tensor
    wqkv: torch.Tensor | fp8.Fp8Weight
    qn: torch.Tensor
    kn: torch.Tensor
    wo: torch.Tensor | fp8.Fp8Weight
    ln2: torch.Tensor
    wgu: torch.Tensor | fp8.Fp8Weight
    wd: torch.Tensor | fp8.Fp8Weight

    def quantized(self) -> "TargetLayer":
        """This layer with its four GEMM weights in FP8 (per-channel scales)."""
        q = fp8.Fp8Weight.of
        return TargetLayer(self.ln1, q(self.wqkv), self.qn, self.kn, q(self.wo), self.ln2, q(self.wgu), q(self.wd))


_GQA_OK: dict = {}


def sdpa_causal(backend: str = "cudnn"):
    """attn(q [b,h,L,d], k/v [b,hk,L,d]) → [b,h,L,d], causal, with one SDPA backend. GQA is
    passed natively (enable_gqa) where the backend takes it, else by repeating k/v."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
          "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend]

    def attn(q, k, v):
        rep = q.shape[1] // k.shape[1]
        with sdpa_kernel([be]):
            if rep > 1 and _GQA_OK.get(backend, True):
                try:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                except RuntimeError:
                    _GQA_OK[backend] = False
            if rep > 1:
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return attn


class FastTarget:
    def __init__(self, shape: ModelShape, embed: torch.Tensor, layers: list[TargetLayer],
                 layer_ids: list[int], final_norm: torch.Tensor | None = None, rope_theta: float = 1e6,
                 eps: float = 1e-6, attn_backend: str = "cudnn", chunk_tokens: int = TARGET_CHUNK_TOKENS):
        self.shape, self.embed, self.layers = shape, embed, layers
        self.chunk_tokens = int(chunk_tokens)
        self.layer_ids = list(layer_ids)
        self.final_norm = final_norm
        self.eps = eps
        self.rope_theta = rope_theta
        self.attn = sdpa_causal(attn_backend)
        self._rope = None
        self.ops = fp8.ops_for(layers[0].wqkv) if layers else fp8.BF16

    @property
    def precision(self) -> str:
        """"fp8" when the layers' GEMM weights are FP8, else "bf16" (the model's dtype)."""
        return self.ops.name

    def _tables(self, L: int, device):
        if self._rope is None or self._rope[0].shape[0] < L:
            self._rope = fo.rope_tables(max(L, 8192), self.shape.head_dim, device, self.rope_theta)
        return self._rope[0][:L], self._rope[1][:L]

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, want_final: bool = False, chunk_tokens: int | None = None):
        """input_ids [b, S] right-padded → (taps [b, S, n·H], final [b, S, H] or None).
        Sequences go through the layers ``chunk_tokens // S`` at a time (at least one;
        default: this target's ``chunk_tokens``); causal attention never crosses sequences,
        so the chunks compute exactly the unchunked forward. Each residual add is fused with
        the norm that follows it."""
        b, L = input_ids.shape
        H = self.shape.hidden
        per = max(1, int(chunk_tokens or self.chunk_tokens) // L)
        out = torch.empty(b, L, len(self.layer_ids) * H, device=input_ids.device, dtype=self.embed.dtype)
        final = torch.empty(b, L, H, device=input_ids.device, dtype=self.embed.dtype) if want_final else None
        for s0 in range(0, b, per):
            sl = slice(s0, min(b, s0 + per))
            self._forward_chunk(input_ids[sl], out[sl], None if final is None else final[sl])
        return out, final

    def _forward_chunk(self, input_ids: torch.Tensor, out: torch.Tensor, final: torch.Tensor | None) -> None:
        s = self.shape
        b, L = input_ids.shape
        H = s.hidden
        x = F.embedding(input_ids, self.embed)
        cos, sin = self._tables(L, input_ids.device)
        want_final = final is not None
        last = len(self.layers) - 1 if want_final else max(self.layer_ids)
        slots = {}  # layer → its column blocks in out (a layer named twice is written twice)
        for j, i in enumerate(self.layer_ids):
            slots.setdefault(i, []).append(j)
        ops = self.ops  # bf16: h is a tensor; fp8: (e4m3, per-row scale) from the producer
        h = ops.norm(x, self.layers[0].ln1, self.eps)
        for i in range(last + 1):
            w = self.layers[i]
            q, k, v = fo.qkv_prep(ops.mm(h, w.wqkv), w.qn, w.kn, cos, sin, s.n_heads, s.n_kv_heads, s.head_dim, self.eps)
            o = ops.heads(self.attn(q, k, v))
            del q, k, v
            x, h = ops.add_norm(x, ops.mm(o, w.wo), w.ln2, self.eps)
            del o
            m = ops.mm(ops.silu_mul(ops.mm(h, w.wgu)), w.wd)
            nxt = self.layers[i + 1].ln1 if i < last else self.final_norm
            if nxt is not None and i < last:
                x, h = ops.add_norm(x, m, nxt, self.eps)
            elif nxt is not None and want_final:
                x, h = fo.add_norm(x, m, nxt, self.eps)  # the final state leaves in the model's dtype
            else:
                x = x + m
            del m
            for j in slots.get(i, ()):
                out[:, :, j * H:(j + 1) * H].copy_(x)
        if want_final:
            final.copy_(h)

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_hf(cls, hf_model, layer_ids, attn_backend: str = "cudnn", keep_all_layers: bool = False,
                share_weights: bool = False, chunk_tokens: int = TARGET_CHUNK_TOKENS):
        """From a transformers Qwen3Model (``model.model``). Layers after the last tapped one
        are skipped unless ``keep_all_layers``. The fused q|k|v and gate|up weights are new
        tensors; with ``share_weights`` the transformers layers' own parameters are re-pointed
        at views of them, so the model's memory is not doubled and both forwards stay usable.
        An HF model whose linears are FP8 (``fp8.quantize_linears``) gives an FP8 forward."""
        cfg = hf_model.config
        shape = ModelShape.from_hf_config(cfg)
        n = shape.n_layers if keep_all_layers else max(layer_ids) + 1
        layers = []
        with torch.no_grad():
            for lyr in hf_model.layers[:n]:
                a, m = lyr.self_attn, lyr.mlp
                wqkv = fp8.fuse((a.q_proj, a.k_proj, a.v_proj), share_weights)
                wgu = fp8.fuse((m.gate_proj, m.up_proj), share_weights)
                layers.append(TargetLayer(
                    lyr.input_layernorm.weight, wqkv, a.q_norm.weight, a.k_norm.weight, fp8.weight_of(a.o_proj),
                    lyr.post_attention_layernorm.weight, wgu, fp8.weight_of(m.down_proj)))
        theta = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 1e6)
        return cls(shape, hf_model.embed_tokens.weight, layers, layer_ids, hf_model.norm.weight,
                   rope_theta=float(theta), eps=float(getattr(cfg, "rms_norm_eps", 1e-6)), attn_backend=attn_backend,
                   chunk_tokens=chunk_tokens)

    @classmethod
    def random(cls, shape: ModelShape, layer_ids, device="cuda", dtype=torch.bfloat16, n_layers: int | None = None,
               attn_backend: str = "cudnn", std: float = 0.02, chunk_tokens: int = TARGET_CHUNK_TOKENS,
               precision: str = "bf16", seed: int | None = None):
        """Random weights made on the device (benchmarks): layers 0..max(layer_ids) unless
        n_layers says more; ``precision`` "fp8" quantizes each layer as it is made (the bf16
        model never exists whole). With ``seed`` the weights are those of any other call with
        the same seed and shape, whatever the precision (bf16 against fp8 on equal weights)."""
        n = n_layers if n_layers is not None else max(layer_ids) + 1
        H, q, kv, I, hd = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate, shape.head_dim

        gen = None
        if seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed)

        def mat(o, i):
            return torch.randn(o, i, device=device, dtype=dtype, generator=gen) * std

        def ones(k):
            return torch.ones(k, device=device, dtype=dtype)

        if precision not in ("bf16", "fp8"):
            raise ValueError(f"precision {precision!r}: expected bf16 or fp8")
        layers = []
        for _ in range(n):
            layer = TargetLayer(ones(H), mat(q + 2 * kv, H), ones(hd), ones(hd), mat(H, q), ones(H), mat(2 * I, H), mat(H, I))
            layers.append(layer.quantized() if precision == "fp8" else layer)
        embed = mat(shape.vocab, H)
        return cls(shape, embed, layers, layer_ids, ones(H), attn_backend=attn_backend, chunk_tokens=chunk_tokens)
