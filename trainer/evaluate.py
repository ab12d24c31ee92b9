"""Acceptance length τ by greedy speculative decoding (TRAINER_SPEC.md, "Evaluation").

Each round: the drafter drafts a block from the committed prefix's tapped target states
(the block is [bonus, MASK × (B-1)] at the next position), the target verifies the whole
block in one forward, the longest prefix of drafts equal to the target's own greedy choice
is accepted, and the target's token after it becomes the next bonus. τ = mean tokens
committed per target forward (the bonus included), so τ ≥ 1 always, and the output equals
plain greedy decoding token for token.

Simple on purpose: the target recomputes the whole prefix every round (no KV cache). That
is fine for CPU tests and small held-out sets; it is not a serving benchmark.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F

from trainer.hf_dflash import accept

EVAL_MAX_NEW = 64  # new tokens per prompt of the evaluation at each save


@torch.no_grad()
def greedy(target, prompt: list[int], max_new: int, device="cpu") -> list[int]:
    seq = list(prompt)
    for _ in range(max_new):
        _, logits = target.forward_logits(torch.tensor([seq], device=device))
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt):]


@torch.no_grad()
def speculative(target, drafter, head, prompt: list[int], max_new: int, device="cpu"):
    """(tokens, accepted per target forward). ``head`` is the target's frozen embed/lm_head."""
    B = drafter.config.block_size
    mask_id = drafter.config.mask_token_id
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if torch.device(device).type == "cuda" else nullcontext()
    seq = list(prompt)
    taps, logits = target.forward_logits(torch.tensor([seq], device=device))
    bonus = int(logits[0, -1].argmax())
    out: list[int] = []
    per_forward: list[int] = []
    while len(out) < max_new:
        n = len(seq)  # the block's anchor (the bonus token) sits at position n
        ids = torch.tensor([seq + [bonus]], device=device)
        anchors = torch.tensor([[n]], device=device)
        keep = torch.ones(1, 1, dtype=torch.bool, device=device)
        with autocast:
            h = drafter(taps[:, :n], head.embed_blocks(ids, anchors, B, mask_id), anchors, keep)
            draft = F.linear(h[0, 1:], head.lm_head).argmax(-1).tolist()
        taps, logits = target.forward_logits(torch.tensor([seq + [bonus] + draft], device=device))
        # target's choice for positions n+1 .. n+B; the export's spec_generate verifies alike
        j, bonus_next = accept(draft, logits[0, n:n + B].argmax(-1).tolist())
        committed = [bonus] + draft[:j]
        seq, out, bonus = seq + committed, out + committed, bonus_next
        per_forward.append(j + 1)
    return out[:max_new], per_forward


def prompts_from(data, n: int, max_prompt: int = 256) -> list[list[int]]:
    """Prompts of the last ``n`` samples (the trainer holds them out of training with
    --eval-prompts n): the tokens before the first loss token."""
    prompts = []
    for i in range(max(0, len(data) - n), len(data)):
        ids, mask = data.sample(i)
        first = int(mask.argmax()) if mask.any() else len(ids)
        prompts.append(ids[:max(1, min(first, max_prompt))].tolist())
    return prompts


def acceptance_length(target, drafter, head, data, n_prompts: int, device, max_new: int = EVAL_MAX_NEW) -> float:
    was_training = drafter.training
    drafter.eval()
    counts: list[int] = []
    for prompt in prompts_from(data, n_prompts):
        counts += speculative(target, drafter, head, prompt, max_new, device)[1]
    drafter.train(was_training)
    return sum(counts) / max(1, len(counts))
