"""trainer.chat.rows: every input format and row form to the same OpenAI-form rows; bad rows named, not fatal."""

import json
import subprocess
import sys

import pytest

from trainer.chat import rows as chatrows
from trainer.chat.rows import ChatRow, ChatRowsError, iter_rows

OPENAI = [
    {"id": "a1", "messages": [{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "Hi"},
                              {"role": "assistant", "content": "Hello."}]},
    {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                  {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6"}]},
    {"id": 7, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "assistant", "content": "18 degrees."}],
     "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]},
]
SHAREGPT = [
    {"id": "a1", "conversations": [{"from": "system", "value": "Be brief."},
                                   {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]},
    {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"},
                       {"from": "human", "value": "and 3+3?"}, {"from": "gpt", "value": "6"}]},
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _good(rows):
    return [(r.id, r.messages) for r in rows if r.problem is None]


def test_jsonl_openai_rows_come_out_normalized_with_ids_and_places(tmp_path):
    rows = list(iter_rows(_jsonl(tmp_path / "c.jsonl", OPENAI)))
    assert [r.problem for r in rows] == [None, None, None]
    assert [r.where for r in rows] == [f"{tmp_path}/c.jsonl:{i}" for i in (1, 2, 3)]
    assert rows[0].id == "a1" and rows[2].id == 7
    assert rows[1].id == chatrows.conversation_id(OPENAI[1]["messages"])
    call = rows[2].messages[1]
    assert call == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}, "id": "c1"}]}
    assert rows[2].messages[2] == {"role": "tool", "content": "18C", "tool_call_id": "c1"}
    assert rows[2].tools == OPENAI[2]["tools"]


def test_sharegpt_maps_to_the_same_messages_as_openai(tmp_path):
    a = list(iter_rows(_jsonl(tmp_path / "o.jsonl", OPENAI[:2])))
    b = list(iter_rows(_jsonl(tmp_path / "s.jsonl", SHAREGPT)))
    assert _good(a) == _good(b)


def test_sharegpt_function_call_and_observation_turns_become_tool_calls(tmp_path):
    row = {"system": "You call tools.", "tools": json.dumps([{"name": "f", "parameters": {}}]),
           "conversations": [{"from": "human", "value": "go"},
                             {"from": "function_call", "value": json.dumps({"name": "f", "arguments": {"x": 1}})},
                             {"from": "observation", "value": "ok"}, {"from": "gpt", "value": "done"}]}
    (r,) = iter_rows(_jsonl(tmp_path / "s.jsonl", [row]))
    assert r.problem is None
    assert [m["role"] for m in r.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert r.messages[2]["tool_calls"] == [{"type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]
    assert r.tools == [{"type": "function", "function": {"name": "f", "parameters": {}}}]


def test_the_conversation_hash_is_stable_and_ignores_formatting(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps(OPENAI[1], indent=None, separators=(", ", ": ")) + "\n"
                 + json.dumps({"extra": 1, **OPENAI[1]}, separators=(",", ":")) + "\n")
    a, b = iter_rows(str(p))
    assert a.id == b.id == chatrows.conversation_id(OPENAI[1]["messages"])
    assert len(a.id) == 64


BAD_LINES = [
    (b'{"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}', "unknown_role"),
    (b'{"messages": []}', "empty_conversation"),
    (b'{"messages": [{"role": "user", "content": "only a question"}]}', "no_assistant_turn"),
    (b'{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]}', "non_string_content"),
    (b'{"messages": [{"role": "user", "content": "x"}, {"role": "assistant"', "broken_json"),
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}, {"role": "assistant", "content": "y"}]}', "invalid_utf8"),
    (b'[1, 2]', "not_an_object"),
    (b'{"text": "no conversation here"}', "no_conversation"),
    (b'{"messages": "hi"}', "not_a_list"),
    (b'{"messages": ["hi", {"role": "assistant", "content": "y"}]}', "bad_message"),
    (b'{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": null, '
     b'"tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}]}', "bad_tool_call"),
    (b'{"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]}', "wrong_form"),
]


def test_every_bad_row_is_yielded_with_its_cause_and_line(tmp_path):
    good = json.dumps(OPENAI[0]).encode()
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b"\n".join([good] + [line for line, _ in BAD_LINES] + [good]) + b"\n")
    rows = list(iter_rows(str(p)))
    assert [r.problem for r in rows] == [None] + [cause for _, cause in BAD_LINES] + [None]
    assert [r.where.rsplit(":", 1)[1] for r in rows] == [str(i) for i in range(1, len(BAD_LINES) + 3)]
    assert all(r.messages == [] for r in rows[1:-1] if r.problem != "no_assistant_turn")
    # a prompt-only row keeps its messages: regenerate answers it (prepare skips it)
    assert rows[3].messages == [{"role": "user", "content": "only a question"}]
    assert set(chatrows.CAUSES) >= {c for _, c in BAD_LINES}


def test_a_forced_form_applies_from_the_first_row(tmp_path):
    p = _jsonl(tmp_path / "s.jsonl", SHAREGPT + OPENAI[:1])
    assert [r.problem for r in iter_rows(p)] == [None, None, "wrong_form"]
    assert [r.problem for r in iter_rows(p, form="openai")] == ["wrong_form", "wrong_form", None]
    with pytest.raises(ChatRowsError, match="form 'chatml'"):
        list(iter_rows(p, form="chatml"))


def test_json_array_streams_elements_with_their_line(tmp_path):
    p = tmp_path / "c.json"
    p.write_text("[\n" + ",\n".join(json.dumps(r, indent=1) for r in OPENAI) + "\n]\n")
    # a tiny read size exercises elements that straddle reads
    rows = [row for row in _via_array(str(p), chunk=7)]
    assert _good(rows) == _good(iter_rows(_jsonl(tmp_path / "c.jsonl", OPENAI)))
    first_lines = [1 + 1 + sum(json.dumps(r, indent=1).count("\n") + 1 for r in OPENAI[:i]) for i in range(3)]
    assert [r.where for r in rows] == [f"{p}:{n}" for n in first_lines]
    assert chatrows.detect_format(str(p)) == "json"


def _via_array(path, chunk):
    for obj, where, problem in chatrows._json_array(path, chunk=chunk):
        yield ChatRow("x", [], where, problem) if problem else chatrows.row_from_obj(obj, where)


def test_json_array_bad_utf8_element_is_skipped_and_the_rest_read(tmp_path):
    p = tmp_path / "c.json"
    a, b = json.dumps(OPENAI[0]).encode(), json.dumps(OPENAI[1]).encode()
    bad = b'{"messages": [{"role": "user", "content": "\xff"}, {"role": "assistant", "content": "y"}]}'
    p.write_bytes(b"[" + a + b",\n" + bad + b",\n" + b + b"]")
    assert [r.problem for r in iter_rows(str(p))] == [None, "invalid_utf8", None]


def test_json_array_broken_element_ends_the_file_with_one_counted_row(tmp_path):
    p = tmp_path / "c.json"
    p.write_text("[" + json.dumps(OPENAI[0]) + ",\n{\"messages\": [oops]}, " + json.dumps(OPENAI[1]) + "]")
    assert [(r.problem, r.where[-2:]) for r in iter_rows(str(p))] == [(None, ":1"), ("broken_json", ":2")]


def test_a_json_file_that_is_not_an_array_is_jsonl_or_one_clear_error(tmp_path):
    p = tmp_path / "lines.json"  # JSON Lines named .json is common
    p.write_text(json.dumps(OPENAI[0]) + "\n")
    assert chatrows.detect_format(str(p)) == "jsonl"
    with pytest.raises(ChatRowsError, match="one JSON array"):
        list(iter_rows(str(p), fmt="json"))
    with pytest.raises(ChatRowsError, match="cannot be read"):
        list(iter_rows(str(tmp_path / "missing.jsonl")))


def test_parquet_rows_with_struct_columns_normalize_like_jsonl(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    p = tmp_path / "c.parquet"
    table = [{**r, "id": str(r["id"])} if "id" in r else {**r, "id": None} for r in OPENAI]  # one column type
    pq.write_table(pa.Table.from_pylist(table), p, row_group_size=2)
    rows = list(iter_rows(str(p)))
    assert chatrows.detect_format(str(p)) == "parquet"
    assert _good(rows) == _good(iter_rows(_jsonl(tmp_path / "c.jsonl", table)))
    assert rows[2].messages[1]["tool_calls"][0]["function"]["name"] == "weather" and "tool_calls" not in rows[0].messages[1]
    assert [r.where for r in rows] == [f"{p}:row {i}" for i in range(3)]


def test_saved_hf_dataset_directories_read_without_importing_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    one, dd = tmp_path / "one", tmp_path / "dd"
    datasets.Dataset.from_list(SHAREGPT).save_to_disk(str(one))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(SHAREGPT),
                          "test": datasets.Dataset.from_list(SHAREGPT[:1])}).save_to_disk(str(dd))
    want = _good(iter_rows(_jsonl(tmp_path / "s.jsonl", SHAREGPT)))
    assert chatrows.detect_format(str(one)) == "hf"
    assert _good(iter_rows(str(one))) == want
    assert _good(iter_rows(str(dd))) == want + want[:1]
    # the regenerate job imports chatrows in containers: nothing beyond the standard library
    code = ("import sys, trainer.chat.rows; bad = {m for m in ('pyarrow', 'datasets', 'numpy', 'torch') "
            "if m in sys.modules}; print(sorted(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_detect_form_reads_the_first_conversation_row(tmp_path):
    assert chatrows.detect_form(_jsonl(tmp_path / "o.jsonl", [{"x": 1}] + OPENAI)) == "openai"
    assert chatrows.detect_form(_jsonl(tmp_path / "s.jsonl", SHAREGPT)) == "sharegpt"
    assert chatrows.detect_form(_jsonl(tmp_path / "t.jsonl", [{"input_ids": [1], "loss_mask": [1]}])) == "tokenized"


def test_a_jsonl_whose_first_line_is_a_json_array_is_read_line_by_line(tmp_path):
    """A JSONL whose first line was `[1, 2]` (or an array of one conversation) was taken for a
    JSON-array file: every later line was dropped silently (1 of 5 rows, exit 0), or the error
    named line 1 twice. Now a file is a JSON array only when its whole content is one array:
    here line 1 is one unusable row, and every line after it is read."""
    for first in ("[1, 2]", json.dumps([OPENAI[0]])):
        p = tmp_path / "c.jsonl"
        p.write_text(first + "\n" + "".join(json.dumps(r) + "\n" for r in OPENAI))
        assert chatrows.detect_format(str(p)) == "jsonl"
        rows = list(iter_rows(str(p)))
        assert [(r.problem, r.where) for r in rows[:1]] == [("not_an_object", f"{p}:1")]
        assert _good(rows[1:]) == _good(iter_rows(_jsonl(tmp_path / "plain.jsonl", OPENAI)))
        assert [r.where for r in rows[1:]] == [f"{p}:{n}" for n in range(2, 2 + len(OPENAI))]


def test_a_json_array_file_is_one_array_and_data_after_it_is_an_error_naming_file_and_line(tmp_path):
    one_line = tmp_path / "one.json"
    one_line.write_text(json.dumps(OPENAI) + "\n")
    assert chatrows.detect_format(str(one_line)) == "json" and len(list(iter_rows(str(one_line)))) == len(OPENAI)
    pretty = tmp_path / "pretty.json"
    pretty.write_text("[\n" + ",\n".join(json.dumps(r, indent=1) for r in OPENAI) + "\n]\n\n{\"messages\": []}\n")
    assert chatrows.detect_format(str(pretty)) == "json"
    line = pretty.read_text().splitlines().index('{"messages": []}') + 1
    with pytest.raises(ChatRowsError) as exc:
        list(iter_rows(str(pretty)))
    assert str(exc.value).startswith(f"{pretty}:{line}: data after the JSON array"), str(exc.value)
