"""The drafter architectures the trainer builds (standard library only: the controller's
preflight and the checkpoint-size prediction read it without torch).

* ``dflash``  — the DFlash block drafter (docs/trainer-spec.md "Drafter architecture").
* ``dflash2`` — DFlash plus a two-tap dynamic depthwise convolution around every attention
  and MLP sublayer and a pairwise path selector over each slot's top-k candidates
  (docs/dflash2.md: the sources, the objective and the serving layout).

The DFlash2 shape below is the one every published DFlash2 config and trainer recipe uses
(z-lab/dflash tests/fixtures/dflash2-config.json, SpecForge configs/qwen3.6-27b-dflash2.json,
NeMo Automodel examples/speculative/dflash/qwen3_dflash2.yaml, vllm-project/speculators
DFlash2SpeculatorConfig defaults); it is written into every export's ``dflash_config``.
"""

from __future__ import annotations

DFLASH, DFLASH2 = "dflash", "dflash2"
ARCHS = (DFLASH, DFLASH2)
# config.json ``architectures`` (the serving engines dispatch on it: vLLM's registry maps
# DFlash2DraftModel to qwen3_dflash2.DFlash2Qwen3ForCausalLM)
ARCHITECTURES = {DFLASH: "DFlashDraftModel", DFLASH2: "DFlash2DraftModel"}

CONV_KERNEL_SIZE = 2  # taps: the position itself and its predecessor in the block
CONV_GROUP_SIZE = 16  # channels sharing one dynamic tap correction
SELECTOR_RANK = 256  # width of the predecessor/successor codebooks and the context gate
SELECTOR_TOP_K = 16  # candidates per slot the selector re-ranks
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
DFLASH2_SHAPE = dict(zip(DFLASH2_FIELDS, (CONV_KERNEL_SIZE, CONV_GROUP_SIZE, SELECTOR_RANK, SELECTOR_TOP_K)))



def of_config(cfg: dict) -> str:
    """The architecture a drafter config.json (or DrafterConfig.to_hf dict) describes."""
    names = cfg.get("architectures") or []
    return DFLASH2 if ARCHITECTURES[DFLASH2] in names else DFLASH


def is_dflash2_only(name: str) -> bool:
    """A tensor a DFlash2 drafter has and a DFlash one does not (safetensors names): an
    --init-from of a DFlash checkpoint leaves exactly these at their identity start."""
    return name.startswith("candidate_selector.") or ".attention_conv." in name or ".mlp_conv." in name


def extra_params(hidden: int, vocab: int, num_layers: int, shape: dict | None = None) -> tuple[int, int]:
    """(parameters, tensors) DFlash2 adds to a DFlash drafter of these widths: per layer two
    convolutions (base kernel [2, taps, H] and a projection H → 2·taps·H/group), and one
    selector (two [vocab, rank] codebooks and a projection H → rank)."""
    s = {**DFLASH2_SHAPE, **(shape or {})}
    taps, groups, rank = s["conv_kernel_size"], hidden // s["conv_group_size"], s["selector_rank"]
    conv = 2 * taps * hidden + hidden * 2 * taps * groups
    return num_layers * 2 * conv + 2 * vocab * rank + hidden * rank, num_layers * 4 + 3


def shape_problems(hidden: int, vocab: int, block_size: int, shape: dict | None = None) -> list[str]:
    """Why a DFlash2 drafter of these widths cannot be built (one line each), or []."""
    s = {**DFLASH2_SHAPE, **(shape or {})}
    out = []
    if s["conv_group_size"] < 1 or hidden % s["conv_group_size"]:
        out.append(f"--drafter-arch dflash2: the drafter's hidden size {hidden} is not a multiple of the "
                   f"convolution group {s['conv_group_size']} (every published DFlash2 drafter uses 16)")
    if not 1 <= s["conv_kernel_size"] <= block_size:
        out.append(f"--drafter-arch dflash2: {s['conv_kernel_size']} convolution taps do not fit a block of "
                   f"--block-size {block_size}")
    if not 1 <= s["selector_top_k"] <= vocab:
        out.append(f"--drafter-arch dflash2: selector top-k {s['selector_top_k']} is outside the vocabulary "
                   f"1..{vocab}")
    if s["selector_rank"] < 1:
        out.append(f"--drafter-arch dflash2: selector rank {s['selector_rank']} must be at least 1")
    return out
