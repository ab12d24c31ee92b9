"""DDTree-style tree verification for a DFlash drafter (docs/research/dflash.md §6; Ringel &
Romano, arXiv 2604.12989, ``liranringel/ddtree``), greedy (T = 0), for evaluation.

One round:

1. the drafter drafts a block from the committed prefix, as in evaluate.speculative, and
   gives per-position log-probs for depths 1..B-1 (positions treated as independent; a
   DFlash2 drafter's: over each slot's top-k, conditioned on the parent token by its path
   selector, :func:`draft_tree`);
2. :func:`build_tree` (:func:`grow_tree`) grows a best-first tree from them: a node is a
   prefix of drafted tokens scored by the sum of its per-position log-probs; the ``budget``
   best prefixes (depth ≤ B-1) become the tree. The root is the bonus token (not counted in
   the budget);
3. the target runs once over prefix + tree with an ancestor-only mask (a node sees the
   prefix, its ancestors and itself) at positions n + depth — so each node's logits are
   exactly the target's logits after its path;
4. walk from the root while the target's greedy token is a child of the current node; the
   target's token where the walk stops is the next bonus.

Lossless: every committed token is the target's greedy choice after the committed prefix,
so the output equals plain greedy decoding token for token (up to floating-point ties).

The target recomputes the whole prefix every round (no cache). Dense (Qwen3) targets only:
a hybrid target is refused with the reason (:func:`tree_refusal`).
"""

from __future__ import annotations

import heapq
from contextlib import nullcontext

import torch
import torch.nn.functional as F


def build_tree(logp: torch.Tensor, budget: int) -> tuple[list[int], list[int], list[int]]:
    """Best-first tree from per-depth log-probs ``logp`` [K, V] (row d-1 = depth d).

    Returns (tokens, parents, depths) of ``min(budget, …)`` nodes in the order they were
    taken (so a parent always precedes its children); parent 0 is the root, node i is 1 + its
    list index. Scores never increase along a child or a next sibling, so popping the heap
    yields prefixes in decreasing score order and the tree is the top-``budget`` prefixes.
    """
    k = min(budget, logp.shape[1])
    vals, idx = logp.float().topk(k, dim=-1)
    vals, idx = vals.tolist(), idx.tolist()
    return grow_tree(lambda depth, parent_token: (vals[depth - 1], idx[depth - 1]), logp.shape[0], budget)


def grow_tree(children, max_depth: int, budget: int, root_token: int | None = None):
    """The best-first tree of :func:`build_tree` for children that may depend on their parent:
    ``children(depth, parent token)`` → (log-probs, best first; their tokens) of the nodes one
    level down (depth 1: after the root, ``root_token``). A node's score is the sum of the
    log-probs along its path; the ``budget`` best prefixes (depth ≤ ``max_depth``) are taken."""
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    below = {0: children(1, root_token)}  # per node: its children's (log-probs, tokens)
    # (−score, tie-break counter, depth, rank, parent node)
    heap = [(-below[0][0][0], 0, 1, 0, 0)]
    count = 1
    while heap and len(tokens) < budget:
        neg, _, d, r, parent = heapq.heappop(heap)
        vals, toks = below[parent]
        tokens.append(toks[r])
        parents.append(parent)
        depths.append(d)
        node = len(tokens)
        score = -neg
        if r + 1 < len(vals):  # next sibling: same parent, next-best token at this depth
            heapq.heappush(heap, (-(score - vals[r] + vals[r + 1]), count, d, r + 1, parent))
            count += 1
        if d < max_depth:  # first child: the best token after this one at the next depth
            below[node] = children(d + 1, toks[r])
            heapq.heappush(heap, (-(score + below[node][0][0]), count, d + 1, 0, node))
            count += 1
    return tokens, parents, depths


def tree_mask(n: int, parents: list[int], dtype, device) -> torch.Tensor:
    """Additive mask [1, 1, Q, Q] for Q = n + 1 + len(parents): the prefix is causal; tree
    node i (0 = root at column n) sees the prefix, its ancestors and itself."""
    T = 1 + len(parents)
    anc = torch.zeros(T, T, dtype=torch.bool)
    anc[0, 0] = True
    for i, p in enumerate(parents, start=1):  # parents precede children: their row is done
        anc[i] = anc[p]
        anc[i, i] = True
    Q = n + T
    allowed = torch.ones(Q, Q, dtype=torch.bool).tril()
    allowed[n:, n:] = anc
    mask = torch.zeros(Q, Q, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None].to(device)


@torch.no_grad()
def target_tree_forward(target, ids: list[int], positions: list[int], mask: torch.Tensor, device):
    """(taps [1, Q, n·H], logits [1, Q, V]) of the target under a custom 4D mask and
    positions. Reads the tapped layers through trainer.target.Target's hooks, as its
    forward_logits does; Hugging Face passes a prepared 4D mask through unchanged."""
    target._taps.clear()
    logits = target.model(input_ids=torch.tensor([ids], device=device), attention_mask=mask,
                          position_ids=torch.tensor([positions], device=device), use_cache=False).logits
    taps = torch.cat([target._taps[i] for i in target.layer_ids], dim=-1)
    target._taps.clear()
    return taps, logits


@torch.no_grad()
def draft_states(drafter, head, taps, seq: list[int], bonus: int, device) -> torch.Tensor:
    """[B-1, H] final-normed drafter states of the drafting slots of the block anchored at the
    bonus (position len(seq))."""
    B = drafter.config.block_size
    n = len(seq)
    ids = torch.tensor([seq + [bonus]], device=device)
    anchors = torch.tensor([[n]], device=device)
    keep = torch.ones(1, 1, dtype=torch.bool, device=device)
    with _autocast(device):
        return drafter(taps[:, :n], head.embed_blocks(ids, anchors, B, drafter.config.mask_token_id), anchors, keep)[0, 1:]


def _autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if torch.device(device).type == "cuda" else nullcontext()


@torch.no_grad()
def draft_logprobs(drafter, head, taps, seq: list[int], bonus: int, device) -> torch.Tensor:
    """[B-1, V] drafter log-probs for the block anchored at the bonus (position len(seq))."""
    h = draft_states(drafter, head, taps, seq, bonus, device)
    with _autocast(device):
        logits = F.linear(h, head.lm_head)
    return logits.float().log_softmax(-1)


@torch.no_grad()
def draft_tree(drafter, head, taps, seq: list[int], bonus: int, budget: int, device):
    """(tokens, parents, depths) of the round's tree. DFlash: :func:`build_tree` over the
    slots' independent log-probs. DFlash2: the selector's tree — at depth d the slot's top-k
    candidates, each child's log-prob its softmax share of the selector's scores S(parent, ·)
    (hf_dflash.selector_scores) after its parent's token (the root's: the bonus), so the
    tree's first path is the selector's greedy walk (docs/dflash2.md)."""
    sel = getattr(drafter, "selector", None)
    if sel is None:
        return build_tree(draft_logprobs(drafter, head, taps, seq, bonus, device), budget)
    h = draft_states(drafter, head, taps, seq, bonus, device)
    with _autocast(device):
        unary, cand = sel.candidates(F.linear(h.to(head.lm_head.dtype), head.lm_head))

    def children(depth: int, parent: int):
        i = depth - 1
        with _autocast(device):
            s = sel.scores(h[i], unary[i], cand[i], torch.tensor(parent, device=h.device)).float().log_softmax(-1)
        v, order = s.sort(descending=True)
        return v.tolist(), cand[i][order].tolist()

    return grow_tree(children, h.shape[0], budget, root_token=bonus)


def tree_refusal(target) -> str | None:
    """Why tree verification cannot be exact for this target, or None. One target pass over
    the tree is exact only when every layer attends: a node then sees its ancestors through
    the mask. Qwen3.5/3.6's Gated DeltaNet layers instead fold the tokens before a node into
    one recurrent state in sequence order, so a node's state would hold its siblings and
    their subtrees — no mask can branch it. Exact alternatives (one pass per root-to-leaf
    path, or a state per node) cost a target pass or a state copy per branch: not built."""
    if getattr(target, "hybrid", False):
        return ("tree verification is not exact for a Qwen3.5/3.6 target: its Gated DeltaNet layers carry one "
                "recurrent state in sequence order, which a tree attention mask cannot branch per node; use block "
                "verification (trainer.serve.evaluate.speculative, exact with the state rolled back to the accepted prefix)")
    return None


@torch.no_grad()
def speculative_tree(target, drafter, head, prompt: list[int], max_new: int, budget: int, device="cpu"):
    """(tokens, accepted per target forward), as evaluate.speculative but with a tree of
    ``budget`` drafted nodes verified per target forward. Refused for a hybrid target
    (:func:`tree_refusal`)."""
    why = tree_refusal(target)
    if why:
        raise ValueError(why)
    mask_dtype = target.model.dtype
    seq = list(prompt)
    taps, logits = target.forward_logits(torch.tensor([seq], device=device))
    bonus = int(logits[0, -1].argmax())
    out: list[int] = []
    per_forward: list[int] = []
    while len(out) < max_new:
        n = len(seq)  # the root (bonus) sits at position n
        tokens, parents, depths = draft_tree(drafter, head, taps, seq, bonus, budget, device)
        mask = tree_mask(n, parents, mask_dtype, device)
        positions = list(range(n + 1)) + [n + d for d in depths]
        taps_all, logits = target_tree_forward(target, seq + [bonus] + tokens, positions, mask, device)
        pred = logits[0, n:].argmax(-1).tolist()  # target's token after each tree node (0 = root)
        children = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens), start=1)}
        cur, path = 0, []
        while (cur, pred[cur]) in children:
            cur = children[(cur, pred[cur])]
            path.append(cur)
        accepted = [tokens[i - 1] for i in path]
        seq += [bonus] + accepted
        out += [bonus] + accepted
        rows = list(range(n + 1)) + [n + i for i in path]  # prefix, root, accepted nodes
        taps = taps_all[:, rows]
        bonus = pred[cur]
        per_forward.append(1 + len(accepted))
    return out[:max_new], per_forward
