"""What shipping a compile cache costs (`ctl env cache export` on one node, `import` on another),
against the first-step compile it spares (34-89 s on an H200: docs/benchmarks.md).

    python3 bench/compile_cache/ship.py --mib 256 --runs 3              # pack and unpack here
    python3 bench/compile_cache/ship.py --mib 256 --runs 3 --sim 200    # and through ctl over the sim node

The cache is synthetic, since this machine has no GPU to fill a real one: files of 64 KiB to
4 MiB, half incompressible bytes (cubins and shared objects compress little) and half
repetitive Python source (Inductor's generated kernels), laid out as
``gen-<id>/{inductor,triton}/…``. Each run packs it with ``python3 -m agent.compilecache``
(the system python, as in a container), unpacks the archive into an empty workspace, and,
with ``--sim CT``, exports it from that container of the simulated node and imports it back
(after the container's cache has been cleared). Figures: median seconds and MiB/s over the
runs, the archive's size. Prints one JSON line per run, then a summary table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from agent import compilecache as cc  # noqa: E402
from agent import genstore  # noqa: E402
from agent.protocol import extract_payload  # noqa: E402

SOURCE = ("@triton.jit\ndef triton_poi_fused_add_mul_silu_{i}(in_ptr0, in_ptr1, out_ptr0, xnumel, XBLOCK: tl.constexpr):\n"
          "    xoffset = tl.program_id(0) * XBLOCK\n    xindex = xoffset + tl.arange(0, XBLOCK)[:]\n"
          "    tmp0 = tl.load(in_ptr0 + (xindex), None).to(tl.float32)\n    tl.store(out_ptr0 + (xindex), tmp0, None)\n")


def make_cache(root: str, gen: str, mib: int, seed: int = 0) -> int:
    """Files under root/gen-<gen>/ adding up to ``mib`` MiB; their count."""
    rnd = random.Random(seed)
    left, n = mib << 20, 0
    while left > 0:
        size = min(left, rnd.choice((64 << 10, 256 << 10, 1 << 20, 4 << 20)))
        kind = "triton" if n % 2 else "inductor"
        path = os.path.join(cc.generation_dir(root, gen), kind, f"{n % 97:02x}", f"entry{n}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if n % 2:
            data = rnd.randbytes(size)
        else:
            text = "".join(SOURCE.format(i=i) for i in range(size // len(SOURCE) + 1)).encode()
            data = text[:size]
        with open(path, "wb") as fh:
            fh.write(data)
        left -= size
        n += 1
    return n


def agent(workspace: str, venv: str, *args: str) -> dict:
    r = subprocess.run(["python3", "-m", "agent.compilecache", "--workspace", workspace, "--venv", venv, *args],
                       env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, check=True)
    return extract_payload(r.stdout)


def ctl(*args: str) -> subprocess.CompletedProcess:
    ctl_bin = os.path.join(os.path.dirname(sys.executable), "ctl")
    r = subprocess.run([ctl_bin, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"ctl {' '.join(args)}: {r.stderr}")
    return r


def one_run(mib: int, sim: int | None, gen: str, sim_gen: str | None, venv: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="ccship-") as tmp:
        src_ws, dst_ws = os.path.join(tmp, "src"), os.path.join(tmp, "dst")
        src_root = cc.root_of(src_ws)
        files = make_cache(src_root, gen, mib)
        archive = os.path.join(tmp, "c.tar.gz")
        t = time.perf_counter()
        agent(src_ws, venv, "pack", "--out", archive)
        pack_s = time.perf_counter() - t
        t = time.perf_counter()
        got = agent(dst_ws, venv, "unpack", archive)
        unpack_s = time.perf_counter() - t
        assert got["added"] == files, got
        out = {"mib": mib, "files": files, "archive_mib": os.path.getsize(archive) / 2**20,
               "pack_s": pack_s, "unpack_s": unpack_s}
        if sim is not None:
            # the same files as the container's generation (its python is not this one)
            os.rename(cc.generation_dir(src_root, gen), cc.generation_dir(src_root, sim_gen))
            agent(src_ws, venv, "pack", "--generation", sim_gen, "--out", archive + ".sim")
            ctl("exec", "-c", str(sim), "--", "rm", "-rf", f"/workspace/{cc.WORKSPACE_CACHE}")
            t = time.perf_counter()
            ctl("env", "cache", "import", archive + ".sim", "--container", str(sim))
            out["import_s"] = time.perf_counter() - t
            t = time.perf_counter()
            ctl("env", "cache", "export", "--container", str(sim), "--out", os.path.join(tmp, "back.tar.gz"))
            out["export_s"] = time.perf_counter() - t
            ctl("exec", "-c", str(sim), "--", "rm", "-rf", f"/workspace/{cc.WORKSPACE_CACHE}")
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sim", type=int, help="also export/import through ctl with this container of the sim node")
    a = ap.parse_args()
    venv = sys.prefix
    gen = genstore.fingerprint(venv)["id"]
    sim_gen = None
    if a.sim is not None:
        sim_gen = json.loads(ctl("env", "cache", "list", "--container", str(a.sim), "--json").stdout)["current"]
    runs = []
    for _ in range(a.runs):
        runs.append(one_run(a.mib, a.sim, gen, sim_gen, venv))
        print(json.dumps(runs[-1]), flush=True)
    keys = [k for k in ("pack_s", "unpack_s", "import_s", "export_s") if k in runs[0]]
    print(f"\n{a.mib} MiB, {runs[0]['files']} files, archive {runs[0]['archive_mib']:.0f} MiB; median of {a.runs} runs")
    print("| step | seconds | MiB/s (unpacked) |\n| --- | --- | --- |")
    for k in keys:
        med = statistics.median(r[k] for r in runs)
        print(f"| {k[:-2]} | {med:.2f} | {a.mib / med:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
