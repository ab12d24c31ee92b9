"""The drafter's training step behind one interface: ``step(mb, taps) -> StepStats``.

Two implementations of the same objective (docs/trainer-spec.md "Objective"), picked by
``--drafter-step`` (flags.drafter_step_for):

* :class:`ReferenceStep` — the whole micro-batch through autograd: trainer/model.py's
  ``Drafter.forward`` and trainer/loss.py's ``dflash_loss``. What a reader opens first; the
  default on CPU, where tests compare against it.
* :class:`ChunkedStep` — trainer/gpu/fast_drafter.py: the same drafter's fused pieces, anchor
  chunk by anchor chunk with the backward per chunk, so activation memory is one chunk's
  whatever the token budget (trainer/plan/memory.py models it). The default on CUDA.

Both accumulate gradients into the drafter's parameters, each micro-batch's loss scaled by
``loss_scale`` (1 / --grad-accum: the step's gradient is the mean over its micro-batches);
the caller averages them over drafter ranks (topology.average_gradients) and steps the
optimizer. Both return the same :class:`StepStats`, so the loop, the probe and the logs
never ask which step ran. tests/test_trainer_train.py keeps a golden trajectory per step.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, fields

import torch

from trainer.loss import LossConfig, dflash_loss
from trainer.model import Drafter, DrafterConfig, FrozenHead
from trainer.topology import MicroBatch


@dataclass
class StepStats:
    """What the drafter's step measured: sums over micro-batches, and over drafter ranks
    after :meth:`reduce`. Tensors stay on the device until :meth:`to_metrics` (one host
    sync, on log steps only)."""

    loss: torch.Tensor  # Σ over micro-batches of the total loss
    ce: torch.Tensor  # Σ of its terms, as trainer/loss.py's dflash_loss reports them
    kl: torch.Tensor
    cap: torch.Tensor
    correct: torch.Tensor  # [B-1] top-1 hits per slot (slot 1 first)
    valid: torch.Tensor  # [B-1] labelled slots behind them
    tokens: torch.Tensor  # real tokens of the micro-batches
    micro_batches: int = 1
    wait_s: float = 0.0  # host time spent waiting for micro-batches (colocated: the target forward)
    ranks: int = 1
    # DFlash2 (``selector``): Σ of the selector term, and per slot the teacher-forced selector
    # hits and the slots whose true token was among the top-k candidates
    sel: torch.Tensor | None = None
    sel_correct: torch.Tensor | None = None
    covered: torch.Tensor | None = None
    selector: bool = False

    def __post_init__(self):
        z = torch.zeros_like(self.correct)
        self.sel = torch.zeros_like(self.loss) if self.sel is None else self.sel
        self.sel_correct = z if self.sel_correct is None else self.sel_correct
        self.covered = z if self.covered is None else self.covered

    @classmethod
    def zero(cls, block_size: int, device, selector: bool = False) -> "StepStats":
        z = torch.zeros((), device=device)
        k = torch.zeros(block_size - 1, device=device)
        return cls(z, z, z, z, k, k, z, micro_batches=0, selector=selector)

    def __add__(self, other: "StepStats") -> "StepStats":
        summed = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self) if f.name != "selector"}
        return StepStats(**summed, selector=self.selector or other.selector)

    def _flat(self) -> torch.Tensor:
        scalars = torch.stack([self.loss.float(), self.ce.float(), self.kl.float(), self.cap.float(),
                               self.tokens.float(), self.sel.float()])
        host = torch.tensor([self.micro_batches, self.wait_s, self.ranks], dtype=torch.float32, device=scalars.device)
        per_slot = [self.correct, self.valid, self.sel_correct, self.covered]
        return torch.cat([scalars, host, *(t.float() for t in per_slot)])

    def reduce(self, topo) -> "StepStats":
        """Summed over the drafter ranks in one all-reduce (every rank gets the sums)."""
        from trainer.topology import drafter_sum

        flat = drafter_sum(topo, self._flat())
        K = self.correct.numel()
        loss, ce, kl, cap, tokens, sel = flat[:6].unbind()
        mbs, wait, ranks = flat[6:9].tolist()
        correct, valid, sel_correct, covered = flat[9:].split(K)
        return StepStats(loss, ce, kl, cap, correct, valid, tokens, micro_batches=round(mbs), wait_s=wait,
                         ranks=round(ranks), sel=sel, sel_correct=sel_correct, covered=covered, selector=self.selector)

    def to_metrics(self, seconds: float) -> dict:
        """The logged numbers: the loss and its terms as means over micro-batches, per-slot
        accuracy (None where a slot had no label), tokens, and rates over ``seconds``; for
        DFlash2 also the selector term, its per-slot teacher-forced accuracy (what the drafter
        proposes when every earlier slot was right) and the candidates' recall (the ceiling
        of that accuracy)."""
        v = self._flat().tolist()
        K = self.correct.numel()
        n = max(1, self.micro_batches)
        correct, valid, sel_correct, covered = (v[9 + i * K:9 + (i + 1) * K] for i in range(4))
        out = {"loss": v[0] / n, "ce": v[1] / n, "kl": v[2] / n, "cap": v[3] / n, "tokens": int(v[4]),
               "tokens_per_s": v[4] / seconds, "drafted_per_s": sum(valid) / seconds,
               "acc": _rates(correct, valid), "wait_s": self.wait_s / max(1, self.ranks)}
        if self.selector:
            out.update(sel=v[5] / n, sel_acc=_rates(sel_correct, valid),
                       recall=round(sum(covered) / sum(valid), 4) if sum(valid) else None)
        return out


def _rates(hits: list[float], counts: list[float]) -> list[float | None]:
    return [round(c / m, 4) if m else None for c, m in zip(hits, counts)]


class ReferenceStep:
    """The whole micro-batch through autograd: Drafter.forward + loss.dflash_loss, under bf16
    autocast and flex attention on CUDA, fp32 and the dense SDPA mask on CPU."""

    def __init__(self, args, drafter: Drafter, head: FrozenHead, dcfg: DrafterConfig, loss_scale: float):
        self.drafter, self.head, self.dcfg, self.loss_scale = drafter, head, dcfg, loss_scale
        cuda = next(drafter.parameters()).device.type == "cuda"
        self.attn = "flex" if cuda else "sdpa"
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()
        self.loss_cfg = LossConfig(block_size=args.block_size, gamma=args.gamma, position_weights=args.position_weights,
                                   dpace_alpha=args.dpace_alpha, use_soft_labels=args.use_soft_labels,
                                   kl_weight=args.kl_weight, kl_temperature=args.kl_temperature,
                                   cap_lambda=args.cap_lambda, selector_weight=selector_weight(args))

    def __call__(self, mb: MicroBatch, taps: torch.Tensor) -> StepStats:
        B, head, d = self.dcfg.block_size, self.head, self.drafter
        with self.autocast:
            blocks = head.embed_blocks(mb.input_ids, mb.anchors, B, self.dcfg.mask_token_id)
            out = d(taps, blocks, mb.anchors, mb.keep, self.attn)
            lo = dflash_loss(self.loss_cfg, out, head.lm_head, mb.input_ids, mb.loss_mask, mb.lengths,
                             mb.anchors, mb.keep, mb.final, selector=d.selector_scores if d.selector else None,
                             top_k=self.dcfg.selector_top_k, teacher_head=head.teacher_head())
        (lo.loss * self.loss_scale).backward()
        return StepStats(lo.loss.detach(), lo.ce, lo.kl, lo.cap, lo.acc * lo.acc_count, lo.acc_count,
                         mb.lengths.sum(), sel=lo.sel, sel_correct=lo.sel_correct, covered=lo.covered,
                         selector=d.selector is not None)


class ChunkedStep:
    """trainer/gpu/fast_drafter.py's anchor-chunked forward + backward (bf16 compute and flex
    attention on CUDA; fp32 and the dense SDPA mask on CPU, where flex has no backward)."""

    def __init__(self, args, drafter: Drafter, head: FrozenHead, dcfg: DrafterConfig, loss_scale: float):
        self.drafter, self.head, self.dcfg, self.loss_scale = drafter, head, dcfg, loss_scale
        cuda = next(drafter.parameters()).device.type == "cuda"
        self.kw = dict(block_size=args.block_size, mask_token_id=dcfg.mask_token_id, gamma=args.gamma,
                       position_weights=args.position_weights, dpace_alpha=args.dpace_alpha,
                       kl_weight=args.kl_weight if args.use_soft_labels else 0.0, temperature=args.kl_temperature,
                       cap_lambda=args.cap_lambda, attn="flex" if cuda else "sdpa",
                       attention_kernel=attention_kernel(args, cuda),
                       dtype=torch.bfloat16 if cuda else torch.float32, selector_weight=selector_weight(args))

    def __call__(self, mb: MicroBatch, taps: torch.Tensor) -> StepStats:
        from trainer.gpu import fast_drafter

        r = fast_drafter.step_backward(self.drafter, self.head.embed, self.head.lm_head, mb.input_ids, taps, mb.loss_mask,
                                       mb.lengths, mb.anchors, mb.keep, teacher_final=mb.final,
                                       loss_scale=self.loss_scale, teacher_fp8=self.head.lm_head8, **self.kw)
        return StepStats(r["loss"], r["ce"], r["kl"], r["cap"], r["correct"], r["valid"], mb.lengths.sum(),
                         sel=r["sel"], sel_correct=r["sel_correct"], covered=r["covered"],
                         selector=self.drafter.selector is not None)


def attention_kernel(args, cuda: bool) -> str:
    """--attention-kernel, resolved: ``python -m trainer`` resolves auto before the run starts;
    a caller that builds its args otherwise (benchmarks, tests) gets it resolved here."""
    from trainer import flags
    from trainer.layers import flex_mask

    choice = getattr(args, "attention_kernel", None) or "auto"
    if choice != "auto":
        return choice
    return flags.attention_kernel_for({"attention_kernel": choice}, cuda, flex_mask.flash_missing() if cuda else "CPU")


def selector_weight(args) -> float:
    """--selector-loss-weight (DFlash2's μ; a run config without the flag: its default)."""
    from trainer.flags import BY_DEST

    return float(getattr(args, "selector_loss_weight", BY_DEST["selector_loss_weight"].default))


STEPS = {"reference": ReferenceStep, "chunked": ChunkedStep}


def make_step(args, drafter: Drafter, head: FrozenHead, dcfg: DrafterConfig, loss_scale: float | None = None):
    """The ``--drafter-step`` (resolved: reference | chunked) for this drafter and head;
    each micro-batch's loss is scaled by ``loss_scale`` (default 1 / --grad-accum)."""
    if args.drafter_step not in STEPS:
        raise ValueError(f"--drafter-step {args.drafter_step!r}: expected reference or chunked (auto is resolved "
                         "before the run starts)")
    scale = 1.0 / args.grad_accum if loss_scale is None else loss_scale
    return STEPS[args.drafter_step](args, drafter, head, dcfg, scale)
