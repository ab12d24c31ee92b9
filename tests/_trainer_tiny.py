"""A tiny Qwen3 target and data prepared from its own greedy continuations, for the trainer
tests (CPU, seconds). Built from a config in code: no hub downloads."""

from __future__ import annotations

import json
import os
import signal
import time

import torch

# Tiny models on a shared 2-core machine: one thread, or matmuls spin-wait for each other.
torch.set_num_threads(1)

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.1,
            tie_word_embeddings=False)


def make_target(directory: str, seed: int = 0, **overrides) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**{**TINY, **overrides})).eval()
    model.save_pretrained(directory)
    return directory


@torch.no_grad()
def make_data(target_dir: str, out_dir: str, samples: int = 48, prompt_len: int = 8, new_tokens: int = 40, seed: int = 1) -> str:
    """Random prompts + the target's greedy continuations; loss on the continuation."""
    from transformers import AutoModelForCausalLM

    from trainer.chat.prepare import prepare

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompts = torch.randint(0, vocab - 1, (samples, prompt_len), generator=g)
    seq = prompts
    for _ in range(new_tokens):
        nxt = model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    jsonl = out_dir.rstrip("/") + ".jsonl"
    with open(jsonl, "w") as fh:
        for i in range(samples):
            # vary lengths a little so batching and padding are exercised
            n = prompt_len + new_tokens - (i % 5) * 3
            ids = seq[i, :n].tolist()
            mask = [0] * prompt_len + [1] * (n - prompt_len)
            fh.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
    prepare([jsonl], out_dir, log=lambda line: None)
    return out_dir


def tiny_setup(root: str) -> tuple[str, str]:
    target = make_target(os.path.join(root, "target"))
    data = make_data(target, os.path.join(root, "data"))
    return target, data


def base_args(target: str, data: str, out: str, *extra: str) -> list[str]:
    return ["--target-model", target, "--data-dir", data, "--output-dir", out, "--device", "cpu",
            "--target-gpus", "0", "--drafter-gpus", "0", "--block-size", "8", "--max-anchors", "6",
            "--num-draft-layers", "2", "--token-budget", "192", "--max-seq-len", "48", "--max-batch-size", "4",
            "--grad-accum", "1", "--lr", "3e-3", "--warmup-ratio", "0.1", "--gamma", "4", "--save-interval", "1000",
            "--epochs", "2", *extra]


def replace(argv: list[str], name: str, value: str) -> list[str]:
    """argv with the value after flag ``name`` replaced."""
    i = argv.index(name)
    return argv[:i + 1] + [value] + argv[i + 2:]


def events(run_dir: str, kind: str | None = None) -> list[dict]:
    """The run directory's events.jsonl, all of them or those of one ``kind``."""
    with open(os.path.join(run_dir, "events.jsonl")) as fh:
        return [e for e in map(json.loads, fh) if kind is None or e["kind"] == kind]


def step_events(run_dir: str) -> list[dict]:
    return events(run_dir, "step")


def sigterm_once_training(proc, run_dir: str, steps: int = 2, poll_s: float = 0.05) -> None:
    """SIGTERM ``proc`` once ``run_dir`` holds ``steps`` step events (or return if it ended)."""
    while proc.poll() is None:
        if os.path.exists(os.path.join(run_dir, "events.jsonl")) and len(step_events(run_dir)) >= steps:
            proc.send_signal(signal.SIGTERM)
            return
        time.sleep(poll_s)


# A tiny Qwen3.5/3.6-style target: 8 layers in the 3:1 Gated DeltaNet / gated full attention
# pattern. Its RMSNorm weights are zero-centred (x̂·(1 + w)) and start at 0, so they get noise:
# a norm applied the Qwen3 way would then show.
TINY_QWEN35 = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=512,
                   initializer_range=0.1, tie_word_embeddings=False)


def make_qwen35_target(directory: str, layout: str = "text", seed: int = 0, **overrides) -> str:
    """``layout`` "text": a qwen3_5_text Qwen3_5ForCausalLM; "vl": the released layout,
    Qwen3_5ForConditionalGeneration (language model under text_config, a small vision tower)."""
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

    torch.manual_seed(seed)
    text = {**TINY_QWEN35, **overrides}
    if layout == "vl":
        vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=text["hidden_size"])
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision,
                                                              tie_word_embeddings=False))
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "visual" not in name:
                p.add_(0.2 * torch.randn_like(p))
    model.eval().save_pretrained(directory)
    return directory


def qwen35_setup(root: str, layout: str = "text") -> tuple[str, str]:
    target = make_qwen35_target(os.path.join(root, f"target-{layout}"), layout)
    data = make_data(target, os.path.join(root, f"data-{layout}"), samples=32, new_tokens=32)
    return target, data


def qwen35_args(target: str, data: str, out: str, *extra: str) -> list[str]:
    """base_args with a drafter small enough for CPU: the public 32/8×128 attention of this
    family's drafters is the default (tested on the real config), here 4/2×16."""
    return base_args(target, data, out, "--drafter-attention", "4/2/16", "--sliding-window", "12", *extra)
