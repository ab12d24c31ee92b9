"""A tiny chat target for the regenerate tests: trainer.synth.tiny's random Qwen3 (vocab 512)
with a real byte-level BPE tokenizer trained here (tokenizers' own trainer) and a ChatML
chat template, so `transformers serve` answers /v1/chat/completions for it. Seconds, CPU."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
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

    from trainer.synth.tiny import VOCAB, build_target

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


class Proxy:
    """A real HTTP proxy in front of the real server, in a thread of the test process: it
    records every chat request's body and, on the test's say, fails some of them.

    ``fail(n_seen, body)`` → None (forward), an int status to answer with, "drop" to
    close the connection unanswered, or "slow" to forward after 3 s. ``gate``: a threading.Event; once ``hold_after``
    requests went through, later ones wait on it (a run held mid-way, for kill tests).
    """

    def __init__(self, upstream: str, fail=None, hold_after: int | None = None, api_key: str | None = None,
                 port: int = 0):
        import http.server
        import threading

        self.upstream = upstream
        self.bodies: list[dict] = []
        self.fail = fail
        self.hold_after = hold_after
        self.api_key = api_key  # when set, a request without "Authorization: Bearer KEY" gets a 401
        self.gate = threading.Event()
        self.held = threading.Semaphore(0)
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def refused(self) -> bool:
                if proxy.api_key and self.headers.get("Authorization") != f"Bearer {proxy.api_key}":
                    self._reply(401, b'{"error": "no or wrong API key"}')
                    return True
                return False

            def do_GET(self):
                if self.refused():
                    return
                with urllib.request.urlopen(proxy.upstream + self.path, timeout=30) as r:
                    self._reply(r.status, r.read())

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.refused():
                    return
                body = json.loads(raw)
                with proxy.lock:
                    proxy.bodies.append(body)
                    n = len(proxy.bodies)
                verdict = proxy.fail(n, body) if proxy.fail else None
                if verdict == "drop":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if verdict == "slow":  # answers, but later than the client waits
                    time.sleep(3.0)
                if isinstance(verdict, int):
                    self._reply(verdict, json.dumps({"error": {"message": f"proxy says {verdict}"}}).encode())
                    return
                if proxy.hold_after is not None and n > proxy.hold_after:
                    proxy.held.release()
                    proxy.gate.wait()
                req = urllib.request.Request(proxy.upstream + self.path, data=raw,
                                             headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=60) as r:
                        self._reply(r.status, r.read())
                except urllib.error.HTTPError as exc:
                    self._reply(exc.code, exc.read())
                except OSError:
                    self.close_connection = True

            def _reply(self, status, data):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()
