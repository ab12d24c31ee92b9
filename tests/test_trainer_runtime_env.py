"""What the trainer's process holds before torch starts CUDA (trainer/runtime_env.py): the
allocator configuration the memory model describes and a compile cache that outlives the
process, per env generation — checked with real processes, a real venv and real compiles."""

from __future__ import annotations

import os
import subprocess
import sys

from agent import genstore
from trainer import runtime_env

from _inductor_cache import compile_once

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_apply_sets_what_is_unset_and_keeps_what_the_operator_set(tmp_path):
    env = {runtime_env.ENV_CACHE_ROOT: str(tmp_path / "cc"), runtime_env.ENV_GENERATION: "3f2a9c0d1b7e"}
    done = runtime_env.apply(env)
    assert env[runtime_env.ENV_ALLOC] == "expandable_segments:True"
    assert env[runtime_env.ENV_INDUCTOR] == str(tmp_path / "cc" / "gen-3f2a9c0d1b7e" / "inductor")
    assert env[runtime_env.ENV_TRITON] == str(tmp_path / "cc" / "gen-3f2a9c0d1b7e" / "triton")
    # flash-attn-4's own kernel cache, off by default there: on, beside Inductor's
    assert env["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    assert env["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == str(tmp_path / "cc" / "gen-3f2a9c0d1b7e" / "flash-attn-cute")
    assert set(done) == {runtime_env.ENV_ALLOC, runtime_env.ENV_INDUCTOR, runtime_env.ENV_TRITON,
                         "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"}
    mine = {runtime_env.ENV_ALLOC: "max_split_size_mb:256", runtime_env.ENV_INDUCTOR: "/mine",
            runtime_env.ENV_TRITON: "/mine-too", "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "0",
            "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "/mine-three", "HOME": str(tmp_path)}
    assert runtime_env.apply(mine) == {} and mine[runtime_env.ENV_ALLOC] == "max_split_size_mb:256"
    assert mine["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "0"


def test_without_the_start_script_the_generation_is_this_interpreters_fingerprint(tmp_path):
    """By hand (no DFLASH_ENV_GENERATION, or a malformed one) the cache is keyed by the same
    id agent/genstore.py gives this venv as a generation, under ~/.cache."""
    venv = os.path.dirname(os.path.dirname(sys.executable))
    assert runtime_env.interpreter_generation() == genstore.fingerprint(venv)["id"]
    env = {"HOME": str(tmp_path), runtime_env.ENV_GENERATION: "../../etc"}
    runtime_env.apply(env)
    gen = genstore.fingerprint(venv)["id"]
    assert env[runtime_env.ENV_INDUCTOR] == str(tmp_path / ".cache/dflash-ctl/compile-cache" / f"gen-{gen}" / "inductor")


def test_python_m_trainer_sets_them_before_torch_and_reports_them_in_the_first_step(tmp_path):
    from tests._trainer_tiny import base_args, events, tiny_setup

    target, data = tiny_setup(str(tmp_path))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTORCH_CUDA_ALLOC", "TORCHINDUCTOR", "TRITON",
                                                                      "DFLASH_"))}
    env.update(HOME=str(tmp_path / "home"), PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "trainer", *base_args(target, data, str(tmp_path / "out")),
                        "--from-scratch", "--max-steps", "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    first, second = events(str(tmp_path / "out"), "step")
    gen = runtime_env.interpreter_generation()
    assert first["alloc_conf"] == "expandable_segments:True"
    assert first["compile_cache"] == str(tmp_path / "home/.cache/dflash-ctl/compile-cache" / f"gen-{gen}" / "inductor")
    assert first["compile_s"] == 0.0 and "compile_cache" not in second  # CPU runs compile nothing
    probe = "import sys, trainer.__main__; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env).returncode == 0


def _compile_once(tmp_path, generation: str) -> dict:
    return compile_once(tmp_path / "cache", generation)


def test_a_relaunch_loads_its_kernels_from_the_cache_and_another_generation_does_not(tmp_path):
    """Every launch used to recompile (the cache lived in /tmp). Three processes: the first
    compiles into the cache of generation A, the second (a relaunch) finds everything there,
    the third runs as generation B — a rollback to another torch — and compiles its own."""
    cold = _compile_once(tmp_path, "aaaaaaaaaaaa")
    warm = _compile_once(tmp_path, "aaaaaaaaaaaa")
    other = _compile_once(tmp_path, "bbbbbbbbbbbb")
    assert cold["compile_cache_misses"] >= 1 and cold["compile_cache_hits"] == 0
    assert warm["compile_cache_hits"] >= 1 and warm["compile_cache_misses"] == 0 and warm["dir"] == cold["dir"]
    assert other["compile_cache_misses"] >= 1 and other["compile_cache_hits"] == 0 and other["dir"] != cold["dir"]
    assert sorted(os.listdir(tmp_path / "cache")) == ["gen-aaaaaaaaaaaa", "gen-bbbbbbbbbbbb"]
