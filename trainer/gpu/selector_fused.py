"""DFlash2's selector objective for the chunked step, with its backward written out: one
autograd node per anchor chunk, pieces of a head chunk's rows, no recompute.

trainer/loss.py ``selector_terms`` is the reference (the CPU loss path and the golden
trajectories' reference step use it): per 1,024 rows a checkpointed piece that casts both
[vocab, rank] codebooks to the compute dtype, gathers the candidates' head rows, scores,
and in backward runs all of it again, then turns each piece's embedding gradient into a
dense [vocab, rank] table (fill, scatter, cast to fp32, add) — about 28 small kernels a piece
forward and twice that backward, 192 pieces a step at the operators' shape: 5,304 kernels of
forward alone, and most of DFlash2's host gaps (docs/benchmarks.md).

Here, for one anchor chunk's slots:

* the rows split into pieces of at most ``rows`` (balanced, so every piece has one shape);
  a piece's forward gathers only its rows of the codebooks and casts those (the values the
  cast-then-gather reference reads), scores, and keeps ∂nll/∂scores (softmax − onehot, [p, k])
  and that direction pushed through the gathered head rows (Σ_k ∂nll/∂s_k · W[b_k], [p, H]),
  so the k·p·H gathered rows are dropped at once and never gathered again;
* backward scales those by the incoming ∂L/∂nll (every gradient is linear in it per row),
  recomputes the cheap rank-sized factors, and scatters the codebooks' row gradients into one
  fp32 [vocab, rank] table per codebook and chunk (not one per piece).

The scores are trainer/layers/hf_dflash.py's ``selector_scores`` (the export's formula) term for
term; tests/test_selector_fused.py holds this to the reference's numbers and gradients.
On CUDA each piece's forward and backward is one compiled function (static shapes, as
trainer/layers/block_conv.py's); ``DFLASH_EAGER=1`` keeps them eager. The frozen LM head gets
no gradient here: a head that requires one takes the reference path (trainer/loss.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from trainer.layers.fused_ops import EAGER, compile_once

_COMPILED: dict = {}
_COMPILED_ON = {"cuda"}  # tests add "cpu" to check the compiled functions against the eager ones


def _on_device(fn, device: torch.device):
    return fn if device.type not in _COMPILED_ON or EAGER else compile_once(fn, _COMPILED)


def _up(t: torch.Tensor) -> torch.Tensor:  # scores in fp32 at least (hf_dflash._up)
    return t if t.dtype == torch.float64 else t.float()


def _factors(h, cand, pred, pred_cb, succ_cb, proj):
    """The pair score's factors in the compute dtype of h: A[a] [p, r], P·h [p, r], B[b] [p, k, r]
    (rows gathered, then cast: the values of the cast tables' rows)."""
    dt = h.dtype
    proj_c = proj.to(dt)
    return F.embedding(pred, pred_cb).to(dt), F.linear(h, proj_c), F.embedding(cand, succ_cb).to(dt), proj_c


def _piece_forward(h, lm_head, cand, labels, pred, pred_cb, succ_cb, proj):
    """One piece: (nll [p], covered [p], hit [p], ∂nll/∂scores [p, k], the same direction
    through the candidates' head rows [p, H])."""
    match = cand == labels[:, None]
    covered, place = match.any(-1), match.long().argmax(-1)
    rows = F.embedding(cand, lm_head)  # [p, k, H]
    unary = torch.einsum("ph,pkh->pk", h, rows)
    a, ph, b, _ = _factors(h, cand, pred, pred_cb, succ_cb, proj)
    pair = torch.einsum("pr,pkr->pk", a * ph, b)
    scores = _up(unary) + _up(pair)
    lse = torch.logsumexp(scores, dim=-1)
    nll = lse - scores.gather(-1, place[:, None]).squeeze(-1)
    best = scores.argmax(-1)
    onehot = torch.arange(cand.shape[-1], device=cand.device) == place[:, None]
    d_scores = torch.exp(scores - lse[:, None]) - onehot.to(scores.dtype)
    d_hidden = torch.einsum("pk,pkh->ph", d_scores.to(h.dtype), rows)
    hit = cand.gather(-1, best[:, None]).squeeze(-1) == labels
    return nll, covered, hit, d_scores, d_hidden


def _piece_backward(g_nll, d_scores, d_hidden, h, cand, pred, pred_cb, succ_cb, proj):
    """∂L/∂(h [p, H], A rows [p, r], B rows [p, k, r], projection [r, H]) of one piece from
    ∂L/∂nll [p], the order and dtypes of autograd through the reference."""
    dt = h.dtype
    g = g_nll.to(d_scores.dtype)[:, None]
    g_pair = (g * d_scores).to(dt)  # through the pair scores' cast up (the unary's: d_hidden)
    a, ph, b, proj_c = _factors(h, cand, pred, pred_cb, succ_cb, proj)
    g_gate = torch.einsum("pk,pkr->pr", g_pair, b)
    g_b = g_pair[:, :, None] * (a * ph)[:, None, :]
    g_a, g_ph = g_gate * ph, g_gate * a
    g_h = (g * _up(d_hidden) + _up(g_ph @ proj_c)).to(dt)
    return g_h, g_a, g_b, g_ph.t() @ h


def piece_rows(n: int, rows: int) -> int:
    """Rows per piece: at most ``rows``, the n rows in pieces of one size (15,872 slots of an
    anchor chunk at 4,096: 4 × 3,968), so the compiled functions see one shape."""
    pieces = math.ceil(n / max(1, int(rows)))
    return max(1, math.ceil(n / max(1, pieces)))


class _SelectorTerms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, lm_head, cand, labels, pred, pred_cb, succ_cb, proj, rows):
        n, per = hidden.shape[0], piece_rows(hidden.shape[0], rows)
        fwd = _on_device(_piece_forward, hidden.device)
        outs = [fwd(hidden[s:s + per], lm_head, cand[s:s + per], labels[s:s + per], pred[s:s + per],
                    pred_cb, succ_cb, proj) for s in range(0, n, per)]
        nll, covered, hit, d_scores, d_hidden = (torch.cat(t) if len(outs) > 1 else t[0] for t in zip(*outs))
        ctx.save_for_backward(hidden, cand, pred, pred_cb, succ_cb, proj, d_scores, d_hidden)
        ctx.per = per
        ctx.mark_non_differentiable(covered, hit)
        return nll, covered, hit

    @staticmethod
    def backward(ctx, g_nll, *_):
        hidden, cand, pred, pred_cb, succ_cb, proj, d_scores, d_hidden = ctx.saved_tensors
        need_h, _, _, _, _, need_a, need_b, need_p = ctx.needs_input_grad[:8]
        bwd = _on_device(_piece_backward, hidden.device)
        per = ctx.per
        acc = torch.float64 if proj.dtype == torch.float64 else torch.float32
        g_h = torch.empty_like(hidden) if need_h else None
        g_acb = torch.zeros(pred_cb.shape, dtype=acc, device=pred_cb.device) if need_a else None
        g_bcb = torch.zeros(succ_cb.shape, dtype=acc, device=succ_cb.device) if need_b else None
        g_proj = torch.zeros(proj.shape, dtype=acc, device=proj.device) if need_p else None
        for s in range(0, hidden.shape[0], per):
            sl = slice(s, s + per)
            gh, ga, gb, gp = bwd(g_nll[sl], d_scores[sl], d_hidden[sl], hidden[sl], cand[sl], pred[sl],
                                 pred_cb, succ_cb, proj)
            if g_h is not None:
                g_h[sl] = gh
            if g_acb is not None:
                g_acb.index_add_(0, pred[sl], ga.to(acc))
            if g_bcb is not None:
                g_bcb.index_add_(0, cand[sl].reshape(-1), gb.reshape(-1, gb.shape[-1]).to(acc))
            if g_proj is not None:
                g_proj += gp.to(acc)
        cast = lambda t, like: None if t is None else t.to(like.dtype)  # noqa: E731
        return (g_h, None, None, None, None, cast(g_acb, pred_cb), cast(g_bcb, succ_cb), cast(g_proj, proj), None)


def selector_terms(hidden, lm_head, candidates, labels, predecessors, weights, rows: int = 4096):
    """trainer/loss.py ``selector_terms`` — (nll [P], covered [P], hit [P]) — with the
    selector's own ``weights`` (predecessor codebook [V, r], successor codebook [V, r],
    hidden projection [r, H]; any dtype: used in the dtype of ``hidden``) in place of its
    scorer callable, computed as this module's docstring says."""
    pred_cb, succ_cb, proj = weights
    if lm_head.requires_grad:  # the head is frozen in training; a trainable one: the reference
        from trainer.loss import selector_terms as reference
        from trainer.layers.hf_dflash import selector_scores

        dt = hidden.dtype

        def scorer(h, u, c, p):
            return selector_scores(h, u, c, p, *(w.to(dt) for w in weights))
        return reference(hidden, lm_head, candidates, labels, predecessors, scorer, rows)
    return _SelectorTerms.apply(hidden, lm_head, candidates, labels, predecessors, pred_cb, succ_cb, proj, int(rows))
