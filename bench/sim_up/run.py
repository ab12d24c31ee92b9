"""How long `up` of the simulated node takes, cold and warm (docs/benchmarks.md, "Simulated node").

    .venv/bin/python bench/sim_up/run.py            # warm cases, median of --runs
    .venv/bin/python bench/sim_up/run.py --cold     # also one cold run: empty cache and state
                                                # (debootstrap needs the Debian mirror)

Uses a node of its own ("simbench", containers 280/281) so the shared node "sim" is never
touched; the cold run uses a scratch cache and state directory, removed afterwards. Run as root.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sim.layout import CACHE_ENV, DIR_ENV  # noqa: E402
from sim.node import SimNode  # noqa: E402

NAME, CTIDS = "simbench", (280, 281)


def timed(fn) -> float:
    started = time.monotonic()
    fn()
    return time.monotonic() - started


def load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def cold() -> float:
    scratch = Path(tempfile.mkdtemp(prefix="simbench-", dir="/var/tmp"))
    saved = {k: os.environ.get(k) for k in (CACHE_ENV, DIR_ENV)}
    os.environ[CACHE_ENV], os.environ[DIR_ENV] = str(scratch / "cache"), str(scratch / "state")
    try:
        node = SimNode(NAME, ctids=CTIDS)
        seconds = timed(node.up)
        node.down(purge=True)
        return seconds
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cold", action="store_true")
    args = ap.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}: {os.cpu_count()} cores, "
          f"load average {load()} at start")
    if args.cold:
        print(f"cold (empty cache and state): {cold():.1f} s")
    node = SimNode(NAME, ctids=CTIDS)
    node.up()  # make sure the cache exists
    node.down(purge=True)
    fresh, restart, noop = [], [], []
    for _ in range(args.runs):
        fresh.append(timed(node.up))
        node.down(purge=True)
    node.up()
    for _ in range(args.runs):
        node.down()
        restart.append(timed(node.up))
    for _ in range(args.runs):
        noop.append(timed(node.up))
    node.down(purge=True)
    for label, values in (("new node, warm cache (copies the rootfs twice)", fresh),
                          ("after `down`, warm cache and node state", restart),
                          ("already up (no-op)", noop)):
        print(f"{label}: median {statistics.median(values):.2f} s of {[round(v, 2) for v in values]}")
    print(f"load average {load()} at end")


if __name__ == "__main__":
    main()
