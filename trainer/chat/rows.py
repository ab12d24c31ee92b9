"""Chat rows in: one normalized record per source row of an operator's conversation file.

``iter_rows(path)`` reads JSONL (a conversation a line), a JSON array file, parquet, a
saved Hugging Face ``datasets`` directory (or one of its ``.arrow`` files) and yields a
``ChatRow`` per source row, streaming: memory stays flat whatever the file size. Rows come
in OpenAI ``messages`` form (``role``/``content``) or ShareGPT ``conversations`` form
(``from``/``value``); the form is detected per file from its first conversation row and can
be forced. Every message comes out in OpenAI form, so a row can be rendered with a chat
template or sent to an OpenAI-compatible endpoint as it is.

A row that cannot be used is still yielded, with ``problem`` set to one of ``CAUSES``'s
codes and ``where`` naming it (``file:line``, or ``file:row N`` for parquet and arrow), so
callers count and name bad rows instead of stopping. Only a file that cannot be read at all
(missing, unknown format, a JSON file that is not an array) raises ``ChatRowsError``.

Standard library only at import time: the regenerate job imports this module inside
containers; pyarrow is imported when a parquet or arrow input is opened.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

FORMS = ("openai", "sharegpt")
FORMATS = ("jsonl", "json", "parquet", "arrow", "hf")

# The one list of reasons a row is skipped; prepare's summary and docs/data.md follow it.
CAUSES: dict[str, str] = {
    "invalid_utf8": "the line is not valid UTF-8",
    "broken_json": "the line is not valid JSON",
    "not_an_object": "the row is not a JSON object",
    "no_conversation": "the row has neither `messages` nor `conversations`",
    "wrong_form": "the row is in the other form than the file's first conversation row",
    "not_a_list": "`messages`/`conversations` is not a list",
    "empty_conversation": "the conversation has no messages",
    "bad_message": "a message is not an object, or has no role",
    "unknown_role": "a message has a role that is not system, developer, user, assistant or tool",
    "non_string_content": "a message's content is not a string (or a list of text parts)",
    "bad_tool_call": "a tool call has no function name or its arguments are not a JSON object",
    "no_assistant_turn": "the conversation has no assistant message",
}

ROLES = ("system", "developer", "user", "assistant", "tool")

# ShareGPT speaker names seen in public sets (FastChat, LLaMA-Factory, Glaive, OpenHermes).
SHAREGPT_ROLES: dict[str, str] = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant", "bot": "assistant",
    "tool": "tool", "function": "tool", "observation": "tool", "function_response": "tool",
    "ipython": "tool",
    "function_call": "assistant",  # its value is the call itself: {"name", "arguments"}
}

# Optional OpenAI message fields carried through; everything else in a message is dropped.
_KEEP = ("name", "tool_call_id", "reasoning_content")

_SURROGATE = re.compile("[\udc80-\udcff]")
_WS = re.compile(r"[ \t\r\n\ufeff]*")


class ChatRowsError(ValueError):
    """A file that cannot be read at all; the message is one line naming it."""


@dataclass(frozen=True)
class ChatRow:
    """One source row.

    ``id``: the row's own ``id`` field when it is a string or an integer (kept as it is),
    else the SHA-256 hex of the normalized messages (and tools) — identical conversations
    share that id. ``messages``: OpenAI-form messages (empty when the row is unusable,
    except a prompt-only row, ``no_assistant_turn``, which keeps them for regenerate).
    ``where``: ``file:line`` or ``file:row N``. ``problem``: ``None``, or a ``CAUSES`` code.
    ``tools``: the row's tool schemas (OpenAI ``tools`` list) when it has them.
    """

    id: str | int
    messages: list[dict]
    where: str
    problem: str | None = None
    tools: list | None = field(default=None)


# -- one row -------------------------------------------------------------------------------

def row_from_obj(obj: Any, where: str, form: str | None = None) -> ChatRow:
    """Normalize one decoded row; ``form`` None detects it from the row's own keys."""
    if not isinstance(obj, dict):
        return ChatRow(_raw_id(repr(obj).encode()), [], where, "not_an_object")
    own_id = obj.get("id")
    own_id = own_id if isinstance(own_id, (str, int)) and not isinstance(own_id, bool) else None
    row_form = form_of(obj)
    if row_form is None:
        return _bad(obj, own_id, where, "no_conversation")
    if form is not None and row_form != form and obj.get(_key(form)) is None:
        return _bad(obj, own_id, where, "wrong_form")
    use = form or row_form
    raw = obj.get(_key(use))
    if not isinstance(raw, list):
        return _bad(obj, own_id, where, "not_a_list")
    if not raw:
        return _bad(obj, own_id, where, "empty_conversation")
    messages, problem = (_from_openai(raw) if use == "openai" else _from_sharegpt(raw, obj.get("system")))
    tools, tools_problem = _tools(obj.get("tools"))
    problem = problem or tools_problem
    if problem:
        return _bad(obj, own_id, where, problem)
    rid = own_id if own_id is not None else conversation_id(messages, tools)
    if not any(m["role"] == "assistant" for m in messages):
        # A prompt-only row keeps its messages: prepare skips it, regenerate answers it.
        return ChatRow(rid, messages, where, "no_assistant_turn", tools)
    return ChatRow(rid, messages, where, None, tools)


def row_from_line(line: bytes, where: str, form: str | None = None) -> ChatRow:
    """Decode and normalize one JSONL line (without or with its newline)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return ChatRow(_raw_id(line), [], where, "invalid_utf8")
    try:
        obj = json.loads(text)
    except ValueError:
        return ChatRow(_raw_id(line), [], where, "broken_json")
    return row_from_obj(obj, where, form)


def form_of(obj: Any) -> str | None:
    """``openai``, ``sharegpt`` or None, from which of the two keys the row has."""
    if not isinstance(obj, dict):
        return None
    if obj.get("messages") is not None:
        return "openai"
    if obj.get("conversations") is not None:
        return "sharegpt"
    return None


def conversation_id(messages: list[dict], tools: list | None = None) -> str:
    """Stable id of a conversation: SHA-256 of its canonical JSON (key order and spacing fixed)."""
    doc: Any = messages if not tools else {"messages": messages, "tools": tools}
    blob = json.dumps(doc, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()


def _key(form: str) -> str:
    return "messages" if form == "openai" else "conversations"


def _bad(obj: dict, own_id, where: str, problem: str) -> ChatRow:
    if own_id is None:
        own_id = _raw_id(json.dumps(obj, sort_keys=True, ensure_ascii=False, default=repr)
                         .encode("utf-8", "surrogatepass"))
    return ChatRow(own_id, [], where, problem)


def _raw_id(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def _content(value: Any, role: str, has_calls: bool) -> str | None:
    if isinstance(value, str):
        return value
    if value is None and role == "assistant" and has_calls:
        return ""
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    return None


def _from_openai(raw: list) -> tuple[list[dict], str | None]:
    out = []
    for m in raw:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return [], "bad_message"
        role = m["role"]
        if role == "function":  # the legacy OpenAI name of a tool result
            role = "tool"
        if role not in ROLES:
            return [], "unknown_role"
        calls = m.get("tool_calls")
        msg: dict = {"role": role}
        if calls is not None and role == "assistant":
            calls = _tool_calls(calls)
            if calls is None:
                return [], "bad_tool_call"
        content = _content(m.get("content"), role, bool(calls))
        if content is None:
            return [], "non_string_content"
        msg["content"] = content
        if calls and role == "assistant":
            msg["tool_calls"] = calls
        for k in _KEEP:
            if isinstance(m.get(k), str):
                msg[k] = m[k]
        out.append(msg)
    return out, None


def _from_sharegpt(raw: list, system: Any) -> tuple[list[dict], str | None]:
    out: list[dict] = []
    if isinstance(system, str) and system:
        out.append({"role": "system", "content": system})
    for m in raw:
        if not isinstance(m, dict) or not isinstance(m.get("from"), str):
            return [], "bad_message"
        speaker = m["from"].strip().lower()
        role = SHAREGPT_ROLES.get(speaker)
        if role is None:
            return [], "unknown_role"
        value = m.get("value")
        if not isinstance(value, str):
            return [], "non_string_content"
        if speaker == "function_call":
            try:
                call = json.loads(value)
            except ValueError:
                return [], "bad_tool_call"
            calls = _tool_calls(call if isinstance(call, list) else [call])
            if calls is None:
                return [], "bad_tool_call"
            out.append({"role": "assistant", "content": "", "tool_calls": calls})
            continue
        msg = {"role": role, "content": value}
        if role == "tool" and isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out, None


def _tool_calls(calls: Any) -> list[dict] | None:
    """OpenAI tool calls with ``arguments`` as a JSON string, as the API carries them.

    Accepts the OpenAI shape ({"type", "function": {"name", "arguments"}}) and the flat one
    ({"name", "arguments"}); arguments may be a JSON string or an object, and must be an
    object once decoded (chat templates iterate them).
    """
    if not isinstance(calls, list) or not calls:
        return None
    out = []
    for c in calls:
        if not isinstance(c, dict):
            return None
        fn = c.get("function") if isinstance(c.get("function"), dict) else c
        name, args = fn.get("name"), fn.get("arguments", fn.get("parameters", {}))
        if not isinstance(name, str) or not name:
            return None
        if isinstance(args, str):
            try:
                decoded = json.loads(args) if args.strip() else {}
            except ValueError:
                return None
        else:
            decoded = args if args is not None else {}
        if not isinstance(decoded, dict):
            return None
        call: dict = {"type": "function",
                      "function": {"name": name, "arguments": json.dumps(decoded, ensure_ascii=False)}}
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        out.append(call)
    return out


def _tools(value: Any) -> tuple[list | None, str | None]:
    if value is None or value == "" or value == []:
        return None, None
    if isinstance(value, str):  # LLaMA-Factory keeps the schemas as a JSON string
        try:
            value = json.loads(value)
        except ValueError:
            return None, "bad_tool_call"
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        return None, "bad_tool_call"
    # the flat schema form ({"name", "parameters"}) is wrapped as the API's {"type", "function"}
    return [t if "function" in t else {"type": "function", "function": t} for t in value], None


# -- files ---------------------------------------------------------------------------------

def detect_format(path: str) -> str:
    """``jsonl``, ``json`` (an array), ``parquet``, ``arrow`` or ``hf``, from the content."""
    if os.path.isdir(path):
        if any(os.path.exists(os.path.join(path, n)) for n in ("state.json", "dataset_dict.json")):
            return "hf"
        raise ChatRowsError(f"{path}: a directory that is not a saved Hugging Face dataset "
                            "(no state.json or dataset_dict.json); give files or a save_to_disk directory")
    try:
        with open(path, "rb") as fh:
            head = fh.peek(64)[:64] if hasattr(fh, "peek") else fh.read(64)
    except OSError as exc:
        raise ChatRowsError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith(b"ARROW1") or head[:4] == b"\xff\xff\xff\xff" or path.endswith(".arrow"):
        return "arrow"
    first = head.lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
    if first == b"[" and not _lines_after_a_whole_first_line(path):
        return "json"
    return "jsonl"


# A JSONL row is never this long; a first line longer than this that starts with "[" is
# taken for a one-line JSON array without reading it all twice.
_FIRST_LINE_MAX = 64 << 20


def _lines_after_a_whole_first_line(path: str) -> bool:
    """The first non-blank line is a JSON value on its own and more non-blank text follows:
    JSON Lines whose first row happens to be an array (`[1, 2]`), not a JSON-array file (one
    array is the file's whole content, over one line or many)."""
    if not os.path.isfile(path):
        return False  # a pipe is read once, by the job: its first character decides
    with open(path, "rb") as fh:
        for raw in fh:
            if raw.strip(b"\xef\xbb\xbf \t\r\n"):
                break
        else:
            return False
        if len(raw) > _FIRST_LINE_MAX:
            return False
        try:
            json.loads(raw.decode("utf-8-sig"))
        except ValueError:
            return False  # an array that goes on over the next lines
        return any(line.strip() for line in fh)


def detect_form(path: str, fmt: str | None = None, scan: int = 1000) -> str | None:
    """The file's form from its first rows: ``openai``, ``sharegpt``, ``tokenized`` or None.

    ``tokenized`` is a pre-tokenized JSONL (``input_ids``); None when none of the first
    ``scan`` rows tells. Reads only the start of the file.
    """
    for i, row in enumerate(iter_objects(path, fmt or detect_format(path))):
        obj = row[0]
        if isinstance(obj, dict):
            if "input_ids" in obj and form_of(obj) is None:
                return "tokenized"
            f = form_of(obj)
            if f:
                return f
        if i + 1 >= scan:
            break
    return None


def iter_rows(path: str, form: str | None = None, fmt: str | None = None) -> Iterator[ChatRow]:
    """Every row of one file as a ``ChatRow``, in file order.

    ``form``: ``openai`` or ``sharegpt`` to force it; None takes the form of the first row
    that has ``messages`` or ``conversations``, and later rows in the other form only are
    ``wrong_form``. ``fmt``: one of ``FORMATS`` to force the file format.
    """
    if form is not None and form not in FORMS:
        raise ChatRowsError(f"form {form!r}: use one of {', '.join(FORMS)}")
    fmt = fmt or detect_format(path)
    if fmt not in FORMATS:
        raise ChatRowsError(f"format {fmt!r}: use one of {', '.join(FORMATS)}")
    fixed = form
    for obj, where, problem in iter_objects(path, fmt):
        if problem is not None:
            yield ChatRow(_raw_id(obj), [], where, problem)
            continue
        if fixed is None:
            fixed = form_of(obj)
        yield row_from_obj(obj, where, fixed)


def iter_lines(path: str) -> Iterator[tuple[bytes, str]]:
    """A JSONL file's non-blank lines as raw bytes with their ``file:line`` (for workers)."""
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise ChatRowsError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    with fh:
        for lineno, line in enumerate(fh, 1):
            if line.strip():
                yield line, f"{path}:{lineno}"


def iter_objects(path: str, fmt: str) -> Iterator[tuple[Any, str, str | None]]:
    """(decoded object, where, None) per row, or (raw bytes, where, cause) for an undecodable one."""
    if fmt == "jsonl":
        for line, where in iter_lines(path):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError:
                yield line, where, "invalid_utf8"
                continue
            try:
                yield json.loads(text), where, None
            except ValueError:
                yield line, where, "broken_json"
    elif fmt == "json":
        yield from _json_array(path)
    elif fmt == "parquet":
        yield from _parquet(path)
    elif fmt == "arrow":
        yield from _arrow(path, os.path.basename(path))
    else:
        yield from _hf_dir(path)


def _json_array(path: str, chunk: int = 1 << 20) -> Iterator[tuple[Any, str, str | None]]:
    """The elements of a top-level JSON array, decoded one at a time (flat memory).

    Bytes are decoded with ``surrogateescape`` so a bad byte does not stop the file: an
    element whose raw text holds an escaped byte is ``invalid_utf8``. An element that does
    not parse is ``broken_json``, and the rest of the file cannot be split reliably, so it ends
    there (that one row is counted).
    """
    decoder = json.JSONDecoder()
    text_of = codecs.getincrementaldecoder("utf-8")("surrogateescape")
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise ChatRowsError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    with fh:
        buf, pos, line, eof = "", 0, 1, False

        def more(n: int) -> bool:
            nonlocal buf, pos, eof
            if eof:
                return False
            data = fh.read(n)
            buf = buf[pos:] + text_of.decode(data, final=not data)
            pos = 0
            eof = not data
            return True

        def skip_ws() -> None:
            nonlocal pos, line
            while True:
                m = _WS.match(buf, pos)
                line += buf.count("\n", pos, m.end())
                pos = m.end()
                if pos < len(buf) or not more(chunk):
                    return

        skip_ws()
        if buf[pos:pos + 1] != "[":
            raise ChatRowsError(f"{path}: a .json input must be one JSON array of conversations "
                                "(or JSON Lines: one object a line)")
        pos += 1
        first = True
        while True:
            skip_ws()
            if pos >= len(buf):
                yield b"", f"{path}:{line}", "broken_json"  # the array never closes
                return
            if buf[pos] == "]":
                pos += 1
                skip_ws()
                if pos < len(buf):  # the file is one array: anything after it is not a row of it
                    raise ChatRowsError(f"{path}:{line}: data after the JSON array's closing ] (a JSON-array file is "
                                        "one array; JSON Lines is one object a line): fix or remove it")
                return
            if not first:
                if buf[pos] != ",":
                    yield buf[pos:pos + 64].encode("utf-8", "surrogateescape"), f"{path}:{line}", "broken_json"
                    return
                pos += 1
                skip_ws()
            first = False
            start_line = line
            want = chunk
            while True:
                try:
                    obj, end = decoder.raw_decode(buf, pos)
                    if end == len(buf) and not eof:
                        raise ValueError("a number may continue in the next chunk")
                    break
                except ValueError:
                    if not more(max(want, len(buf))):
                        yield buf[pos:pos + 64].encode("utf-8", "surrogateescape"), f"{path}:{start_line}", "broken_json"
                        return
                    want *= 2
            segment = buf[pos:end]
            line += segment.count("\n")
            pos = end
            if _SURROGATE.search(segment):
                yield segment.encode("utf-8", "surrogateescape"), f"{path}:{start_line}", "invalid_utf8"
            else:
                yield obj, f"{path}:{start_line}", None


def _pyarrow():
    try:
        import pyarrow  # noqa: F401
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise ChatRowsError("reading parquet or arrow files needs pyarrow: "
                            "pip install 'dflash-ctl[trainer]' (or pip install pyarrow)") from None
    return pyarrow


def _batches_to_rows(batches, label: str) -> Iterator[tuple[Any, str, str | None]]:
    i = 0
    for batch in batches:
        for obj in batch.to_pylist():
            yield obj, f"{label}:row {i}", None
            i += 1


def _parquet(path: str) -> Iterator[tuple[Any, str, str | None]]:
    pa = _pyarrow()
    try:
        pf = pa.parquet.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise ChatRowsError(f"{path}: not a readable parquet file ({exc})") from None
    yield from _batches_to_rows(pf.iter_batches(batch_size=512), path)


def _arrow(path: str, label: str) -> Iterator[tuple[Any, str, str | None]]:
    """An Arrow IPC file: ``datasets`` writes the stream format; the file format is read too."""
    pa = _pyarrow()
    source = pa.memory_map(path)
    try:
        reader = pa.ipc.open_stream(source)
    except pa.ArrowException:
        try:
            reader = pa.ipc.open_file(source)
        except pa.ArrowException as exc:
            raise ChatRowsError(f"{path}: not a readable arrow file ({exc})") from None
        yield from _batches_to_rows((reader.get_batch(i) for i in range(reader.num_record_batches)), label)
        return
    yield from _batches_to_rows(reader, label)


def _hf_dir(path: str) -> Iterator[tuple[Any, str, str | None]]:
    """A ``save_to_disk`` directory: a Dataset (state.json) or a DatasetDict (every split, in order)."""
    dd = os.path.join(path, "dataset_dict.json")
    if os.path.exists(dd):
        try:
            with open(dd) as fh:
                splits = json.load(fh)["splits"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ChatRowsError(f"{dd}: unreadable ({exc})") from None
        for split in splits:
            yield from _hf_dir(os.path.join(path, split))
        return
    state = os.path.join(path, "state.json")
    try:
        with open(state) as fh:
            files = [f["filename"] for f in json.load(fh)["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ChatRowsError(f"{state}: unreadable ({exc}); is {path} a datasets save_to_disk directory?") from None
    for name in files:
        yield from _arrow(os.path.join(path, name), os.path.join(path, name))
