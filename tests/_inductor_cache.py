"""One torch.compile in a fresh process, with its compile cache where the trainer puts it
(trainer/runtime_env.py: ``DFLASH_COMPILE_CACHE``/gen-<id>/…): the real Inductor cache the
compile-cache tests fill, move and read. CPU Inductor needs a C++ compiler; without one the
test is skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parent.parent)

COMPILE = """
import json, os
from trainer import runtime_env
runtime_env.apply()
import torch
from trainer.train import compile_stats

@torch.compile(dynamic=False)
def f(x):
    return (x.float() * 2).sin().to(x.dtype)

f(torch.randn(16, 16))
print(json.dumps({**compile_stats(), "dir": os.environ["TORCHINDUCTOR_CACHE_DIR"]}))
"""


def compile_once(cache_root: Path | str, generation: str) -> dict:
    """compile_stats() of the process (hits, misses) and its Inductor cache directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR", "TRITON", "DFLASH_ENV"))}
    env.update({"DFLASH_COMPILE_CACHE": str(cache_root), "DFLASH_ENV_GENERATION": generation, "PYTHONPATH": ROOT})
    r = subprocess.run([sys.executable, "-c", COMPILE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and "compiler" in r.stderr.lower():
        pytest.skip("no C++ compiler for torch.compile on CPU here")
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
