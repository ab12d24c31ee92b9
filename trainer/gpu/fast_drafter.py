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
   in fp32 (the GEMM weights' through model.StepGemmWeights' hook, the small ones through
   their casts) and the context k/v gradients go to fp32 accumulators
   (the context k/v enter each chunk as fresh leaves);
3. one backward through the context path with the accumulated k/v gradients.

Activation memory is therefore one chunk's, whatever the token budget: peak ≈ weights,
gradients and AdamW state + the micro-batch's context (per token) + one chunk of positions ×
(per-layer activations) + one head chunk of logits (trainer/plan/memory.py models it). The
result equals the unchunked step (tests/test_gpu_blocks.py checks loss and every gradient
against a dense reference).

Parameters stay fp32 (master weights). The layers' GEMM weights are cast to the compute
dtype (bf16) once per step (model.StepGemmWeights: their gradients go into the fp32 ``.grad``
chunk by chunk); the small ones (norms, DFlash2's convolutions) are cast where they are used. With soft labels the teacher's logits are
formed once per distinct target position of a head chunk, not once per drafted slot
(chunked_head.chunk_spans): the spans of a micro-batch's chunks are the one GPU value read on
the host, once, before any of its work is queued.
The layer math is the drafter's own (trainer/model.py: ``Drafter.context_kv`` and
``Drafter.block_forward``); this module owns only the chunking and the gradient plumbing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from trainer.gpu import chunked_head, fp8, selector_fused
from trainer.layers import flex_mask
from trainer.layers import fused_ops as fo
from trainer.gpu.chunked_head import chunk_spans, chunked_head_loss, head_ce, span_plan
from trainer.layers.flex_mask import dense_dflash_mask, dflash_mask_mod, direct_block_mask, flex_attention_fn
from trainer.gpu.kernel_profile import REGION_HEAD, REGION_SELECTOR, region
from trainer.loss import decay_weights, dflash_loss_fn, dpace_weights, run_products
from trainer.model import StepGemmWeights

_MASKS: dict = {}


def _accumulator(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Zeros of ``t``'s shape in the layout AccumulateGrad gives a gradient of a leaf viewing
    ``t`` (zeros_like keeps the strides of a dense tensor, the context k, and makes a view into
    the fused k/v output, v, contiguous): the chunk adds then walk both in the same order."""
    return torch.zeros_like(t, dtype=dtype)


def flex_options(kernel: str = "triton") -> dict | None:
    """flex attention's kernel_options for --attention-kernel ``kernel`` (resolved: triton or
    flash): torch's own Triton defaults measured best at the operators' chunk shape; flash is a
    backend of its own."""
    return {"BACKEND": "FLASH"} if kernel == "flash" else None


def _chunk_block_mask(a, kp, S_pad: int, B: int, window: int | None = None):
    """BlockMask for one chunk (full or sliding-window layers). The mask_mod closes over
    persistent buffers (one set per shape) that are refilled per chunk, so the compiled flex
    kernel sees the same mask function every time and never recompiles for new anchors."""
    n = a.shape[0]
    key = (n, S_pad, B, a.device, window)
    if key not in _MASKS:
        a_buf = torch.zeros(1, n, dtype=torch.long, device=a.device)
        k_buf = torch.zeros(1, n, dtype=torch.bool, device=a.device)
        _MASKS[key] = (a_buf, k_buf, dflash_mask_mod(a_buf, S_pad, B, k_buf, window))
    a_buf, k_buf, mod = _MASKS[key]
    a_buf.copy_(a[None])
    k_buf.copy_(kp[None])
    # no compile: the tiles follow from the anchors (flex_mask.py)
    return direct_block_mask(a, kp, S_pad, B, mod, tile=(flex_mask.Q_TILE, 128), window=window)


def teacher_spans(tpos, keep, n_c: int, head_chunk_rows: int) -> list:
    """Per (sequence, anchor chunk), chunked_head's teacher spans of its head chunks: tpos
    [b, N', B-1] each slot's teacher position, keep [b, N'] (N' whole chunks of ``n_c``). One
    small host read for the whole micro-batch."""
    b, N, K = tpos.shape
    sp = chunk_spans(tpos.reshape(b * (N // n_c), n_c, K), keep.reshape(b * (N // n_c), n_c), head_chunk_rows)
    return [span_plan(g, n_c, head_chunk_rows, K) for g in sp.tolist()]


def teacher_rows_computed(anchors, keep, S: int, block_size: int, chunk_anchors: int = 512,
                          head_chunk_rows: int = 4096) -> int:
    """Rows of teacher logits a soft-label step computes for this micro-batch (a span's
    positions, or a chunk's rows where it has no span): the head GEMM's real work, for
    the step's roofline table in bench/."""
    B, N = int(block_size), anchors.shape[1]
    n_c = max(1, min(int(chunk_anchors), N))
    pad = math.ceil(N / n_c) * n_c - N
    anchors, keep = F.pad(anchors, (0, pad)), F.pad(keep, (0, pad), value=False)
    tpos = (anchors[:, :, None] + torch.arange(1, B, device=anchors.device)).clamp(max=S - 1) - 1
    cb = chunked_head.balanced_chunk_blocks(n_c, head_chunk_rows, B - 1)
    total = 0
    for plan in teacher_spans(tpos.clamp(min=0), keep, n_c, head_chunk_rows):
        for i, sp in enumerate(plan):
            total += (sp[1] - sp[0]) if sp else (min(n_c, (i + 1) * cb) - i * cb) * (B - 1)
    return total


def step_backward(drafter, embed, lm_head, input_ids, taps, loss_mask, lengths, anchors, keep, *,
                  block_size: int, mask_token_id: int, gamma: float = 10.0, kl_weight: float = 0.0,
                  temperature: float = 1.0, cap_lambda: float = 0.0, teacher_final=None,
                  position_weights: str = "decay", dpace_alpha: float = 0.5,
                  chunk_anchors: int = 512, head_chunk_rows: int = 4096, dtype=torch.bfloat16,
                  attn: str = "flex", attention_kernel: str = "triton", ctx_multiple: int = 1, loss_scale: float = 1.0,
                  n_anchors_host=None, selector_weight: float = 1.0, teacher_fp8=None) -> dict:
    """Forward + backward of the DFlash loss for one micro-batch; gradients land in the
    drafter's parameters (accumulating, as ``loss.backward()`` would — scale with
    ``loss_scale`` for gradient accumulation). Returns detached metrics (device tensors):
    ``loss`` (the micro-batch's total), its terms ``ce``, ``kl`` (T²-scaled; 0 without soft
    labels) and ``cap`` as trainer/loss.py's ``dflash_loss`` reports them, and per slot
    ``correct`` / ``valid`` [B-1].

    input_ids/loss_mask [b, S]; lengths [b]; taps [b, S, n·H]; anchors/keep [b, N] (sorted,
    padded with keep False); teacher_final [b, S, H] final-normed target states (soft labels).
    attn: "flex" (block-sparse, CUDA compiled / CPU eager) or "sdpa" (dense mask; tests).
    attention_kernel: flex's kernels on CUDA, "triton" or "flash" (--attention-kernel, resolved).
    ctx_multiple: pad the context length to a multiple of this (fewer distinct shapes for
    the compiled kernels). n_anchors_host: optional host list of real anchors per sequence,
    so chunks that hold only padding are skipped without reading the GPU.
    position_weights: "decay" (exp(−(k−1)/γ)) or "dpace" (trainer.loss.dpace_weights of the
    drafter's own detached CE). D-PACE's normaliser Σw spans the whole micro-batch, and each
    chunk's backward needs it, so dpace first runs every chunk forward without gradient
    (drafter + head statistics, no logits kept) to get the CE: a gradient-free forward is
    roughly a third of forward + backward (estimate; not measured on GPU).
    A DFlash2 drafter (one with a selector) adds its selector term (trainer/loss.py
    ``selector_terms``, computed by trainer/gpu/selector_fused.py: one autograd node per chunk, its
    backward written out) to each chunk's loss before that chunk's backward, with the same
    weights and global normaliser Σw, its candidates the top-k of the logits the head chunk
    already forms: ``sel`` (the term), ``sel_correct`` and ``covered`` [B-1] come back too
    (zeros for DFlash).
    teacher_fp8: the LM head's e4m3 copy (--target-precision fp8, trainer/gpu/fp8.py): each
    sequence's final states are quantized per row once (one compiled pass) and the teacher's
    logits are their scaled matmul with it.
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
    cos, sin = fo.rope_tables(S_pad + B + 1, c.head_dim, dev, float(c.rope_theta))

    # weights and labels for every block, computed once (global normalisers)
    k_idx = torch.arange(1, B, device=dev)
    pos = anchors[:, :, None] + k_idx  # [b, N', B-1] = a+k
    posc = pos.clamp(max=S - 1)
    valid = (pos < lengths.view(b, 1, 1)) & loss_mask.gather(1, posc.reshape(b, -1)).view(posc.shape).bool() & keep[:, :, None]
    wdt = torch.float64 if dtype == torch.float64 else torch.float32
    labels = input_ids.gather(1, posc.reshape(b, -1)).view(posc.shape)
    n_valid_blocks = keep.sum().clamp_min(1)
    soft = teacher_final is not None and kl_weight > 0
    top_k = c.selector_top_k if drafter.selector is not None else 0
    if top_k:  # the true token before each slot: the selector's teacher-forced predecessor
        preds = input_ids.gather(1, (pos - 1).clamp(max=S - 1).reshape(b, -1)).view(posc.shape)

    tpos_all = (posc - 1).clamp(min=0)  # [b, N', B-1] the target position whose logits teach slot k
    spans = teacher_spans(tpos_all, keep, n_c, head_chunk_rows) if soft else None

    # 1. context path (graph kept until the end)
    ctx = drafter.context_kv(taps, cos[:S], sin[:S], dtype)
    leaves_src = [(k.detach(), v.detach()) for k, v in ctx]
    gacc = [(_accumulator(k, wdt), _accumulator(v, wdt)) for k, v in leaves_src]

    flex = flex_attention_fn(dev.type) if attn == "flex" else None
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
        attends = {t: attend_fn(a, kp, c.window_of(t)) for t in set(c.layer_types)}
        return drafter.block_forward(x, kv, cos[bpos], sin[bpos], attends, dtype, gemm).view(n_c, B, -1)[:, 1:]

    def attend_fn(a, kp, window):
        """attend(q, k, v) under the DFlash mask of one chunk for layers of this window."""
        if attn == "flex":
            bm = _chunk_block_mask(a, kp, S_pad, B, window)
            opts = flex_options(attention_kernel) if dev.type == "cuda" else None
            return lambda q, k, v: flex(q, k, v, block_mask=bm, enable_gqa=k.shape[1] != q.shape[1], kernel_options=opts)
        m = dense_dflash_mask(a[None], S_pad, B, kp[None], window)[:, None]

        def attend(q, k, v):
            rep = q.shape[1] // k.shape[1]
            return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=m)
        return attend

    # the layers' GEMM weights in the compute dtype for every chunk (fp32 master weights only)
    cast = any(p.dtype != dtype for p in drafter.layers.parameters())
    gemm = StepGemmWeights(drafter, dtype) if cast else None

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
    ce_sum, kl_sum, cap_sum, sel_sum = (torch.zeros((), device=dev, dtype=wdt) for _ in range(4))
    n_correct, n_sel, n_covered = (torch.zeros(B - 1, device=dev, dtype=torch.float32) for _ in range(3))
    quantized = [None, None]  # (sequence, its final states quantized per row): --target-precision fp8
    for s, sl in chunks():
        kp = keep[s, sl]
        leaves = [(k[s:s + 1].detach().requires_grad_(True), v[s:s + 1].detach().requires_grad_(True))
                  for k, v in leaves_src]
        h = chunk_hidden(s, sl, leaves)
        teacher = teacher_final[s] if soft else None  # rows tpos_all[s, sl] of it (chunked_head)
        if soft and teacher_fp8 is not None:
            if quantized[0] != s:  # once per sequence, not per anchor chunk
                quantized[:] = [s, fp8.quantize_table(teacher)]
            teacher = quantized[1]
        fn = dflash_loss_fn(weights[s, sl], kl_weight=kl_weight if soft else 0.0, temperature=temperature,
                            cap_lambda=cap_lambda, block_valid=kp, denom=denom, n_valid_blocks=n_valid_blocks)
        with region(REGION_HEAD):
            loss, ce, kl, correct, *cand = chunked_head_loss(
                h, lm_head, labels[s, sl], fn, teacher=teacher, temperature=temperature, chunk_rows=head_chunk_rows,
                top_k=top_k, teacher_rows=tpos_all[s, sl] if soft else None,
                teacher_spans=spans[s * n_chunks + sl.start // n_c] if spans else None,
                teacher_fp8=teacher_fp8 if soft else None)
        if top_k:
            with region(REGION_SELECTOR):
                sel_args = (h.reshape(-1, h.shape[-1]), lm_head, cand[0].view(-1, top_k), labels[s, sl].reshape(-1),
                            preds[s, sl].reshape(-1))
                # one node per chunk, its backward written out (selector_fused.py)
                nll, cov, hit = selector_fused.selector_terms(*sel_args, drafter.selector_weights(), head_chunk_rows)
            cov, hit = cov.view(n_c, B - 1), hit.view(n_c, B - 1)
            sel_part = (weights[s, sl] * cov * nll.view(n_c, B - 1).to(wdt)).sum()
            loss = loss + selector_weight * (sel_part / denom).to(loss.dtype)
            sel_sum = sel_sum + sel_part.detach()
            v = valid[s, sl]
            n_sel, n_covered = n_sel + (hit & v).sum(0), n_covered + (cov & v).sum(0)
        (loss * loss_scale).backward()
        # Metrics only: ce/kl come out of the head's autograd Function still linked to its
        # graph, and summed as they were, they kept every chunk's graph — with its context
        # k/v leaves and their gradients — alive to the end of the step: 20 × [1, nkv, S, hd]
        # per sequence, 41 KB per token for Qwen3-8B (found by the H200 allocator trace of
        # the memory-trace benchmark). Detached, and each leaf's gradient dropped once
        # it is in the accumulator.
        ce, kl = ce.detach(), (None if kl is None else kl.detach())
        for (kl_, vl_), (gk, gv) in zip(leaves, gacc):
            if kl_.grad is not None:
                gk[s:s + 1].add_(kl_.grad)
            if vl_.grad is not None:
                gv[s:s + 1].add_(vl_.grad)
            kl_.grad = vl_.grad = None
        total = total + loss.detach()
        # the terms as loss.dflash_loss reports them (CAP also when it is not in the loss)
        w, v = weights[s, sl], valid[s, sl]
        ce_sum = ce_sum + (w * ce).sum()
        if kl is not None:
            kl_sum = kl_sum + (w * kl).sum()
        accepted = run_products(ce, v).sum(-1)
        cap_sum = cap_sum + ((1 - accepted / (B - 1)) * kp).sum()
        n_correct = n_correct + (correct & v).sum(0)
    del gemm  # its gradients are in the parameters; the context path's backward has its own casts
    # 4. context path backward with the accumulated k/v gradients
    outs, grads = [], []
    for (k, v), (gk, gv) in zip(ctx, gacc):
        outs += [k, v]
        grads += [gk.to(k.dtype), gv.to(v.dtype)]
    torch.autograd.backward(outs, grads)
    return {"loss": total, "ce": ce_sum / denom, "kl": float(temperature) ** 2 * kl_sum / denom,
            "cap": cap_sum / n_valid_blocks, "correct": n_correct, "valid": valid.sum((0, 1)).float(),
            "sel": sel_sum / denom, "sel_correct": n_sel, "covered": n_covered,
            "weight_sum": denom, "blocks": keep.sum(), "positions": keep.sum() * B}
