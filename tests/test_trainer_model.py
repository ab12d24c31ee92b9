"""The drafter's attention mask and math: no block sees its own future hidden states or
another block (the SpecForge #470 leak), and the batched drafter equals a plain per-block
reference written here independently — for DFlash and for DFlash2 (its in-block
convolutions with non-trivial weights included; docs/dflash2.md)."""

import math

import pytest
import torch

from trainer.model import Drafter, DrafterConfig, FrozenHead, build_target_layer_ids

B = 8  # block size


ARCHS = ["dflash", "dflash2"]


def tiny_drafter(seed=0, arch="dflash"):
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=64, num_hidden_layers=2,
                        num_target_layers=6, target_layer_ids=[1, 3], block_size=B, mask_token_id=63, arch=arch)
    model = Drafter(cfg).double().eval()
    for n, p in model.named_parameters():  # non-trivial norms so a wrong norm placement shows
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
        elif "_conv." in n:  # and convolutions away from their identity start, so both taps act
            p.data.add_(0.3 * torch.randn_like(p))
    head = FrozenHead(torch.randn(64, 32, dtype=torch.float64), torch.randn(64, 32, dtype=torch.float64))
    return model, head


def inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    S = 24
    taps = torch.randn(2, S, 64, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 63, (2, S), generator=g)
    # overlapping blocks (3 and 5 share positions 5..10), a padded block, adjacent anchors
    anchors = torch.tensor([[3, 5, 12], [2, 9, 10]])
    keep = torch.tensor([[True, True, True], [True, True, False]])
    return taps, ids, anchors, keep


def run(model, head, taps, ids, anchors, keep, impl="sdpa"):
    blocks = head.embed_blocks(ids, anchors, B, model.config.mask_token_id)
    with torch.no_grad():
        return model(taps, blocks, anchors, keep, impl).view(anchors.shape[0], anchors.shape[1], B, -1)


# -- an independent reference: one block at a time, explicit attention over [ctx < a, block]

def _rms(x, w, eps=1e-6):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):  # x [heads, N, D]; rotate pairs (i, i + D/2) by pos·θ^(-2i/D)
    D = x.shape[-1]
    out = torch.empty_like(x)
    for i in range(D // 2):
        ang = pos.double() * theta ** (-2 * i / D)
        c, s = torch.cos(ang), torch.sin(ang)
        a, b = x[..., i], x[..., i + D // 2]
        out[..., i] = a * c - b * s
        out[..., i + D // 2] = b * c + a * s
    return out


def _conv(x, conv, side, h_in):
    """One side of a DFlash2 sublayer convolution, per block position t and channel:
    Σ_tap (base[side, tap] + the group's dynamic tap from the sublayer input h_in) · x[t − tap]."""
    taps, G = conv.base_kernel.shape[1], x.shape[-1] // 16
    dyn = (h_in @ conv.kernel_projection.weight.T).view(len(x), 2, taps, G)
    out = torch.zeros_like(x)
    for t in range(len(x)):
        for tap in range(taps):
            if t - tap >= 0:  # never across the block's start
                k = conv.base_kernel[side, tap] + dyn[t, side, tap].repeat_interleave(16)
                out[t] += k * x[t - tap]
    return out


def reference_block(model, head, taps_row, anchor_token, a):
    c = model.config
    ctx = _rms(taps_row[:a] @ model.fc.weight.T, model.hidden_norm.weight)  # only positions < a exist here
    x = head.embed[torch.tensor([anchor_token] + [c.mask_token_id] * (B - 1))]
    qpos = torch.arange(a, a + B)
    kpos = torch.cat([torch.arange(a), qpos])
    for layer in model.layers:
        at = layer.self_attn
        xn = _rms(x, layer.input_layernorm.weight)
        conv = getattr(layer, "attention_conv", None)
        h_in = xn
        if conv is not None:
            xn = _conv(xn, conv, 0, h_in)
        kv = torch.cat([ctx, xn])
        q = (xn @ at.q_proj.weight.T).view(B, c.num_attention_heads, c.head_dim).transpose(0, 1)
        k = (kv @ at.k_proj.weight.T).view(len(kv), c.num_key_value_heads, c.head_dim).transpose(0, 1)
        v = (kv @ at.v_proj.weight.T).view(len(kv), c.num_key_value_heads, c.head_dim).transpose(0, 1)
        q, k = _rope(_rms(q, at.q_norm.weight), qpos, c.rope_theta), _rope(_rms(k, at.k_norm.weight), kpos, c.rope_theta)
        heads = []
        for h in range(c.num_attention_heads):
            kh = h // (c.num_attention_heads // c.num_key_value_heads)
            att = torch.softmax(q[h] @ k[kh].T / math.sqrt(c.head_dim), dim=-1)  # no mask: everything here is visible
            heads.append(att @ v[kh])
        o = torch.cat(heads, dim=-1) @ at.o_proj.weight.T
        x = x + (o if conv is None else _conv(o, conv, 1, h_in))
        xn = _rms(x, layer.post_attention_layernorm.weight)
        conv, h_in = getattr(layer, "mlp_conv", None), xn
        if conv is not None:
            xn = _conv(xn, conv, 0, h_in)
        m = layer.mlp
        o = (torch.nn.functional.silu(xn @ m.gate_proj.weight.T) * (xn @ m.up_proj.weight.T)) @ m.down_proj.weight.T
        x = x + (o if conv is None else _conv(o, conv, 1, h_in))
    return _rms(x, model.norm.weight)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("impl", ["sdpa", "flex"])
def test_drafter_equals_per_block_reference(impl, arch):
    model, head = tiny_drafter(arch=arch)
    taps, ids, anchors, keep = inputs()
    out = run(model, head, taps, ids, anchors, keep, impl)
    for b in range(2):
        for i in range(3):
            if not keep[b, i]:
                continue
            a = int(anchors[b, i])
            ref = reference_block(model, head, taps[b], int(ids[b, a]), a)
            torch.testing.assert_close(out[b, i], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("impl", ["sdpa", "flex"])
def test_no_mask_leak_from_future_states_or_other_blocks(impl, arch):
    model, head = tiny_drafter(arch=arch)
    taps, ids, anchors, keep = inputs()
    base = run(model, head, taps, ids, anchors, keep, impl)
    g = torch.Generator().manual_seed(7)
    for b in range(2):
        for i in range(3):
            if not keep[b, i]:
                continue
            a = int(anchors[b, i])
            # hidden states at and after the anchor: invisible to this block
            t2 = taps.clone()
            t2[b, a:] += torch.randn(t2[b, a:].shape, generator=g, dtype=t2.dtype)
            torch.testing.assert_close(run(model, head, t2, ids, anchors, keep, impl)[b, i], base[b, i], atol=1e-9, rtol=0)
            # tokens after the anchor, and every other block's anchor token: invisible too
            i2 = ids.clone()
            i2[b, a + 1:] = (i2[b, a + 1:] + 1) % 63
            for j in range(3):
                if j != i:
                    i2[b, anchors[b, j]] = (ids[b, anchors[b, j]] + 5) % 63
            i2[b, a] = ids[b, a]
            torch.testing.assert_close(run(model, head, taps, i2, anchors, keep, impl)[b, i], base[b, i], atol=1e-9, rtol=0)
            # ... while the state just before the anchor does reach it (the mask is not empty)
            if a > 0:
                t3 = taps.clone()
                t3[b, a - 1] += 1.0
                assert (run(model, head, t3, ids, anchors, keep, impl)[b, i] - base[b, i]).abs().max() > 1e-6


def test_flex_and_sdpa_agree():
    model, head = tiny_drafter()
    taps, ids, anchors, keep = inputs()
    torch.testing.assert_close(run(model, head, taps, ids, anchors, keep, "flex"), run(model, head, taps, ids, anchors, keep, "sdpa"),
                               atol=1e-9, rtol=1e-9)


def test_target_layer_ids_follow_the_reference_rule():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab's Qwen3-8B drafter
    assert build_target_layer_ids(36, 1) == [18]


@pytest.mark.parametrize("arch", ARCHS)
def test_export_round_trips(tmp_path, arch):
    model, _ = tiny_drafter(arch=arch)
    model.float().save_pretrained(str(tmp_path / "drafter"))
    back = Drafter.from_pretrained(str(tmp_path / "drafter"))
    assert back.config == model.config
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), back.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    assert "layers.0.self_attn.q_proj.weight" in back.state_dict() and "fc.weight" in back.state_dict()


# -- DFlash2's additions (docs/dflash2.md)

def test_dflash2_tensors_have_the_published_names_and_shapes():
    """The tensor contract of z-lab's released DFlash2 drafter (tests/fixtures/
    dflash2-safetensors-header.json there: hidden 6656 → kernel_projection [1664, 6656])
    at this drafter's widths, and the parameter count trainer/arch.py predicts."""
    from trainer import arch

    model, _ = tiny_drafter(arch="dflash2")
    shapes = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    H, V = 32, 64
    for i in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            assert shapes[f"layers.{i}.{conv}.base_kernel"] == (2, 2, H)
            assert shapes[f"layers.{i}.{conv}.kernel_projection.weight"] == (2 * 2 * H // 16, H)
    assert shapes["candidate_selector.predecessor_codebook"] == (V, 256)
    assert shapes["candidate_selector.successor_codebook"] == (V, 256)
    assert shapes["candidate_selector.hidden_projection.weight"] == (256, H)
    dflash, _ = tiny_drafter(arch="dflash")
    extra = {n for n in shapes if n not in dflash.state_dict()}
    assert extra == {n for n in shapes if arch.is_dflash2_only(n)} and len(extra) == 11
    assert sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in dflash.parameters()) == \
        arch.extra_params(H, V, 2)[0]


def test_a_fresh_dflash2_drafter_shares_dflash_weights_and_drafts_what_dflash_drafts():
    """Same --seed: the same DFlash weights, the additions at their identity start (unit self
    tap, zero correction, zero successor codebook), so the same block states and drafts."""
    cfg = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=64, num_hidden_layers=2, num_target_layers=6,
               target_layer_ids=[1, 3], block_size=B, mask_token_id=63)
    torch.manual_seed(3)
    d1 = Drafter(DrafterConfig(**cfg)).double().eval()
    torch.manual_seed(3)
    d2 = Drafter(DrafterConfig(**cfg, arch="dflash2")).double().eval()
    head = FrozenHead(torch.randn(64, 32, dtype=torch.float64), torch.randn(64, 32, dtype=torch.float64))
    taps, ids, anchors, keep = inputs()
    h1, h2 = run(d1, head, taps, ids, anchors, keep), run(d2, head, taps, ids, anchors, keep)
    assert torch.equal(h1, h2)
    for b in range(2):
        for i in range(3):
            anchor = int(ids[b, anchors[b, i]])
            assert d2.propose(h2[b, i, 1:], head.lm_head, anchor) == d1.propose(h1[b, i, 1:], head.lm_head, anchor)


def test_the_selector_walk_follows_the_pair_scores_from_the_anchor():
    """The greedy walk against the formula: at each slot the top-k candidate maximising
    U(b) + <A[prev] * P h, B[b]>, prev starting at the anchor and then the token chosen."""
    model, head = tiny_drafter(arch="dflash2")
    sel = model.candidate_selector
    with torch.no_grad():  # a selector that overrules the argmax
        for p in sel.parameters():
            p.normal_(std=1.0)
    taps, ids, anchors, keep = inputs()
    h = run(model, head, taps, ids, anchors, keep)[0, 1, 1:]
    logits = h @ head.lm_head.T
    prev, want = 17, []
    for i in range(B - 1):
        unary, cand = logits[i].topk(16)
        gate = sel.predecessor_codebook[prev] * (sel.hidden_projection.weight @ h[i])
        scores = unary + sel.successor_codebook[cand] @ gate
        prev = int(cand[int(scores.argmax())])
        want.append(prev)
    assert model.propose(h, head.lm_head, 17) == want
    assert want != logits.argmax(-1).tolist()  # the selector changed the drafts here


def test_a_dflash2_drafter_refuses_widths_its_shape_cannot_take():
    cfg = dict(hidden_size=40, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=64, num_hidden_layers=2, num_target_layers=6,
               target_layer_ids=[1, 3], block_size=B, mask_token_id=63, arch="dflash2")
    with pytest.raises(ValueError, match="hidden size 40 is not a multiple of the convolution group 16"):
        DrafterConfig(**cfg)
    with pytest.raises(ValueError, match="selector top-k 16 is outside the vocabulary 1..8"):
        DrafterConfig(**{**cfg, "hidden_size": 32, "vocab_size": 8, "mask_token_id": 7})
