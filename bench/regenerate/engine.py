"""Benchmark: what `python -m trainer regenerate` itself costs per request, against a bare
httpx loop sending the same requests at the same concurrency.

The server is a real HTTP server (uvicorn, from the `serve` extra) answering every chat
completion at once with a fixed answer, so the figure is the job's own ceiling — reading rows,
building histories, retries machinery, appending and fsyncing the output, progress — not a
model's speed. The seed's generation ran at about 4 requests/s (192,995 prompts in 15.56 h), so
the engine only has to stay far above that. Runs alternate (regenerate, bare loop), median of
N each; the ratio is regenerate's requests/s over the bare loop's, from the same run.

    .venv/bin/python bench/regenerate/engine.py [--rows 3000] [--concurrency 64] [-n 3]

Figures go to docs/benchmarks.md under "Regenerate: the job's own overhead".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = "stub"
ANSWER = json.dumps({"id": "x", "object": "chat.completion", "model": MODEL,
                     "choices": [{"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": "An answer of a few words."}}],
                     "usage": {"prompt_tokens": 20, "completion_tokens": 7, "total_tokens": 27}}).encode()
MODELS = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()


async def app(scope, receive, send):
    """The stub server: an ASGI app with /health, /v1/models and /v1/chat/completions."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    body = {"/v1/models": MODELS, "/health": b"{}"}.get(scope["path"], ANSWER)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str) -> None:
    for _ in range(200):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("the stub server did not start")


def write_rows(path: str, n: int) -> None:
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"r{i}", "messages": [{"role": "system", "content": "Be brief."},
                                                            {"role": "user", "content": f"question {i} " * 20}]}) + "\n")


def run_regenerate(url: str, rows_path: str, concurrency: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "trainer", "regenerate", "--input", rows_path, "--out", out,
                        "--endpoint", url, "--concurrency", str(concurrency), "--max-tokens", "16"],
                       cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        return time.perf_counter() - started


def run_bare(url: str, rows_path: str, concurrency: int) -> float:
    """The same requests from a bare httpx loop (interpreter start and imports included, as for regenerate)."""
    code = f"""
import asyncio, json, httpx
async def main():
    rows = [json.loads(l) for l in open({rows_path!r})]
    sem = asyncio.Semaphore({concurrency})
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections={concurrency})) as c:
        async def one(r):
            async with sem:
                x = await c.post({url!r} + "/v1/chat/completions",
                                 json={{"model": {MODEL!r}, "messages": r["messages"], "max_tokens": 16}})
                x.json()["choices"][0]["message"]["content"]
        await asyncio.gather(*(one(r) for r in rows))
asyncio.run(main())
"""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - started


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("-n", type=int, default=3)
    p.add_argument("--stub-port", type=int, help=argparse.SUPPRESS)  # the server's own process
    args = p.parse_args()
    if args.stub_port:
        import uvicorn

        uvicorn.run(app, host="127.0.0.1", port=args.stub_port, log_level="warning", access_log=False)
        return 0
    load_before = os.getloadavg()[0]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, __file__, "--stub-port", str(port)])
    try:
        wait_up(url)
        with tempfile.TemporaryDirectory() as d:
            rows = os.path.join(d, "rows.jsonl")
            write_rows(rows, args.rows)
            run_bare(url, rows, args.concurrency)  # warm-up (page cache, server)
            regen, bare = [], []
            for _ in range(args.n):
                regen.append(run_regenerate(url, rows, args.concurrency))
                bare.append(run_bare(url, rows, args.concurrency))
    finally:
        server.terminate()
        server.wait()
    r, b = statistics.median(regen), statistics.median(bare)
    print(json.dumps({
        "machine": f"{platform.node()} ({os.cpu_count()} cores)", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_1min_before_after": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        "rows": args.rows, "concurrency": args.concurrency, "runs": args.n,
        "regenerate_s": [round(x, 2) for x in regen], "bare_s": [round(x, 2) for x in bare],
        "regenerate_req_per_s": round(args.rows / r, 1), "bare_req_per_s": round(args.rows / b, 1),
        "ratio": round(b / r, 3),
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
