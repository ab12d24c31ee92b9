"""Where a drafter step's GPU sits idle, and what the host was doing meanwhile.

kernel_profile.py counts a step's idle time (its span on the GPU clock minus the union of its
kernels) as one class, "idle / host gaps": 100-130 ms of a 3.6 s DFlash step on an H100, the
third largest loss. This says where it lies: one step of the operators' shape (the same
profiled step as op_sources.py) written as a Chrome trace, every gap between one GPU activity
(kernel, copy, fill) and the next longer than ``--min-gap-us``, and for each gap

* ``late launch``: the next kernel was launched after the GPU had gone idle, so the host was
  the bottleneck; the gap goes to the operator that launched it (its innermost CPU op, its
  autograd node, its innermost trainer/ frames), and the host calls that ran in the gap on
  that thread are listed;
* ``sync``: the host waited on the GPU (a synchronize or a device-to-host copy overlapping
  the gap): the gap goes to what asked for the wait;
* ``queued``: the next kernel had been launched before the gap began (the GPU waited on
  something else: an event, another stream).

Gaps are grouped by (kind, where) and ranked by their total. What it prints is a map for the
next change, not a figure to report.

    PYTHONUNBUFFERED=1 python3 bench/drafter_step/idle_sources.py --out DIR [--arch dflash] [--attention-kernel flash]
    python3 bench/drafter_step/idle_sources.py --smoke --out /tmp/is     # the same on CPU: no GPU, no gaps

Writes DIR/idle_sources.txt (the table), DIR/idle_sources.json and DIR/trace.json.gz.
"""

from __future__ import annotations

import bisect
import gzip
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync", "cuStreamSynchronize", "cuCtxSynchronize")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")

from bench.drafter_step.op_sources import AUTOGRAD, profile_for, step_parser, trainer_frames, write_outputs  # noqa: E402


class _Thread:
    """One host thread's CPU ops and Python frames, sorted by start, to find what enclosed a
    moment and what ran during an interval."""

    def __init__(self, events: list[dict]):
        self.events = sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0)))
        self.starts = [e["ts"] for e in self.events]

    def enclosing_many(self, moments: list[float]) -> dict:
        """For each moment, the events that contain it, outermost first: one sweep with a stack
        of open events (a thread's ops and frames nest)."""
        out, stack, i = {}, [], 0
        for t in sorted(set(moments)):
            while i < len(self.events) and self.events[i]["ts"] <= t:
                e = self.events[i]
                while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) < e["ts"]:
                    stack.pop()
                stack.append(e)
                i += 1
            out[t] = [e for e in stack if e["ts"] + e.get("dur", 0) >= t]
        return out

    def during(self, lo: float, hi: float) -> list[dict]:
        """CPU ops (not Python frames) that started in [lo, hi)."""
        i, j = bisect.bisect_left(self.starts, lo), bisect.bisect_left(self.starts, hi)
        return [e for e in self.events[i:j] if e.get("cat") == "cpu_op"]


def where(enclosing: list[dict]) -> str:
    """``op [in autograd node] @ trainer frames`` for a launch's enclosing events."""
    ops = [e["name"] for e in enclosing if e.get("cat") == "cpu_op" and not e["name"].startswith("autograd::")]
    nodes = [e["name"][len(AUTOGRAD):].strip() for e in enclosing
             if e.get("cat") == "cpu_op" and e["name"].startswith(AUTOGRAD)]
    stack = [e["name"] for e in reversed(enclosing) if e.get("cat") == "python_function"]
    op = ops[-1] if ops else "(no op)"
    return f"{op}{' in ' + nodes[-1] if nodes else ''} @ {trainer_frames(stack)}"


def analyze(trace: dict, min_gap_us: float = 5.0) -> dict:
    """The gaps of ``trace`` (a Chrome trace's dict) between GPU activities on one device,
    classified and grouped; times in µs."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    by_corr = {}
    for e in events:
        if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {}):
            by_corr[e["args"]["correlation"]] = e
    threads: dict = {}
    for e in events:
        if e.get("cat") in ("cpu_op", "python_function"):
            threads.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    threads = {k: _Thread(v) for k, v in threads.items()}
    syncs_by_end = sorted((e for e in events if e.get("cat") in LAUNCH_CATS and e["name"].startswith(SYNC_CALLS)),
                          key=lambda e: e["ts"] + e.get("dur", 0))
    sync_ends = [e["ts"] + e.get("dur", 0) for e in syncs_by_end]
    # the gaps, each with what it is charged to: (lo, hi, kind, thread key, moment, name)
    found, end = [], None
    for k in gpu:
        if end is not None and k["ts"] - end > min_gap_us:
            lo, hi = end, k["ts"]
            launch = by_corr.get(k.get("args", {}).get("correlation"))
            j = bisect.bisect_left(sync_ends, lo)  # the syncs still running when the gap began
            sync = next((s for s in syncs_by_end[j:] if s["ts"] < hi
                         and min(hi, s["ts"] + s.get("dur", 0)) - max(s["ts"], lo) > (hi - lo) / 2), None)
            if sync is not None:
                found.append((lo, hi, "sync", (sync.get("pid"), sync.get("tid")), sync["ts"], sync["name"]))
            elif launch is not None and launch["ts"] >= lo:
                found.append((lo, hi, "late launch", (launch.get("pid"), launch.get("tid")), launch["ts"],
                              launch["name"]))
            else:
                found.append((lo, hi, "queued", None, None, k["name"][:80]))
        end = max(end or 0.0, k["ts"] + k.get("dur", 0))
    chains = {key: th.enclosing_many([f[4] for f in found if f[3] == key]) for key, th in threads.items()}
    groups: dict = {}
    total = 0.0
    for lo, hi, kind, key, moment, name in found:
        th = threads.get(key)
        place = where(chains[key][moment]) if th is not None else name
        g = groups.setdefault((kind, place), {"kind": kind, "where": place, "us": 0.0, "gaps": 0, "host": {}})
        g["us"] += hi - lo
        g["gaps"] += 1
        if kind == "late launch" and th is not None:
            for e in th.during(lo, moment):
                g["host"][e["name"]] = g["host"].get(e["name"], 0) + 1
        total += hi - lo
    n_gaps = len(found)
    ranked = sorted(groups.values(), key=lambda g: -g["us"])
    for g in ranked:
        g["host"] = [n for n, _ in sorted(g["host"].items(), key=lambda kv: -kv[1])[:4]]
    span = (end - gpu[0]["ts"]) if gpu else 0.0
    return {"span_us": span, "gap_us": total, "gaps": n_gaps, "min_gap_us": min_gap_us, "rows": ranked}


def table(result: dict, top: int) -> str:
    lines = [f"Gaps over {result['min_gap_us']:g} µs: {result['gaps']}, {result['gap_us'] / 1e3:.1f} ms of a "
             f"{result['span_us'] / 1e3:.1f} ms span.", "",
             "| kind | where (op, autograd node, trainer/ frames) | ms | gaps | host ran meanwhile |",
             "| --- | --- | --- | --- | --- |"]
    for g in result["rows"][:top]:
        lines.append(f"| {g['kind']} | {g['where']} | {g['us'] / 1e3:.2f} | {g['gaps']} | {', '.join(g['host'])} |")
    return "\n".join(lines)


def main() -> int:
    p = step_parser(__doc__, 40)
    p.add_argument("--min-gap-us", type=float, default=5.0)
    a = p.parse_args()
    prof = profile_for(p, a)
    os.makedirs(a.out, exist_ok=True)
    raw = os.path.join(a.out, "trace.json")
    prof.export_chrome_trace(raw)
    with open(raw) as fh:
        trace = json.load(fh)
    with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
        dst.write(src.read())
    os.remove(raw)
    result = analyze(trace, a.min_gap_us)
    write_outputs(a, "idle_sources", result, table(result, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
