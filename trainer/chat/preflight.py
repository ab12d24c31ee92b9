"""A data job's checks before anything starts (``python -m trainer prepare|regenerate …
--preflight``): what the job itself would refuse at its start, asked by the launch's
preflight in the container (agent/preflight.py check_data_job) so that a wrong --target, a
target without a chat template, an unreadable input, an endpoint that does not answer or an
out that cannot be written is one refusal before a run directory exists — not a failed run
per typo. Writes nothing; prints its verdict as the agent's JSON payload and exits 0 (fine)
or 2 (refused).

Each check is the job's own code path (the Renderer that loads the tokenizer and probes the
template, the reader that detects the format and counts the rows, the client that asks the
endpoints for their model), so the preflight cannot pass what the job then refuses.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from agent.protocol import EXIT_OK, EXIT_USAGE, wrap_payload

# Room an out needs, as a multiple of its inputs' size: prepared shards hold 4-byte token ids
# and a mask byte per token (a few bytes per input byte at most); regenerated rows are about
# the size of the input rows they replace.
ROOM_FACTOR = {"prepare": 2.0, "regenerate": 1.0}


def inputs_problems(paths: list[str], option: str = "--input") -> tuple[list[str], int]:
    """(one line per input that cannot be read, the readable inputs' total bytes)."""
    from trainer.chat import rows as chatrows

    problems, total = [], 0
    for path in paths:
        if os.path.exists(path) and not (os.path.isfile(path) or os.path.isdir(path)):
            # a pipe (or a device) is the job's to read: reading it here would take its rows
            if not os.access(path, os.R_OK):
                problems.append(f"{option} {path}: not readable by this user")
            continue
        try:
            fmt = chatrows.detect_format(path)
            if fmt in ("jsonl", "json"):
                with open(path, "rb") as fh:
                    fh.read(1)
            total += _size(path)
        except chatrows.ChatRowsError as exc:
            problems.append(f"{option} {exc}")
        except OSError as exc:
            problems.append(f"{option} {path}: cannot be read ({exc.strerror or exc})")
    return problems, total


def _size(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    return os.path.getsize(path)


def out_problems(out: str, need_bytes: int, option: str = "--out") -> list[str]:
    """``out``'s nearest existing ancestor takes a new directory (made and removed here) and
    has ``need_bytes`` free."""
    probe = os.path.abspath(out)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    base = probe if os.path.isdir(probe) else os.path.dirname(probe)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dflash-preflight-", dir=base))
    except OSError as exc:
        return [f"{option} {out}: nothing can be created in {base} ({exc.strerror or exc}); give a writable path"]
    free = shutil.disk_usage(base).free
    if free < need_bytes:
        return [f"{option} {out}: {free / 2**30:.2f} GiB free at {base}, the job needs about "
                f"{need_bytes / 2**30:.2f} GiB; free some or choose another place"]
    return []


def target_problems(target: str, thinking: bool | None, last_turn_only: bool) -> list[str]:
    """The target's tokenizer and chat template load and render a plain exchange (the job's Renderer)."""
    from trainer.chat.template import Renderer, TemplateError

    try:
        Renderer(target, thinking, last_turn_only)
    except TemplateError as exc:
        return [str(exc)]
    return []


def report(problems: list[str]) -> int:
    sys.stdout.write(wrap_payload({"ok": not problems, "errors": problems}))
    sys.stdout.flush()
    return EXIT_OK if not problems else EXIT_USAGE
