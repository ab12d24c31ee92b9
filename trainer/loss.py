"""The DFlash objective (docs/trainer-spec.md, "Objective").

Shapes: b sequences, N blocks (anchors) per sequence, B slots per block; slot k of the block
at anchor a predicts token x[a+k]. Slot 0 (the anchor itself) has weight 0, so only slots
1..B-1 ever go through the LM head; everything below indexes those K = B-1 slots.

* anchors        :func:`sample_anchors` — positions a with loss_mask[a] and loss_mask[a+1],
                 up to max_anchors per sequence, uniform without replacement, keyed by
                 (seed, epoch, sample id) so every process draws the same ones.
* valid_k        loss_mask[a+k] · [a+k < len] · keep (the slot has a real label).
* weights        decay: w_k = exp(-(k-1)/gamma) · valid_k;
                 dpace: w_j = Σ_{m≥j} Π_{i≤m} q̃_i, q̃_i = ((1-α)·exp(-CE_i) + α)·valid_i,
                 detached (an invalid slot ends the chain: nothing after it can be accepted).
* CE             Σ w·ce / Σ w.
* KL (soft)      teacher = the target's logits at a+k-1 (its own next-token distribution for
                 a+k), temperature T: Σ w·T²·KL(p_t‖p_d) / Σ w; L = (1-kl_w)·CE + kl_w·KL.
* CAP            p_k = exp(-ce_k)·valid_k, C_j = Π_{k≤j} p_k, E = Σ_j C_j;
                 L += λ·mean over kept blocks of (1 - E/(B-1)).
* selector       DFlash2 only (docs/dflash2.md): the slot's top-k candidates of the drafter's
                 logits, scored S(x[a+k-1], b) after the true predecessor (teacher forcing);
                 nll_k = CE over the k candidates with the true token x[a+k] as label, at slots
                 whose true token is among them (covered); L += μ·Σ w·covered·nll / Σ w, with
                 the same weights w and normaliser as CE (μ = --selector-loss-weight).

Vocabulary-sized logits exist for one chunk of positions at a time; with autograd on, each
chunk is recomputed in backward (activation checkpointing), so the peak is one chunk's
logits, never positions × vocab.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

def key(*parts) -> int:
    """A 63-bit integer from any tuple of ints/strings: the seed of one keyed random draw.
    Keyed draws (not per-process RNG streams) make split and colocated runs, and resumed
    and straight runs, see the same anchors and noise."""
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


def sample_anchors(loss_mask: np.ndarray, lengths: np.ndarray, max_anchors: int, keys: list[int]):
    """Anchors for a padded batch (numpy, on the host that assembles the batch).

    loss_mask [b, S] (0/1), lengths [b] (after truncation), keys [b] (one per sample).
    Returns anchors int64 [b, N] (sorted, padded with 0) and keep bool [b, N], where
    N = max over the batch of min(max_anchors, valid count), at least 1.
    """
    b, S = loss_mask.shape
    chosen = []
    for i in range(b):
        n = int(lengths[i])
        lm = loss_mask[i, :n].astype(bool)
        cand = np.flatnonzero(lm[:-1] & lm[1:]) if n >= 2 else np.zeros(0, np.int64)
        rng = np.random.default_rng(keys[i])
        pick = cand[rng.permutation(len(cand))[:max_anchors]] if len(cand) else cand
        chosen.append(np.sort(pick))
    N = max(1, max(len(c) for c in chosen))
    anchors = np.zeros((b, N), np.int64)
    keep = np.zeros((b, N), bool)
    for i, c in enumerate(chosen):
        anchors[i, :len(c)] = c
        keep[i, :len(c)] = True
    return anchors, keep


def slot_index(anchors: torch.Tensor, block_size: int, shift: int = 0) -> torch.Tensor:
    """[b, N, B-1] absolute positions a+k+shift for k = 1..B-1."""
    k = torch.arange(1, block_size, device=anchors.device)
    return anchors[:, :, None] + k + shift


def valid_slots(anchors, keep, loss_mask, lengths, block_size) -> torch.Tensor:
    """float [b, N, B-1]: loss_mask[a+k] · [a+k < len] · keep."""
    b, S = loss_mask.shape
    pos = slot_index(anchors, block_size)
    inb = pos < lengths[:, None, None]
    lm = loss_mask.gather(1, pos.clamp(max=S - 1).reshape(b, -1)).reshape(pos.shape).bool()
    return (inb & lm & keep[:, :, None]).float()


def decay_weights(valid: torch.Tensor, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) · valid[.., k] for slots k = 1..B-1 (the last dim of valid)."""
    K = valid.shape[-1]
    w = torch.exp(-torch.arange(K, device=valid.device, dtype=valid.dtype) / gamma)  # k-1 = 0..K-1
    return w * valid


def run_products(ce: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """CAP's C_j = Π_{k≤j} p_k over the last dim, p_k = exp(−ce_k) where ``live`` and 0
    elsewhere (a dead slot ends the run), written as alive_j · exp(−Σ_{k≤j} ce_k) with alive_j =
    no dead slot at or before j. The same value and gradient as ``cumprod(exp(−ce) · live)`` to
    float rounding, but torch's cumprod backward asks the host whether its input holds a zero
    (a ``.item()``: one GPU synchronisation per call, i.e. per anchor chunk of the step, after
    which the host launches every kernel late; bench/drafter_step/idle_sources.py found it), and a
    cumulative sum's backward is another cumulative sum, asked nothing."""
    alive = (live == 0).cumsum(-1) == 0
    return torch.where(alive, torch.exp(-torch.where(alive, ce, 0.0).cumsum(-1)), 0.0)


def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    q = ((1 - alpha) * torch.exp(-ce.detach()) + alpha) * valid
    C = torch.cumprod(q, dim=-1)
    w = C.flip(-1).cumsum(-1).flip(-1)  # w_j = Σ_{m≥j} C_m
    return w * valid


def position_terms(hidden, lm_head, labels, teacher_hidden=None, temperature: float = 1.0,
                   chunk: int = 4096, top_k: int = 0, teacher_head=None):
    """Per-position ce, kl (T²-scaled; zeros without a teacher), correct, and (``top_k`` > 0)
    the top-k candidate ids [P, top_k] (best first; None otherwise) for flattened positions.

    hidden [P, H] drafter outputs; labels [P]; teacher_hidden [P, H] the target's final
    (normed) hidden state at the teacher position, whose logits are lm_head(teacher_hidden),
    or ``teacher_head(teacher_hidden)`` when given (the FP8 head of --target-precision fp8:
    trainer/gpu/fp8.py ``teacher_logits``). Logits are formed ``chunk`` positions at a time and
    recomputed in backward.
    """
    ces, kls, oks, cands = [], [], [], []
    for s in range(0, hidden.shape[0], chunk):
        h = hidden[s:s + chunk]
        t = teacher_hidden[s:s + chunk] if teacher_hidden is not None else None
        args = (h, lm_head, labels[s:s + chunk], t, temperature, top_k, teacher_head)
        if torch.is_grad_enabled() and h.requires_grad:
            ce, kl, ok, cand = checkpoint(_chunk_terms, *args, use_reentrant=False)
        else:
            ce, kl, ok, cand = _chunk_terms(*args)
        ces.append(ce), kls.append(kl), oks.append(ok), cands.append(cand)
    return torch.cat(ces), torch.cat(kls), torch.cat(oks), (torch.cat(cands) if top_k else None)


def _up(x):  # softmax statistics in fp32 at least (fp64 stays fp64, for exact tests)
    return x if x.dtype == torch.float64 else x.float()


def _chunk_terms(h, lm_head, labels, teacher_h, T, top_k=0, teacher_head=None):
    z = _up(F.linear(h, lm_head))
    logp = z.log_softmax(-1)
    ce = -logp.gather(-1, labels[:, None]).squeeze(-1)
    ok = (z.argmax(-1) == labels).float()
    cand = z.detach().topk(top_k, dim=-1).indices if top_k else torch.zeros(0, dtype=torch.long, device=z.device)
    if teacher_h is None:
        return ce, torch.zeros_like(ce), ok, cand
    zt = _up(F.linear(teacher_h, lm_head) if teacher_head is None else teacher_head(teacher_h))
    log_pt = (zt / T).log_softmax(-1)
    log_pd = (z / T).log_softmax(-1)
    kl = (T * T) * (log_pt.exp() * (log_pt - log_pd)).sum(-1)
    return ce, kl, ok, cand


def selector_terms(hidden, lm_head, candidates, labels, predecessors, scorer, rows: int = 4096):
    """DFlash2's selector objective per flattened position: (nll [P], covered [P] bool, hit [P]
    bool). hidden [P, H] the drafting slots' final-normed states; candidates [P, k] their top-k
    of the drafter's logits; labels [P] the true tokens; predecessors [P] the true tokens before
    them; ``scorer(hidden, unary, candidates, predecessors)`` → pair scores [P, k] (the
    drafter's selector). nll is the CE over the k candidates against the label's place among
    them (meaningful where covered: the label is a candidate); hit: the best-scored candidate
    is the label. The unary logits are the k candidates' own head rows against the state (their
    gradient reaches the drafter as the full logits' would), formed ``rows``/4 positions at a
    time (k·rows/4 gathered head rows: 128 MiB at 4,096 rows, k 16, H 4,096 in bf16, under the
    head chunk's logits) and recomputed in backward: no vocabulary-sized tensor."""
    match = candidates == labels[:, None]
    covered, place = match.any(-1), match.long().argmax(-1)
    per = max(1, int(rows) // 4)
    nlls, bests = [], []
    for s in range(0, hidden.shape[0], per):
        args = (hidden[s:s + per], lm_head, candidates[s:s + per], predecessors[s:s + per], place[s:s + per], scorer)
        if torch.is_grad_enabled() and hidden.requires_grad:
            nll, best = checkpoint(_selector_piece, *args, use_reentrant=False)
        else:
            nll, best = _selector_piece(*args)
        nlls.append(nll), bests.append(best)
    best = torch.cat(bests)
    return torch.cat(nlls), covered, candidates.gather(-1, best[:, None]).squeeze(-1) == labels


def _selector_piece(h, lm_head, cand, pred, place, scorer):
    unary = torch.einsum("ph,pkh->pk", h, F.embedding(cand, lm_head))
    scores = scorer(h, unary, cand, pred)
    nll = torch.logsumexp(scores, dim=-1) - scores.gather(-1, place[:, None]).squeeze(-1)
    return nll, scores.detach().argmax(-1)


@dataclass
class LossConfig:
    block_size: int
    gamma: float = 10.0
    position_weights: str = "decay"  # decay | dpace
    dpace_alpha: float = 0.5
    use_soft_labels: bool = False
    kl_weight: float = 0.15
    kl_temperature: float = 2.0
    cap_lambda: float = 0.0
    selector_weight: float = 1.0  # DFlash2: μ of the selector term (used only with a selector)
    chunk: int = 4096


@dataclass
class LossOut:
    loss: torch.Tensor  # scalar, differentiable
    ce: torch.Tensor  # detached scalars below
    kl: torch.Tensor
    cap: torch.Tensor
    acc: torch.Tensor  # [B-1] per-slot accuracy over valid slots (slot k at index k-1)
    acc_count: torch.Tensor  # [B-1] number of valid slots behind each accuracy
    # DFlash2 (zeros without a selector): the selector term Σ w·covered·nll / Σ w, and per slot
    # over valid slots: teacher-forced selector hits and slots whose true token was a candidate
    sel: torch.Tensor | None = None
    sel_correct: torch.Tensor | None = None
    covered: torch.Tensor | None = None


def dflash_loss(c: LossConfig, block_out, lm_head, input_ids, loss_mask, lengths, anchors, keep,
                target_final=None, selector=None, top_k: int = 0, teacher_head=None) -> LossOut:
    """block_out [b, N·B, H] (drafter output); input_ids/loss_mask [b, S]; lengths [b];
    anchors/keep [b, N]; target_final [b, S, H] (soft labels only); ``selector`` (DFlash2:
    the drafter's pair scorer, see :func:`selector_terms`) over each slot's ``top_k``;
    ``teacher_head``: what forms the teacher's logits from its states (:func:`position_terms`)."""
    b, S = input_ids.shape
    n = anchors.shape[1]
    B = c.block_size
    H = block_out.shape[-1]
    h = block_out.view(b, n, B, H)[:, :, 1:]  # slot 0 has weight 0: never through the head
    pos = slot_index(anchors, B).clamp(max=S - 1)  # a+k
    labels = input_ids.gather(1, pos.reshape(b, -1)).reshape(-1)
    teacher = None
    if c.use_soft_labels:
        tpos = slot_index(anchors, B, shift=-1).clamp(max=S - 1)  # a+k-1
        teacher = target_final.gather(1, tpos.reshape(b, -1, 1).expand(-1, -1, target_final.shape[-1])).reshape(-1, H)
    ce, kl, ok, cand = position_terms(h.reshape(-1, H), lm_head, labels, teacher, c.kl_temperature, c.chunk,
                                      top_k if selector is not None else 0, teacher_head)
    shape = (b, n, B - 1)
    ce, kl, ok = ce.view(shape), kl.view(shape), ok.view(shape)

    valid = valid_slots(anchors, keep, loss_mask, lengths, B).to(ce.dtype)
    if c.position_weights == "dpace":
        w = dpace_weights(ce, valid, c.dpace_alpha)
    else:
        w = decay_weights(valid, c.gamma)
    wsum = w.sum().clamp(min=1e-12)
    ce_loss = (w * ce).sum() / wsum
    kl_loss = (w * kl).sum() / wsum
    loss = (1 - c.kl_weight) * ce_loss + c.kl_weight * kl_loss if c.use_soft_labels else ce_loss

    # CAP: expected accepted length from the drafter's probability of the true tokens.
    C = run_products(ce, valid)
    kept = keep.to(ce.dtype)
    cap = ((1 - C.sum(-1) / (B - 1)) * kept).sum() / kept.sum().clamp(min=1)
    if c.cap_lambda > 0:
        loss = loss + c.cap_lambda * cap

    count = valid.sum((0, 1))
    acc = (ok * valid).sum((0, 1)) / count.clamp(min=1)
    zero = torch.zeros(B - 1, dtype=ce.dtype, device=ce.device)
    sel, sel_correct, covered = torch.zeros((), dtype=ce.dtype, device=ce.device), zero, zero
    if selector is not None:
        pred = input_ids.gather(1, slot_index(anchors, B, shift=-1).clamp(max=S - 1).reshape(b, -1)).reshape(-1)
        nll, cov, hit = selector_terms(h.reshape(-1, H), lm_head, cand, labels, pred, selector, c.chunk)
        cov, hit = cov.view(shape).to(ce.dtype), hit.view(shape).to(ce.dtype)
        sel = (w * cov * nll.view(shape)).sum() / wsum
        loss = loss + c.selector_weight * sel
        sel_correct, covered = (hit * valid).sum((0, 1)), (cov * valid).sum((0, 1))
    return LossOut(loss, ce_loss.detach(), kl_loss.detach(), cap.detach(), acc.detach(), count.detach(),
                   sel.detach(), sel_correct.detach(), covered.detach())


def dflash_loss_fn(weights: torch.Tensor, *, kl_weight: float = 0.0, temperature: float = 1.0,
                   cap_lambda: float = 0.0, block_valid: Optional[torch.Tensor] = None,
                   denom: Optional[torch.Tensor] = None, n_valid_blocks: Optional[torch.Tensor] = None
                   ):
    """The spec's objective as a per-chunk function ``(ce [n, K], kl [n, K] | None, blocks:
    slice) -> loss``, the form trainer/gpu/chunked_head.py differentiates chunk by chunk
    (docs/trainer-spec.md "Objective"; :func:`dflash_loss` is the whole-batch form):

    L = (1 − kl_weight)·Σ w·ce / Σ w + kl_weight·Σ w·T²·kl / Σ w
        + cap_lambda · mean over valid blocks of (1 − E/(B−1)), E = Σ_j Π_{k≤j} p_k,
    with p_k = exp(−ce_k) at slots whose weight is > 0 and 0 elsewhere (an invalid slot ends
    the accepted run). weights [nb, K]; normalisers are global (fixed before the chunks).
    When kl is None (no soft labels) the first term has weight 1.
    Normalisers stay tensors (no host sync)."""
    if denom is None:
        denom = weights.sum().clamp_min(1e-6)
    if block_valid is None:
        block_valid = (weights > 0).any(-1)
    if n_valid_blocks is None:
        n_valid_blocks = block_valid.sum().clamp_min(1)
    T2 = float(temperature) ** 2

    def fn(ce: torch.Tensor, kl: Optional[torch.Tensor], sl: slice) -> torch.Tensor:
        w = weights[sl]
        if kl is None:
            loss = (w * ce).sum() / denom
        else:
            loss = ((1.0 - kl_weight) * (w * ce).sum() + kl_weight * T2 * (w * kl).sum()) / denom
        if cap_lambda:
            E = run_products(ce, w > 0).sum(-1)
            K = ce.shape[-1]
            cap = ((1.0 - E / K) * block_valid[sl].float()).sum() / n_valid_blocks
            loss = loss + cap_lambda * cap
        return loss

    return fn
