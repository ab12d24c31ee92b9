"""A tiny chat target for the regenerate tests: trainer.tiny's random Qwen3 (vocab 512)
with a real byte-level BPE tokenizer trained here (tokenizers' own trainer) and a ChatML
chat template, so `transformers serve` answers /v1/chat/completions for it. Seconds, CPU."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# Qwen3's public template, trimmed to what the tests need: system, user/assistant turns,
# enable_thinking (an empty think block when off, as Qwen3 does).
CHAT_TEMPLATE = (
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
CORPUS = ["The quick brown fox jumps over the lazy dog. " * 3, "Speculative decoding drafts tokens ahead. ",
          "What is the capital of France? Paris is the capital. ", "Write a haiku about the sea and the sky. ",
          "0123456789 +-*/ ()[]{} hello world, user, assistant, system prompt. "]


def make_chat_target(directory: str, seed: int = 0) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from trainer.tiny import VOCAB, build_target

    os.makedirs(directory, exist_ok=True)
    model = build_target(seed)
    model.generation_config.eos_token_id = None
    model.save_pretrained(directory)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 50, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_argv(target: str, port: int) -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "transformers")
    return [exe, "serve", target, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32"]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"transformers serve exited {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("transformers serve did not become healthy")
