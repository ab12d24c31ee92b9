"""``python -m trainer regenerate``: the target writes the answers.

Each source conversation's user turns go one at a time, with its system prompt and the
target's own earlier answers (not the dataset's) as the history, to one or more
OpenAI-compatible chat endpoints (SGLang, vLLM, ``transformers serve``); the answers replace
the dataset's in ``DIR/regenerated.jsonl``, a chat row per source row carrying its id
(trainer/regen/store.py: appended and fsynced in batches; a restart skips the ids already
written, so every id is written exactly once). Transient errors are retried with backoff,
permanent ones recorded in ``DIR/failures.jsonl`` (trainer/regen/client.py); rows the reader
marks unusable are skipped by cause. The end prints done + failed + skipped = input.

Exit codes (agent/protocol.py): 0 every row done or skipped and the accounting adds up;
1 rows failed (run again to retry them) or the accounting does not add up; 2 bad input
(flags, the input file, an unreachable endpoint, an output directory of other settings),
nothing written; 75 stopped by SIGTERM/SIGINT after flushing what was answered (run the same
command again to resume).
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import sys
import time
from typing import Iterable, Sequence

from agent.protocol import ENV_RUN_DIR, EXIT_FAILURE, EXIT_OK, EXIT_STOPPED, EXIT_USAGE
from trainer.flags import Bounded, UsageParser
from trainer.regen.client import PermanentError

PROG = "python -m trainer regenerate"
DEFAULT_CONCURRENCY = 32
DEFAULT_FLUSH_ROWS = 64
DEFAULT_FLUSH_S = 5.0
DEFAULT_PROGRESS_S = 30.0
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_SERVE_TIMEOUT_S = 900.0
DEFAULT_SERVE_STOP_GRACE_S = 30.0
# Reader causes regenerate does not mind: a prompt-only row is what it answers.
ANSWERABLE = frozenset({"no_assistant_turn"})
# Causes regenerate adds to the reader's (trainer/chat/rows.py CAUSES), for docs/regenerate.md.
OWN_CAUSES = {
    "tool_turns": "the conversation has tool schemas, calls or results: the target's own calls would not match "
                  "the recorded results, so it is not regenerated",
    "no_user_turn": "the conversation has no user message to answer",
    "duplicate_id": "an earlier row of the input has the same id (identical conversations without an id share one)",
}


class UsageError(ValueError):
    """Bad input: one line on stderr, exit 2."""


# The ceiling of --concurrency. The engine keeps one task per conversation in flight and never
# more (run_rows), so memory follows min(concurrency, rows left), not the setting; but each
# in-flight conversation also holds a connection and its history, and an SGLang or vLLM server
# runs a few hundred requests at once (--max-running-requests, --max-num-seqs) and queues the
# rest. 4096 is well past what any one server uses; 10^9 once took a node down.
MAX_CONCURRENCY = 4096
DAY_S = 86400.0
WEEK_S = 7 * DAY_S
_SECONDS = dict(low=0.0, low_open=True)


def build_parser() -> UsageParser:
    p = UsageParser(prog=PROG, description="Regenerate a chat dataset's answers with the target, turn by turn, "
                                           "through OpenAI-compatible endpoints; resumable.")
    p.add_argument("--input", required=True, metavar="PATH",
                   help="conversations: JSONL, a JSON array, parquet or a saved datasets directory (OpenAI "
                        "messages or ShareGPT conversations)")
    p.add_argument("--form", choices=("openai", "sharegpt"), help="force the row form (default: detected)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="output directory; run again with the same one to resume")
    p.add_argument("--endpoint", action="append", required=True, metavar="URL",
                   help="an OpenAI-compatible server, e.g. http://10.0.0.5:30000 (repeatable: conversations are "
                        "spread over them, a retry goes to the next)")
    p.add_argument("--model", help="the model name to ask for (default: the one model every endpoint serves)")
    p.add_argument("--api-key-env", metavar="VAR",
                   help="the environment variable holding the servers' API key (SGLang/vLLM --api-key), sent as "
                        "a bearer token; never the key itself on the command line")
    p.add_argument("--concurrency", type=Bounded("int", 1, MAX_CONCURRENCY, why="the documented ceiling: docs/regenerate.md"),
                   default=DEFAULT_CONCURRENCY, metavar="N",
                   help=f"conversations in flight at once (default {DEFAULT_CONCURRENCY}, at most {MAX_CONCURRENCY})")
    g = p.add_argument_group("sampling (unset: the server's default)")
    g.add_argument("--temperature", type=Bounded("float", 0.0, 2.0, why="the OpenAI API's range"))
    g.add_argument("--top-p", type=Bounded("float", 0.0, 1.0, low_open=True), dest="top_p")
    g.add_argument("--max-tokens", type=Bounded("int", 1, 1 << 24), dest="max_tokens", metavar="N", help="per answer")
    g.add_argument("--seed", type=Bounded("int", -(1 << 63), (1 << 63) - 1))
    g.add_argument("--thinking", choices=("on", "off"),
                   help="chat_template_kwargs.enable_thinking, for templates that have it (Qwen3)")
    r = p.add_argument_group("retries and durability")
    r.add_argument("--max-attempts", type=Bounded("int", 1, 1000), default=8, metavar="N",
                   help="attempts per request before a transient error (connection, 408, 429, 5xx) fails the row "
                        "(default 8)")
    r.add_argument("--retry-initial", type=Bounded("float", high=DAY_S, **_SECONDS), default=1.0, metavar="S",
                   help="first backoff in seconds, doubling with jitter (default 1)")
    r.add_argument("--retry-max-wait", type=Bounded("float", high=DAY_S, **_SECONDS), default=60.0, metavar="S",
                   help="longest backoff in seconds (default 60)")
    r.add_argument("--request-timeout", type=Bounded("float", high=WEEK_S, **_SECONDS), default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=f"seconds one answer may take (default {DEFAULT_TIMEOUT_S:g})")
    r.add_argument("--flush-rows", type=Bounded("int", 1, 1 << 20), default=DEFAULT_FLUSH_ROWS, metavar="N",
                   help=f"fsync the output every N finished rows (default {DEFAULT_FLUSH_ROWS})")
    r.add_argument("--flush-s", type=Bounded("float", high=DAY_S, **_SECONDS), default=DEFAULT_FLUSH_S, metavar="S",
                   help=f"… or every S seconds, whichever comes first (default {DEFAULT_FLUSH_S:g})")
    o = p.add_argument_group("progress and the server")
    o.add_argument("--progress-s", type=Bounded("float", high=DAY_S, **_SECONDS), default=DEFAULT_PROGRESS_S, metavar="S",
                   help=f"a progress event and line every S seconds (default {DEFAULT_PROGRESS_S:g}; a terminal: 1)")
    o.add_argument("--run-dir", metavar="DIR",
                   help=f"where events.jsonl goes (default ${ENV_RUN_DIR}, else --out)")
    o.add_argument("--serve", metavar="CMD",
                   help="start this server command first (split like a shell would, no shell run), wait until "
                        "every --endpoint is healthy, stop it at the end")
    o.add_argument("--serve-timeout", type=Bounded("float", high=WEEK_S, **_SECONDS), default=DEFAULT_SERVE_TIMEOUT_S, metavar="S",
                   help=f"seconds the server may take to become healthy (default {DEFAULT_SERVE_TIMEOUT_S:g})")
    o.add_argument("--serve-stop-grace", type=Bounded("float", high=DAY_S, **_SECONDS), default=DEFAULT_SERVE_STOP_GRACE_S, metavar="S",
                   help="seconds the server has to exit after SIGTERM before SIGKILL, at the end or when the job dies "
                        f"(default {DEFAULT_SERVE_STOP_GRACE_S:g}; a GPU server may need them to free its memory)")
    p.add_argument("--preflight", action="store_true",
                   help="only check what the job would refuse at its start (trainer/chat/preflight.py): the input, "
                        "the endpoints (without --serve), the out; write nothing")
    return p


def preflight(args) -> int:
    """The job's start checks, nothing written (trainer/chat/preflight.py)."""
    from trainer.chat import preflight as pf
    from trainer.chat import rows as chatrows
    from trainer.regen.client import pick_model

    problems, size = pf.inputs_problems([args.input])
    if not problems:
        try:
            count_rows(args.input, args.form, chatrows.detect_format(args.input))
        except chatrows.ChatRowsError as exc:
            problems.append(f"--input {exc}")
    # A server the job starts itself is checked by the job (--serve-timeout); a key that only
    # the run's secret file will hold (ctl launch writes it at the commit) is not here yet.
    if not args.serve and not (args.api_key_env and not os.environ.get(args.api_key_env)):
        try:
            pick_model(args.endpoint, args.model, api_key_of(args))
        except ValueError as exc:
            problems.append(str(exc))
    return pf.report(problems + pf.out_problems(args.out, int(size * pf.ROOM_FACTOR["regenerate"])))


def api_key_of(args) -> str | None:
    if not args.api_key_env:
        return None
    key = os.environ.get(args.api_key_env)
    if not key:
        raise UsageError(f"--api-key-env {args.api_key_env}: that environment variable is not set (or empty); "
                         "export the servers' API key in it")
    return key


def settings_of(args, model: str) -> dict:
    """What the rows are made with: a restart with other settings is refused (trainer/regen/store.py)."""
    return {"--input": os.path.abspath(args.input), "--form": args.form, "--model": model,
            "--temperature": args.temperature, "--top-p": args.top_p, "--max-tokens": args.max_tokens,
            "--seed": args.seed, "--thinking": args.thinking}


def skip_cause(row, seen: set) -> str | None:
    """Why this row is not sent, or None; ``seen`` collects the ids met so far."""
    if row.problem is not None and row.problem not in ANSWERABLE:
        return row.problem
    if row.id in seen:
        return "duplicate_id"
    seen.add(row.id)
    if row.tools or any(m["role"] == "tool" or m.get("tool_calls") for m in row.messages):
        return "tool_turns"
    if not any(m["role"] == "user" for m in row.messages):
        return "no_user_turn"
    return None


async def answer_conversation(row, client, first_endpoint: int, progress) -> dict:
    """The row with the dataset's assistant turns replaced by the target's, turn by turn."""
    history: list[dict] = []
    out: list[dict] = []
    finish: list = []
    tokens = 0
    for m in row.messages:
        if m["role"] == "assistant":
            continue  # the dataset's answer: replaced by the target's below its user turn
        out.append(m)
        history.append({"role": m["role"], "content": m["content"]})
        if m["role"] != "user":
            continue
        a = await client.answer(history, first_endpoint)
        progress.answered(a.output_tokens)
        tokens += a.output_tokens
        finish.append(a.finish_reason)
        history.append({"role": "assistant", "content": a.content})
        msg = {"role": "assistant", "content": a.content}
        if a.reasoning:
            msg["reasoning_content"] = a.reasoning
        out.append(msg)
    return {"id": row.id, "messages": out,
            "regen": {"model": client.model, "finish_reasons": finish, "output_tokens": tokens}}


async def run_rows(rows: Iterable, store, client, progress, args, stop: asyncio.Event) -> bool:
    """Send every row not done yet; True when the input was gone through, False when stopped.

    One task per conversation in flight, made when a slot frees and gone when it ends: never
    more than ``args.concurrency`` at once, and never more than the rows still to send, so
    memory follows the work in flight, not the setting (a pool of N workers made up front
    held 10^9 idle tasks before the first answer)."""
    slots = asyncio.Semaphore(args.concurrency)
    in_flight: set[asyncio.Task] = set()
    crashed: list[BaseException] = []

    def maybe_flush() -> None:
        if store.pending() >= args.flush_rows:
            store.flush()

    async def one(row, first: int) -> None:
        progress.in_flight += 1
        try:
            record = await answer_conversation(row, client, first, progress)
        except PermanentError as exc:
            store.add_failed(row.id, row.where, str(exc))
            progress.failed += 1
        else:
            store.add_done(record)
            progress.done += 1
        finally:
            progress.in_flight -= 1
            slots.release()
        maybe_flush()

    def ended(task: asyncio.Task) -> None:
        in_flight.discard(task)
        if not task.cancelled() and task.exception() is not None:
            crashed.append(task.exception())

    async def produce() -> None:
        seen: set = set()
        n_sent = 0
        for i, row in enumerate(rows):
            if i % 512 == 511:
                await asyncio.sleep(0)  # a long stretch of done rows must not starve the ones in flight
            cause = skip_cause(row, seen)
            if cause is not None:
                progress.skip(cause)
            elif row.id in store.done:
                progress.already_done()
            else:
                await slots.acquire()
                if crashed:
                    raise crashed[0]  # a bug in a row's task is raised, not hidden
                task = asyncio.create_task(one(row, n_sent % len(client.endpoints)))
                in_flight.add(task)
                task.add_done_callback(ended)
                n_sent += 1
        while in_flight:
            await asyncio.wait(set(in_flight))
        if crashed:
            raise crashed[0]

    async def tick() -> None:
        while True:
            await asyncio.sleep(min(0.5, args.flush_s))
            if store.pending() and time.monotonic() - store.last_flush >= args.flush_s:
                store.flush()
            progress.tick()

    progress.tick(force=True)  # the total and the line from the start, not after the first interval
    producer = asyncio.create_task(produce())
    ticker = asyncio.create_task(tick())
    stopper = asyncio.create_task(stop.wait())
    finished, _ = await asyncio.wait({producer, stopper}, return_when=asyncio.FIRST_COMPLETED)
    completed = producer in finished
    for t in (ticker, stopper, producer, *in_flight):
        t.cancel()
    await asyncio.gather(producer, ticker, stopper, *in_flight, return_exceptions=True)
    store.flush()  # what was answered is kept, even when a bug below is raised
    if completed:
        producer.result()  # a bug in a row's task is raised, not hidden
    return completed


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    try:
        return preflight(args) if args.preflight else _main(args)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE


class _Telemetry:
    """events.jsonl and heartbeat/rank-0 in the run directory, opened on first use: a run
    refused for bad input writes nothing."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.events = self.hb = None

    def open(self) -> None:
        from trainer.telemetry import Events, Heartbeat

        if self.events is None:
            os.makedirs(self.run_dir, exist_ok=True)
            self.events = Events(self.run_dir, None, "regenerate", None)
            self.hb = Heartbeat(self.run_dir, 0, "regenerate", None)
            self.hb.beat(0, "loading")  # the agent's start-up deadline: the job is alive before its first row

    def close(self) -> None:
        if self.events is not None:
            self.events.close()


def _main(args) -> int:
    from trainer import outlock
    from trainer.chat import rows as chatrows

    try:
        fmt = chatrows.detect_format(args.input)
        serve_argv = shlex.split(args.serve) if args.serve else None
    except chatrows.ChatRowsError as exc:
        raise UsageError(f"--input {exc}") from None
    except ValueError as exc:
        raise UsageError(f"--serve {args.serve!r}: {exc}") from None
    if serve_argv == []:
        raise UsageError("--serve: give the server's command, e.g. --serve 'python -m sglang.launch_server …'")
    # One writer per --out for the job's whole life, before a server starts or a row is read
    # (trainer/outlock.py): a second job, or the same command typed by hand, is refused here.
    parent = os.path.dirname(os.path.abspath(args.out))
    try:
        os.makedirs(parent, exist_ok=True)
        held = outlock.claim(args.out, "regenerate")
    except (outlock.OutBusy, OSError) as exc:
        raise UsageError(f"--out {exc}" if isinstance(exc, outlock.OutBusy) else
                         f"--out {args.out}: cannot lock it ({exc.strerror or exc})") from None
    try:
        return _main_locked(args, fmt, serve_argv)
    finally:
        outlock.release(held)


def _main_locked(args, fmt: str, serve_argv) -> int:
    from trainer.chat import rows as chatrows
    from trainer.regen.client import pick_model
    from trainer.regen.server import Server, ServeError
    from trainer.regen.store import Store, StoreError

    tel = _Telemetry(args.run_dir or os.environ.get(ENV_RUN_DIR) or args.out)
    stop = {"signal": None}  # a SIGTERM before the engine runs (its loop installs its own handlers)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.__setitem__("signal", signum))
    server = None
    try:
        if serve_argv:
            os.makedirs(args.out, exist_ok=True)
            tel.open()
            tel.events.emit("phase", phase="serving")
            server = Server(serve_argv, args.out, args.serve_stop_grace)
            try:
                server.start(args.endpoint, args.serve_timeout, log=lambda line: print(line, flush=True),
                             stopped=lambda: stop["signal"] is not None, api_key=api_key_of(args))
            except ServeError as exc:
                print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
                tel.events.emit("error", error="serve", message=str(exc))
                tel.hb.beat(0, "failed")
                return EXIT_FAILURE
            if stop["signal"] is not None:
                tel.hb.beat(0, "stopped")
                return EXIT_STOPPED
        # Without --serve, nothing is written before this: an endpoint that does not answer,
        # or does not serve the model, or an output directory of other settings is bad input.
        try:
            total = count_rows(args.input, args.form, fmt)  # a JSON-array file with data after it: refused here
            model = pick_model(args.endpoint, args.model, api_key_of(args))
            store = Store(args.out, settings_of(args, model))
        except chatrows.ChatRowsError as exc:
            raise UsageError(f"--input {exc}") from None
        except (ValueError, StoreError) as exc:
            raise UsageError(str(exc)) from None
        tel.open()
        return _regenerate(args, fmt, model, store, tel, stop, total)
    finally:
        if server is not None:
            print(f"regenerate: stopped the server (exit {server.stop()})", flush=True)
        tel.close()


def count_rows(path: str, form: str | None, fmt: str) -> int:
    """The input's rows: one per non-blank line in JSONL (no parsing needed to count); other
    formats are read once more (which also finds a JSON-array file's trailing data)."""
    from trainer.chat import rows as chatrows

    return sum(1 for _ in (chatrows.iter_lines(path) if fmt == "jsonl" else chatrows.iter_rows(path, form, fmt)))


def _regenerate(args, fmt: str, model: str, store, tel: _Telemetry, stop: dict, total: int) -> int:
    """The engine over the input, then the summary and the exit code."""
    from trainer.regen.client import Retry, Sampling
    from trainer.regen.progress import Progress

    if store.torn:
        print(f"regenerate: cut a torn last line off {store.output.path} (the row is done again)", flush=True)
    progress = Progress(total, tel.events, sys.stdout, args.progress_s, tel.hb)
    sampling = Sampling(args.temperature, args.top_p, args.max_tokens, args.seed,
                        None if args.thinking is None else args.thinking == "on")
    retry = Retry(args.max_attempts, args.retry_initial, args.retry_max_wait)
    print(f"regenerate: {total:,} input rows, {len(store.done):,} done before, "
          f"{len(store.failed_before):,} failed before (tried again); model {model} on "
          f"{', '.join(args.endpoint)}, concurrency {args.concurrency}", flush=True)
    tel.events.emit("phase", phase="regenerating")
    completed = asyncio.run(_run(args, fmt, model, sampling, retry, store, progress, stop))
    summary, snap = progress.summary(stopped=not completed)
    store.close({**snap, "adds_up": progress.adds_up()} if completed else None)
    tel.hb.beat(progress.done, "done" if completed else "stopped")
    print(f"regenerate: {summary}", flush=True)
    if not completed:
        tel.events.emit("phase", phase="stopping")
        print(f"regenerate: stopped by signal {stop['signal']} after writing what was answered; "
              "run the same command again to resume", flush=True)
        return EXIT_STOPPED
    tel.events.emit("phase", phase="done")
    if store.failed_now:
        first = list(store.failed_now.values())[:3]
        print(f"regenerate: {len(store.failed_now):,} rows failed, listed in {store.failures.path} "
              "(run again to retry them); first: " + "; ".join(f"{f['where']}: {f['error']}" for f in first),
              file=sys.stderr, flush=True)
    if not progress.adds_up():
        said = (f"the accounting does not add up: done + failed + skipped = {progress.accounted():,} of {total:,} "
                "input rows, so a row was lost or counted twice; the output is kept (run again to redo what is "
                "missing) — please report it with the summary in regenerate.json")
        print(f"{PROG}: error: {said}", file=sys.stderr, flush=True)
        # the job's failure in its own words: the agent names the run's failure with it
        tel.events.emit("error", error="accounting", message=f"regenerate: {said}")
        return EXIT_FAILURE
    if store.failed_now:
        first = next(iter(store.failed_now.values()))
        tel.events.emit("error", error="rows_failed", failed=len(store.failed_now), total=total,
                        message=f"regenerate: {len(store.failed_now):,} of {total:,} rows failed (listed in "
                                f"{store.failures.path}; launch the same config again to retry them); first: "
                                f"{first['where']}: {first['error']}")
        return EXIT_FAILURE
    return EXIT_OK


async def _run(args, fmt, model, sampling, retry, store, progress, stop_flag) -> bool:
    from trainer.chat import rows as chatrows
    from trainer.regen.client import ChatClient

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum):
        stop_flag["signal"] = signum
        stop.set()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    if stop_flag["signal"] is not None:
        stop.set()
    client = ChatClient(args.endpoint, model, sampling, retry, args.concurrency, args.request_timeout,
                        api_key_of(args))
    try:
        return await run_rows(chatrows.iter_rows(args.input, args.form, fmt), store, client, progress, args, stop)
    finally:
        await client.aclose()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
