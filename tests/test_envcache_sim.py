"""`ctl env cache` on the simulated node: a venv generation's compile cache carried from one
container to another through the operator's own commands, over real SSH and `pct exec`, and
refused with nothing changed where it could not help.

The containers have no C++ compiler (torch.compile on CPU needs one), so the cache is
compiled here, for the containers' generation, by the same torch version, packed by the
agent, and then goes controller → container 200 → controller → container 201 → controller.
What comes back is byte for byte what was compiled, and a fresh process that reads it
compiles nothing. That the trainer in a container looks exactly where the import puts it is
asked of the trainer's own code in the container (``python -m trainer.runtime_env`` with the
start script's environment)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

import _ctl_subprocess as C
from _ctl_subprocess import ctl, sh
from agent import compilecache as cc
from agent import genstore
from _inductor_cache import compile_once

pytestmark = [pytest.mark.sim]

CT_A, CT_B = 200, 201
WORKSPACE = "/workspace"
CACHE_ROOT = f"{WORKSPACE}/{cc.WORKSPACE_CACHE}"
ROOT = str(C.REPO)

@pytest.fixture(scope="module")
def env(sim_node, ctl_config, tmp_path_factory):
    env = C.no_torch_env(ctl_config, tmp_path_factory.mktemp("no-torch"))
    for ct in (CT_A, CT_B):
        sh(env, "rm", "-rf", CACHE_ROOT, ct=ct)
    yield env
    for ct in (CT_A, CT_B):  # the node is shared: leave no cache behind
        sh(env, "rm", "-rf", CACHE_ROOT, ct=ct)


def _listing(env, ct: int) -> dict:
    p = ctl(env, "env", "cache", "list", "--container", ct, "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def _members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive, "r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()[1:] if m.isfile()}


def _trainer_looks_in(ct_id: int, env) -> dict:
    """The compile-cache directories a trainer started by the start script in that container
    would use: the trainer's own code, run there with the start script's environment."""
    from controller import config as cfg
    from controller.agentcall import AgentCaller
    from controller.container import Container
    from controller.render import start_env
    from controller.session import open_runner
    from trainer import runtime_env

    name, node = cfg.load(env["DFLASH_CTL_CONFIG"]).node()
    with open_runner(name, node) as runner:
        ct = Container(runner, name, node, ct_id)
        root = start_env(ct.config, bundle="/unused", run_id="x", run_dir="/unused")[runtime_env.ENV_CACHE_ROOT]
        assert root == CACHE_ROOT
        got = AgentCaller(ct, env={runtime_env.ENV_CACHE_ROOT: root}).run("trainer.runtime_env")
        assert got.ok, got.stderr
        return json.loads(got.stdout)


def _launch_preflight_sees(ct_id: int, env) -> dict:
    """The compile cache a GPU launch's preflight (agent/preflight.py, in the container) reports."""
    from controller import config as cfg
    from controller.agentcall import AgentCaller
    from controller.container import Container
    from controller.session import open_runner

    name, node = cfg.load(env["DFLASH_CTL_CONFIG"]).node()
    with open_runner(name, node) as runner:
        ct = Container(runner, name, node, ct_id)
        request = {"workspace": WORKSPACE, "run_id": "cache-probe", "start": {"kind": "scratch"},
                   "flags": {"device": "auto", "target_gpus": [0], "drafter_gpus": [0]}}
        return AgentCaller(ct).call("agent.preflight", ["check"], request=request)["compile_cache"]


def test_a_compile_cache_goes_from_container_to_container_and_lands_where_the_trainer_looks(env, tmp_path):
    gen = _listing(env, CT_A)["current"]
    assert gen and _listing(env, CT_B)["current"] == gen  # one rootfs, one venv: one generation
    assert _listing(env, CT_A)["generations"] == []
    looks = _trainer_looks_in(CT_A, env)
    assert looks["TORCHINDUCTOR_CACHE_DIR"] == f"{CACHE_ROOT}/gen-{gen}/inductor"
    assert looks["TRITON_CACHE_DIR"] == f"{CACHE_ROOT}/gen-{gen}/triton"
    assert _launch_preflight_sees(CT_A, env) == {"generation": gen, "dir": f"{CACHE_ROOT}/gen-{gen}", "files": 0, "bytes": 0}

    # a real Inductor cache of that generation, made here and packed by the agent
    seed_ws = tmp_path / "seed-ws"
    cold = compile_once(Path(cc.root_of(str(seed_ws))), gen)
    assert cold["compile_cache_misses"] >= 1
    seed = tmp_path / "seed.tar.gz"
    packed = subprocess.run(["python3", "-m", "agent.compilecache", "--workspace", str(seed_ws), "--venv", sys.prefix,
                             "pack", "--generation", gen, "--out", str(seed)],
                            env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=300)
    assert packed.returncode == 0, packed.stdout + packed.stderr

    imported = ctl(env, "env", "cache", "import", seed, "--container", CT_A)
    assert imported.returncode == 0, imported.stderr
    files = len(_members(seed))
    assert f"gained {files} entries (0 were there already)" in imported.stdout
    (entry,) = _listing(env, CT_A)["generations"]
    assert entry["generation"] == gen and entry["current"] and entry["files"] == files
    seen = _launch_preflight_sees(CT_A, env)  # and the next GPU launch there is told so
    assert seen["generation"] == gen and seen["files"] == files

    from_a = tmp_path / "from-a.tar.gz"
    exported = ctl(env, "env", "cache", "export", "--container", CT_A, "--out", from_a)
    assert exported.returncode == 0, exported.stderr
    assert f"generation {gen}, {files} files" in exported.stdout
    assert sorted(os.listdir(tmp_path)) == ["from-a.tar.gz", "seed-ws", "seed.tar.gz"]  # no part file left

    assert ctl(env, "env", "cache", "import", from_a, "--container", CT_B).returncode == 0
    from_b = tmp_path / "from-b.tar.gz"
    assert ctl(env, "env", "cache", "export", "--container", CT_B, "--out", from_b).returncode == 0
    assert _members(from_b) == _members(seed)  # two round trips, byte for byte

    # what came back, read by a fresh process: every graph loads, none compiles
    final = tmp_path / "final" / f"gen-{gen}"
    for name, data in _members(from_b).items():
        path = final / name.split("/", 1)[1]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    warm = compile_once(tmp_path / "final", gen)
    assert warm["compile_cache_hits"] >= 1 and warm["compile_cache_misses"] == 0, warm

    again = ctl(env, "env", "cache", "import", from_a, "--container", CT_B)
    assert again.returncode == 0 and f"gained 0 entries ({files} were there already)" in again.stdout


def test_what_cannot_help_is_refused_before_or_with_nothing_changed(env, tmp_path):
    for ct in (CT_A, CT_B):
        sh(env, "rm", "-rf", CACHE_ROOT, ct=ct)
    # another compile stack's cache: this machine's own venv (another python), packed by the agent
    own = genstore.fingerprint(sys.prefix)["id"]
    ws = tmp_path / "ws"
    kernel = Path(cc.generation_dir(cc.root_of(str(ws)), own)) / "triton" / "K" / "k.cubin"
    kernel.parent.mkdir(parents=True)
    kernel.write_bytes(b"\x7fELF")
    other = tmp_path / "other.tar.gz"
    assert subprocess.run(["python3", "-m", "agent.compilecache", "--workspace", str(ws), "--venv", sys.prefix, "pack",
                           "--out", str(other)], env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True).returncode == 0
    gen = _listing(env, CT_A)["current"]
    p = ctl(env, "env", "cache", "import", other, "--container", CT_A)
    assert p.returncode == 3 and "refused" in p.stderr and own in p.stderr and f"generation {gen}" in p.stderr, p.stderr
    assert "its compile stack differs: python " in p.stderr  # this machine's python is not the container's
    assert _listing(env, CT_A)["generations"] == []

    # an empty cache has nothing to export, and no file is left behind
    out = tmp_path / "empty.tar.gz"
    p = ctl(env, "env", "cache", "export", "--container", CT_A, "--out", out)
    assert p.returncode == 3 and "is empty: nothing has compiled there yet" in p.stderr, p.stderr
    assert sorted(os.listdir(tmp_path)) == ["other.tar.gz", "ws"]

    # refused before connecting: an existing --out, a file that is no archive, a bad generation
    p = ctl(env, "env", "cache", "export", "--container", CT_A, "--out", other)
    assert p.returncode == 2 and "exists; name a new file or pass --force" in p.stderr
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"junk")
    p = ctl(env, "env", "cache", "import", junk, "--container", CT_A)
    assert p.returncode == 2 and "is not a compile-cache archive" in p.stderr
    p = ctl(env, "env", "cache", "export", "--container", CT_A, "--out", out, "--generation", "../../etc")
    assert p.returncode == 2 and "is not a generation id" in p.stderr
    assert "Traceback" not in p.stderr


def _interrupted(env, pause: Path, point: str, *args) -> tuple[int, str]:
    """`ctl *args` stopped by SIGINT once it reaches ``point`` (controller/interrupts.py);
    the paused place is never let go: the process ends on the signal."""
    pause.mkdir()
    proc = subprocess.Popen([*C.CTL, *map(str, args)], env={**env, "DFLASH_CTL_PAUSE_AT": point,
                                                            "DFLASH_CTL_PAUSE_DIR": str(pause)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not (pause / f"{point}.reached").exists():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def test_ctrl_c_while_an_archive_is_sent_leaves_the_cache_as_it_was_and_the_same_command_completes_it(env, tmp_path):
    for ct in (CT_A, CT_B):
        sh(env, "rm", "-rf", CACHE_ROOT, ct=ct)
    gen = _listing(env, CT_A)["current"]
    ws = tmp_path / "ws"
    for i in range(8):  # incompressible: the archive takes many chunks to send
        path = Path(cc.generation_dir(cc.root_of(str(ws)), gen)) / "triton" / f"K{i}" / "k.cubin"
        path.parent.mkdir(parents=True)
        path.write_bytes(os.urandom(1 << 19))
    archive = tmp_path / "c.tar.gz"
    assert subprocess.run(["python3", "-m", "agent.compilecache", "--workspace", str(ws), "--venv", sys.prefix, "pack",
                           "--generation", gen, "--out", str(archive)],
                          env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True).returncode == 0
    code, err = _interrupted(env, tmp_path / "pause", "cache.import.sending",
                             "env", "cache", "import", archive, "--container", CT_A)
    assert code == 130 and "Traceback" not in err, err
    assert "interrupted: container 200's compile cache holds what it held" in err
    # the container refuses the cut archive and removes what it staged
    for _ in range(300):
        left = sh(env, "ls", "-A", CACHE_ROOT, ct=CT_A, check=False).split()
        if not [n for n in left if n.startswith(cc.IMPORT_PREFIX)]:
            break
        time.sleep(0.1)
    assert not [n for n in left if n.startswith(cc.IMPORT_PREFIX)], left
    assert _listing(env, CT_A)["generations"] == []
    again = ctl(env, "env", "cache", "import", archive, "--container", CT_A)
    assert again.returncode == 0 and "gained 8 entries (0 were there already)" in again.stdout, again.stderr

    # and Ctrl-C while that cache comes back: nothing is written here, no part file is left
    out = tmp_path / "back" / "c.tar.gz"
    out.parent.mkdir()
    code, err = _interrupted(env, tmp_path / "pause-export", "cache.export.receiving",
                             "env", "cache", "export", "--container", CT_A, "--out", out)
    assert code == 130 and "Traceback" not in err, err
    assert f"interrupted: nothing was written to {out}" in err
    assert os.listdir(out.parent) == []
