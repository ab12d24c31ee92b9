"""DFlash2's selector objective with its backward written out (trainer/gpu/selector_fused.py):
the numbers and gradients of the checkpointed reference (trainer/loss.py selector_terms with
the export's selector_scores), eager and compiled, and the chunked step's switch between them."""

import pytest
import torch

from trainer.gpu import selector_fused as sf
from trainer.layers.hf_dflash import selector_scores
from trainer.loss import selector_terms as reference


def _inputs(dtype, P=37, V=50, H=16, r=8, k=4, seed=0, wdtype=None):
    g = torch.Generator().manual_seed(seed)
    wdtype = wdtype or dtype
    h = torch.randn(P, H, generator=g, dtype=torch.float64).to(dtype)
    head = torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype)
    cand = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(P)])
    labels = torch.randint(0, V, (P,), generator=g)
    labels[::2] = cand[::2, 1]  # half the slots covered, the label at a place other than the first
    labels[1::4] = cand[1::4, 0]
    pred = torch.randint(0, V, (P,), generator=g)
    weights = [torch.randn(V, r, generator=g, dtype=torch.float64).to(wdtype),
               torch.randn(V, r, generator=g, dtype=torch.float64).to(wdtype),
               0.3 * torch.randn(r, H, generator=g, dtype=torch.float64).to(wdtype)]
    upstream = torch.rand(P, generator=g, dtype=torch.float64)
    return h, head, cand, labels, pred, weights, upstream


def _run(fused: bool, h, head, cand, labels, pred, weights, upstream, rows):
    hs = h.clone().requires_grad_(True)
    ws = [w.clone().requires_grad_(True) for w in weights]
    if fused:
        nll, cov, hit = sf.selector_terms(hs, head, cand, labels, pred, ws, rows)
    else:
        def scorer(x, u, c, p):
            return selector_scores(x, u, c, p, *(w.to(x.dtype) for w in ws))
        nll, cov, hit = reference(hs, head, cand, labels, pred, scorer, rows)
    # the chunked step's use: Σ w · covered · nll over the chunk
    (upstream.to(nll.dtype) * cov.to(nll.dtype) * nll).sum().backward()
    return [nll.detach(), cov, hit, hs.grad, *(w.grad for w in ws)]


NAMES = ("nll", "covered", "hit", "hidden", "predecessor_codebook", "successor_codebook", "hidden_projection")


@pytest.mark.parametrize("dtype,rows", [(torch.float64, 12), (torch.float64, 4096), (torch.float32, 40)])
def test_the_fused_selector_gives_the_references_numbers_and_gradients(dtype, rows):
    """nll, covered, hit and the gradients w.r.t. the states, both codebooks and the
    projection equal the checkpointed reference's; pieces of any size (12 rows: 37 as 4 × 10,
    the last one short; 4,096: one piece; 40: one piece, not the reference's 4 of 10)."""
    args = _inputs(dtype)
    want, got = _run(False, *args, rows), _run(True, *args, rows)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert want[1].any() and not want[1].all() and want[2].any()  # covered and uncovered slots, some hits
    for name, w, g in zip(NAMES, want, got):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        if w.dtype == torch.bool:
            assert torch.equal(g, w), name
        else:
            torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=name)
    assert got[5].abs().sum() > 0 and got[6].abs().sum() > 0


def test_the_fused_selector_in_bf16_with_fp32_masters_is_the_references_up_to_rounding():
    """The GPU's configuration: bf16 states and head, fp32 selector weights used in bf16 (the
    reference casts the whole tables, the fused path the gathered rows: the same values)."""
    shape = dict(P=64, V=300, H=64, r=16, k=8, seed=3)
    args = _inputs(torch.bfloat16, wdtype=torch.float32, **shape)
    want, got = _run(False, *args, 4096), _run(True, *args, 4096)
    truth = _run(False, *_inputs(torch.float64, **shape), 4096)  # the same draws, in float64
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    for name, w, g, t in zip(NAMES[3:], want[3:], got[3:], truth[3:]):
        assert g.dtype == w.dtype, name
        rel = lambda x: float((x.double() - t).norm() / t.norm())  # noqa: E731
        assert rel(g) < 1e-2 and rel(g) <= 1.1 * rel(w) + 1e-6, (name, rel(g), rel(w))  # as close as the reference


def test_a_trainable_head_takes_the_reference_and_gets_its_gradient():
    """The head is frozen in training (FrozenHead): the fused path forms no head gradient, so
    a head that wants one is sent to the reference, which forms it."""
    h, head, cand, labels, pred, weights, up = _inputs(torch.float64)
    grads = []
    for fused in (False, True):
        hd = head.clone().requires_grad_(True)
        if fused:
            nll, cov, _ = sf.selector_terms(h, hd, cand, labels, pred, weights, 12)
        else:
            nll, cov, _ = reference(h, hd, cand, labels, pred, lambda x, u, c, p: selector_scores(x, u, c, p, *weights), 12)
        (up * cov * nll).sum().backward()
        grads.append(hd.grad)
    assert grads[1] is not None and grads[1].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-12)


def test_pieces_are_balanced_to_one_shape():
    assert sf.piece_rows(512 * 31, 4096) == 3968  # an anchor chunk at the operators' shape: 4 × 3,968
    assert sf.piece_rows(37, 12) == 10 and sf.piece_rows(37, 4096) == 37 and sf.piece_rows(5, 1) == 1


def test_the_compiled_selector_gives_the_eager_numbers(monkeypatch):
    """On CUDA each piece's forward and backward run compiled; the same compiled
    functions, here on CPU, against the eager ones."""
    monkeypatch.setattr(sf, "_COMPILED_ON", {"cuda", "cpu"})
    monkeypatch.setattr(sf, "_COMPILED", {})
    args = _inputs(torch.float32, P=24, V=40, H=16, r=8, k=4, seed=1)
    monkeypatch.setattr(sf, "EAGER", True)
    eager = _run(True, *args, 12)
    monkeypatch.setattr(sf, "EAGER", False)
    compiled = _run(True, *args, 12)
    assert len(sf._COMPILED) == 2  # the piece's forward and its backward, each compiled once (one shape)
    for name, w, g in zip(NAMES, eager, compiled):
        if w.dtype == torch.bool:
            assert torch.equal(g, w), name
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)


def test_the_chunked_step_uses_the_fused_selector_with_the_references_loss_and_gradients(monkeypatch):
    """trainer/gpu/fast_drafter.py's DFlash2 step calls the fused selector once per anchor chunk;
    with trainer/loss.py's checkpointed reference in its place the step gives the same loss and
    gradients."""
    from trainer.gpu import fast_drafter as fd
    from trainer import loss as loss_mod
    from trainer.model import Drafter, DrafterConfig

    torch.manual_seed(2)
    H, V, B, b, S, N = 16, 53, 4, 2, 22, 5
    cfg = DrafterConfig(hidden_size=H, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=4, rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=V, num_hidden_layers=2,
                        num_target_layers=6, target_layer_ids=[0, 1], block_size=B, mask_token_id=V - 1,
                        arch="dflash2")
    d = Drafter(cfg).double()
    for p in d.parameters():
        p.data.add_(0.1 * torch.randn_like(p))
    embed, head = torch.randn(V, H, dtype=torch.float64), torch.randn(V, H, dtype=torch.float64)
    ids = torch.randint(0, V - 1, (b, S))
    taps = torch.randn(b, S, 2 * H, dtype=torch.float64)
    anchors = torch.sort(torch.stack([torch.randperm(S - 1)[:N] for _ in range(b)]), -1).values
    keep = torch.ones(b, N, dtype=torch.bool)
    calls = {"fused": 0, "reference": 0}
    fused_fn, ref_fn = sf.selector_terms, loss_mod.selector_terms

    def count(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    def reference(h, head_w, cand, labels, preds, _weights, rows):
        return ref_fn(h, head_w, cand, labels, preds, lambda *a: d.selector_scores(*a, dtype=torch.float64), rows)

    def step(fused: bool):
        monkeypatch.setattr(sf, "selector_terms", count("fused", fused_fn) if fused else count("reference", reference))
        d.zero_grad()
        out = fd.step_backward(d, embed, head, ids, taps, torch.ones(b, S, dtype=torch.long), torch.tensor([S, 17]),
                               anchors, keep, block_size=B, mask_token_id=V - 1, chunk_anchors=3, head_chunk_rows=6,
                               dtype=torch.float64, attn="sdpa", selector_weight=0.7)
        return out, {n: p.grad.clone() for n, p in d.named_parameters()}

    (ref, g_ref), (got, g_got) = step(False), step(True)
    assert calls == {"fused": 4, "reference": 4}  # 2 sequences × 2 anchor chunks, each way
    assert float(ref["sel"]) > 0
    for term in ("loss", "sel", "sel_correct", "covered"):
        torch.testing.assert_close(got[term], ref[term], rtol=1e-12, atol=1e-12, msg=term)
    for n in g_ref:
        torch.testing.assert_close(g_got[n], g_ref[n], rtol=1e-10, atol=1e-12, msg=n)


def test_the_fused_selector_keeps_no_gathered_rows_for_backward():
    """What stays from forward to backward besides the inputs: ∂nll/∂scores [P, k] and its
    image through the head rows [P, H] — never the k·P·H gathered head rows (520 MB a piece at
    the operators' shape) nor codebook rows; backward gathers only rank-sized rows again."""
    h, head, cand, labels, pred, weights, _ = _inputs(torch.float32, P=30, V=50, H=16, r=8, k=4)
    h.requires_grad_(True)
    ws = [w.clone().requires_grad_(True) for w in weights]
    inputs = {t.untyped_storage().data_ptr() for t in (h, head, cand, labels, pred, *ws)}
    kept = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in inputs:
            kept[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sf.selector_terms(h, head, cand, labels, pred, ws, 12)
    assert sum(kept.values()) == 30 * 16 * 4 + 30 * 4 * 4
