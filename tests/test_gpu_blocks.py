"""CPU checks of the GPU building blocks: the DFlash flex-attention mask, the chunked
LM head + loss, the FLOP counter and the memory model. Small and fast."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from trainer.gpu import chunked_head as chh  # noqa: E402
from trainer.layers import flex_mask as fm  # noqa: E402
from trainer.plan import flops  # noqa: E402
from trainer.plan import memory
from trainer.loss import decay_weights, dflash_loss_fn  # noqa: E402


# ---------------------------------------------------------------- mask

def _rule(a: int, keep: bool, i: int, q_blk: int, kv: int, S: int, B: int) -> bool:
    """The spec's rule, stated once more per (query block, key) pair."""
    if kv < S:
        return keep and kv < a
    return (kv - S) // B == i


def test_dense_mask_matches_rule():
    S, B = 20, 4
    anchors = torch.tensor([[0, 3, 7, 15], [2, 2, 9, 19]])
    keep = torch.tensor([[True, True, True, True], [True, True, False, True]])
    m = fm.dense_dflash_mask(anchors, S, B, keep)
    for b in range(2):
        for q in range(anchors.shape[1] * B):
            i = q // B
            for kv in range(S + anchors.shape[1] * B):
                assert bool(m[b, q, kv]) == _rule(int(anchors[b, i]), bool(keep[b, i]), i, q, kv, S, B)


def test_mask_mod_matches_dense_mask():
    from torch.nn.attention.flex_attention import create_mask

    torch.manual_seed(0)
    S, B, n = 37, 8, 5
    anchors = torch.sort(torch.randint(0, S, (3, n)), dim=-1).values
    keep = torch.rand(3, n) > 0.2
    dense = fm.dense_dflash_mask(anchors, S, B, keep)
    mod = fm.dflash_mask_mod(anchors, S, B, keep)
    got = create_mask(mod, 3, 1, n * B, S + n * B, device="cpu")[:, 0]
    assert torch.equal(got, dense)
    assert int(dense.sum()) == fm.visible_pairs(anchors, S, B, keep)


def test_no_leak_to_own_anchor_future_or_other_blocks():
    S, B = 16, 4
    anchors = torch.tensor([[5, 9]])
    m = fm.dense_dflash_mask(anchors, S, B)
    # block 0 (anchor 5): context 0..4 only; never context 5.. (its own/future hidden states)
    assert m[0, 0, :5].all() and not m[0, 0, 5:S].any()
    # never another block
    assert not m[0, :B, S + B:].any() and not m[0, B:, S:S + B].any()
    # own block, both directions
    assert m[0, :B, S:S + B].all() and m[0, B:, S + B:].all()


def test_flex_attention_with_block_mask_matches_sdpa():
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(1)
    S, B, n, Hq, Hk, D = 40, 8, 6, 4, 2, 16
    anchors = torch.sort(torch.randint(1, S, (2, n)), dim=-1).values
    keep = torch.ones(2, n, dtype=torch.bool)
    keep[1, -1] = False
    bm = fm.make_dflash_block_mask(anchors, S, B, keep, q_block=16, kv_block=16)
    q = torch.randn(2, Hq, n * B, D, dtype=torch.float64)
    k = torch.randn(2, Hk, S + n * B, D, dtype=torch.float64)
    v = torch.randn(2, Hk, S + n * B, D, dtype=torch.float64)
    out = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    dense = fm.dense_dflash_mask(anchors, S, B, keep)
    kk = k.repeat_interleave(Hq // Hk, 1)
    vv = v.repeat_interleave(Hq // Hk, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=dense[:, None])
    assert (out - ref).norm() / ref.norm() < 1e-10


# ---------------------------------------------------------------- chunked head

@pytest.mark.parametrize("soft,cap", [(False, 0.0), (True, 0.0), (False, 0.3), (True, 0.2)])
def test_chunked_head_matches_naive(soft, cap):
    torch.manual_seed(2)
    nb, K, H, V = 7, 5, 12, 97
    W = torch.randn(V, H, dtype=torch.float64)
    t = torch.randint(0, V, (nb, K))
    valid = torch.rand(nb, K) > 0.2
    valid[3] = False
    w = decay_weights(valid.double(), 4.0)
    teacher = torch.randn(nb, K, H, dtype=torch.float64) if soft else None
    fn = dflash_loss_fn(w, kl_weight=0.15 if soft else 0.0, temperature=2.0, cap_lambda=cap)
    h1 = torch.randn(nb, K, H, dtype=torch.float64, requires_grad=True)
    h2 = h1.detach().clone().requires_grad_(True)
    loss, ce, kl, correct = chh.chunked_head_loss(h1, W, t, fn, teacher=teacher, temperature=2.0,
                                                  chunk_rows=2 * K)  # 4 chunks, last partial
    ref = chh.naive_head_loss(h2, W, t, fn, teacher=teacher, temperature=2.0)
    assert abs(float(loss - ref)) < 1e-10
    (3.0 * loss).backward()
    (3.0 * ref).backward()
    assert (h1.grad - h2.grad).norm() / h2.grad.norm() < 1e-10
    z = (h2.detach().reshape(-1, H) @ W.t())
    assert torch.allclose(ce.reshape(-1), torch.nn.functional.cross_entropy(z, t.reshape(-1), reduction="none"))
    assert torch.equal(correct.reshape(-1), z.argmax(-1) == t.reshape(-1))
    assert (kl is None) == (not soft)


def test_chunked_head_teacher_logits_and_bf16():
    torch.manual_seed(3)
    nb, K, H, V = 4, 3, 16, 64
    W = torch.randn(V, H).bfloat16()
    t = torch.randint(0, V, (nb, K))
    w = decay_weights(torch.ones(nb, K), 7.0)
    tl = torch.randn(nb, K, V)
    fn = dflash_loss_fn(w, kl_weight=0.5, temperature=1.5)
    h = torch.randn(nb, K, H).bfloat16().requires_grad_(True)
    loss = chh.chunked_head_loss(h, W, t, fn, teacher=tl, teacher_is_logits=True, temperature=1.5, chunk_rows=K)[0]
    loss.backward()
    h64 = h.detach().double().requires_grad_(True)
    ref = chh.naive_head_loss(h64, W.double(), t, fn, teacher=tl.double(), teacher_is_logits=True, temperature=1.5)
    ref.backward()
    assert abs(float(loss) - float(ref)) / abs(float(ref)) < 1e-2
    assert (h.grad.double() - h64.grad).norm() / h64.grad.norm() < 2e-2


# ---------------------------------------------------------------- flops / memory

def test_flops_linear_counts():
    s = flops.QWEN3_8B
    # per-layer parameters of Qwen3-8B: q,o 4096², k,v 4096·1024, MLP 3·4096·12288
    assert s.layer_params == 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288
    t = flops.target_forward_flops(s, [8192], last_layer=33)
    lin = 2 * 34 * s.layer_params * 8192
    attn = 34 * 4 * 32 * 128 * (8192 * 8193 // 2)
    assert t == lin + attn
    d = flops.drafter_step_flops(s, n_layers=5, block_size=16, n_blocks=512, ctx_tokens=8192,
                                 visible_ctx_pairs=512 * 16 * 4000, head_positions=512 * 15)
    assert d["total"] == d["layers"] + d["attention"] + d["head"] + d["context"]
    assert d["head"] == 2 * 2 * 4096 * 151936 * 512 * 15


def test_memory_model_monotone_and_fits_logic():
    from trainer.gpu import probe

    base = dict(shape=memory.QWEN3_27B_LIKE, n_layers=5, block_size=32, max_anchors=1024,
                max_seq_len=8192, token_budget=49152, n_tapped=5)
    m1 = memory.drafter_peak_bytes(**base)
    m2 = memory.drafter_peak_bytes(**{**base, "token_budget": 65536})
    assert m2["total"] > m1["total"] > 0 and m2["reserved"] > m2["total"]
    assert set(m1) >= {"drafter_state", "activations", "logits", "context", "taps", "total"}
    kw = dict(block_size=32, max_anchors=1024, max_seq_len=8192, num_draft_layers=5)
    auto = probe.auto_budget(memory.QWEN3_27B_LIKE, 96e9, 2e9, role="drafter", **kw)
    assert auto >= 8192 and probe.plan(memory.QWEN3_27B_LIKE, token_budget=auto, **kw)["drafter"]["need"] <= 94e9
    tgt = memory.target_peak_bytes(memory.QWEN3_8B, token_budget=49152, max_seq_len=8192, last_layer=33, n_tapped=5)
    layer = memory.QWEN3_8B.layer_params + memory.QWEN3_8B.layer_norm_params
    assert tgt["target_weights"] == 2 * (34 * layer + 151936 * 4096 + 4096)
    assert math.isfinite(tgt["total"])


# ---------------------------------------------------------------- chunked drafter step

@pytest.mark.parametrize("attn,soft,cap,weights,window,arch", [
    ("sdpa", False, 0.0, "decay", None, "dflash"), ("sdpa", True, 0.2, "decay", None, "dflash"),
    ("sdpa", False, 0.0, "dpace", None, "dflash"), ("sdpa", True, 0.2, "dpace", None, "dflash"),
    ("sdpa", False, 0.0, "decay", 7, "dflash"), ("sdpa", True, 0.2, "dpace", 7, "dflash"),  # a sliding layer before a full one
    # DFlash2: convolutions and selector away from their identity start, the selector term on
    ("sdpa", False, 0.0, "decay", None, "dflash2"), ("sdpa", True, 0.2, "dpace", 7, "dflash2")])
def test_fast_drafter_step_matches_dense_reference(attn, soft, cap, weights, window, arch, monkeypatch):  # flex has no CPU backward
    """The chunked step against the reference step's math, unchunked, in fp64: trainer/
    model.py's Drafter.forward under the dense mask + trainer/loss.py's dflash_loss (with
    DFlash2's selector term for a DFlash2 drafter)."""
    from trainer.gpu import fast_drafter as fd
    from trainer.loss import LossConfig, dflash_loss
    from trainer.model import Drafter, DrafterConfig

    torch.manual_seed(4)
    H, nh, nkv, hd, I, V, nl, nt, B = 16, 4, 2, 4, 24, 53, 2, 2, 4
    b, S, N = 2, 22, 5
    cfg = DrafterConfig(hidden_size=H, intermediate_size=I, num_attention_heads=nh, num_key_value_heads=nkv,
                        head_dim=hd, rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=V, num_hidden_layers=nl,
                        num_target_layers=6, target_layer_ids=list(range(nt)), block_size=B, mask_token_id=V - 1,
                        layer_types=["sliding_attention", "full_attention"] if window else None, sliding_window=window,
                        arch=arch)
    d = Drafter(cfg).double()
    for p in d.parameters():  # non-trivial norm weights too
        p.data.add_(0.1 * torch.randn_like(p))
    embed = torch.randn(V, H, dtype=torch.float64)
    head = torch.randn(V, H, dtype=torch.float64)
    ids = torch.randint(0, V - 1, (b, S))
    lengths = torch.tensor([S, 17])
    lm = (torch.rand(b, S) > 0.15).long()
    taps = torch.randn(b, S, nt * H, dtype=torch.float64)
    anchors = torch.sort(torch.stack([torch.randperm(S - 1)[:N], torch.randperm(15)[:N]]), -1).values
    keep = torch.ones(b, N, dtype=torch.bool)
    keep[1, -2:] = False
    teacher = torch.randn(b, S, H, dtype=torch.float64) if soft else None
    lcfg = LossConfig(block_size=B, gamma=3.0, position_weights=weights, dpace_alpha=0.3, use_soft_labels=soft,
                      kl_weight=0.3, kl_temperature=2.0, cap_lambda=cap)
    blocks = torch.nn.functional.embedding(torch.cat([ids.gather(1, anchors)[:, :, None],
                                                      torch.full((b, N, B - 1), V - 1)], -1).view(b, -1), embed)
    lcfg.selector_weight = 0.6
    scorer = d.selector_scores if d.selector else None
    ref = dflash_loss(lcfg, d(taps, blocks, anchors, keep, "sdpa"), head, ids, lm, lengths, anchors, keep, teacher,
                      selector=scorer, top_k=cfg.selector_top_k)
    ref.loss.backward()
    g_ref = {n: p.grad.clone() for n, p in d.named_parameters()}
    d.zero_grad()
    kw = dict(block_size=B, mask_token_id=V - 1, gamma=3.0, cap_lambda=cap, kl_weight=0.3 if soft else 0.0,
              temperature=2.0, teacher_final=teacher, position_weights=weights, dpace_alpha=0.3, selector_weight=0.6)
    spans_used = []  # soft labels: some head chunks' teacher logits once per distinct position
    teacher_logits = chh._teacher_logits
    monkeypatch.setattr(chh, "_teacher_logits",
                        lambda table, rows, w, dtype, span, *a: spans_used.append(span) or teacher_logits(table, rows, w, dtype, span, *a))
    out = fd.step_backward(d, embed, head, ids, taps, lm, lengths, anchors, keep, chunk_anchors=2,
                           head_chunk_rows=6, dtype=torch.float64, attn=attn, ctx_multiple=8, **kw)
    assert abs(float(out["loss"]) - float(ref.loss.detach())) < 1e-9
    if soft:
        assert any(sp is not None for sp in spans_used) and None in spans_used, spans_used
    for n, p in d.named_parameters():
        assert (p.grad - g_ref[n]).norm() <= 1e-9 * (1 + g_ref[n].norm()), n
    # the terms and per-slot counts it reports are dflash_loss's
    for term in ("ce", "cap") + (("kl",) if soft else ()):
        assert abs(float(out[term]) - float(getattr(ref, term))) < 1e-9, term
    assert torch.equal(out["valid"], ref.acc_count.float())
    assert torch.allclose(out["correct"], (ref.acc * ref.acc_count).float())
    assert abs(float(out["sel"]) - float(ref.sel)) < 1e-9
    assert torch.equal(out["sel_correct"], ref.sel_correct.float()) and torch.equal(out["covered"], ref.covered.float())
    if arch == "dflash2":  # the selector term is really in both, and reaches the selector and the convolutions
        assert float(ref.sel) > 0 and ref.covered.sum() > 0
        assert all(g_ref[n].abs().sum() > 0 for n in g_ref if "candidate_selector" in n or "_conv." in n)


# ---------------------------------------------------------------- fast target

def test_fast_target_matches_hf_qwen3():
    transformers = pytest.importorskip("transformers")
    from trainer.gpu.fast_target import FastTarget

    torch.manual_seed(5)
    cfg = transformers.Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=128, attn_implementation="sdpa")
    hf = transformers.Qwen3Model(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, 97, (2, 19))
    taps = [1, 3, 4]
    ft = FastTarget.from_hf(hf, taps, attn_backend="math", keep_all_layers=True)
    with torch.no_grad():
        ref = hf(input_ids=ids, output_hidden_states=True)
    got, final = ft.forward(ids, want_final=True)
    want = torch.cat([ref.hidden_states[i + 1] for i in taps], -1)
    assert (got - want).norm() / want.norm() < 1e-5
    assert (final - ref.last_hidden_state).norm() / ref.last_hidden_state.norm() < 1e-5
    short, none = FastTarget.from_hf(hf, taps, attn_backend="math").forward(ids)
    assert none is None and torch.allclose(short, want, atol=1e-5)


def test_gpus_per_role_rule():
    # measured per-GPU rates (docs/benchmarks.md): 8B target 39.8 Ktok/s, drafter b32/1024 14.1 Ktok/s
    assert flops.gpus_per_role(8, 39.8e3, 14.1e3)[:2] == (2, 6)
    assert flops.gpus_per_role(8, 39.8e3, 51.2e3)[:2] == (4, 4)
    assert flops.gpus_per_role(2, 1.0, 1.0)[:2] == (1, 1)
    t, d = flops.role_tok_s(flops.QWEN3_8B, flops.QWEN3_8B, seq_len=8192, anchors_per_seq=1024, block_size=32)
    assert 30e3 < t < 50e3 and 10e3 < d < 20e3


def _tiny_chunked_step_inputs(arch, param_dtype, soft, io_dtype, seed=5):
    """A tiny drafter with ``param_dtype`` master weights, its frozen embedding/head, target
    states and teacher in the compute dtype ``io_dtype`` (as the trainer holds them on GPU)."""
    from trainer.model import Drafter, DrafterConfig

    torch.manual_seed(seed)
    H, nh, nkv, hd, I, V, nl, nt, B = 16, 4, 2, 4, 24, 53, 2, 2, 4
    b, S, N = 2, 22, 5
    cfg = DrafterConfig(hidden_size=H, intermediate_size=I, num_attention_heads=nh, num_key_value_heads=nkv,
                        head_dim=hd, rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=V, num_hidden_layers=nl,
                        num_target_layers=6, target_layer_ids=list(range(nt)), block_size=B, mask_token_id=V - 1,
                        arch=arch)
    d = Drafter(cfg).to(param_dtype)
    for p in d.parameters():
        p.data.add_(0.1 * torch.randn_like(p))
    data = dict(embed=torch.randn(V, H).to(io_dtype), lm_head=torch.randn(V, H).to(io_dtype),
                input_ids=torch.randint(0, V - 1, (b, S)), taps=torch.randn(b, S, nt * H).to(io_dtype),
                loss_mask=(torch.rand(b, S) > 0.15).long(), lengths=torch.tensor([S, 17]),
                anchors=torch.sort(torch.stack([torch.randperm(S - 1)[:N], torch.randperm(15)[:N]]), -1).values,
                keep=torch.ones(b, N, dtype=torch.bool))
    data["keep"][1, -2:] = False
    kw = dict(block_size=B, mask_token_id=V - 1, gamma=3.0, cap_lambda=0.2, kl_weight=0.3 if soft else 0.0,
              temperature=2.0, teacher_final=torch.randn(b, S, H).to(io_dtype) if soft else None,
              position_weights="dpace" if soft else "decay", dpace_alpha=0.3, chunk_anchors=2, head_chunk_rows=6,
              attn="sdpa")
    return d, data, kw


@pytest.mark.parametrize("arch,param_dtype,dtype,soft", [
    ("dflash", torch.float32, torch.bfloat16, False), ("dflash", torch.float32, torch.bfloat16, True),
    ("dflash2", torch.float32, torch.bfloat16, True), ("dflash", torch.float64, torch.float32, True)])
def test_gemm_weights_cast_once_per_step_give_the_per_chunk_gradients_bit_for_bit(arch, param_dtype, dtype, soft,
                                                                                    monkeypatch):
    """model.StepGemmWeights (the layers' GEMM weights in the compute dtype once per step, their
    gradients scattered into the master weights' .grad chunk by chunk) against the casts in every
    chunk: the same loss and the same fp32 gradients to the last bit, over two accumulated
    micro-batches (a first .grad and adds), with soft labels, D-PACE's gradient-free pre-pass
    and DFlash2's convolutions and selector."""
    from trainer.gpu import fast_drafter as fd

    def run(cast_once):
        with monkeypatch.context() as m:
            if not cast_once:  # no StepGemmWeights: block_forward casts in every chunk, as before it
                m.setattr(fd, "StepGemmWeights", lambda *a: None)
            return _run(cast_once)

    def _run(cast_once):
        d, data, kw = _tiny_chunked_step_inputs(arch, param_dtype, soft, dtype)
        outs = [fd.step_backward(d, data["embed"], data["lm_head"], data["input_ids"], data["taps"],
                                 data["loss_mask"], data["lengths"], data["anchors"], data["keep"], dtype=dtype,
                                 loss_scale=scale, **kw) for scale in (1.0, 0.5)]
        return [float(o["loss"]) for o in outs], {n: p.grad for n, p in d.named_parameters()}

    loss_chunk, g_chunk = run(False)
    loss_once, g_once = run(True)
    assert loss_once == loss_chunk
    assert g_once.keys() == g_chunk.keys()
    for n, g in g_chunk.items():
        assert g is not None and g_once[n] is not None, n
        assert g_once[n].dtype == param_dtype and torch.equal(g_once[n], g), n
    assert any(g.abs().sum() > 0 for n, g in g_once.items() if "mlp.down_proj" in n)


def test_the_chunked_step_casts_each_gemm_weight_once_not_once_per_chunk(monkeypatch):
    """What StepGemmWeights is for: with fp32 master weights and bf16 compute, every layer's
    q/k/v/o/gate/up/down weight is cast once in the block path (k and v once more by the
    context path, which runs once per step), however many anchor chunks the step has; cast
    per chunk, each was cast once per chunk (6 here)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from trainer.gpu import fast_drafter as fd

    class CastCounter(TorchDispatchMode):
        def __init__(self, ptrs):
            super().__init__()
            self.ptrs, self.counts = ptrs, {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.ptrs:
                name = self.ptrs[args[0].data_ptr()]
                self.counts[name] = self.counts.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    def casts(cast_once):
        with monkeypatch.context() as m:
            if not cast_once:
                m.setattr(fd, "StepGemmWeights", lambda *a: None)
            return _casts()

    def _casts():
        d, data, kw = _tiny_chunked_step_inputs("dflash", torch.float32, False, torch.bfloat16)
        gemm = {p.data_ptr(): n for n, p in d.layers.named_parameters() if n.endswith("proj.weight")}
        counter = CastCounter(gemm)
        with counter:
            fd.step_backward(d, data["embed"], data["lm_head"], data["input_ids"], data["taps"], data["loss_mask"],
                             data["lengths"], data["anchors"], data["keep"], dtype=torch.bfloat16, **kw)
        assert set(counter.counts) == set(gemm.values())
        return counter.counts

    per_chunk, once = casts(False), casts(True)
    chunks = 6  # 2 sequences × ceil(5 anchors / 2 per chunk) = 3
    for name, n in once.items():
        in_context = name.endswith(("k_proj.weight", "v_proj.weight"))
        assert n == 1 + in_context, (name, n)
        assert per_chunk[name] == chunks + in_context, (name, per_chunk[name])
