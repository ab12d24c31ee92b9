"""agent/compilecache.py: a venv generation's compile cache packed on one machine and unpacked
on another loads there instead of compiling (a fresh machine's first step), and an
archive that could not help or could harm is refused with nothing changed.

The round trip is real: torch.compile on CPU (tests/_inductor_cache.py) fills the cache in one workspace, the agent
packs it with the system python (as in a container), the first workspace is deleted, the
archive is unpacked into another, and a fresh process there finds every graph."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from agent import compilecache as cc
from agent import genstore
from agent.protocol import extract_payload
from _inductor_cache import compile_once

ROOT = str(Path(__file__).resolve().parent.parent)
VENV = sys.prefix  # this interpreter's venv: its fingerprint is the generation the cache is for
FP = genstore.fingerprint(VENV)
GEN = FP["id"]

def _compile(workspace: Path) -> dict:
    return compile_once(cc.root_of(str(workspace)), GEN)


def agent(workspace: Path, *args: str, env: dict | None = None) -> tuple[int, dict]:
    """``python3 -m agent.compilecache`` on the system python, as the controller runs it."""
    r = subprocess.run(["python3", "-m", "agent.compilecache", "--workspace", str(workspace), "--venv", VENV, *args],
                       cwd="/", env={**os.environ, "PYTHONPATH": ROOT, **(env or {})}, capture_output=True,
                       text=True, timeout=300)
    try:
        return r.returncode, extract_payload(r.stdout)
    except Exception:  # noqa: BLE001 - a killed process has no reply; the caller looks at the code
        return r.returncode, {"stderr": r.stderr}


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under root, the cache root's lock file aside."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}


def test_a_cache_shipped_to_another_workspace_is_loaded_there_instead_of_compiled(tmp_path):
    a, b = tmp_path / "node-a", tmp_path / "node-b"
    cold = _compile(a)
    assert cold["compile_cache_misses"] >= 1 and cold["compile_cache_hits"] == 0
    code, packed = agent(a, "pack", "--out", str(tmp_path / "cache.tar.gz"))
    assert code == 0, packed
    manifest = packed["manifest"]
    assert manifest["generation"] == GEN and manifest["files"] >= 1 and manifest["kinds"]["inductor"]["files"] >= 1
    assert packed["bytes"] == os.path.getsize(tmp_path / "cache.tar.gz")
    original = _tree(Path(cc.generation_dir(cc.root_of(str(a)), GEN)))
    shutil.rmtree(a)  # the archive must not lean on the machine it came from

    code, got = agent(b, "unpack", str(tmp_path / "cache.tar.gz"))
    assert code == 0, got
    assert got["generation"] == GEN and got["added"] == manifest["files"] and got["present"] == 0
    gen_b = Path(cc.generation_dir(cc.root_of(str(b)), GEN))
    assert {k: v for k, v in _tree(gen_b).items() if k != "imported.json"} == {
        k: v for k, v in original.items() if not k.startswith(("inductor/locks",)) and not k.endswith((".lock", ".tmp"))}
    assert not [n for n in os.listdir(cc.root_of(str(b))) if n.startswith(cc.IMPORT_PREFIX)]

    warm = _compile(b)
    assert warm["compile_cache_hits"] >= 1 and warm["compile_cache_misses"] == 0, warm
    assert warm["dir"] == str(gen_b / "inductor")

    again = agent(b, "unpack", str(tmp_path / "cache.tar.gz"))[1]  # a second import adds nothing
    assert again["added"] == 0 and again["present"] == manifest["files"]
    listed = agent(b, "list")[1]
    (entry,) = listed["generations"]
    assert entry["generation"] == GEN and entry["current"] and entry["files"] >= manifest["files"]
    assert entry["imported_from"]["added"] == 0


def _cache_files(workspace: Path, gen: str = GEN, files: dict | None = None) -> Path:
    gen_dir = Path(cc.generation_dir(cc.root_of(str(workspace)), gen))
    for rel, data in (files or {"inductor/fxgraph/ab/entry": b"graph", "triton/KEY/k.cubin": b"\x7fELF",
                                "triton/KEY/k.json": b"{}", "triton/KEY/__grp__k.json": b"{}"}).items():
        (gen_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (gen_dir / rel).write_bytes(data)
    return gen_dir


def _archive(path: Path, manifest: dict | None, members: list[tuple[str, bytes, bytes]]) -> Path:
    """A hand-made archive: (name, type, data) members after an optional manifest."""
    with tarfile.open(path, "w:gz") as tar:
        if manifest is not None:
            doc = json.dumps(manifest).encode()
            info = tarfile.TarInfo(cc.MANIFEST)
            info.size = len(doc)
            tar.addfile(info, io.BytesIO(doc))
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind == tarfile.SYMTYPE:
                info.linkname = "/etc/passwd"
            else:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
    return path


GOOD_MANIFEST = {"format": cc.ARCHIVE_FORMAT, "generation": GEN, "gpus": [], "bytes": 1}


@pytest.mark.parametrize("manifest, members, words", [
    ({**GOOD_MANIFEST, "generation": "0123456789ab", "compile_key": "ffffffffffff",
      "compile_stack": {**cc.compile_stack(FP), "torch": {"version": "2.9.1", "build": "cu128"}}},
     [("cache/inductor/x", tarfile.REGTYPE, b"x")], ["generation 0123456789ab", f"generation {GEN}",
                                                     "its compile stack differs: torch 2.9.1 (cu128) → ",
                                                     "never look these entries up"]),
    ({**GOOD_MANIFEST, "generation": "0123456789ab"}, [("cache/inductor/x", tarfile.REGTYPE, b"x")],
     ["the archive does not say what it was compiled with"]),
    (GOOD_MANIFEST, [("cache/inductor/../../../../etc/evil", tarfile.REGTYPE, b"x")], ["not a plain relative path"]),
    (GOOD_MANIFEST, [("/etc/evil", tarfile.REGTYPE, b"x")], ["not a plain relative path"]),
    (GOOD_MANIFEST, [("cache/bin/evil", tarfile.REGTYPE, b"x")], ["outside cache/<inductor|triton|flash-attn-cute>/"]),
    (GOOD_MANIFEST, [("cache/triton/link", tarfile.SYMTYPE, b"")], ["a link or a special file"]),
    (GOOD_MANIFEST, [("cache/triton/dev", tarfile.CHRTYPE, b"")], ["a link or a special file"]),
    (None, [("cache/inductor/x", tarfile.REGTYPE, b"x")], ["not a compile-cache archive"]),
    ({**GOOD_MANIFEST, "format": 99}, [], ["unknown archive format 99"]),
    (GOOD_MANIFEST, [("cache/inductor/x", tarfile.REGTYPE, b"x"), ("cache/inductor/y", tarfile.REGTYPE, b"y")],
     ["holds more than the 1 bytes its manifest declares"]),
    ({**GOOD_MANIFEST, "gpus": [{"name": "NVIDIA A100", "compute_cap": "8.0"}]},
     [("cache/triton/x", tarfile.REGTYPE, b"x")], ["compute capability 8.0 (NVIDIA A100)", "9.0 (NVIDIA H200)"]),
], ids=["other-stack", "unknown-stack", "dot-dot", "absolute", "other-kind", "symlink", "device", "no-manifest", "format",
        "more-than-declared", "other-gpu"])
def test_an_archive_that_cannot_help_or_could_harm_is_refused_with_nothing_changed(tmp_path, manifest, members, words):
    existing = _cache_files(tmp_path / "ws")
    before = _tree(existing.parent)
    archive = _archive(tmp_path / "bad.tar.gz", manifest, members)
    with pytest.raises(cc.Refused) as caught:
        cc.op_unpack(cc.root_of(str(tmp_path / "ws")), VENV, str(archive),
                     here_gpus=[{"name": "NVIDIA H200", "compute_cap": "9.0"}])
    for word in words:
        assert word in str(caught.value)
    assert _tree(existing.parent) == before
    assert not (tmp_path / "etc").exists()


def test_not_a_tar_and_a_missing_file_are_refused_by_name(tmp_path):
    (tmp_path / "x.tar.gz").write_bytes(b"not gzip")
    code, reply = agent(tmp_path / "ws", "unpack", str(tmp_path / "x.tar.gz"))
    assert code == 2 and reply["kind"] == "refused" and "is not a gzip'd tar" in reply["error"]
    code, reply = agent(tmp_path / "ws", "unpack", str(tmp_path / "nope.tar.gz"))
    assert code == 2 and "nope.tar.gz does not exist" in reply["error"]


def test_kernels_built_on_the_same_compute_capability_or_without_a_gpu_are_taken():
    h200, h100 = {"name": "NVIDIA H200", "compute_cap": "9.0"}, {"name": "NVIDIA H100 80GB HBM3", "compute_cap": "9.0"}
    assert cc.capability_problem([h200], [h100, h100]) is None
    assert cc.capability_problem([], [h100]) is None  # a CPU machine's Inductor graphs
    assert cc.capability_problem([h200], []) is None
    assert "8.0" in cc.capability_problem([h200], [{"name": "NVIDIA A100", "compute_cap": "8.0"}])
    # within one capability the kernels load, and what does not is said
    assert cc.model_note([h200], [h200]) is None and cc.model_note([], [h100]) is None
    assert "Inductor's graphs (keyed by the GPU's name) compile again" in cc.model_note([h200], [h100])


def test_an_import_onto_another_gpu_model_of_the_same_capability_is_taken_with_a_note(tmp_path):
    archive = _archive(tmp_path / "a.tar.gz", {**GOOD_MANIFEST, "gpus": [{"name": "NVIDIA H200", "compute_cap": "9.0"}]},
                       [("cache/triton/x", tarfile.REGTYPE, b"x")])
    got = cc.op_unpack(cc.root_of(str(tmp_path / "ws")), VENV, str(archive),
                       here_gpus=[{"name": "NVIDIA H100 80GB HBM3", "compute_cap": "9.0"}])
    assert got["added"] == 1 and got["gpu_mismatch"] is None and "NVIDIA H100 80GB HBM3" in got["gpu_note"]


def test_the_other_gpu_refusal_can_be_overridden_and_is_reported(tmp_path):
    archive = _archive(tmp_path / "a.tar.gz", {**GOOD_MANIFEST, "gpus": [{"name": "NVIDIA A100", "compute_cap": "8.0"}]},
                       [("cache/inductor/x", tarfile.REGTYPE, b"x")])
    got = cc.op_unpack(cc.root_of(str(tmp_path / "ws")), VENV, str(archive), force_gpu=True,
                       here_gpus=[{"name": "NVIDIA H200", "compute_cap": "9.0"}])
    assert got["added"] == 1 and "8.0" in got["gpu_mismatch"]


def test_pack_leaves_out_locks_and_temp_files_and_refuses_an_empty_cache(tmp_path):
    ws = tmp_path / "ws"
    code, reply = agent(ws, "pack", "--out", str(tmp_path / "c.tar.gz"))
    assert code == 2 and "is empty: nothing has compiled there yet" in reply["error"]
    assert sorted(os.listdir(tmp_path)) == []  # neither an archive nor a cache directory made by the refusal
    _cache_files(ws, files={"inductor/fxgraph/ab/entry": b"graph", "inductor/locks/abc.lock": b"",
                            "inductor/fxgraph/ab/.123.456.tmp": b"half", "triton/K/.tmp.k.cubin": b"half",
                            "triton/K/k.cubin.tmp": b"half", "triton/K/tmp.pid_77_123/k.cubin": b"half",
                            "flash-attn-cute/f.o": b"obj"})
    code, reply = agent(ws, "pack", "--out", str(tmp_path / "c.tar.gz"))
    assert code == 0
    assert reply["sha256"] == hashlib.sha256((tmp_path / "c.tar.gz").read_bytes()).hexdigest()
    with tarfile.open(reply["archive"]) as tar:
        names = tar.getnames()
    assert names == [cc.MANIFEST, "cache/inductor/fxgraph/ab/entry", "cache/flash-attn-cute/f.o"]
    assert reply["manifest"]["kinds"]["flash-attn-cute"] == {"files": 1, "bytes": 3}
    assert sorted(os.listdir(tmp_path)) == ["c.tar.gz", "ws"]  # no temp file left beside it


def test_the_archive_streams_through_stdout_and_stdin_with_the_reply_beside_it(tmp_path):
    """The controller's way: pack to stdout (reply on stderr), unpack from stdin."""
    # a kernel too large and random for the cut below to fall inside the manifest's block
    src = _cache_files(tmp_path / "src", files={"inductor/fxgraph/ab/entry": b"graph", "triton/K/k.cubin": os.urandom(1 << 18),
                                                "triton/K/k.json": b"{}", "triton/K/__grp__k.json": b"{}"})
    env = {**os.environ, "PYTHONPATH": ROOT}
    base = ["python3", "-m", "agent.compilecache", "--venv", VENV]
    packed = subprocess.run([*base, "--workspace", str(tmp_path / "src"), "pack", "--out", "-"], env=env,
                            capture_output=True, timeout=120)
    assert packed.returncode == 0
    assert extract_payload(packed.stderr.decode())["manifest"]["files"] == 4
    got = subprocess.run([*base, "--workspace", str(tmp_path / "dst"), "unpack", "-"], env=env, input=packed.stdout,
                         capture_output=True, timeout=120)
    assert got.returncode == 0 and extract_payload(got.stdout.decode())["added"] == 4
    dst = Path(cc.generation_dir(cc.root_of(str(tmp_path / "dst")), GEN))
    assert {k: v for k, v in _tree(dst).items() if k != "imported.json"} == _tree(src)
    cut = subprocess.run([*base, "--workspace", str(tmp_path / "cut"), "unpack", "-"], env=env,
                         input=packed.stdout[: len(packed.stdout) * 2 // 3], capture_output=True, timeout=120)
    reply = extract_payload(cut.stdout.decode())
    assert cut.returncode == 2 and "damaged or cut short" in reply["error"], reply
    assert not _tree(tmp_path / "cut")  # nothing but the lock


def test_an_import_killed_midway_leaves_whole_entries_and_a_rerun_completes_it(tmp_path):
    src = tmp_path / "src"
    # one Triton kernel: by name its group file ("__grp__…") would come before the kernel it marks complete
    _cache_files(src, files={"triton/KEY/__grp__k.json": b'{"child_paths": {}}', "triton/KEY/k.cubin": b"\x7fELF",
                             "triton/KEY/k.json": b"{}", "triton/KEY/k.ptx": b"ptx"})
    archive = agent(src, "pack", "--out", str(tmp_path / "c.tar.gz"))[1]["archive"]
    ws = tmp_path / "ws"
    code, _ = agent(ws, "unpack", archive, env={"DFLASH_ENVGEN_FAULT": "cache-import:mid-merge"})
    assert code == -9  # SIGKILL at the fault point
    gen_dir = Path(cc.generation_dir(cc.root_of(str(ws)), GEN))
    moved = _tree(gen_dir)
    assert len(moved) == 1 and not any("__grp__" in k for k in moved)  # a group file never precedes its kernel
    assert [n for n in os.listdir(cc.root_of(str(ws))) if n.startswith(cc.IMPORT_PREFIX)]
    code, got = agent(ws, "unpack", archive)
    assert code == 0 and got["added"] == 3 and got["present"] == 1
    assert not [n for n in os.listdir(cc.root_of(str(ws))) if n.startswith(cc.IMPORT_PREFIX)]
    assert {k: v for k, v in _tree(gen_dir).items() if k != "imported.json"} == _tree(
        Path(cc.generation_dir(cc.root_of(str(src)), GEN)))


def _unpack_on_small_disk(tmp_path, archive: Path, size: str) -> tuple[int, dict]:
    """unpack with the workspace on a tmpfs of ``size``, in a mount namespace of its own."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare for a private tmpfs")
    ws = tmp_path / "small"
    ws.mkdir(exist_ok=True)
    script = ('mount -t tmpfs -o size="$1" tmpfs "$2" && python3 -m agent.compilecache --workspace "$2" --venv "$3" '
              'unpack "$4"; code=$?; ls -A "$2/.dflash-ctl/compile-cache" > "$5"; exit $code')
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", size, str(ws), VENV,
                        str(archive), str(tmp_path / "left.txt")],
                       env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=120)
    return r.returncode, extract_payload(r.stdout)


def test_an_archive_the_disk_cannot_hold_is_refused_before_or_while_staging_with_nothing_left(tmp_path):
    big = _cache_files(tmp_path / "big", files={"triton/K/k.cubin": os.urandom(1 << 20)})
    code, reply = _unpack_on_small_disk(tmp_path, Path(agent(big.parents[2], "pack", "--out",
                                                              str(tmp_path / "big.tar.gz"))[1]["archive"]), "256k")
    assert code == 2 and "the archive holds 1 MiB" in reply["error"] and "free space there first" in reply["error"]
    assert (tmp_path / "left.txt").read_text().split() == [".lock"]
    # 300 one-byte files: the manifest's 300 bytes fit, their 300 blocks do not
    many = _cache_files(tmp_path / "many", files={f"inductor/fxgraph/{i:03d}": b"x" for i in range(300)})
    code, reply = _unpack_on_small_disk(tmp_path, Path(agent(many.parents[2], "pack", "--out",
                                                              str(tmp_path / "many.tar.gz"))[1]["archive"]), "256k")
    assert code == 2 and "filled up while staging" in reply["error"], reply
    assert (tmp_path / "left.txt").read_text().split() == [".lock"]



def _with(fp: dict, **packages) -> dict:
    return {**fp, "packages": {**fp["packages"], **packages}}


def test_the_compile_key_follows_what_compiled_code_depends_on_and_nothing_else():
    key = cc.compile_key(FP)
    assert cc.compile_key(_with(FP, numpy="9.9.9", safetensors="99.0", wandb="0.1")) == key
    for changed in (_with(FP, triton="9.9.9"), _with(FP, **{"flash-attn-4": "4.0.0b36"}),
                    _with(FP, **{"nvidia-cutlass-dsl-libs-cu13": "4.8.1"}), {**FP, "python": "3.99.0"},
                    {**FP, "torch": {**(FP["torch"] or {}), "build": "cu999"}}):
        assert cc.compile_key(changed) != key
    assert cc.stack_difference(cc.compile_stack(FP), cc.compile_stack(_with(FP, triton="9.9.9"))) == \
        f"triton {FP['packages'].get('triton', 'absent')} → 9.9.9"


def test_another_generation_with_the_same_compile_stack_takes_the_archive_into_its_own_cache(tmp_path):
    """Two nodes whose venvs differ only in, say, numpy: the entries are the same."""
    archive = _archive(tmp_path / "a.tar.gz", {**GOOD_MANIFEST, "generation": "0123456789ab",
                                               "compile_key": cc.compile_key(_with(FP, numpy="0.0.1"))},
                       [("cache/triton/K/k.cubin", tarfile.REGTYPE, b"x")])
    got = cc.op_unpack(cc.root_of(str(tmp_path / "ws")), VENV, str(archive), here_gpus=[])
    assert got["added"] == 1 and got["generation"] == GEN and got["archive_generation"] == "0123456789ab"
    assert (Path(cc.generation_dir(cc.root_of(str(tmp_path / "ws")), GEN)) / "triton/K/k.cubin").read_bytes() == b"x"


def _managed_venv(tmp_path: Path, parent_fp: dict) -> tuple[str, str]:
    """A venv path whose generations store records a parent generation with ``parent_fp``'s
    packages (agent/genstore.py's own layout): (venv, parent id)."""
    venv = tmp_path / "venv"
    venv.symlink_to(VENV)
    parent = dict(parent_fp, id="0123456789ab")
    store = genstore.Store(str(venv))
    os.makedirs(store.gen_dir(parent["id"]))
    with open(os.path.join(store.gen_dir(parent["id"]), genstore.META), "w") as fh:
        json.dump({"id": parent["id"], "fingerprint": parent}, fh)
    return str(venv), parent["id"]


def test_a_new_generation_that_compiles_the_same_starts_with_its_parents_entries_linked(tmp_path):
    """`ctl env install numpy==…` makes a new generation; its first step must not recompile."""
    venv, parent = _managed_venv(tmp_path, _with(FP, numpy="0.0.1"))
    ws = tmp_path / "ws"
    src = _cache_files(ws, gen=parent)
    r = agent_venv(ws, venv, "seed", "--from", parent)
    assert r["seeded"] == 4 and r["generation"] == GEN
    dst = Path(cc.generation_dir(cc.root_of(str(ws)), GEN))
    assert _tree(dst) == _tree(src)
    assert os.stat(dst / "triton/KEY/k.cubin").st_ino == os.stat(src / "triton/KEY/k.cubin").st_ino  # no copy
    assert agent_venv(ws, venv, "seed", "--from", parent)["seeded"] == 0  # already there


def test_a_new_torch_or_an_unrecorded_parent_seeds_nothing_and_says_why(tmp_path):
    venv, parent = _managed_venv(tmp_path, {**FP, "torch": {"version": "2.9.1", "build": "cu128"}})
    ws = tmp_path / "ws"
    _cache_files(ws, gen=parent)
    r = agent_venv(ws, venv, "seed", "--from", parent)
    assert r["seeded"] == 0 and r["why"].startswith("the compile stack changed: torch 2.9.1 (cu128) → ")
    assert not os.path.exists(cc.generation_dir(cc.root_of(str(ws)), GEN))
    r = agent_venv(ws, venv, "seed", "--from", "abcdefabcdef")
    assert r["seeded"] == 0 and "packages are not recorded" in r["why"]
    code, reply = agent(ws, "seed", "--from", "../../etc")
    assert code == 2 and "is not a generation id" in reply["error"]


def agent_venv(workspace: Path, venv: str, *args: str) -> dict:
    r = subprocess.run(["python3", "-m", "agent.compilecache", "--workspace", str(workspace), "--venv", venv, *args],
                       cwd="/", env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return extract_payload(r.stdout)
