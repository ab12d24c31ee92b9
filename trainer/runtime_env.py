"""The process environment the trainer needs before torch initialises CUDA: the caching
allocator's configuration and a persistent compile cache. Standard library only (the
controller renders the same values into the start script; ``python -m trainer`` applies them
itself when they are unset, so a hand-started run gets them too).

Allocator. ``expandable_segments:True``: one mapped address range per stream that grows in
pages, so a freed block of any size can be reused by any later request that fits and free
pages are unmapped again when the GPU runs short. The default allocator keeps one segment
per large request; at a 450,560-token budget it held 26 GiB reserved but unallocated and
died at step 2 on an H200, where the same run with expandable segments trained.
trainer/plan/memory.py models both (``ALLOCATORS``).

Compile cache. torch.compile's Inductor and Triton caches default to /tmp, which a container
restart empties: every relaunch then recompiled for 60-120 s. They are kept under
``DFLASH_COMPILE_CACHE`` (the start script sets ``<workspace>/.dflash-ctl/compile-cache``;
by hand: ``~/.cache/dflash-ctl/compile-cache``), in one directory per env generation, so a
rollback to another torch never loads kernels built by this one (a generation that compiles
the same as its parent starts with the parent's entries, and a node can be given another's:
agent/compilecache.py). flash-attn-4's CuTe kernels
(``--attention-kernel flash``) keep no disk cache unless asked: each new process compiled them
again, 17-29 s of a relaunch's first step on an H200 (docs/benchmarks.md); their
persistent cache is switched on and kept beside Inductor's (measured: a relaunch's first step
28.6 -> 11.1 s, Qwen3-8B). The generation is
``DFLASH_ENV_GENERATION`` when the start script found the venv to be a generation link
(agent/envgen.py), else the same fingerprint id computed from this interpreter's packages.
"""

from __future__ import annotations

import os
import sys
from typing import MutableMapping

from agent import compilecache

ENV_ALLOC = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_CONF = "expandable_segments:True"
ENV_CACHE_ROOT = "DFLASH_COMPILE_CACHE"
ENV_GENERATION = "DFLASH_ENV_GENERATION"
# The cache's layout has its home in agent/compilecache.py, which also ships it between containers.
ENV_INDUCTOR, ENV_TRITON, ENV_FLASH_CACHE_DIR = (key for key, _ in compilecache.KINDS)
# flash-attn-4 (flash_attn/cute/cache_utils.py) reads this and its cache directory when it is imported
ENV_FLASH_CACHE_ON = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"
WORKSPACE_CACHE = compilecache.WORKSPACE_CACHE  # under the container's workspace (controller/render.py)


def interpreter_generation() -> str:
    """This interpreter's env fingerprint id (agent/envfp.py: python version, installed
    distributions and torch build) — the id its venv generation has."""
    from agent import envfp

    # Taken by the interpreter itself in isolated mode, as agent/envgen.py takes a venv's: the
    # running process's sys.path (PYTHONPATH, a checkout with its egg-info, paths a caller
    # added) would name other distributions and give another id than the generation's.
    try:
        return envfp.of_python(sys.executable)["id"]
    except envfp.FingerprintError:
        return envfp.collect()["id"]


def env_generation(environ: MutableMapping[str, str] = os.environ) -> str:
    gen = environ.get(ENV_GENERATION, "").strip()
    return gen if compilecache.generation_id_ok(gen) else interpreter_generation()


def cache_root(environ: MutableMapping[str, str] = os.environ) -> str:
    root = environ.get(ENV_CACHE_ROOT, "").strip()
    if root:
        return root
    base = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dflash-ctl", "compile-cache")


def apply(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set what is unset (an operator's own value always wins); returns what was set. Call
    before torch is imported."""
    done = {}
    if ENV_ALLOC not in environ:
        environ[ENV_ALLOC] = done[ENV_ALLOC] = ALLOC_CONF
    if ENV_FLASH_CACHE_ON not in environ:
        environ[ENV_FLASH_CACHE_ON] = done[ENV_FLASH_CACHE_ON] = "1"
    if any(key not in environ for key, _ in compilecache.KINDS):
        gen_dir = compilecache.generation_dir(cache_root(environ), env_generation(environ))
        for key, sub in compilecache.KINDS:
            if key not in environ:
                environ[key] = done[key] = os.path.join(gen_dir, sub)
    return done


if __name__ == "__main__":
    # `python -m trainer.runtime_env`: the values a trainer started here with this environment
    # would run under (the compile cache's directories above all), as JSON
    import json

    env = dict(os.environ)
    apply(env)
    print(json.dumps({key: env[key] for key in (ENV_ALLOC, ENV_FLASH_CACHE_ON, *(k for k, _ in compilecache.KINDS))},
                     indent=1))
