"""`ctl kill-and-rollback` with venv generations, end to end on a simulated node of its own
(tests/_rollback_node.py): the story of docs/design.md, scripted.

A good run on generation A becomes known-good; a new generation B gets a newer, deliberately
broken version of a package the trainer imports (safetensors, through transformers), from a
wheelhouse inside the container (offline: pip --no-index); a run on B fails;
`ctl kill-and-rollback --yes` leaves no process, puts the venv back on A (same fingerprint),
reports the change and prints a `ctl launch … --resume-from …` line that then works on A.
"""

from __future__ import annotations

import json
import shlex
import signal
import time
from pathlib import Path

import pytest

from _rollback_node import (started_run, SNAP_CT, Handle, ctl, ctl_popen, rb_config, rb_node,  # noqa: F401 (fixtures)
                            reset_to_pristine, tiny_config)
from wheel_factory import build_wheel

pytestmark = [pytest.mark.sim, pytest.mark.slow]

CT = str(SNAP_CT)
WHEELHOUSE = "/workspace/wheelhouse"
BROKEN = 'raise ImportError("safetensors 99.0 is deliberately broken (rollback test fixture)")\n'


@pytest.fixture(scope="module")
def node(rb_node, rb_config, tmp_path_factory):
    reset_to_pristine(rb_config)
    h = Handle(rb_config, SNAP_CT)
    wheel = build_wheel(tmp_path_factory.mktemp("wheels"), "safetensors", "99.0", BROKEN)
    h.sh("mkdir", "-p", WHEELHOUSE)
    h.ct.write_file(f"{WHEELHOUSE}/{wheel.name}", wheel.read_bytes())
    # Every test starts from a managed venv (the first generation: the venv as provisioned).
    adopted = ctl(rb_config, "env", "adopt", "--container", CT)
    assert adopted.returncode == 0, adopted.stderr
    yield h
    h.close()


@pytest.fixture(scope="module")
def run_config(tmp_path_factory) -> Path:
    return tiny_config(tmp_path_factory.mktemp("runcfg"))


@pytest.fixture(scope="module")
def long_config(tmp_path_factory) -> Path:
    """A run that trains long enough to be stopped while it runs."""
    return tiny_config(tmp_path_factory.mktemp("runcfg-long"), max_steps=100000, save_interval=100000)


def env_list(config) -> dict:
    proc = ctl(config, "env", "list", "--container", CT, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def venv_safetensors(h: Handle) -> str:
    """What a new process in the container gets from /root/venv: the installed version, and
    whether it imports. A broken venv (no python) fails the test here."""
    r = h.sh("/root/venv/bin/python3", "-c",
             "import importlib.metadata as m; print(m.version('safetensors'))\nimport safetensors")
    assert r.stdout.strip(), f"the venv in container {CT} is broken: {r.stderr}"
    return r.stdout.strip() + ("" if r.ok else " (broken)")


def launch(config, run_config: Path, *extra: str) -> tuple[int, str, str]:
    proc = ctl(config, "launch", "--container", CT, "--config", str(run_config), *extra, "--follow")
    out = proc.stdout + proc.stderr
    run_id = next((w for line in out.splitlines() for w in line.split()
                   if w.startswith("tiny-") and line.startswith("run ")), None)
    return proc.returncode, out, run_id


def second_generation(config, cur: str) -> str:
    """A generation other than ``cur`` (built with the broken safetensors if there is none);
    ``cur`` stays current."""
    gens = [g["id"] for g in env_list(config)["generations"]]
    other = next((g for g in gens if g != cur), None)
    if other is None:
        proc = ctl(config, "env", "install", "--container", CT, "safetensors==99.0", "--wheelhouse", WHEELHOUSE,
                   "--force")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        other = env_list(config)["current"]
        assert ctl(config, "env", "switch", "--container", CT, cur, "--force").returncode == 0
    return other


def launch_long(config, long_config: Path) -> str:
    """A run that trains until stopped; its id."""
    proc = ctl_popen(config, "launch", "--container", CT, "--config", str(long_config), "--from-scratch",
                     "--accept-drift")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out + err
    return started_run(out)


def survivors(h: Handle, run_id: str) -> list:
    from controller import envgen_client as eg

    return eg.recovery(h.ct, "survivors", "--run", run_id)["survivors"]


def history(config) -> list[dict]:
    proc = ctl(config, "history", "--container", CT, "--json")
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def compile_cache_of(config, gen: str, tmp_path: Path) -> int:
    """Real Inductor entries for generation ``gen``, compiled here and imported into the
    container with `ctl env cache import`; how many files."""
    import os
    import subprocess
    import sys

    from _inductor_cache import ROOT, compile_once

    root = tmp_path / "cc-ws" / ".dflash-ctl" / "compile-cache"
    compile_once(root, gen)
    archive = tmp_path / "a.tar.gz"
    packed = subprocess.run(["python3", "-m", "agent.compilecache", "--workspace", str(tmp_path / "cc-ws"), "--venv",
                             sys.prefix, "pack", "--generation", gen, "--out", str(archive)],
                            env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True)
    assert packed.returncode == 0, packed.stdout + packed.stderr
    proc = ctl(config, "env", "cache", "import", str(archive), "--container", CT)
    assert proc.returncode == 0, proc.stderr
    from agent.protocol import extract_payload

    return extract_payload(packed.stdout)["manifest"]["files"]


def test_the_story_good_run_upgrade_breaks_kill_and_rollback_resume(node, rb_config, run_config, tmp_path):
    h = node
    # 1. A good run on the container's venv as provisioned; it becomes the known-good run.
    rc, out, good_run = launch(rb_config, run_config, "--from-scratch")
    assert rc == 0, out
    status = ctl(rb_config, "status", "--container", CT, "--run", good_run)
    assert "known-good" in status.stdout, status.stdout
    good_ckpt = next(line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("== checkpoint step 4"))

    # Generation A's compile cache (real Inductor entries compiled here for A: the container has
    # no C++ compiler), put there by `ctl env cache import`.
    cached = compile_cache_of(rb_config, env_list(rb_config)["current"], tmp_path)

    # 2. Generation B: a newer safetensors from the in-container wheelhouse (offline).
    proc = ctl(rb_config, "env", "install", "--container", CT, "safetensors==99.0", "--wheelhouse", WHEELHOUSE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "↑ safetensors 0.8.0 → 99.0" in proc.stdout
    gens = env_list(rb_config)
    gen_a, gen_b = (g["id"] for g in gens["generations"])
    assert gens["current"] == gen_b
    # safetensors compiles nothing: B starts with A's entries, linked, not compiled again
    assert f"compile cache: {cached} entries of generation {gen_a} carried over" in proc.stdout, proc.stdout
    inodes = h.sh("sh", "-c", f'cd /workspace/.dflash-ctl/compile-cache && for f in $(cd gen-{gen_a} && find . -type f ! -name imported.json); '
                              f'do echo "$(stat -c %i gen-{gen_a}/$f) $(stat -c %i gen-{gen_b}/$f)"; done')
    pairs = [line.split() for line in inodes.stdout.splitlines()]
    assert len(pairs) == cached and all(a == b for a, b in pairs), inodes.stdout + inodes.stderr
    assert "known-good-" + good_run in [r for g in gens["generations"] for r in g["refs"]]
    assert venv_safetensors(h) == "99.0 (broken)"

    # 3. The continuation on B fails (transformers imports safetensors).
    rc, out, bad_run = launch(rb_config, run_config, "--resume-from", good_ckpt, "--accept-drift")
    assert rc != 0 and bad_run, out

    # A generation a known-good run used is never removed.
    proc = ctl(rb_config, "env", "remove", "--container", CT, gen_a)
    assert proc.returncode == 3 and "known-good" in proc.stderr, proc.stderr

    # 4. Kill and roll back to the last known-good environment.
    proc = ctl(rb_config, "kill-and-rollback", "--container", CT, "--yes", "--grace", "20")
    report = proc.stdout
    assert proc.returncode == 0, report + proc.stderr
    assert f"env:{gen_a}" in report and f"known-good run {good_run}" in report
    assert f"verified  venv fingerprint {gen_a} == target {gen_a}  [OK]" in report
    assert "↓ safetensors 99.0 → 0.8.0" in report
    assert survivors(h, bad_run) == []
    gens = env_list(rb_config)
    assert gens["current"] == gen_a and {g["id"] for g in gens["generations"]} == {gen_a, gen_b}
    assert venv_safetensors(h) == "0.8.0"
    fp = json.loads(ctl(rb_config, "env", "show", "--container", CT, "--json").stdout)
    assert fp["id"] == gen_a and fp["fingerprint"]["id"] == gen_a

    # The kill and the rollback are in the container's history.
    events = [(r["event"], r["run"]) for r in history(rb_config)]
    assert events[-2:] == [("kill", bad_run), ("rollback", bad_run)]

    # 5. The printed launch line resumes on A. Its --config names the run config by its name
    # (launch records do not carry the operator's file path): ours is a temp file.
    line = next(l.strip() for l in report.splitlines() if l.strip().startswith("ctl launch"))
    argv = shlex.split(line)
    assert argv[argv.index("--resume-from") + 1] == good_ckpt
    assert argv[argv.index("--container") + 1] == CT
    argv[argv.index("--config") + 1] = str(run_config)
    proc = ctl(rb_config, *argv[1:], "--follow")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "completed" in proc.stdout


def test_kill_of_a_live_run_checkpoints_and_resume_line_names_that_checkpoint(node, rb_config, long_config):
    h = node
    base = env_list(rb_config)["current"]
    run_id = launch_long(rb_config, long_config)
    # Wait until it trains, then stop it through kill-and-rollback (target: the current gen).
    events = f"/workspace/runs/{run_id}/events.jsonl"
    deadline = time.monotonic() + 300
    while not h.sh("grep", "-q", '"step"', events).ok:
        assert time.monotonic() < deadline, f"run {run_id} never reached a training step"
        time.sleep(2)
    proc = ctl(rb_config, "kill-and-rollback", "--container", CT, "--run", run_id, "--to", f"env:{base}",
               "--yes", "--grace", "60")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Normally "ended stopped (stopped on request)"; on a loaded machine the trainer may be
    # caught mid-step and end otherwise. What matters: it ended, nothing is left, a checkpoint.
    assert f"stopped   run {run_id}: ended " in proc.stdout, proc.stdout
    assert survivors(h, run_id) == []
    # The kill is an event in the run's own stream (written by the agent's stop), the
    # rollback a record in the container's history (the stream ends with the terminal status).
    assert h.sh("grep", "-q", "agent.stop", f"/workspace/runs/{run_id}/stream.jsonl").ok
    assert [r["event"] for r in history(rb_config) if r["run"] == run_id] == ["kill", "rollback"]
    line = next(l.strip() for l in proc.stdout.splitlines() if l.strip().startswith("ctl launch"))
    ckpt = shlex.split(line)[shlex.split(line).index("--resume-from") + 1]
    assert h.sh("test", "-e", ckpt).ok, ckpt


def test_two_kill_and_rollbacks_at_once_make_one_kill_and_one_rollback(node, rb_config, long_config):
    """Both used to stop the run and both wrote a kill and a rollback record. The
    container's claim (agent/recovery.py) lets one through and refuses the other (exit 3)."""
    base = env_list(rb_config)["current"]
    run_id = launch_long(rb_config, long_config)
    both = [ctl_popen(rb_config, "kill-and-rollback", "--container", CT, "--run", run_id, "--to", f"env:{base}",
                      "--yes", "--grace", "5") for _ in range(2)]
    done = [(p.wait(timeout=600), *p.communicate()) for p in both]
    assert sorted(rc for rc, _, _ in done) == [0, 3], done
    loser = next(err for rc, _, err in done if rc == 3)
    assert "another kill-and-rollback in container" in loser and "under way" in loser, loser
    assert [r["event"] for r in history(rb_config) if r["run"] == run_id] == ["kill", "rollback"]
    assert survivors(node, run_id) == []


def test_refusals_change_nothing(node, rb_config):
    h = node
    before = env_list(rb_config)
    n_hist = len(history(rb_config))
    for to, words, code in (("env:feedbeef0000", "does not exist", 3), ("snapshot:nosuchsnap", "does not exist", 3),
                            ("bogus", "give last-good", 2), ("snapshot:../x", "a Proxmox snapshot name", 2)):
        # 3: refused in the container; 2: bad input, refused before anything connected
        proc = ctl(rb_config, "kill-and-rollback", "--container", CT, "--to", to, "--yes")
        assert proc.returncode == code, proc.stdout + proc.stderr
        assert words in proc.stderr and ("nothing changed" in proc.stderr or code == 2)
    after = env_list(rb_config)
    assert after["current"] == before["current"] and after["generations"] == before["generations"]
    assert len(history(rb_config)) == n_hist


def test_a_run_that_cannot_be_stopped_refuses_the_rollback(node, rb_config):
    """Something outside the run keeps restarting its processes (the marker DFLASH_RUN_ID is
    what the agent's stop and our scan look for): the rollback must not happen."""
    h = node
    run_id = "unstoppable-20261201-000000-0001"  # the run-id grammar (agent/protocol.py)
    h.sh("mkdir", "-p", f"/workspace/runs/{run_id}")
    h.ct.write_file(f"/workspace/runs/{run_id}/status.json", json.dumps({"state": "running"}))
    respawner = ("while :; do env DFLASH_RUN_ID=" + run_id + " sleep 2 & sleep 0.2; done")
    start = h.sh("sh", "-c", f"setsid sh -c {shlex.quote(respawner)} >/dev/null 2>&1 & echo $!")
    pid = start.stdout.strip()
    try:
        before = env_list(rb_config)
        gens = [g["id"] for g in before["generations"]] or [before.get("current")]
        other = next((g for g in gens if g != before["current"]), before["current"])
        proc = ctl(rb_config, "kill-and-rollback", "--container", CT, "--run", run_id, "--to", f"env:{other}",
                   "--yes", "--grace", "1")
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert "cannot be stopped" in proc.stderr and "Nothing was rolled back" in proc.stderr
        assert env_list(rb_config)["current"] == before["current"]
    finally:
        h.sh("kill", pid)
        h.sh("rm", "-rf", f"/workspace/runs/{run_id}")


@pytest.mark.parametrize("point", ["switch:after-link", "install:before-switch"])
def test_interrupted_switch_never_leaves_a_broken_venv_and_a_rerun_completes(node, rb_config, point):
    """The container-side process dies at a named point mid-operation (SIGKILL, as on a node
    reboot): the venv gives the old or the new generation, whole; rerunning completes it."""
    h = node
    cur = env_list(rb_config)["current"]
    if point.startswith("install"):
        proc = ctl(rb_config, "env", "install", "--container", CT, "safetensors==99.0", "--wheelhouse", WHEELHOUSE,
                   "--force", env={"DFLASH_ENVGEN_FAULT": f"{point}=die"})
    else:
        other = second_generation(rb_config, cur)
        proc = ctl(rb_config, "kill-and-rollback", "--container", CT, "--to", f"env:{other}", "--yes",
                   env={"DFLASH_ENVGEN_FAULT": f"{point}=die"})
    assert proc.returncode != 0 and "killed midway" in proc.stderr, proc.stdout + proc.stderr
    assert venv_safetensors(h) in ("0.8.0", "99.0 (broken)")  # whole, old or new
    assert env_list(rb_config)["pending"] is not None
    proc = ctl(rb_config, "env", "resume", "--container", CT)
    assert proc.returncode == 0 and "completed the interrupted" in proc.stdout, proc.stdout + proc.stderr
    after = env_list(rb_config)
    assert after["pending"] is None and after["current"] != cur
    # Back to where the test began, for the next test.
    assert ctl(rb_config, "env", "switch", "--container", CT, cur, "--force").returncode == 0


def test_ctl_killed_while_the_container_side_pauses_then_rerun_completes(node, rb_config):
    """`ctl` dies (ssh gone) while the in-container step is paused mid-install; the
    container-side process is then killed too. Nothing is broken; `ctl env resume` finishes."""
    h = node
    cur = env_list(rb_config)["current"]
    proc = ctl_popen(rb_config, "env", "install", "--container", CT, "safetensors==99.0", "--wheelhouse",
                     WHEELHOUSE, "--force",
                     env={"DFLASH_ENVGEN_FAULT": "install:before-switch=pause", "DFLASH_ENVGEN_PAUSE_S": "600"})
    journal = "/root/.venv-generations/journal.json"
    deadline = time.monotonic() + 300
    while '"state": "switch"' not in h.sh("cat", journal).stdout:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert venv_safetensors(h) in ("0.8.0", "99.0 (broken)")
    ps = h.sh("ps", "-eo", "pid=,args=").stdout
    pids = [l.split()[0] for l in ps.splitlines() if "agent.envgen" in l and "install" in l]
    assert pids, ps
    h.sh("kill", "-9", *pids)
    assert venv_safetensors(h) in ("0.8.0", "99.0 (broken)")
    proc = ctl(rb_config, "env", "resume", "--container", CT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert env_list(rb_config)["pending"] is None
    assert ctl(rb_config, "env", "switch", "--container", CT, cur, "--force").returncode == 0
