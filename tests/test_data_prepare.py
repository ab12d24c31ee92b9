"""`python -m trainer prepare`: round trip, statistics, atomicity, bad input (trainer/chat/prepare.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from trainer import data
from trainer.chat import prepare as prepare_job
from trainer.chat.prepare import prepare
from trainer.data import DataError, PreparedData

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def random_samples(n: int, seed: int = 0, max_len: int = 300, vocab: int = 50_000):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(1, max_len))
        ids = rng.integers(0, vocab, length).tolist()
        prompt = int(rng.integers(0, length))
        out.append({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (length - prompt)})
    return out


def write_jsonl(path, rows, raw_lines=()):
    with open(path, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
        for line in raw_lines:
            fh.write(line + "\n")
    return str(path)


def quiet(_line):
    pass


# --------------------------------------------------------------------------- round trip


def test_round_trip_across_shards_and_files(tmp_path):
    rows = random_samples(120, seed=1)
    a = write_jsonl(tmp_path / "a.jsonl", rows[:70])
    b = write_jsonl(tmp_path / "b.jsonl", rows[70:])
    meta = prepare([a, b], str(tmp_path / "out"), shard_tokens=2_000, log=quiet)
    assert len(meta["shards"]) > 3  # small shards: the index → shard mapping is exercised
    d = PreparedData(str(tmp_path / "out"))
    assert len(d) == 120
    assert d.meta == meta
    np.testing.assert_array_equal(d.lengths, [len(r["input_ids"]) for r in rows])
    assert d.lengths.dtype == np.int64
    for i, r in enumerate(rows):
        ids, mask = d.sample(i)
        assert ids.dtype == np.int32 and mask.dtype == np.uint8
        np.testing.assert_array_equal(ids, r["input_ids"])
        np.testing.assert_array_equal(mask, r["loss_mask"])
    ids, _ = d.sample(-1)
    np.testing.assert_array_equal(ids, rows[-1]["input_ids"])
    with pytest.raises(IndexError):
        d.sample(120)
    d.verify()


def test_sample_is_a_writable_copy(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", random_samples(3))
    prepare([src], str(tmp_path / "out"), log=quiet)
    d = PreparedData(str(tmp_path / "out"))
    ids, mask = d.sample(0)
    assert ids.flags.writeable and mask.flags.writeable  # torch.from_numpy warns on read-only arrays
    first = int(ids[0])
    ids[0] = first + 1
    assert int(d.sample(0)[0][0]) == first  # the shard itself is untouched


def test_meta_statistics_match_direct_computation(tmp_path):
    rows = random_samples(500, seed=2, max_len=900)
    src = write_jsonl(tmp_path / "a.jsonl", rows, raw_lines=["", "   "])  # blank lines are skipped
    meta = prepare([src], str(tmp_path / "out"), log=quiet)
    lens = np.array([len(r["input_ids"]) for r in rows])
    loss = sum(sum(r["loss_mask"]) for r in rows)
    assert meta["format"] == "dflash-prepared-data" and meta["format_version"] == 1
    assert meta["samples"] == 500
    assert meta["tokens"] == int(lens.sum())
    assert meta["loss_tokens"] == loss
    assert meta["loss_fraction"] == pytest.approx(loss / lens.sum())
    assert meta["samples_without_loss"] == sum(1 for r in rows if not any(r["loss_mask"]))
    assert meta["max_token_id"] == max(max(r["input_ids"]) for r in rows)
    ln = meta["length"]
    assert ln["mean"] == pytest.approx(lens.mean())
    assert ln["min"] == lens.min() and ln["max"] == lens.max()
    for q in (50, 90, 99):
        assert ln[f"p{q}"] == pytest.approx(np.percentile(lens, q))
    assert meta["sources"] == [{"file": "a.jsonl", "bytes": os.path.getsize(src), "lines": 502, "samples": 500}]


def test_fingerprint_depends_on_content_not_layout(tmp_path):
    rows = random_samples(40, seed=3)
    a = write_jsonl(tmp_path / "a.jsonl", rows)
    # the same samples formatted differently and split over two files
    with open(tmp_path / "b1.jsonl", "w") as fh:
        for r in rows[:10]:
            fh.write(json.dumps(r, indent=None, separators=(",", ":")) + "\n")
    b2 = write_jsonl(tmp_path / "b2.jsonl", rows[10:])
    fp1 = prepare([a], str(tmp_path / "o1"), log=quiet)["fingerprint"]
    fp2 = prepare([str(tmp_path / "b1.jsonl"), b2], str(tmp_path / "o2"), shard_tokens=500, log=quiet)["fingerprint"]
    assert fp1 == fp2
    rows[5]["loss_mask"][-1] ^= 1
    c = write_jsonl(tmp_path / "c.jsonl", rows)
    assert prepare([c], str(tmp_path / "o3"), log=quiet)["fingerprint"] != fp1
    assert PreparedData(str(tmp_path / "o1")).fingerprint == fp1


def test_progress_lines_on_stderr(tmp_path, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", random_samples(25))
    assert prepare_job.main(["--input", src, "--out", str(tmp_path / "out"), "--progress-every", "10"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("prepare: 10 samples") and err[1].startswith("prepare: 20 samples")


def test_empty_existing_out_dir_is_accepted(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", random_samples(3))
    (tmp_path / "out").mkdir()
    prepare([src], str(tmp_path / "out"), log=quiet)
    assert len(PreparedData(str(tmp_path / "out"))) == 3


def test_cli_through_python_m_trainer(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", random_samples(5))
    proc = subprocess.run([sys.executable, "-m", "trainer", "prepare", "--input", src, "--out", str(tmp_path / "out")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "5 samples" in proc.stdout
    assert PreparedData(str(tmp_path / "out")).meta["samples"] == 5


# --------------------------------------------------------------------------- bad input

GOOD = json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]})
BAD_LINES = {
    "malformed_json": ("{\"input_ids\": [1, 2", "not valid JSON"),
    "length_mismatch": (json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1]}), "loss_mask has 2"),
    "negative_id": (json.dumps({"input_ids": [1, -4, 3], "loss_mask": [0, 1, 1]}), "is negative"),
    "missing_mask": (json.dumps({"input_ids": [1, 2]}), "missing key 'loss_mask'"),
    "not_object": ("[1, 2, 3]", "expected a JSON object"),
    "float_id": (json.dumps({"input_ids": [1, 2.5], "loss_mask": [0, 1]}), "flat list of integers"),
    "nested_ids": (json.dumps({"input_ids": [[1], [2]], "loss_mask": [0, 1]}), "flat list of integers"),
    "mask_value": (json.dumps({"input_ids": [1, 2], "loss_mask": [0, 2]}), "must be 0 or 1"),
    "empty_sample": (json.dumps({"input_ids": [], "loss_mask": []}), "input_ids is empty"),
    "id_too_big": (json.dumps({"input_ids": [1, 2 ** 31], "loss_mask": [0, 1]}), "int32"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_line_names_file_and_line_exits_2_writes_nothing(tmp_path, capsys, case):
    line, words = BAD_LINES[case]
    src = tmp_path / "in.jsonl"
    src.write_text(GOOD + "\n" + GOOD + "\n" + line + "\n" + GOOD + "\n")
    out = tmp_path / "new" / "out"  # a missing parent is created, then removed again on failure
    before = sorted(os.listdir(tmp_path))
    assert prepare_job.main(["--input", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"{src}:3:" in err and words in err
    assert sorted(os.listdir(tmp_path)) == before


def test_missing_input_file(tmp_path, capsys):
    good = write_jsonl(tmp_path / "a.jsonl", random_samples(2))
    missing = str(tmp_path / "nope.jsonl")
    assert prepare_job.main(["--input", good, missing, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and missing in err and "not found" in err
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl"]


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_dataset(tmp_path, capsys, content):
    src = tmp_path / "empty.jsonl"
    src.write_text(content)
    assert prepare_job.main(["--input", str(src), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(src) in err and "no samples" in err
    assert sorted(os.listdir(tmp_path)) == ["empty.jsonl"]


def test_existing_dataset_is_not_overwritten(tmp_path, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", random_samples(4))
    prepare([src], str(tmp_path / "out"), log=quiet)
    before = PreparedData(str(tmp_path / "out")).fingerprint
    other = write_jsonl(tmp_path / "b.jsonl", random_samples(4, seed=9))
    assert prepare_job.main(["--input", other, "--out", str(tmp_path / "out")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert PreparedData(str(tmp_path / "out")).fingerprint == before


def test_usage_errors_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        prepare_job.main(["--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_damaged_directory_is_refused(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", random_samples(10))
    prepare([src], str(tmp_path / "out"), log=quiet)
    with pytest.raises(DataError, match="not a prepared data directory"):
        PreparedData(str(tmp_path / "nothing"))
    ids = tmp_path / "out" / "shard-00000.ids.int32"
    ids.write_bytes(ids.read_bytes()[:-4])
    with pytest.raises(DataError, match="shard-00000.ids.int32.*damaged"):
        PreparedData(str(tmp_path / "out"))


# --------------------------------------------------------------------------- atomicity


def test_kill_during_prepare_leaves_no_dataset(tmp_path):
    """SIGKILL mid-stream: DIR must not exist (only a hidden .partial- dir without meta.json)."""
    fifo = tmp_path / "in.jsonl"
    os.mkfifo(fifo)
    out = tmp_path / "data"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from trainer.chat.prepare import main; sys.exit(main(sys.argv[1:]))",
         "--input", str(fifo), "--out", str(out), "--progress-every", "50", "--shard-tokens", "1000"],
        cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        # The reader blocks on the FIFO after these lines, so the kill lands mid-prepare.
        with open(fifo, "w") as fh:
            for r in random_samples(120, seed=4):
                fh.write(json.dumps(r) + "\n")
            fh.flush()
            line = proc.stderr.readline()
            assert line.startswith("prepare: 50 samples"), line
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    leftovers = [p for p in os.listdir(tmp_path) if p != "in.jsonl"]
    partials = [p for p in leftovers if p.startswith(".data.partial-")]
    assert sorted(set(leftovers) - set(partials)) == [".data.prepare-lock"]  # its claim, no longer held
    assert len(partials) == 1 and not os.path.exists(tmp_path / partials[0] / "meta.json")
    # and a re-run succeeds, removing the leftover and naming it
    src = write_jsonl(tmp_path / "a.jsonl", random_samples(3))
    said = []
    prepare([src], str(out), log=said.append)
    assert len(PreparedData(str(out))) == 3
    assert said[0].startswith(f"prepare: removed {tmp_path / partials[0]}, the partial output of an earlier prepare")
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl", "data", "in.jsonl"]


@pytest.mark.parametrize("stop", [KeyboardInterrupt, prepare_job._Stopped])
def test_a_stop_after_the_data_is_in_place_says_it_is_complete(tmp_path, monkeypatch, capsys, stop):
    """A Ctrl-C or SIGTERM that lands after the rename (here: in the parent's fsync) used to be
    reported as "nothing written" with exit 130/75 while the data stood complete in --out."""
    src = write_jsonl(tmp_path / "a.jsonl", random_samples(30))
    out = str(tmp_path / "out")

    def fsync_dir(path):
        raise stop()  # where the signal's handler would raise it

    monkeypatch.setattr(prepare_job, "_fsync_dir", fsync_dir)
    assert prepare_job.main(["--input", src, "--out", out]) == 0
    said = capsys.readouterr()
    assert said.err.splitlines()[-1] == "prepare: the stop came after the data was in place; it is complete"
    assert said.out.startswith(f"prepare: wrote {out}: 30 samples")
    assert len(PreparedData(out)) == 30
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back to the caller


def test_a_ctrl_c_in_the_interpreters_teardown_after_a_prepare_is_ignored(tmp_path):
    """The command's work is done and reported; a Ctrl-C that comes while the interpreter
    tears down (here: from an atexit hook, which runs last) put a KeyboardInterrupt traceback
    under the summary, or killed the process by SIGINT after its data was written."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import atexit, os, signal, time\n"
        "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.5)))\n")
    src = write_jsonl(tmp_path / "a.jsonl", random_samples(5))
    got = subprocess.run([sys.executable, "-m", "trainer", "prepare", "--input", src, "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**os.environ, "PYTHONPATH": f"{hook}:{REPO}"})
    assert got.returncode == 0, got.stderr
    assert "KeyboardInterrupt" not in got.stderr and "Traceback" not in got.stderr, got.stderr
    assert got.stdout.startswith(f"prepare: wrote {tmp_path / 'out'}: 5 samples")


def test_interrupt_cleans_up(tmp_path, monkeypatch):
    """KeyboardInterrupt (or any exception) mid-stream removes the temp directory."""
    src = write_jsonl(tmp_path / "a.jsonl", random_samples(30))
    calls = {"n": 0}
    real_add = data.ShardWriter.add

    def add(self, ids, mask):
        calls["n"] += 1
        if calls["n"] == 20:
            raise KeyboardInterrupt
        real_add(self, ids, mask)

    monkeypatch.setattr(data.ShardWriter, "add", add)
    with pytest.raises(KeyboardInterrupt):
        prepare([src], str(tmp_path / "out"), log=quiet)
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl"]
