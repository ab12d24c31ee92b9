"""bench/compare.py: one benchmark command against a base commit and the working tree,
alternating, each run in its own tree with the working tree's bench/, both medians and the
ratio (> 1: the working tree better)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import compare

# a "benchmark" that reports which tree it ran in: the base tree carries BENCH_BASE_COMMIT, and
# it is slower there; its loss is the same in both trees
PROBE = ("import json, os; base = os.path.exists('BENCH_BASE_COMMIT'); "
         "json.dump({'step_s': {'value': 2.0 if base else 1.0, 'better': 'lower'}, "
         "'tokens_s': {'value': 50.0 if base else 100.0, 'better': 'higher'}, "
         "'loss': {'value': 5.25, 'better': 'same'}, "
         "'has_compare': {'value': int(os.path.exists('bench/compare.py')), 'better': 'same'}}, "
         "open(os.path.join(os.environ['BENCH_OUT'], 'metrics.json'), 'w')); "
         "open(os.path.join('{out}', 'cwd'), 'w').write(os.getcwd())")


def _has_history() -> bool:
    try:
        compare.git("rev-parse", "HEAD")
        return True
    except (OSError, subprocess.CalledProcessError):
        return False


@pytest.mark.skipif(not _has_history(), reason="needs the repository's git history")
def test_compare_runs_the_command_in_both_trees_alternately_and_gives_the_ratio(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert compare.main(["--base", "HEAD", "--out", str(out), "--runs", "2", "--",
                         sys.executable, "-c", PROBE]) == 0
    res = json.loads((out / "compare.json").read_text())
    assert [(r["side"], r["run"]) for r in res["records"]] == [("base", 0), ("head", 0), ("head", 1), ("base", 1)]
    s = res["summary"]
    assert s["step_s"]["ratio"] == pytest.approx(2.0) and s["tokens_s"]["ratio"] == pytest.approx(2.0)
    assert s["loss"]["equal"] is True
    assert s["has_compare"]["base"] == [1, 1]  # the base tree runs the working tree's bench/
    assert (out / "head-0" / "cwd").read_text() == ROOT
    assert (out / "base-0" / "cwd").read_text() != ROOT
    assert not os.path.exists((out / "base-0" / "cwd").read_text())  # the temporary base tree is gone
    printed = capsys.readouterr().out
    assert "| step_s | 2 | 1 | 2.000× |" in printed and "| loss | 5.25 | 5.25 | equal |" in printed


def test_a_figure_that_must_be_the_same_and_differs_is_marked():
    s = compare.summarise([{"side": "base", "metrics": {"loss": {"value": 1.0, "better": "same"}}},
                           {"side": "head", "metrics": {"loss": {"value": 1.5, "better": "same"}}}])
    assert s["loss"]["equal"] is False
    assert "**differ**" in compare.markdown(s, {"base": "b", "head": "h", "machine": "m", "date": "d", "runs": 1})


def test_the_order_puts_each_tree_first_as_often_as_second():
    assert compare.order(3) == [("base", 0), ("head", 0), ("head", 1), ("base", 1), ("base", 2), ("head", 2)]


def test_bad_input_is_refused_with_what_to_do(tmp_path):
    with pytest.raises(SystemExit):
        compare.main(["--out", str(tmp_path), "--", "true"])  # neither --base nor --base-dir
    with pytest.raises(SystemExit):
        compare.main(["--base", "HEAD", "--out", str(tmp_path)])  # no command
    with pytest.raises(SystemExit, match="no BENCH_BASE_COMMIT in it; make it with --prepare"):
        compare.main(["--base-dir", str(tmp_path), "--out", str(tmp_path / "o"), "--", "true"])
    if _has_history():
        with pytest.raises(SystemExit, match="--base no-such-commit: no such commit"):
            compare.prepare("no-such-commit", str(tmp_path / "t"))
