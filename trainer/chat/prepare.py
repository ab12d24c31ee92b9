"""``python -m trainer prepare``: training data in, memory-mapped shards + ``meta.json`` out.

    python -m trainer prepare --input FILE [more…] --out DIR [--target T --thinking on|off]

Pre-tokenized JSONL (``{"input_ids": [...], "loss_mask": [...]}`` a line) goes straight into the
shard format (trainer/data.py: docs/data.md); conversations (JSONL, a JSON array, parquet, a saved
``datasets`` directory) are rendered with the target's own chat template on every core
(trainer/chat/encode.py). The output appears only when complete: everything is written into a
temporary directory beside DIR, claimed by a lock, and renamed into place at the end.

numpy + standard library at import time: the tokenizer is loaded only for conversations.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from array import array
from typing import Any, Sequence

import numpy as np

from trainer.data import (DEFAULT_PROGRESS_EVERY, DEFAULT_SHARD_TOKENS, FORMAT, FORMAT_VERSION, IDS_DTYPE, MASK_DTYPE,
                          MAX_TOKEN_ID, META, OFFSETS_DTYPE, DataError, Fingerprint, PreparedData,
                          ShardWriter)
from trainer.flags import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_STOPPED, EXIT_USAGE, Bounded, UsageParser


def _check_sample(obj: Any) -> tuple[np.ndarray, np.ndarray]:
    """Validate one decoded JSON line; raise DataError(reason) without location."""
    if not isinstance(obj, dict):
        raise DataError(f"expected a JSON object with input_ids and loss_mask, got {type(obj).__name__}")
    for key in ("input_ids", "loss_mask"):
        if key not in obj:
            raise DataError(f"missing key {key!r}")
        if not isinstance(obj[key], list):
            raise DataError(f"{key} must be a list, got {type(obj[key]).__name__}")
    raw_ids, raw_mask = obj["input_ids"], obj["loss_mask"]
    if len(raw_ids) != len(raw_mask):
        raise DataError(f"input_ids has {len(raw_ids)} tokens but loss_mask has {len(raw_mask)}; they must be equally long")
    if not raw_ids:
        raise DataError("input_ids is empty")
    try:
        ids = np.array(raw_ids)
        mask = np.array(raw_mask)
    except (ValueError, OverflowError):
        raise DataError("input_ids and loss_mask must be flat lists of integers") from None
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise DataError("input_ids must be a flat list of integers")
    if ids.min() < 0:
        j = int(np.argmax(ids < 0))
        raise DataError(f"input_ids[{j}] = {int(ids[j])} is negative; token ids must be >= 0")
    if ids.max() > MAX_TOKEN_ID:
        j = int(np.argmax(ids > MAX_TOKEN_ID))
        raise DataError(f"input_ids[{j}] = {int(ids[j])} does not fit in int32")
    if mask.ndim != 1 or mask.dtype.kind not in "iub":
        raise DataError("loss_mask must be a flat list of 0/1 (or true/false)")
    if mask.dtype.kind != "b" and ((mask < 0) | (mask > 1)).any():
        j = int(np.argmax((mask < 0) | (mask > 1)))
        raise DataError(f"loss_mask[{j}] = {int(mask[j])}; loss_mask values must be 0 or 1")
    return ids.astype(IDS_DTYPE), mask.astype(MASK_DTYPE)


def _length_stats(lengths: np.ndarray) -> dict[str, float]:
    # np.percentile's default (linear interpolation); docs/data.md says so.
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return {
        "min": int(lengths.min()),
        "mean": float(lengths.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": int(lengths.max()),
    }


def prepare(
    inputs: Sequence[str],
    out: str,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress_every: int = DEFAULT_PROGRESS_EVERY,
    log=None,
    extra_meta: dict | None = None,
    chat=None,
) -> dict:
    """Stream ``inputs`` (JSONL) into a prepared directory at ``out``; return its meta.

    Everything is written into a hidden temp directory beside ``out`` and renamed into place
    only when complete, so ``out`` either does not exist or holds a whole dataset. Raises
    DataError (one line naming the file and line) on bad input; nothing is left behind then.
    """
    log = log if log is not None else (lambda line: print(line, file=sys.stderr, flush=True))
    out = os.path.abspath(os.fspath(out))
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens {shard_tokens} must be >= 1")
    if not inputs:
        raise DataError("no --input given; name at least one JSONL file")
    for path in inputs:
        # exists-and-not-a-directory rather than isfile: a FIFO or /dev/stdin is a fine input
        if not os.path.exists(path):
            raise DataError(f"{path}: input file not found; check the --input path")
        if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, n))
                                           for n in ("state.json", "dataset_dict.json")):
            raise DataError(f"{path}: a directory, and not a saved Hugging Face dataset (no state.json or "
                            "dataset_dict.json); give files, or a save_to_disk directory")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise DataError(f"{out}: already exists and is not empty; remove it or choose another --out")
    parent = os.path.dirname(out)
    created = _missing_ancestors(parent)
    os.makedirs(parent, exist_ok=True)
    try:
        claim = _claim(out)
    except BaseException:
        _remove_created(created)
        raise
    # What a prepare killed by SIGKILL (the OOM killer, a power loss) left: no live prepare
    # holds the claim now, so every partial directory of this --out is stale.
    mine = re.compile(re.escape(f".{os.path.basename(out)}.partial-") + r"[a-z0-9_]{8}")  # mkdtemp's names
    for stale in sorted(os.path.join(parent, n) for n in os.listdir(parent) if claim and mine.fullmatch(n)):
        shutil.rmtree(stale, ignore_errors=True)
        log(f"prepare: removed {stale}, the partial output of an earlier prepare into {out} that did not finish")
    # Same parent → same file system → os.rename is atomic.
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.partial-", dir=parent)
    writer = ShardWriter(tmp, shard_tokens)
    committed = False
    try:
        meta = _fill(inputs, writer, shard_tokens, progress_every, log, chat)
        if extra_meta:
            meta.update(extra_meta)
        with open(os.path.join(tmp, META), "w", encoding="utf-8") as fh:
            json.dump(meta, fh, indent=1, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        try:
            os.rename(tmp, out)  # replaces an empty directory; fails on a non-empty one
        except OSError as exc:
            raise DataError(f"{out}: cannot move the prepared data into place ({exc}); remove it or choose another --out") from None
        committed = True
        _fsync_dir(parent)
        return meta
    finally:
        if not committed:  # bad input or interrupted: leave nothing behind, not even parents
            writer.abort()
            shutil.rmtree(tmp, ignore_errors=True)
        _release(claim)
        if not committed:
            _remove_created(created)


def _remove_created(created: list[str]) -> None:
    for d in created:
        try:
            os.rmdir(d)
        except OSError:
            break


def _claim(out: str):
    """trainer/outlock.py's lock of ``out``, held while a prepare writes it; its refusal as
    the prepare's own one-line DataError. None where the file system has no locks: then
    nothing is swept (a live prepare's partial looks the same)."""
    from trainer import outlock

    try:
        return outlock.claim(out, "prepare")
    except outlock.OutBusy as exc:
        raise DataError(str(exc)) from None


def _release(claim) -> None:
    from trainer import outlock

    outlock.release(claim)


def _missing_ancestors(path: str) -> list[str]:
    """Directories that ``os.makedirs(path)`` would create, deepest first."""
    missing = []
    while path and not os.path.exists(path):
        missing.append(path)
        up = os.path.dirname(path)
        if up == path:
            break
        path = up
    return missing


def _fill(inputs: Sequence[str], writer: ShardWriter, shard_tokens: int, progress_every: int, log,
          chat=None) -> dict:
    fp = Fingerprint()
    lengths = array("q")
    loss_tokens = 0
    no_loss = 0
    max_id = -1
    sources = []
    renderer, stats = None, None
    tokens = 0
    for path in inputs:
        kind, fmt, form = _kind(path)
        size = os.path.getsize(path) if os.path.isfile(path) else None
        first = len(lengths)
        if kind == "tokenized":
            source = {"file": os.path.basename(path), "bytes": size, "lines": 0}
            samples = _tokenized(path, source)
            progress = _progress(log, progress_every, None)
        else:
            from trainer.chat import encode as chat_prepare
            from trainer.chat.template import Renderer, TemplateError

            if chat is None:
                raise DataError(f"{path}: holds conversations ({form or 'chat'} rows); give --target DIR, the target "
                                "model's directory, for its tokenizer and chat template")
            if renderer is None:
                try:
                    renderer = Renderer(chat.target, chat.thinking, chat.last_turn_only)
                except TemplateError as exc:
                    raise DataError(str(exc)) from None
                stats = chat_prepare.ChatStats()
            source = {"file": os.path.basename(path), "bytes": size, "format": fmt, "form": form or chat.form}
            rows_before = stats.rows
            samples = ((ids, mask, path) for ids, mask in
                       chat_prepare.iter_samples(path, chat, renderer, stats, fmt, chat.form or form))
            progress = _progress(log, progress_every, size if fmt == "jsonl" else None)
        for ids, mask, where in samples:
            writer.add(ids, mask)
            fp.add(ids, mask)
            lengths.append(len(ids))
            tokens += len(ids)
            m = int(mask.sum())
            loss_tokens += m
            no_loss += m == 0
            max_id = max(max_id, int(ids.max()))
            progress.update(len(lengths), tokens, stats.done_bytes if stats and kind != "tokenized" else None, where)
        progress.finish()
        if kind != "tokenized":
            source["rows"] = stats.rows - rows_before
        # samples are written in input order: these counts give each sample its source, so τ can
        # be reported per category (chat, code, math: the input files' names)
        source["samples"] = len(lengths) - first
        sources.append(source)
    if not lengths:
        if stats and stats.rows:
            raise DataError(f"{', '.join(inputs)}: no samples; all {stats.rows:,} rows were skipped "
                            f"({_causes(stats)}), first {', '.join(stats.first_bad)}")
        raise DataError(f"{', '.join(inputs)}: no samples; the input holds no JSON lines — check the --input files")
    shards = writer.close()
    lens = np.frombuffer(lengths, dtype=np.int64)
    tokens = int(lens.sum())
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "fingerprint": fp.hexdigest(),
        "samples": len(lens),
        "tokens": tokens,
        "loss_tokens": loss_tokens,
        "loss_fraction": loss_tokens / tokens,
        "samples_without_loss": int(no_loss),
        "length": _length_stats(lens),
        "max_token_id": max_id,
        "dtypes": {"input_ids": IDS_DTYPE.str, "loss_mask": MASK_DTYPE.str, "offsets": OFFSETS_DTYPE.str},
        "shard_tokens": shard_tokens,
        "shards": shards,
        "sources": sources,
    }
    if renderer is not None:
        meta["chat"] = {**renderer.describe(), "max_seq_len": chat.max_seq_len, "too_long": chat.too_long,
                        **stats.meta()}
    return meta


def _causes(stats) -> str:
    return ", ".join(f"{cause} {n:,}" for cause, n in sorted(stats.skipped.items(), key=lambda kv: -kv[1]))


def _progress(log, every: int, total_bytes):
    from trainer.chat.encode import Progress  # stdlib + numpy only; no tokenizer import

    return Progress(log, every, total_bytes)


def _kind(path: str) -> tuple[str, str, str | None]:
    """("tokenized" | "chat", file format, row form) from the file's first rows.

    A pipe cannot be read twice: it is taken as JSONL and judged by its first line only.
    """
    from trainer.chat import rows as chatrows

    if os.path.isfile(path) or os.path.isdir(path):
        try:
            fmt = chatrows.detect_format(path)
            form = chatrows.detect_form(path, fmt)
        except chatrows.ChatRowsError as exc:
            raise DataError(str(exc)) from None
        if fmt == "jsonl" and form in ("tokenized", None):
            return "tokenized", fmt, None  # as before: pre-tokenized JSONL, bad lines stop it
        return "chat", fmt, form if form != "tokenized" else None
    return "tokenized", "jsonl", None


def _tokenized(path: str, source: dict):
    """Pre-tokenized JSONL samples; the first bad line stops the prepare (DataError)."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            source["lines"] = lineno
            if not raw.strip():
                continue  # blank lines (e.g. a trailing newline) are not samples
            try:
                ids, mask = _check_sample(json.loads(raw))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            except UnicodeDecodeError:
                raise DataError(f"{path}:{lineno}: not valid UTF-8") from None
            except DataError as exc:
                raise DataError(f"{path}:{lineno}: {exc}") from None
            yield ids, mask, f"{path}:{lineno}"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- CLI


# A sane ceiling for --workers whatever the machine (the job also refuses more than the CPUs it
# may use: main); the run config is checked against it before anything starts.
MAX_WORKERS = 1024


def build_parser() -> argparse.ArgumentParser:
    p = UsageParser(prog="python -m trainer prepare",
                    description="Turn training data into memory-mapped shards + meta.json for the trainer's --data-dir: "
                                "pre-tokenized JSONL ({\"input_ids\": [...], \"loss_mask\": [...]} per line), or "
                                "conversations (JSONL, a JSON array, parquet, a saved datasets directory; OpenAI "
                                "messages or ShareGPT conversations) tokenized with the --target's own chat template.")
    p.add_argument("--input", nargs="+", required=True, metavar="FILE", action="extend",
                   help="input files (or saved datasets directories), read in the order given (repeatable)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (must not exist, or be empty)")
    p.add_argument("--shard-tokens", type=Bounded("int", 1, 1 << 40), default=DEFAULT_SHARD_TOKENS, metavar="N",
                   help=f"tokens per shard file (default {DEFAULT_SHARD_TOKENS})")
    p.add_argument("--progress-every", type=Bounded("int", 0, 1 << 40), default=DEFAULT_PROGRESS_EVERY, metavar="N",
                   help=f"off a terminal, a progress line on stderr every N samples (default {DEFAULT_PROGRESS_EVERY}; "
                        "0: none); on a terminal a progress bar")
    c = p.add_argument_group("conversations")
    c.add_argument("--target", metavar="DIR", help="the target model's directory: its tokenizer.json and chat template")
    c.add_argument("--thinking", choices=("on", "off"),
                   help="enable_thinking for templates that have it (Qwen3, 3.5, 3.6): as the target is served")
    c.add_argument("--last-turn-only", action="store_true", help="loss on the last assistant turn only")
    c.add_argument("--max-seq-len", type=Bounded("int", 2, 1 << 20), metavar="N", help="samples longer than N tokens are truncated or dropped")
    c.add_argument("--too-long", choices=("truncate", "drop"), default="truncate",
                   help="what --max-seq-len does to a longer sample (default truncate); counted either way")
    c.add_argument("--form", choices=("openai", "sharegpt"),
                   help="force the row form (default: detected per file from its first conversation row)")
    c.add_argument("--strict", action="store_true",
                   help="any unusable row is an error (exit 2, nothing written) instead of skipped and counted")
    c.add_argument("--workers", type=Bounded("int", 0, MAX_WORKERS), default=0, metavar="N",
                   help="worker processes (default 0: every core the job may use; never more than those)")
    p.add_argument("--preflight", action="store_true",
                   help="only check what the job would refuse at its start (trainer/chat/preflight.py); write nothing")
    return p


def preflight(args) -> int:
    """The job's start checks, nothing written (trainer/chat/preflight.py)."""
    from trainer.chat import preflight as pf

    problems, size = pf.inputs_problems(args.input)
    if args.target is not None:
        problems += pf.target_problems(args.target, None if args.thinking is None else args.thinking == "on",
                                       args.last_turn_only)
    if os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        problems.append(f"--out {args.out}: already exists and is not empty; remove it or choose another --out")
    else:
        problems += pf.out_problems(args.out, int(size * pf.ROOM_FACTOR["prepare"]))
    return pf.report(problems)


class _Stopped(Exception):
    """SIGTERM: stop, write nothing, exit EXIT_STOPPED (a relaunch starts over)."""


def _on_sigterm(signum, frame):
    # Once: the agent signals the job's group and then each of its processes, and a second
    # _Stopped raised inside the first one's cleanup would end the job with a traceback and
    # exit 1 instead of EXIT_STOPPED (tests/test_jobs.py saw it).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Stopped()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    # Checked here, where the job runs (a run config is judged on the operator's machine):
    # more workers than the CPUs the job may use only adds processes that wait for a core.
    if args.workers > _cores():
        print(f"prepare: error: --workers {args.workers}: this machine lets the job use {_cores()} CPU(s); give at "
              f"most {_cores()}, or 0 for all of them", file=sys.stderr)
        return EXIT_USAGE
    if args.preflight:
        return preflight(args)
    chat = None
    if args.target is not None:
        from trainer.chat.encode import ChatOptions

        chat = ChatOptions(target=args.target, thinking=None if args.thinking is None else args.thinking == "on",
                           last_turn_only=args.last_turn_only, max_seq_len=args.max_seq_len,
                           too_long=args.too_long, form=args.form, strict=args.strict, workers=args.workers)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    started = time.monotonic()
    stopped = False
    try:
        try:
            meta = prepare(args.input, args.out, shard_tokens=args.shard_tokens, progress_every=args.progress_every,
                           chat=chat)
        except ValueError as exc:  # DataError, and the chat readers' one-line errors
            print(f"prepare: error: {exc}", file=sys.stderr, flush=True)
            return EXIT_USAGE
        except RuntimeError as exc:  # chat_prepare.WorkerDied
            print(str(exc), file=sys.stderr, flush=True)
            return EXIT_FAILURE
        except (_Stopped, KeyboardInterrupt) as exc:
            meta = _written_meta(args.out)
            if meta is None:
                stopped = isinstance(exc, _Stopped)
                print("prepare: stopped (SIGTERM); nothing written" if stopped else
                      "prepare: interrupted; nothing written", file=sys.stderr, flush=True)
                return EXIT_STOPPED if stopped else EXIT_INTERRUPTED
            # after the rename: saying "nothing written" would leave the operator deleting good data
            print("prepare: the stop came after the data was in place; it is complete", file=sys.stderr, flush=True)
        # The data is in place: a stop now changes nothing, and must not cut the summary short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            workers = (chat.workers or _cores()) if chat else 1
            for line in summary(meta, os.path.abspath(args.out), time.monotonic() - started, workers):
                print(line, flush=True)
        finally:
            signal.signal(signal.SIGINT, previous_int)
        return EXIT_OK
    finally:
        if not stopped:  # stopped: later SIGTERMs (the agent sends several) stay ignored until the exit
            signal.signal(signal.SIGTERM, previous)


def _written_meta(out: str) -> dict | None:
    """The meta of ``out`` if this prepare put its data in place (prepare refuses a non-empty
    --out and holds the claim, so data there now is this run's), else None."""
    try:
        return PreparedData(out).meta
    except (DataError, OSError):
        return None


# The seed's run, for the "how long would it take" line (docs/data.md).
SEED_SAMPLES, SEED_TOKENS = 1_100_000, 2_400_000_000


def _cores() -> int:
    from trainer.chat.encode import cores

    return cores()


def summary(meta: dict, out: str, seconds: float | None = None, workers: int = 1) -> list[str]:
    ln = meta["length"]
    lines = [f"prepare: wrote {out}: {meta['samples']:,} samples, {meta['tokens']:,} tokens, "
             f"length mean {ln['mean']:.0f} p50 {ln['p50']:.0f} p99 {ln['p99']:.0f} max {ln['max']}, "
             f"loss tokens {meta['loss_fraction']:.1%}, fingerprint {meta['fingerprint'][:16]}"]
    chat = meta.get("chat")
    if chat:
        skipped = sum(chat["skipped"].values())
        line = f"prepare: {chat['rows']:,} rows, {skipped:,} skipped"
        if skipped:
            line += " (" + ", ".join(f"{c} {n:,}" for c, n in sorted(chat["skipped"].items(), key=lambda kv: -kv[1]))
            line += "); first: " + ", ".join(chat["skipped_first"])
        if chat["max_seq_len"]:
            line += (f"; {chat['truncated']:,} truncated, {chat['dropped_too_long']:,} dropped "
                     f"past --max-seq-len {chat['max_seq_len']:,}")
        lines.append(line)
    if seconds and meta["samples"] >= 1000:  # a rate from fewer says more about start-up than throughput
        per_s = meta["tokens"] / seconds
        lines.append(f"prepare: {seconds:.1f} s, {meta['samples'] / seconds:,.0f} samples/s, {per_s:,.0f} tokens/s "
                     f"on {workers} worker(s); the seed's 1.1 M samples ({SEED_TOKENS / 1e9:.1f} B tokens) would take "
                     f"about {_human(SEED_TOKENS / per_s)} at this rate")
    return lines


def _human(secs: float) -> str:
    if secs < 90:
        return f"{secs:.0f} s"
    if secs < 5400:
        return f"{secs / 60:.0f} min"
    return f"{secs / 3600:.1f} h"


if __name__ == "__main__":
    sys.exit(main())
