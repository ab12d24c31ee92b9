"""A DFlash or DFlash2 drafter for transformers: the modeling file written into every export
(``modeling_dflash.py`` beside config.json, named by its ``auto_map``: ``DFlashDraftModel``
or ``DFlash2DraftModel``), so that

    draft = AutoModel.from_pretrained(DIR, trust_remote_code=True, dtype="auto")
    out = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=256)

works with torch and transformers alone. Nothing here imports dflash-ctl: this file is read
as text by trainer/serve/export.py and must stay loadable on a machine that has only torch,
transformers and safetensors (tests/test_export_served.py loads it in such a venv).

The math is the trainer's, op for op and in the same order: trainer/model.py takes its
norm, RoPE and MLP from this file and trainer/serve/evaluate.py its verification step
(:func:`accept`) and its drafts (:func:`propose`: argmax, or DFlash2's path selector); the
DFlash2 convolutions, selector scores and layer sequence (:func:`layer_forward`) are the
trainer's too; the attention here repeats the trainer's sdpa path (context K/V projected
together with the block's, the same boolean mask through SDPA). So a drafter decodes here
exactly as the trainer's evaluator decodes it: same drafts, same acceptance length
(tests/test_export_served.py).

``spec_generate`` is greedy block verification without a KV cache: every round the target
recomputes the committed prefix, as the evaluator does. It is the reference for what the
drafter accepts, not a fast server; SGLang (``--speculative-algorithm DFLASH``) and vLLM
(``"method": "dflash"``) serve the same directory with their own kernels.
"""

from __future__ import annotations

import copy

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PreTrainedModel

try:
    from transformers import Qwen3Config
except ImportError:  # transformers older than Qwen3's addition (4.51)
    from transformers.models.qwen3.configuration_qwen3 import Qwen3Config


def _rope_theta(config) -> float:
    # transformers 5 keeps θ in rope_parameters; 4.x kept a top-level rope_theta.
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)


def _dflash(config) -> dict:
    return dict(getattr(config, "dflash_config", None) or {})


class DFlashRMSNorm(nn.Module):
    """Qwen3's RMSNorm: statistics in fp32, the weight applied in the input dtype."""

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
    """cos/sin [b, N, head_dim] in fp32 at integer positions [b, N] (default RoPE)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DFlashAttention(nn.Module):
    """Queries from the block; keys and values from [context, block], projected together."""

    def __init__(self, config):
        super().__init__()
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        nh, nkv, hd = config.num_attention_heads, config.num_key_value_heads, self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, nh * hd, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, nkv * hd, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, nkv * hd, bias=bias)
        self.o_proj = nn.Linear(nh * hd, config.hidden_size, bias=bias)
        self.q_norm = DFlashRMSNorm(hd, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(hd, config.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_k, mask):
        b, q_len, _ = x.shape
        hd = self.head_dim
        kv_in = torch.cat([ctx, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(b, q_len, -1, hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(b, kv_in.shape[1], -1, hd)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, kv_in.shape[1], -1, hd).transpose(1, 2)
        q, k = apply_rope(q, *rope_q), apply_rope(k, *rope_k)
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP; a DFlash2 layer (``conv`` = (taps, group size)) also
    has the in-block convolutions ``attention_conv`` and ``mlp_conv`` around its sublayers."""

    def __init__(self, config, conv: tuple[int, int] | None = None):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        if conv is not None:
            self.attention_conv = DFlashGroupedConv(config.hidden_size, *conv)
            self.mlp_conv = DFlashGroupedConv(config.hidden_size, *conv)

    def forward(self, x, ctx, rope_q, rope_k, mask, block_size: int):
        return layer_forward(self, x, lambda h: self.self_attn(h, ctx, rope_q, rope_k, mask), block_size)


def layer_forward(layer, x: torch.Tensor, attend, block_size: int) -> torch.Tensor:
    """One decoder layer's residual sequence over blocks x [b, n·B, H]; ``attend(h)`` is its
    attention on the normed input. A DFlash2 layer convolves each sublayer's input
    (``prepare``) and output (``finish``) within each block of ``block_size``, both halves'
    dynamic taps projected from the sublayer's input (docs/dflash2.md)."""
    h = layer.input_layernorm(x)
    conv = getattr(layer, "attention_conv", None)
    if conv is not None:
        h, dyn = conv.prepare(h, block_size)
    o = attend(h)
    x = x + (o if conv is None else conv.finish(o, dyn, block_size))
    h = layer.post_attention_layernorm(x)
    conv = getattr(layer, "mlp_conv", None)
    if conv is not None:
        h, dyn = conv.prepare(h, block_size)
    m = layer.mlp(h)
    return x + (m if conv is None else conv.finish(m, dyn, block_size))


# -- DFlash2: the in-block convolution and the path selector (docs/dflash2.md) ----------------


def grouped_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int,
                 block_size: int) -> torch.Tensor:
    """Dynamic depthwise convolution over the positions of each block: x [b, n·B, H] (whole
    blocks end to end), dynamic [b, n·B, taps, H/group], base [taps, H]:
    out_t = Σ_tap (base[tap] + dynamic[t, tap] shared by the group's channels) · x_{t−tap}.
    A tap never crosses a block boundary: slot 0 reads zeros before it, so slot 1 reads the
    anchor (the last verified token) and a packed batch of blocks equals one block at a time."""
    b, n, H = x.shape
    taps, G = base.shape[0], H // group_size
    blocks = x.view(b, n // block_size, block_size, G, group_size)
    coef = base.to(x.dtype).view(taps, G, group_size) + dynamic.reshape(b, n // block_size, block_size, taps, G, 1)
    out = coef[:, :, :, 0] * blocks
    for tap in range(1, taps):
        out = out + coef[:, :, :, tap] * F.pad(blocks[:, :, :-tap], (0, 0, 0, 0, tap, 0))
    return out.view(b, n, H)


def conv_prepare(x: torch.Tensor, projection: torch.Tensor, base: torch.Tensor, group_size: int, block_size: int,
                 conv=None):
    """(x convolved with the input-side taps, the output-side dynamic taps): one projection of
    the sublayer input [.., H] → [.., 2, taps, H/group] gives both sides' corrections.
    ``conv``: another implementation of :func:`grouped_conv` (the trainer's, for backward)."""
    taps = base.shape[1]
    dyn = F.linear(x, projection).view(*x.shape[:-1], 2, taps, x.shape[-1] // group_size)
    return (conv or grouped_conv)(x, dyn[..., 0, :, :], base[0], group_size, block_size), dyn[..., 1, :, :]


class DFlashGroupedConv(nn.Module):
    """One sublayer's convolutions: ``base_kernel`` [2 (input, output side), taps, H] and
    ``kernel_projection`` H → 2·taps·H/group. Starts as the identity (unit self tap, zero
    correction), so a new DFlash2 layer computes what its DFlash layer computes."""

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        base = torch.zeros(2, taps, hidden_size)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * (hidden_size // group_size), bias=False)
        self.group_size = group_size
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor, block_size: int):
        return conv_prepare(x, self.kernel_projection.weight, self.base_kernel, self.group_size, block_size)

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor, block_size: int) -> torch.Tensor:
        return grouped_conv(x, dynamic, self.base_kernel[1], self.group_size, block_size)


def _up(t: torch.Tensor) -> torch.Tensor:  # scores in fp32 at least (fp64 stays fp64, for exact tests)
    return t if t.dtype == torch.float64 else t.float()


def selector_scores(hidden, unary, candidates, predecessors, predecessor_codebook, successor_codebook,
                    hidden_projection) -> torch.Tensor:
    """S(a, b) = U(b) + ⟨A[a] ⊙ P·h, B[b]⟩ for candidates b [.., k] of a slot with hidden state
    h [.., H], unary logits U [.., k], after predecessor token a [..]: the drafter's own logit
    plus a low-rank bilinear match of the two tokens' codebook rows under a gate of h."""
    gate = F.embedding(predecessors, predecessor_codebook) * F.linear(hidden, hidden_projection)
    pair = torch.einsum("...r,...kr->...k", gate, F.embedding(candidates, successor_codebook))
    return _up(unary) + _up(pair)


class DFlashCandidateSelector(nn.Module):
    """The pairwise path selector: ``predecessor_codebook`` and ``successor_codebook``
    [vocab, rank] (plain parameters: the tensor names the published drafters and the serving
    engines use) and ``hidden_projection`` H → rank. The successor codebook starts at zero,
    so every score starts as the drafter's own logit (DFlash's choice)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = int(top_k)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.predecessor_codebook.normal_(std=0.02)
            self.successor_codebook.zero_()

    def scores(self, hidden, unary, candidates, predecessors) -> torch.Tensor:
        return selector_scores(hidden, unary, candidates, predecessors, self.predecessor_codebook,
                               self.successor_codebook, self.hidden_projection.weight)

    def candidates(self, logits: torch.Tensor):
        """(unary logits, token ids) of each slot's top-k, best first."""
        return logits.topk(self.top_k, dim=-1)

    @torch.no_grad()
    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: int) -> list[int]:
        """The greedy path through the slots' candidates: hidden [n, H], logits [n, V] of the
        block's drafting slots, ``anchor`` the last verified token (slot 1's predecessor); at
        each slot the best-scored candidate after the token just chosen (ties: the candidate
        with the larger unary logit, as vLLM's walk)."""
        unary, cand = self.candidates(logits)
        prev, path = torch.tensor(int(anchor), device=hidden.device), []
        for i in range(hidden.shape[0]):
            prev = cand[i, self.scores(hidden[i], unary[i], cand[i], prev).argmax()]
            path.append(int(prev))
        return path


def propose(hidden: torch.Tensor, lm_head: torch.Tensor, anchor: int, selector=None) -> list[int]:
    """A block's drafts from the final-normed states of its drafting slots hidden [B−1, H]
    through the target's LM head: each slot's argmax (DFlash), or the selector's path from the
    anchor through each slot's top-k (DFlash2)."""
    logits = F.linear(hidden.to(lm_head.dtype), lm_head)
    if selector is None:
        return logits.argmax(-1).tolist()
    return selector.walk(hidden, logits, anchor)


def block_mask(anchors: torch.Tensor, keep: torch.Tensor, ctx_len: int, block_size: int,
               window: int | None = None) -> torch.Tensor:
    """Boolean [b, 1, N·B, S + N·B], True where a query may attend: block i (anchor a_i) sees
    context positions < a_i and its own block in both directions. ``window`` (a sliding
    layer) also bounds the context the way transformers counts a sliding window — a query at
    position p sees context keys at positions > p - window — and makes the block causal, the
    convention vLLM applies to DFlash sliding layers. A padded block sees only itself."""
    b, n = anchors.shape
    dev = anchors.device
    q_blk = torch.arange(n * block_size, device=dev) // block_size
    a_q = anchors[:, q_blk]
    keep_q = keep[:, q_blk]
    kv_pos = torch.arange(ctx_len, device=dev)[None, None, :]
    ctx_ok = (kv_pos < a_q[:, :, None]) & keep_q[:, :, None]
    own = (q_blk[:, None] == q_blk[None, :]).expand(b, -1, -1)
    if window is not None:
        q_pos = a_q + torch.arange(n * block_size, device=dev) % block_size
        ctx_ok = ctx_ok & (kv_pos > q_pos[:, :, None] - window)
        own = own & torch.ones(n * block_size, n * block_size, dtype=torch.bool, device=dev).tril()
    return torch.cat([ctx_ok, own], dim=2).unsqueeze(1)


class DFlashDraftModel(PreTrainedModel):
    """The drafter: ``fc`` + ``hidden_norm`` fuse the tapped target states into context K/V
    for every layer; the block [bonus, MASK × (B-1)] is embedded with the target's table and
    the result goes through the target's LM head. No embedding or LM head of its own."""

    config_class = Qwen3Config
    base_model_prefix = "model"
    _no_split_modules = ["DFlashDecoderLayer"]
    supports_gradient_checkpointing = False
    dflash2 = False  # DFlash2DraftModel: convolutions in every layer and a path selector

    def __init__(self, config):
        super().__init__(config)
        dflash = _dflash(config)
        self.block_size = int(getattr(config, "block_size", None) or dflash.get("block_size") or 16)
        self.mask_token_id = int(dflash.get("mask_token_id", getattr(config, "mask_token_id", 0)))
        self.target_layer_ids = [int(i) for i in dflash["target_layer_ids"]]
        self.layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
        self.sliding_window = getattr(config, "sliding_window", None)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.rope_theta = _rope_theta(config)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        conv = None
        if self.dflash2:  # the DFlash2 shape, as its loaders read it (dflash_config; docs/dflash2.md)
            conv = (int(dflash["conv_kernel_size"]), int(dflash["conv_group_size"]))
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, conv) for _ in range(config.num_hidden_layers)])
        self.norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.dflash2:
            self.candidate_selector = DFlashCandidateSelector(config.vocab_size, config.hidden_size,
                                                              int(dflash["selector_rank"]), int(dflash["selector_top_k"]))
        self.post_init()

    @property
    def selector(self):
        return getattr(self, "candidate_selector", None)

    def propose(self, hidden: torch.Tensor, lm_head: torch.Tensor, anchor: int) -> list[int]:
        """The drafts of one block from its drafting slots' states hidden [B−1, H]."""
        return propose(hidden, lm_head, anchor, self.selector)

    def forward(self, target_hidden: torch.Tensor, noise_embedding: torch.Tensor,
                anchors: torch.Tensor | None = None, keep: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """target_hidden [b, S, n·H]: the tapped target layers' outputs, concatenated;
        noise_embedding [b, N·B, H]: each block [x[a], MASK…] embedded with the target's table;
        anchors/keep [b, N] (default: one block right after the context). Returns the final
        normed block states [b, N·B, H]; the target's lm_head turns them into drafts."""
        dtype = self.fc.weight.dtype
        taps, x = target_hidden.to(dtype), noise_embedding.to(dtype)
        b, S, _ = taps.shape
        B = self.block_size
        if anchors is None:
            anchors = torch.full((b, x.shape[1] // B), S, dtype=torch.long, device=taps.device)
        if keep is None:
            keep = torch.ones(anchors.shape, dtype=torch.bool, device=taps.device)
        n = anchors.shape[1]
        ctx = self.hidden_norm(self.fc(taps))
        ctx_pos = torch.arange(S, device=taps.device).expand(b, S)
        blk_pos = (anchors[:, :, None] + torch.arange(B, device=taps.device)).reshape(b, n * B)
        rope_q = rope_cos_sin(blk_pos, self.head_dim, self.rope_theta)
        rope_k = rope_cos_sin(torch.cat([ctx_pos, blk_pos], dim=1), self.head_dim, self.rope_theta)
        full = block_mask(anchors, keep, S, B)
        sliding = block_mask(anchors, keep, S, B, int(self.sliding_window)) if "sliding_attention" in self.layer_types else None
        for layer, kind in zip(self.layers, self.layer_types):
            x = layer(x, ctx, rope_q, rope_k, sliding if kind == "sliding_attention" else full, B)
        return self.norm(x)

    # -- greedy speculative decoding against a target ------------------------------------------
    @torch.no_grad()
    def spec_generate(self, target, input_ids: torch.Tensor, max_new_tokens: int,
                      stop_token_ids: list[int] | None = None, temperature: float = 0.0, return_stats: bool = False):
        """Greedy block verification: each round drafts B-1 tokens after the last committed
        one, the target checks them in one forward, the longest agreeing prefix is kept plus
        the target's own next token. The output equals the target's greedy decoding token for
        token. Returns the ids [1, prompt + new]; with ``return_stats`` a namespace with
        ``output_ids``, ``acceptance_lengths`` (tokens committed per target forward) and
        ``tau`` (their mean). Batch size 1."""
        if temperature and temperature > 0:
            raise NotImplementedError("spec_generate is greedy (temperature 0); sampling is not implemented")
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"spec_generate takes one sequence, input_ids of shape [1, n]; got {tuple(input_ids.shape)}")
        self.eval()
        device = input_ids.device
        embed = target.get_input_embeddings().weight
        lm_head = target.get_output_embeddings().weight
        stops = set(stop_token_ids or ())
        B = self.block_size
        taps_of = _Taps(target, self.target_layer_ids)
        try:
            def draft(taps, n, bonus):
                block = torch.full((1, B), self.mask_token_id, dtype=torch.long, device=device)
                block[0, 0] = bonus
                h = self(taps[:, :n], F.embedding(block, embed), torch.tensor([[n]], device=device))
                return self.propose(h[0, 1:], lm_head, bonus)

            out, per_forward = speculative_decode(
                lambda ids, c: taps_of.cached(torch.tensor(ids, device=device), c), draft,
                input_ids[0].tolist(), max_new_tokens, stops)
        finally:
            taps_of.close()
        out = out[:max_new_tokens]
        ids = torch.tensor([input_ids[0].tolist() + out], device=device)
        if not return_stats:
            return ids
        return SimpleNamespace(output_ids=ids, acceptance_lengths=per_forward,
                               tau=sum(per_forward) / max(1, len(per_forward)), num_output_tokens=len(out))


def speculative_decode(forward_cached, draft_fn, prompt: list[int], max_new: int, stops=()) -> tuple[list, list]:
    """Greedy block speculative decoding: (new tokens, tokens committed per target forward).

    ``forward_cached(ids, cache) -> (taps, logits, cache)`` is the target with its cache (see
    verify_block); ``draft_fn(taps, n, bonus)`` drafts block-size − 1 tokens after the bonus
    token at position n from the target's taps of positions < n. The target keeps its cache
    between rounds, as serving engines do. trainer/serve/evaluate.py and the export's
    spec_generate both decode with this, so the served drafter is measured as trained."""
    seq = list(prompt)
    taps, logits, cache = forward_cached([seq], None)
    bonus = int(logits[0, -1].argmax())
    out: list[int] = []
    per_forward: list[int] = []
    while len(out) < max_new:
        draft = draft_fn(taps, len(seq), bonus)
        j, bonus, committed, block_taps, cache = verify_block(forward_cached, cache, bonus, draft)
        taps = torch.cat([taps, block_taps], dim=1)
        seq += committed
        out += committed
        per_forward.append(j + 1)
        if stops and any(t in stops for t in out):
            out = out[:next(i for i, t in enumerate(out) if t in stops) + 1]
            break
    return out, per_forward


def verify_block(forward_cached, cache, bonus: int, draft: list[int]):
    """One round of greedy block verification on a target that keeps its cache:
    ``forward_cached(ids, cache) -> (taps, logits, cache)`` runs token rows ``ids`` after the
    prefix ``cache`` holds (and updates it). Returns (drafts accepted, next bonus token, the
    committed tokens, their taps, the cache after exactly them). A rejected tail is undone by
    replaying the committed tokens on the state before the block, which also holds for
    layers with recurrent state (Qwen3.5's Gated DeltaNet), where a cache cannot be cut."""
    before = copy.deepcopy(cache)
    block_taps, logits, cache = forward_cached([[bonus] + draft], cache)
    j, nxt = accept(draft, logits[0].argmax(-1).tolist())
    committed = [bonus] + draft[:j]
    if j < len(draft):
        block_taps, _, cache = forward_cached([committed], before)
    return j, nxt, committed, block_taps[:, :len(committed)], cache


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2: the DFlash drafter with a two-tap dynamic depthwise convolution around every
    attention and MLP sublayer and a pairwise path selector over each slot's top-k candidates
    (``dflash_config``: conv_kernel_size, conv_group_size, selector_rank, selector_top_k)."""

    _no_split_modules = ["DFlashDecoderLayer"]
    dflash2 = True


def accept(draft: list[int], pred: list[int]) -> tuple[int, int]:
    """Greedy verification of one block: ``pred`` is the target's token after the bonus and
    after each draft (len(draft) + 1 of them). Returns (drafts accepted — the longest prefix
    equal to the target's own choices —, the target's token after them: the next bonus)."""
    j = 0
    while j < len(draft) and draft[j] == pred[j]:
        j += 1
    return j, pred[j]


def cache_kwarg(model) -> str:
    """The forward's cache argument: transformers renamed past_key_values → cache (5.2x)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class _Taps:
    """The target's forward with hooks on the tapped decoder layers: (taps [1, S, n·H],
    logits [1, S, V]). Layer outputs are read where the trainer reads them (the decoder
    layer's own output), not from ``output_hidden_states``, whose last entry is normed."""

    def __init__(self, target, layer_ids: list[int]):
        decoder = target.get_decoder() if hasattr(target, "get_decoder") else target.model
        layers = decoder.layers
        self.target = target
        self.layer_ids = layer_ids
        self.seen: dict[int, torch.Tensor] = {}
        self.handles = [layers[i].register_forward_hook(self._hook(i)) for i in sorted(set(layer_ids))]

    def _hook(self, i):
        def fn(module, inputs, output):
            self.seen[i] = output[0] if isinstance(output, (tuple, list)) else output
        return fn

    def cached(self, ids: torch.Tensor, cache):
        """(taps, logits, cache) of ``ids`` after the prefix ``cache`` holds (None: none)."""
        self.seen.clear()
        kw = {cache_kwarg(self.target): cache} if cache is not None else {}
        out = self.target(input_ids=ids, use_cache=True, **kw)
        taps = torch.cat([self.seen[i] for i in self.layer_ids], dim=-1)
        self.seen.clear()
        new = getattr(out, "cache", None)  # not `or`: a cache object may define __len__
        return taps, out.logits, new if new is not None else out.past_key_values

    def close(self) -> None:
        for h in self.handles:
            h.remove()
