"""Acceptance length τ by greedy speculative decoding (docs/trainer-spec.md, "Evaluation").

Each round: the drafter drafts a block from the committed prefix's tapped target states
(the block is [bonus, MASK × (B-1)] at the next position; each slot's argmax, or for a
DFlash2 drafter its path selector's walk from the bonus through each slot's top-k: the
hf_dflash.propose, as the export's modeling file drafts), the target verifies the whole
block in one forward, the longest prefix of drafts equal to the target's own greedy choice
is accepted, and the target's token after it becomes the next bonus. τ = mean tokens
committed per target forward (the bonus included), so τ ≥ 1 always, and the output equals
plain greedy decoding token for token.

The target keeps a cache of the committed prefix (attention K/V, and for a Qwen3.5/3.6
target the Gated DeltaNet layers' convolution and recurrent states), so a round costs the
block, not the prefix. Verification runs on a copy of that cache; when only j < B-1 drafts
are accepted, the kept cache is advanced by the committed tokens alone. Attention K/V could
simply be cut back to the accepted length, but a recurrent state has folded every verified
token in and cannot be: it is rolled back by restarting from the state before the round.
So every committed token is the target's greedy choice after exactly the committed prefix,
and the output equals plain greedy decoding token for token (tests: Qwen3 and both Qwen3.5
layouts). Not a serving benchmark: batch 1, transformers' forward.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from trainer.layers.hf_dflash import propose, speculative_decode

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

    def draft(taps, n, bonus):
        ids = torch.full((1, n + 1), bonus, device=device)  # embed_blocks reads only the anchor's token
        anchors = torch.tensor([[n]], device=device)
        keep = torch.ones(1, 1, dtype=torch.bool, device=device)
        with autocast:
            h = drafter(taps, head.embed_blocks(ids, anchors, B, mask_id), anchors, keep)
            return propose(h[0, 1:], head.lm_head, bonus, getattr(drafter, "selector", None))

    # one decode loop with the export's spec_generate (trainer/layers/hf_dflash.py)
    out, per_forward = speculative_decode(
        lambda rows, c: target.forward_cached(torch.tensor(rows, device=device), c), draft, prompt, max_new)
    return out[:max_new], per_forward


def _held(data, n: int) -> list[int]:
    return data.held_out(n) if hasattr(data, "held_out") else list(range(max(0, len(data) - n), len(data)))


def prompts_from(data, n: int, max_prompt: int = 256) -> list[list[int]]:
    """Prompts of the ``n`` samples the trainer holds out of training with --eval-prompts n
    (PreparedData.held_out): the tokens before the first loss token."""
    prompts = []
    for i in _held(data, n):
        ids, mask = data.sample(i)
        first = int(mask.argmax()) if mask.any() else len(ids)
        prompts.append(ids[:max(1, min(first, max_prompt))].tolist())
    return prompts


def acceptance_length(target, drafter, head, data, n_prompts: int, device, max_new: int = EVAL_MAX_NEW) -> float:
    return evaluate(target, drafter, head, data, n_prompts, device, max_new)["tau"]


def evaluate(target, drafter, head, data, n_prompts: int, device, max_new: int = EVAL_MAX_NEW) -> dict:
    """τ over the held-out prompts, pooled over every round, and per category where the data
    says which source each sample came from (``by_category``: {name: τ}; {} otherwise)."""
    was_training = drafter.training
    drafter.eval()
    counts: list[int] = []
    by: dict[str, list[int]] = {}
    for i, prompt in zip(_held(data, n_prompts), prompts_from(data, n_prompts)):
        per_forward = speculative(target, drafter, head, prompt, max_new, device)[1]
        counts += per_forward
        category = data.category(i) if hasattr(data, "category") else None
        if category is not None:
            by.setdefault(category, []).extend(per_forward)
    drafter.train(was_training)
    tau = lambda c: sum(c) / max(1, len(c))  # noqa: E731
    return {"tau": tau(counts), "by_category": {name: tau(c) for name, c in sorted(by.items())}}
