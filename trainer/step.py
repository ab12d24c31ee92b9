"""The drafter's training step behind one interface: ``step(mb, taps) -> StepStats``.

Two implementations of the same objective (TRAINER_SPEC.md "Objective"), picked by
``--drafter-step`` (flags.drafter_step_for):

* :class:`ReferenceStep` — the whole micro-batch through autograd: trainer/model.py's
  ``Drafter.forward`` and trainer/loss.py's ``dflash_loss``. What a reader opens first; the
  default on CPU, where tests compare against it.
* :class:`ChunkedStep` — trainer/fast_drafter.py: the same drafter's fused pieces, anchor
  chunk by anchor chunk with the backward per chunk, so activation memory is one chunk's
  whatever the token budget (trainer/memory.py models it). The default on CUDA.

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

    @classmethod
    def zero(cls, block_size: int, device) -> "StepStats":
        z = torch.zeros((), device=device)
        k = torch.zeros(block_size - 1, device=device)
        return cls(z, z, z, z, k, k, z, micro_batches=0)

    def __add__(self, other: "StepStats") -> "StepStats":
        return StepStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def _flat(self) -> torch.Tensor:
        scalars = torch.stack([self.loss.float(), self.ce.float(), self.kl.float(), self.cap.float(), self.tokens.float()])
        host = torch.tensor([self.micro_batches, self.wait_s, self.ranks], dtype=torch.float32, device=scalars.device)
        return torch.cat([scalars, host, self.correct.float(), self.valid.float()])

    def reduce(self, topo) -> "StepStats":
        """Summed over the drafter ranks in one all-reduce (every rank gets the sums)."""
        from trainer.topology import drafter_sum

        flat = drafter_sum(topo, self._flat())
        K = self.correct.numel()
        loss, ce, kl, cap, tokens = flat[:5].unbind()
        mbs, wait, ranks = flat[5:8].tolist()
        return StepStats(loss, ce, kl, cap, flat[8:8 + K], flat[8 + K:], tokens,
                         micro_batches=round(mbs), wait_s=wait, ranks=round(ranks))

    def to_metrics(self, seconds: float) -> dict:
        """The logged numbers: the loss and its terms as means over micro-batches, per-slot
        accuracy (None where a slot had no label), tokens, and rates over ``seconds``."""
        v = self._flat().tolist()
        K = self.correct.numel()
        n = max(1, self.micro_batches)
        correct, valid = v[8:8 + K], v[8 + K:]
        return {"loss": v[0] / n, "ce": v[1] / n, "kl": v[2] / n, "cap": v[3] / n, "tokens": int(v[4]),
                "tokens_per_s": v[4] / seconds, "drafted_per_s": sum(valid) / seconds,
                "acc": [round(c / m, 4) if m else None for c, m in zip(correct, valid)],
                "wait_s": self.wait_s / max(1, self.ranks)}


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
                                   cap_lambda=args.cap_lambda)

    def __call__(self, mb: MicroBatch, taps: torch.Tensor) -> StepStats:
        B, head = self.dcfg.block_size, self.head
        with self.autocast:
            blocks = head.embed_blocks(mb.input_ids, mb.anchors, B, self.dcfg.mask_token_id)
            out = self.drafter(taps, blocks, mb.anchors, mb.keep, self.attn)
            lo = dflash_loss(self.loss_cfg, out, head.lm_head, mb.input_ids, mb.loss_mask, mb.lengths,
                             mb.anchors, mb.keep, mb.final)
        (lo.loss * self.loss_scale).backward()
        return StepStats(lo.loss.detach(), lo.ce, lo.kl, lo.cap, lo.acc * lo.acc_count, lo.acc_count,
                         mb.lengths.sum())


class ChunkedStep:
    """trainer/fast_drafter.py's anchor-chunked forward + backward (bf16 compute and flex
    attention on CUDA; fp32 and the dense SDPA mask on CPU, where flex has no backward)."""

    def __init__(self, args, drafter: Drafter, head: FrozenHead, dcfg: DrafterConfig, loss_scale: float):
        self.drafter, self.head, self.dcfg, self.loss_scale = drafter, head, dcfg, loss_scale
        cuda = next(drafter.parameters()).device.type == "cuda"
        self.kw = dict(block_size=args.block_size, mask_token_id=dcfg.mask_token_id, gamma=args.gamma,
                       position_weights=args.position_weights, dpace_alpha=args.dpace_alpha,
                       kl_weight=args.kl_weight if args.use_soft_labels else 0.0, temperature=args.kl_temperature,
                       cap_lambda=args.cap_lambda, attn="flex" if cuda else "sdpa",
                       dtype=torch.bfloat16 if cuda else torch.float32)

    def __call__(self, mb: MicroBatch, taps: torch.Tensor) -> StepStats:
        from trainer import fast_drafter

        r = fast_drafter.step_backward(self.drafter, self.head.embed, self.head.lm_head, mb.input_ids, taps, mb.loss_mask,
                                       mb.lengths, mb.anchors, mb.keep, teacher_final=mb.final,
                                       loss_scale=self.loss_scale, **self.kw)
        return StepStats(r["loss"], r["ce"], r["kl"], r["cap"], r["correct"], r["valid"], mb.lengths.sum())


STEPS = {"reference": ReferenceStep, "chunked": ChunkedStep}


def make_step(args, drafter: Drafter, head: FrozenHead, dcfg: DrafterConfig, loss_scale: float | None = None):
    """The ``--drafter-step`` (resolved: reference | chunked) for this drafter and head;
    each micro-batch's loss is scaled by ``loss_scale`` (default 1 / --grad-accum)."""
    if args.drafter_step not in STEPS:
        raise ValueError(f"--drafter-step {args.drafter_step!r}: expected reference or chunked (auto is resolved "
                         "before the run starts)")
    scale = 1.0 / args.grad_accum if loss_scale is None else loss_scale
    return STEPS[args.drafter_step](args, drafter, head, dcfg, scale)
