"""A before/after: one benchmark command against a base commit and against the working tree.

    python3 bench/compare.py --base 2761340 --out DIR -- python3 bench/drafter_step/run.py --out {out}
    python3 bench/compare.py --base-dir .bench-base --out DIR -- ...   # a base tree made by --prepare
    python3 bench/compare.py --prepare .bench-base --base 2761340        # only make the base tree, then stop

The base tree is ``git archive BASE`` unpacked into a temporary folder, with the working
tree's own bench/ copied over its bench/: the two runs differ in the product (trainer/,
agent/, controller/ ...), never in the benchmark. Then the command runs alternately in the two
trees (base, head, head, base, base, head, ...: ``--runs`` each), each time with the tree as
its working directory and first on PYTHONPATH, ``{out}`` in the command replaced by that run's
own folder (also in $BENCH_OUT) and ``{tree}`` by the tree. The command writes
``{out}/metrics.json``: ``{"NAME": {"value": X, "better": "higher" | "lower" | "same"}}``.

Written to DIR: ``base-N/`` and ``head-N/`` (each run's outputs and log.txt), compare.json
(every run's figures, the medians, the ratios, the commits, the machine) and compare.md (the
table it prints last). The ratio is head ÷ base for "higher is better" figures and base ÷ head
for "lower is better" ones, so > 1 always means the working tree is faster; "same" figures
(a first-step loss) must be equal in every run of both trees.

A machine without the repository's history (a copy of the working tree) takes a base tree
made beforehand with ``--prepare DIR``, carried along, and ``--base-dir DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_FILE = "BENCH_BASE_COMMIT"  # in a prepared base tree: the commit it was made from


def git(*args: str, cwd: str = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def head_commit() -> str:
    """The working tree's commit, marked when it has uncommitted changes ("" without git)."""
    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return ""
    return commit + (" + uncommitted changes" if dirty else "")


def prepare(base: str, into: str) -> str:
    """The base tree in ``into``: ``git archive base``, bench/ replaced by the working tree's.
    Returns the full commit."""
    try:
        commit = git("rev-parse", "--verify", f"{base}^{{commit}}")
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(f"--base {base}: no such commit in {ROOT} ({getattr(exc, 'stderr', exc)!s}".strip()
                         + "); on a machine without the history make the tree elsewhere with "
                           "--prepare DIR --base COMMIT and pass --base-dir DIR") from None
    if os.path.exists(into) and os.listdir(into):
        raise SystemExit(f"--prepare {into}: not empty; give a new folder")
    os.makedirs(into, exist_ok=True)
    with tempfile.TemporaryFile() as fh:
        subprocess.run(["git", "archive", "--format=tar", commit], cwd=ROOT, stdout=fh, check=True)
        fh.seek(0)
        with tarfile.open(fileobj=fh) as tar:
            tar.extractall(into, filter="data")
    shutil.rmtree(os.path.join(into, "bench"), ignore_errors=True)
    shutil.copytree(os.path.join(ROOT, "bench"), os.path.join(into, "bench"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    with open(os.path.join(into, BASE_FILE), "w") as fh:
        fh.write(commit + "\n")
    return commit


def base_commit_of(tree: str) -> str:
    try:
        with open(os.path.join(tree, BASE_FILE)) as fh:
            return fh.read().strip()
    except OSError:
        raise SystemExit(f"--base-dir {tree}: no {BASE_FILE} in it; make it with --prepare DIR --base COMMIT") from None


def machine() -> str:
    """The GPU(s) by name, else the CPU: what the figures were measured on."""
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=20, check=False).stdout.split("\n")
        names = [n.strip() for n in names if n.strip()]
        if names:
            return f"{len(names)} × {names[0]}"
    except (OSError, subprocess.SubprocessError):
        pass
    return f"{os.cpu_count()} CPU cores, no GPU"


def order(runs: int) -> list[tuple[str, int]]:
    """base, head, head, base, base, head, ...: each side as often first as second."""
    out = []
    for i in range(runs):
        pair = [("base", i), ("head", i)]
        out += pair if i % 2 == 0 else pair[::-1]
    return out


def run_one(side: str, i: int, tree: str, command: list[str], out: str) -> dict:
    run_dir = os.path.join(out, f"{side}-{i}")
    os.makedirs(run_dir, exist_ok=True)
    argv = [a.replace("{out}", run_dir).replace("{tree}", tree) for a in command]
    if os.sep in argv[0] and not os.path.isabs(argv[0]):  # a program named from here (.venv/bin/python)
        argv[0] = os.path.abspath(argv[0])
    env = dict(os.environ, BENCH_OUT=run_dir,
               PYTHONPATH=os.pathsep.join([tree, *filter(None, [os.environ.get("PYTHONPATH")])]))
    t0 = time.time()
    with open(os.path.join(run_dir, "log.txt"), "w") as log:
        rc = subprocess.run(argv, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    rec = {"side": side, "run": i, "rc": rc, "wall_s": round(time.time() - t0, 1)}
    try:
        with open(os.path.join(run_dir, "metrics.json")) as fh:
            rec["metrics"] = json.load(fh)
    except (OSError, ValueError) as exc:
        rec["error"] = f"no metrics.json ({exc}); see {os.path.join(run_dir, 'log.txt')}"
    return rec


def summarise(records: list[dict]) -> dict:
    """Per figure: each side's values and median, and the ratio (> 1: the working tree better)."""
    names: dict = {}
    for r in records:
        for name, m in (r.get("metrics") or {}).items():
            names.setdefault(name, {"better": m.get("better", "higher"), "base": [], "head": []})
            names[name][r["side"]].append(m["value"])
    out = {}
    for name, f in names.items():
        row = {"better": f["better"], "base": f["base"], "head": f["head"]}
        if f["base"] and f["head"]:
            b, h = statistics.median(f["base"]), statistics.median(f["head"])
            row.update(base_median=b, head_median=h)
            if f["better"] == "same":
                row["equal"] = len(set(f["base"] + f["head"])) == 1
            elif b and h:
                row["ratio"] = h / b if f["better"] == "higher" else b / h
        out[name] = row
    return out


def fmt(v: float) -> str:
    return f"{v:.6g}"


def markdown(summary: dict, meta: dict) -> str:
    head = (f"Base {meta['base']} against the working tree {meta['head'] or '(no git)'}; {meta['machine']}; "
            f"{meta['date']}; {meta['runs']} run(s) each, alternating; median of the runs.")
    lines = [head, "",
             "| figure | base | working tree | ratio (> 1: the working tree better) | runs: base / working tree |",
             "| --- | --- | --- | --- | --- |"]
    for name, r in summary.items():
        if "ratio" in r:
            ratio = f"{r['ratio']:.3f}×"
        elif "equal" in r:
            ratio = "equal" if r["equal"] else "**differ**"
        else:
            ratio = "—"
        lines.append(f"| {name} | {fmt(r['base_median']) if 'base_median' in r else '—'} | "
                     f"{fmt(r['head_median']) if 'head_median' in r else '—'} | {ratio} | "
                     f"{', '.join(map(fmt, r['base']))} / {', '.join(map(fmt, r['head']))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                usage="%(prog)s (--base COMMIT | --base-dir DIR) --out DIR [--runs N] -- COMMAND ...")
    p.add_argument("--base", help="the commit to compare against (git archive of it)")
    p.add_argument("--base-dir", help="a base tree made by --prepare (for a machine without the history)")
    p.add_argument("--prepare", metavar="DIR", help="only make the base tree of --base in DIR, then stop")
    p.add_argument("--out", help="where each run's outputs, compare.json and compare.md go")
    p.add_argument("--runs", type=int, default=2, help="runs per tree (default 2)")
    p.add_argument("--deadline-s", type=float, default=0,
                   help="start no run that would end past this many seconds, going by the longest run so far "
                        "(each tree still runs once); 0: no deadline")
    a = p.parse_args(argv)
    if a.prepare:
        if not a.base:
            p.error("--prepare needs --base COMMIT")
        print(f"base tree of {prepare(a.base, a.prepare)} in {a.prepare}")
        return 0
    if bool(a.base) == bool(a.base_dir):
        p.error("give one of --base COMMIT or --base-dir DIR")
    if not command:
        p.error("no command: put it after --, e.g. -- python3 bench/drafter_step/run.py --out {out}")
    if not a.out:
        p.error("--out DIR is required")
    if a.runs < 1:
        p.error(f"--runs {a.runs}: at least 1")
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    tmp = None
    if a.base_dir:
        base_tree, base = os.path.abspath(a.base_dir), base_commit_of(a.base_dir)
    else:
        tmp = tempfile.mkdtemp(prefix="bench-base-")
        base_tree = os.path.join(tmp, "tree")
        base = prepare(a.base, base_tree)
    trees = {"base": base_tree, "head": ROOT}
    meta = {"base": base[:12], "head": head_commit(), "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
            "runs": a.runs, "command": command}
    t0, records = time.time(), []
    try:
        for side, i in order(a.runs):
            longest = max((r["wall_s"] for r in records), default=0)
            done = {r["side"] for r in records}
            if a.deadline_s and side in done and time.time() - t0 + longest > a.deadline_s:
                print(f"[compare] {side}-{i} not started: the deadline ({a.deadline_s:.0f} s) would pass", flush=True)
                continue
            print(f"[compare] {side}-{i} in {trees[side]} ...", flush=True)
            rec = run_one(side, i, trees[side], command, out)
            records.append(rec)
            print(f"[compare] {side}-{i}: rc {rec['rc']}, {rec['wall_s']} s"
                  + (f", {rec['error']}" if "error" in rec else ""), flush=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    meta["runs"] = min(sum(r["side"] == s for r in records) for s in trees)
    summary = summarise(records)
    with open(os.path.join(out, "compare.json"), "w") as fh:
        json.dump({**meta, "records": records, "summary": summary}, fh, indent=1)
    md = markdown(summary, meta)
    with open(os.path.join(out, "compare.md"), "w") as fh:
        fh.write(md + "\n")
    print(md, flush=True)
    failed = [f"{r['side']}-{r['run']}" for r in records if r["rc"] != 0 or "error" in r]
    if failed:
        print(f"[compare] failed runs: {', '.join(failed)} (their log.txt)", flush=True)
    return 1 if failed or not summary else 0


if __name__ == "__main__":
    sys.exit(main())
