"""The drafter variants, each trained by our trainer with the same budget (steps, data,
seed, shape, learning rate); only the objective flags differ — and for "dflash2" the
architecture (docs/dflash2.md): DFlash2 on the reference objective, so its Δτ against
"decay" is DFlash2 against DFlash at the same target, data, steps, block size and seed
(the same --seed gives both the same DFlash weights and, at step 0, the same drafts).

"fp8-taps" is the reference objective trained on the taps of the target in FP8
(``--target-precision fp8``: e4m3 weights with a scale per output channel, activations per row;
trainer/gpu/fp8.py; emulated with the same arithmetic on CPU): its Δτ against "decay" is what
FP8 taps cost, everything else equal. Every other variant pins ``--target-precision bf16``."""

from __future__ import annotations

import os
import shlex

# Objective flags per variant. The reference is DFlash's decay-weighted CE with γ = 7, the
# value the literature gives for block 16; "operators" is the operators' own objective
# flags as they launch them (γ = 10 included).
SOFT = ["--use-soft-labels", "--kl-weight", "0.15", "--kl-temperature", "2.0"]
CAP = ["--cap-lambda", "0.1"]
NOISE = ["--noise-type", "uniform", "--noise-start", "0.05", "--noise-end", "0.01"]
VARIANTS: dict[str, list[str]] = {
    "decay": ["--position-weights", "decay", "--gamma", "7"],
    "soft-kl": ["--position-weights", "decay", "--gamma", "7", *SOFT],
    "cap": ["--position-weights", "decay", "--gamma", "7", *CAP],
    "noise": ["--position-weights", "decay", "--gamma", "7", *NOISE],
    "dpace": ["--position-weights", "dpace", "--dpace-alpha", "0.5"],
    "operators": ["--position-weights", "decay", "--gamma", "10.0", *NOISE, *SOFT, *CAP],
    "dflash2": ["--drafter-arch", "dflash2", "--position-weights", "decay", "--gamma", "7"],
    "fp8-taps": ["--position-weights", "decay", "--gamma", "7", "--target-precision", "fp8"],
}


def target_precision(variant: str) -> str:
    """The --target-precision a variant trains with (its taps' precision)."""
    flags = VARIANTS[variant]
    return flags[flags.index("--target-precision") + 1] if "--target-precision" in flags else "bf16"


def trainer_argv(variant: str, target_dir: str, data_dir: str, out_dir: str, d: dict, seed: int = 0) -> list[str]:
    """Full ``python -m trainer`` argv for one variant; ``d`` is the scale's drafter budget."""
    argv = ["--target-model", target_dir, "--data-dir", data_dir, "--output-dir", out_dir,
            "--target-gpus", "0", "--drafter-gpus", "0", "--from-scratch",
            "--epochs", str(d["epochs"]), "--max-steps", str(d["steps"]), "--schedule-steps", str(d["steps"]),
            "--lr", str(d["lr"]), "--warmup-ratio", "0.04", "--grad-accum", "1", "--seed", str(seed),
            "--token-budget", str(d["token_budget"]), "--max-seq-len", str(d["max_seq_len"]),
            "--max-batch-size", str(d["max_batch_size"]), "--block-size", str(d["block_size"]),
            "--max-anchors", str(d["max_anchors"]), "--num-draft-layers", str(d["layers"]),
            "--save-interval", str(d["save_interval"]), "--log-interval", str(d["log_interval"]),
            "--keep-checkpoints", "0",  # every checkpoint: the τ-vs-steps curve evaluates each
            # one implementation for every variant, the reference step: per-slot metrics, the CPU path
            "--drafter-step", "reference", "--target-forward", "hf"]
    if d.get("target_layer_ids"):
        argv += ["--target-layer-ids", d["target_layer_ids"]]
    if "--target-precision" not in VARIANTS[variant]:
        # said, not defaulted: a variant's taps stay bf16 whatever the trainer's default becomes
        argv += ["--target-precision", "bf16"]
    return argv + VARIANTS[variant]


def train(argv: list[str]) -> int:
    """Run the trainer in this process (its ``main`` with this argv is exactly
    ``python -m trainer ARGV``): one import of torch and one flex-attention compile serve
    every variant."""
    from trainer.__main__ import main

    return main(argv)


def command_line(argv: list[str]) -> str:
    return "python -m trainer " + " ".join(shlex.quote(a) for a in argv)


def checkpoints(out_dir: str) -> list[tuple[int, str]]:
    """(step, step_N directory) for every complete checkpoint, ascending. Drafters are loaded
    from checkpoint.pt (fp32 masters, trainer.checkpoint.load_drafter): step_N/drafter/ is
    the bf16 export."""
    out = []
    for name in os.listdir(out_dir):
        if name.startswith("step_") and os.path.isfile(os.path.join(out_dir, name, "checkpoint.pt")):
            out.append((int(name[5:]), os.path.join(out_dir, name)))
    return sorted(out)
