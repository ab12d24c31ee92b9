"""Each term of the DFlash objective against a direct, loop-by-loop computation on small
tensors (docs/trainer-spec.md, "Objective")."""

import math

import numpy as np
import pytest
import torch

from trainer.loss import LossConfig, dflash_loss, key, sample_anchors

B, V, H = 5, 11, 6


def case(seed=0):
    g = torch.Generator().manual_seed(seed)
    b, S = 2, 14
    ids = torch.randint(0, V, (b, S), generator=g)
    lm = torch.ones(b, S, dtype=torch.long)
    lm[0, :3] = 0
    lm[0, 9] = 0  # a hole inside a block
    lm[1, :2] = 0
    lengths = torch.tensor([14, 10])
    anchors = torch.tensor([[3, 6, 10], [2, 7, 0]])  # block at 10 runs past the end; row 1 has a padded block
    keep = torch.tensor([[True, True, True], [True, True, False]])
    out = torch.randn(b, 3 * B, H, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.randn(V, H, generator=g, dtype=torch.float64)
    final = torch.randn(b, S, H, generator=g, dtype=torch.float64)
    return out, head, ids, lm, lengths, anchors, keep, final


def direct(cfg, out, head, ids, lm, lengths, anchors, keep, final):
    """Plain loops: returns (loss, ce, kl, cap)."""
    b, N = anchors.shape
    T = cfg.kl_temperature
    h = out.view(b, N, B, H)
    num_ce = num_kl = den = 0.0
    cap_sum, blocks = 0.0, 0
    for s in range(b):
        for i in range(N):
            a = int(anchors[s, i])
            ces, valids = [], []
            for k in range(1, B):
                valid = bool(keep[s, i]) and a + k < int(lengths[s]) and bool(lm[s, a + k])
                if not valid:
                    ces.append(torch.tensor(0.0, dtype=torch.float64)), valids.append(0.0)
                    continue
                z = head @ h[s, i, k]
                ce = -torch.log_softmax(z, -1)[ids[s, a + k]]
                ces.append(ce), valids.append(1.0)
            if cfg.position_weights == "dpace":
                qt = [((1 - cfg.dpace_alpha) * math.exp(-float(c.detach())) + cfg.dpace_alpha) * v for c, v in zip(ces, valids)]
                Cm = [math.prod(qt[:m + 1]) for m in range(B - 1)]
                ws = [sum(Cm[j:]) * valids[j] for j in range(B - 1)]
            else:
                ws = [math.exp(-(k - 1) / cfg.gamma) * valids[k - 1] for k in range(1, B)]
            for k in range(1, B):
                w = ws[k - 1]
                if w == 0:
                    continue
                num_ce = num_ce + w * ces[k - 1]
                den += w
                zt = head @ final[s, a + k - 1]  # the target's own next-token logits for a+k
                pt = torch.softmax(zt / T, -1)
                kl = (pt * (torch.log(pt) - torch.log_softmax((head @ h[s, i, k]) / T, -1))).sum()
                num_kl = num_kl + w * T * T * kl
            if keep[s, i]:
                E, C = 0.0, 1.0
                for k in range(1, B):
                    C = C * torch.exp(-ces[k - 1]) * valids[k - 1]
                    E = E + C
                cap_sum = cap_sum + (1 - E / (B - 1))
                blocks += 1
    ce, kl, cap = num_ce / den, num_kl / den, cap_sum / blocks
    loss = (1 - cfg.kl_weight) * ce + cfg.kl_weight * kl if cfg.use_soft_labels else ce
    return loss + cfg.cap_lambda * cap, ce, kl, cap


CONFIGS = [
    LossConfig(block_size=B, gamma=3.0),
    LossConfig(block_size=B, gamma=3.0, use_soft_labels=True, kl_weight=0.3, kl_temperature=2.0),
    LossConfig(block_size=B, gamma=3.0, cap_lambda=0.5),
    LossConfig(block_size=B, position_weights="dpace", dpace_alpha=0.5, use_soft_labels=True, kl_weight=0.15, cap_lambda=0.1),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["decay-ce", "soft-labels", "cap", "dpace-all"])
def test_loss_matches_direct_computation(cfg):
    out, head, ids, lm, lengths, anchors, keep, final = case()
    got = dflash_loss(cfg, out, head, ids, lm, lengths, anchors, keep, final if cfg.use_soft_labels else None)
    loss, ce, kl, cap = direct(cfg, out, head, ids, lm, lengths, anchors, keep, final)
    torch.testing.assert_close(got.loss, loss, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(got.ce, ce.detach(), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(got.cap, cap.detach(), atol=1e-10, rtol=1e-10)
    if cfg.use_soft_labels:
        torch.testing.assert_close(got.kl, kl.detach(), atol=1e-10, rtol=1e-10)
    # gradients too (D-PACE weights are detached in both)
    g1, = torch.autograd.grad(got.loss, out)
    g2, = torch.autograd.grad(loss, out)
    torch.testing.assert_close(g1, g2, atol=1e-10, rtol=1e-8)


def test_chunked_head_equals_unchunked():
    out, head, ids, lm, lengths, anchors, keep, final = case(3)
    cfg = LossConfig(block_size=B, use_soft_labels=True, cap_lambda=0.2)
    small = LossConfig(**{**cfg.__dict__, "chunk": 3})
    a = dflash_loss(cfg, out, head, ids, lm, lengths, anchors, keep, final)
    c = dflash_loss(small, out, head, ids, lm, lengths, anchors, keep, final)
    torch.testing.assert_close(a.loss, c.loss)
    torch.testing.assert_close(torch.autograd.grad(a.loss, out)[0], torch.autograd.grad(c.loss, out)[0])


def test_soft_labels_read_the_target_at_a_plus_k_minus_1():
    out, head, ids, lm, lengths, anchors, keep, final = case()
    cfg = LossConfig(block_size=B, use_soft_labels=True, kl_weight=1.0)
    base = dflash_loss(cfg, out, head, ids, lm, lengths, anchors, keep, final).kl
    f2 = final.clone()
    f2[1, 7 + B - 1] += 3.0  # position a+B-1 of the block at 7: a label position, never a teacher position
    f2[1, 0:2] += 3.0  # before the first anchor of row 1
    assert torch.equal(dflash_loss(cfg, out, head, ids, lm, lengths, anchors, keep, f2).kl, base)
    f2[1, 7] += 3.0  # a+0: the teacher for slot 1
    assert not torch.equal(dflash_loss(cfg, out, head, ids, lm, lengths, anchors, keep, f2).kl, base)


def test_slot_accuracy_counts_only_valid_slots():
    out, head, ids, lm, lengths, anchors, keep, final = case()
    got = dflash_loss(LossConfig(block_size=B), out, head, ids, lm, lengths, anchors, keep)
    # label positions per slot k=1..4 of blocks (0,3) (0,6) (0,10) (1,2) (1,7); the padded block has none.
    # k=3: 6, 9 (loss_mask 0), 13, 5, 10 (>= len 10) → 3;  k=4: 7, 10, 14 (>= len 14), 6, 11 → 3
    assert got.acc_count.tolist() == [5, 5, 3, 3]


def test_anchor_sampling():
    lm = np.zeros((3, 20), np.int64)
    lm[0, 5:18] = 1
    lm[1, 2:4] = 1  # exactly one valid anchor (2)
    lm[2, 10:] = 1
    lengths = np.array([20, 20, 15])
    keys = [key(0, "anchors", 0, s) for s in (11, 12, 13)]
    anchors, keep = sample_anchors(lm, lengths, 4, keys)
    assert anchors.shape == (3, 4)
    assert keep.tolist()[1] == [True, False, False, False] and anchors[1, 0] == 2
    for s in range(3):
        a = anchors[s][keep[s]]
        assert list(a) == sorted(set(a))  # without replacement, sorted
        assert all(lm[s, x] and lm[s, x + 1] and x + 1 < lengths[s] for x in a)
    again, _ = sample_anchors(lm, lengths, 4, keys)
    assert np.array_equal(anchors, again)  # keyed: same key, same anchors, in any process
    other, _ = sample_anchors(lm, lengths, 4, [key(0, "anchors", 1, s) for s in (11, 12, 13)])
    assert not np.array_equal(anchors[0], other[0])  # another epoch draws others
    # uniform: every valid anchor of row 0 (5..16) is drawn about equally often
    counts = np.zeros(20)
    for e in range(600):
        a, k = sample_anchors(lm[:1], lengths[:1], 4, [key(1, e)])
        counts[a[0][k[0]]] += 1
    assert counts[:5].sum() == 0 and counts[17:].sum() == 0
    assert counts[5:17].min() > 0.6 * counts[5:17].mean()


# -- DFlash2's selector term (docs/dflash2.md), against plain loops

def direct_selector(cfg, sel, top_k, out, head, ids, lm, lengths, anchors, keep):
    """μ·Σ w·nll / Σ w over valid slots whose true token is among the top-k of the drafter's
    logits; nll is the CE over those k of U(b) + <A[x[a+k-1]] * P h, B[b]>; plus, per slot,
    the teacher-forced hits and the covered slots."""
    b, N = anchors.shape
    h = out.view(b, N, B, H)
    num, den = 0.0, 0.0
    hits, covered = [0] * (B - 1), [0] * (B - 1)
    for s in range(b):
        for i in range(N):
            a = int(anchors[s, i])
            for k in range(1, B):
                if not (bool(keep[s, i]) and a + k < int(lengths[s]) and bool(lm[s, a + k])):
                    continue
                w = math.exp(-(k - 1) / cfg.gamma)
                den += w
                z = head @ h[s, i, k]
                cand = z.detach().topk(top_k).indices.tolist()
                label, prev = int(ids[s, a + k]), int(ids[s, a + k - 1])
                gate = sel.predecessor_codebook[prev] * (sel.hidden_projection.weight @ h[s, i, k])
                scores = torch.stack([z[c] + gate @ sel.successor_codebook[c] for c in cand])
                hits[k - 1] += cand[int(scores.argmax())] == label
                if label in cand:
                    covered[k - 1] += 1
                    num = num + w * -torch.log_softmax(scores, -1)[cand.index(label)]
    return cfg.selector_weight * num / den, num / den, hits, covered


def test_selector_term_matches_direct_computation():
    from trainer.layers.hf_dflash import DFlashCandidateSelector

    out, head, ids, lm, lengths, anchors, keep, final = case(5)
    torch.manual_seed(0)
    sel = DFlashCandidateSelector(V, H, rank=3, top_k=4).double()
    for p in sel.parameters():  # away from the identity start, so the pair term matters
        p.data.normal_()
    cfg = LossConfig(block_size=B, gamma=3.0, selector_weight=0.7)
    got = dflash_loss(cfg, out, head, ids, lm, lengths, anchors, keep, selector=sel.scores, top_k=4)
    base = dflash_loss(cfg, out, head, ids, lm, lengths, anchors, keep)
    extra, term, hits, covered = direct_selector(cfg, sel, 4, out, head, ids, lm, lengths, anchors, keep)
    torch.testing.assert_close(got.loss, base.loss + extra, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(got.sel, term.detach(), atol=1e-10, rtol=1e-10)
    assert got.sel_correct.tolist() == hits and got.covered.tolist() == covered and 0 < sum(covered) < sum(got.acc_count)
    # the selector term's gradient reaches the drafter's states and every selector weight
    params = [out, *sel.parameters()]
    g1 = torch.autograd.grad(got.loss - base.loss, params)
    g2 = torch.autograd.grad(extra, params)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)
        assert a.abs().sum() > 0


def _graph_nodes(t: torch.Tensor) -> set:
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(n for n, _ in node.next_functions)
    return names


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_run_products_equal_cumprod_in_value_and_gradient_without_a_cumprod_node(dtype):
    """CAP's run products (loss.run_products) against cumprod(exp(−ce) · live): dead slots
    first, in the middle, at the end and everywhere; the same values and ce gradients to float
    rounding, and the graph holds no CumprodBackward0 (its backward reads the input on the host,
    one GPU sync per anchor chunk)."""
    from trainer import loss as L

    g = torch.Generator().manual_seed(4)
    ce = (torch.rand(6, 31, generator=g, dtype=dtype) * 3).requires_grad_()
    live = torch.rand(6, 31, generator=g) > 0.15
    live[0] = True
    live[1] = False
    live[2, 0] = False
    live[3, -1] = False
    up = torch.randn(6, 31, generator=g, dtype=dtype)
    want = torch.cumprod(torch.exp(-ce) * live, dim=-1)
    got = L.run_products(ce, live)
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    assert torch.allclose(got, want, rtol=tol, atol=tol)
    assert (got[~((~live).cumsum(-1) == 0)] == 0).all()  # after a dead slot nothing is accepted
    (gw,) = torch.autograd.grad((want * up).sum(), ce)
    (gg,) = torch.autograd.grad((got * up).sum(), ce)
    assert torch.allclose(gg, gw, rtol=tol, atol=tol)
    assert "CumprodBackward0" not in _graph_nodes(got)
    # the step's per-chunk objective and the whole-batch loss use it
    w = torch.where(live, torch.rand(6, 31, generator=g, dtype=dtype), 0.0)
    fn = L.dflash_loss_fn(w, cap_lambda=0.1)
    assert "CumprodBackward0" not in _graph_nodes(fn(ce, None, slice(None)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device: the sync is a GPU one")
def test_the_cap_terms_backward_never_synchronises_on_cuda():
    from trainer import loss as L

    ce = (torch.rand(64, 31, device="cuda") * 3).requires_grad_()
    w = torch.where(torch.rand(64, 31, device="cuda") > 0.1, 1.0, 0.0)
    loss = L.dflash_loss_fn(w, cap_lambda=0.1, denom=w.sum(), n_valid_blocks=torch.tensor(64.0, device="cuda"))(
        ce, None, slice(None))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(ce.grad).all()
