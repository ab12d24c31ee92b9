"""A target's own chat template: render a conversation as serving engines do, and mark
the tokens the target itself writes (the loss mask).

Tokenizer and template come from the target directory (``tokenizer.json``; the template
from ``chat_template.jinja`` or ``tokenizer_config.json``), loaded by transformers, and each
conversation is rendered once by transformers' own ``render_jinja_template`` — the function
``apply_chat_template`` (and so vLLM and SGLang) use — and encoded once; the mask comes from
character spans mapped to tokens by the encoding's offsets.

Where the assistant spans come from (docs/data.md, "Loss mask"):

* ``markers``: the template has ``{% generation %}`` blocks; their character ranges, as
  transformers records them for ``return_assistant_tokens_mask``, are the spans.
* ``header``: otherwise, probed once per template: rendering ``[user]`` with and without the
  generation prompt gives the prompt a served model continues from (``G``, e.g.
  ``<|im_start|>assistant\\n<think>\\n``), rendering ``[user, assistant]`` gives the
  assistant header ``H`` (the start ``G`` and the rendered turn share) and the end-of-turn
  token ``T`` (the special token right after the assistant's text). In a rendered
  conversation the k-th ``H`` starts the k-th assistant turn; its span runs from after ``H``
  — and after the rest of ``G`` where the turn repeats it (the empty think block of
  thinking-off) — through the first ``T``. A row whose count of ``H`` differs from its
  count of assistant messages (a user quoting the header) is skipped as ``template_span``.

Either way the span is what the served target generates: its reasoning where the turn
shows it, its answer, its tool calls and its end-of-turn token.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

RENDER_CAUSES: dict[str, str] = {
    "template_error": "the chat template refused the conversation (its own error)",
    "template_span": "the assistant turns could not be found in the rendered text",
}

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_PROBE_USER, _PROBE_ASSISTANT = "PROBE-USER-7f3a", "PROBE-ANSWER-7f3a"


class TemplateError(ValueError):
    """The target's tokenizer or template cannot be used; one line saying what to do."""


@dataclass(frozen=True)
class Layout:
    """What the header method needs, probed from the template."""

    header: str          # H: starts every assistant turn
    prompt_rest: str     # G after H: the part of the generation prompt a turn may repeat
    end: str             # T: the end-of-turn token the target writes


def load_tokenizer(target: str):
    """The target's fast tokenizer, with its chat template (loaded once per process and target files)."""
    if not os.path.isdir(target):
        raise TemplateError(f"--target {target}: not a directory; give the target model's directory "
                            "(it holds tokenizer.json and the chat template)")
    files = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
    stamp = tuple((os.stat(p).st_mtime_ns, os.stat(p).st_size) if os.path.exists(p) else None
                  for p in (os.path.join(target, f) for f in files))
    return _load(os.path.abspath(target), stamp)


@functools.lru_cache(maxsize=4)
def _load(target: str, stamp: tuple):
    if not os.path.isdir(target):
        raise TemplateError(f"--target {target}: not a directory; give the target model's directory "
                            "(it holds tokenizer.json and the chat template)")
    if not os.path.isfile(os.path.join(target, "tokenizer.json")):
        raise TemplateError(f"--target {target}: no tokenizer.json there; prepare needs the target's fast tokenizer")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # prepare's workers are processes
    try:
        import jinja2  # noqa: F401  (transformers renders chat templates with it, and does not require it)
    except ImportError:
        raise TemplateError("rendering the chat template needs jinja2, which this environment lacks: "
                            "pip install 'jinja2>=3.1' (part of dflash-ctl[trainer])") from None
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError) as exc:
        raise TemplateError(f"--target {target}: the tokenizer does not load ({str(exc).splitlines()[0]})") from None
    if not getattr(tok, "is_fast", False):
        raise TemplateError(f"--target {target}: not a fast tokenizer; prepare needs tokenizer.json")
    template = tok.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    if not isinstance(template, str) or not template.strip():
        raise TemplateError(f"--target {target}: no chat template (neither chat_template.jinja nor "
                            "tokenizer_config.json's chat_template); the data must be rendered as the target is served")
    return tok, template


def uses_thinking(template: str) -> bool:
    return "enable_thinking" in template


class Renderer:
    """Render + encode + mask for one target; built once per worker process."""

    def __init__(self, target: str, thinking: bool | None, last_turn_only: bool = False):
        self.tok, self.template = load_tokenizer(target)
        self.backend = self.tok.backend_tokenizer
        self.kwargs: dict[str, Any] = dict(self.tok.special_tokens_map)
        if uses_thinking(self.template):
            if thinking is None:
                raise TemplateError(
                    f"--thinking: the chat template of {target} switches on enable_thinking (Qwen3-style); "
                    "say --thinking on or --thinking off, as the target is served")
            self.kwargs["enable_thinking"] = thinking
        self.last_turn_only = last_turn_only
        self.method = "markers" if _GENERATION.search(self.template) else "header"
        self.layout = None if self.method == "markers" else self._probe()

    def describe(self) -> dict:
        """What meta.json records about how the samples were made (no paths: reproducible)."""
        import hashlib

        return {"template_sha256": hashlib.sha256(self.template.encode()).hexdigest(),
                "mask_method": self.method, "thinking": self.kwargs.get("enable_thinking"),
                "last_turn_only": self.last_turn_only}

    # -- rendering -------------------------------------------------------------------------

    def _render(self, messages: list[dict], tools, add_generation_prompt=False, markers=False):
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, indices = render_jinja_template(
            conversations=[messages], tools=tools, chat_template=self.template,
            return_assistant_tokens_mask=markers, add_generation_prompt=add_generation_prompt, **self.kwargs)
        return rendered[0], (indices[0] if markers else None)

    def _probe(self) -> Layout:
        user = [{"role": "user", "content": _PROBE_USER}]
        try:
            base, _ = self._render(user, None)
            prompt, _ = self._render(user, None, add_generation_prompt=True)
            answer = user + [{"role": "assistant", "content": _PROBE_ASSISTANT}]
            full, _ = self._render(answer, None)
            # an earlier turn may look different (Qwen3 drops its think block): probe one too
            history, _ = self._render(answer + [{"role": "user", "content": _PROBE_USER}], None)
        except Exception as exc:  # jinja raises anything
            raise TemplateError(f"the chat template fails on a plain user/assistant exchange ({exc})") from None
        gen = prompt[len(base):] if prompt.startswith(base) else ""
        turn = full[len(base):] if full.startswith(base) else ""
        earlier = history[len(base):] if history.startswith(base) else ""
        at, at_earlier = turn.find(_PROBE_ASSISTANT), earlier.find(_PROBE_ASSISTANT)
        header = (os.path.commonprefix([gen, turn[:at], earlier[:at_earlier]])
                  if gen and at > 0 and at_earlier > 0 else "")
        after = turn[at + len(_PROBE_ASSISTANT):] if at >= 0 else ""
        end = next((t for t in sorted(self.tok.all_special_tokens, key=len, reverse=True)
                    if t and after.startswith(t)), "")
        if not header or not end:
            raise TemplateError("cannot find the assistant turns in this chat template's output (no common "
                                "assistant header or end-of-turn token); add {% generation %} markers to the "
                                "template around what the assistant writes")
        return Layout(header, gen[len(header):], end)

    def spans(self, messages: list[dict], tools) -> tuple[str, list[tuple[int, int]]] | str:
        """(rendered text, assistant character spans), or a RENDER_CAUSES code."""
        messages = [_for_template(m) for m in messages]
        n_assistant = sum(m["role"] == "assistant" for m in messages)
        try:
            text, marked = self._render(messages, tools, markers=self.method == "markers")
        except Exception:  # the template's own raise_exception, or a jinja error on this row
            return "template_error"
        if self.method == "markers":
            spans = [tuple(s) for s in marked if s[1] > s[0]]
        else:
            spans = self._header_spans(text)
            if spans is None or len(spans) != n_assistant:
                return "template_span"
        if self.last_turn_only:
            spans = spans[-1:]
        return text, spans

    def _header_spans(self, text: str) -> list[tuple[int, int]] | None:
        lay, spans, pos = self.layout, [], 0
        while True:
            at = text.find(lay.header, pos)
            if at < 0:
                return spans
            start = at + len(lay.header)
            if lay.prompt_rest and text.startswith(lay.prompt_rest, start):
                start += len(lay.prompt_rest)
            end = text.find(lay.end, start)
            if end < 0:
                return None
            spans.append((start, end + len(lay.end)))
            pos = end + len(lay.end)

    # -- encoding --------------------------------------------------------------------------

    def encode(self, rendered: list[tuple[str, list[tuple[int, int]]]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """One batched encode; each span's first and last characters mapped to tokens."""
        encodings = self.backend.encode_batch([t for t, _ in rendered], add_special_tokens=False)
        out = []
        for enc, (_, spans) in zip(encodings, rendered):
            ids = np.array(enc.ids, dtype=np.int32)
            mask = np.zeros(len(ids), dtype=np.uint8)
            for s, e in spans:
                a, b = enc.char_to_token(s), enc.char_to_token(e - 1)
                if a is not None and b is not None:
                    mask[a:b + 1] = 1
            out.append((ids, mask))
        return out


def _for_template(message: dict) -> dict:
    """As vLLM and SGLang hand messages to a template: tool-call arguments decoded to objects."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    m = dict(message)
    m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _args(c["function"].get("arguments"))}}
                       for c in calls]
    return m


def _args(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value
