"""The operator's loop end to end on the simulated node: real sshd, real LXC, the real
trainer on CPU, and `ctl` run as the operator runs it — a subprocess in which ``import torch``
fails (a sitecustomize meta-path blocker), so every test here also shows the controller side
never needs torch.

One good run is launched (with a wandb key by reference) and followed by `ctl tail` through a
TCP proxy that cuts the SSH connection 10 times; the other tests build on it: known-good
baseline, env and data drift, refusals, secret hygiene. Container 201 is used so the
snapshot tests on 200 are not disturbed; what these tests change in it is restored.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from trainer.flags import START_DECISION_HELP

pytestmark = [pytest.mark.sim, pytest.mark.slow]

CT = 201
WS = "/workspace"
REPO = Path(__file__).resolve().parent.parent
# examples/tiny.toml under a name of our own, so runs of other tests sharing the container
# (their run ids start with their config's name) never count as ours.
NAME = "launchtest"
SAVED = "/tmp/dflash-test-saved"  # the container's baseline while this module runs
TINY = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"dflash-{NAME}-{os.getpid()}.toml")
Path(TINY).write_text((REPO / "examples" / "tiny.toml").read_text().replace('name = "tiny"', f'name = "{NAME}"'))
PROBE = "dflash-driftprobe"
LONG = ["--set", "epochs=10", "--set", "max-steps=360", "--set", "save-interval=180"]
LAST = 360

from _ctl_subprocess import BLOCKER, baseline_aside, baseline_back  # noqa: E402  (BLOCKER makes `import torch` fail in ctl)


# --- helpers -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ctl_env(ctl_config, tmp_path_factory):
    blocker = tmp_path_factory.mktemp("no-torch")
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(blocker)
    env["DFLASH_CTL_CONFIG"] = str(ctl_config)
    env["DFLASH_CTL_SSH_CONFIG"] = "none"
    env["COLUMNS"] = "200"
    return env


CTL = [str(Path(sys.executable).with_name("ctl"))]


def ctl(env, *args, timeout=600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(CTL + [str(a) for a in args], env=env, capture_output=True, text=True,
                          timeout=timeout, **kw)


def sh(env, *argv, check=True) -> str:
    """A command in the test container through `ctl exec` (the product's own path)."""
    p = ctl(env, "exec", "-c", CT, "--", *argv)
    if check and p.returncode != 0:
        raise AssertionError(f"{argv} failed ({p.returncode}): {p.stderr}")
    return p.stdout


def runs_now(env) -> list[str]:
    return sorted(r for r in sh(env, "sh", "-c", f"ls -1 {WS}/runs 2>/dev/null || true").split()
                  if r.startswith(f"{NAME}-"))


def job_processes(env) -> list[str]:
    """Agent, start script and trainer processes of our runs in the container."""
    out = sh(env, "ps", "-eo", "pid=,args=")
    return [l for l in out.splitlines() if f"{WS}/runs/{NAME}-" in l]


def grep_secret(env, secret: str, *paths: str) -> list[str]:
    """Files under ``paths`` holding ``secret``; the secret goes in through stdin, so the
    search itself never has it in an argv."""
    p = subprocess.run(CTL + ["exec", "-c", str(CT), "--stdin", "--", "sh", "-c",
                              'grep -rl -a -F -f /dev/stdin "$@" 2>/dev/null; true', "sh", *paths],
                       env=env, input=secret + "\n", capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


def install_probe(env, version: str, wheel_dir: Path) -> None:
    from wheel_factory import build_wheel

    whl = build_wheel(wheel_dir, PROBE, version, f'VERSION = "{version}"\n')
    data = whl.read_bytes()
    dest = f"/tmp/{whl.name}"
    p = subprocess.run(CTL + ["exec", "-c", str(CT), "--stdin", "--", "sh", "-c", 'cat > "$1"', "sh", dest],
                       env=env, input=data, capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr
    sh(env, "/root/venv/bin/python3", "-m", "pip", "install", "-q", "--no-index", "--no-deps",
       "--disable-pip-version-check", dest)


class CuttingProxy:
    """127.0.0.1:port → sshd; ``cut()`` drops every connection at once, as a network would.
    ``rate`` (bytes/s) throttles the node → client direction when set."""

    def __init__(self, upstream_port: int, rate: int | None = None):
        self.upstream = upstream_port
        self.rate = rate
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.accepted = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream))
            with self.lock:
                self.pairs.append((client, upstream))
                self.accepted += 1
            threading.Thread(target=self._pump, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, self.rate), daemon=True).start()

    @staticmethod
    def _pump(a, b, rate):
        try:
            while data := a.recv(2048):
                b.sendall(data)
                if rate:
                    time.sleep(len(data) / rate)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> int:
        with self.lock:
            pairs, self.pairs = self.pairs, []
        for pair in pairs:
            for s in pair:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                    s.close()
                except OSError:
                    pass
        return len(pairs)

    def close(self):
        self.sock.close()
        self.cut()


def proxied_config(ctl_config: Path, proxy_port: int, out: Path) -> Path:
    import tomllib

    import tomli_w

    conf = tomllib.loads(Path(ctl_config).read_text())
    node = conf["nodes"]["sim"]
    real = node["port"]
    known = Path(node["known_hosts"]).read_text().replace(f"[127.0.0.1]:{real}", f"[127.0.0.1]:{proxy_port}")
    (out / "known_hosts").write_text(known)
    node["port"] = proxy_port
    node["known_hosts"] = str(out / "known_hosts")
    path = out / "config.toml"
    path.write_text(tomli_w.dumps(conf))
    return path


# --- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prepared(sim_node, ctl_env, tmp_path_factory):
    """Container 201 with /workspace/tiny and the drift probe 1.0; on teardown the probe is
    removed and the known-good record, launch records and our runs are put back as found."""
    from controller import config as cfg
    from controller.container import Container
    from controller.provision import provision_tiny
    from controller.session import open_runner

    conf = cfg.load(ctl_env["DFLASH_CTL_CONFIG"])
    name, node = conf.node()
    with open_runner(name, node) as runner:
        provision_tiny(Container(runner, name, node, CT))
    wheels = tmp_path_factory.mktemp("wheels")
    saved = tmp_path_factory.mktemp("saved-state")
    before_runs = runs_now(ctl_env)
    # no baseline but the ones these tests make (another module's run may have left one)
    sh(ctl_env, *baseline_aside(WS, SAVED))
    install_probe(ctl_env, "1.0", wheels)
    yield {"wheels": wheels, "before_runs": before_runs, "saved": saved}
    sh(ctl_env, "/root/venv/bin/python3", "-m", "pip", "uninstall", "-y", "-q", PROBE, check=False)
    ours = [r for r in runs_now(ctl_env) if r not in before_runs]
    for run in ours:
        sh(ctl_env, "rm", "-rf", "--", f"{WS}/runs/{run}", f"{WS}/.dflash-ctl/secrets/{run}.env", check=False)
    sh(ctl_env, *baseline_back(WS, SAVED), check=False)


@pytest.fixture(scope="module")
def good_run(prepared, ctl_env, ctl_config, sim_node, tmp_path_factory):
    """A tiny run launched with a wandb key (by file), followed by `ctl tail --follow --json`
    through a proxy that drops the SSH connection 10 times."""
    tmp = tmp_path_factory.mktemp("good-run")
    secret = "wandb-" + secrets.token_hex(20)
    key_file = tmp / "wandb.key"
    key_file.write_text(secret + "\n")
    key_file.chmod(0o600)
    # 360 steps over 10 epochs: long enough to cut a live stream 10 times on a fast day (at 120
    # steps a quiet CI machine finished before the 10th cut had a live stream to interrupt).
    launch = ctl(ctl_env, "launch", "--container", CT, "--config", TINY, "--from-scratch", "--json",
                 "--set", f"wandb.api-key-file={key_file}", *LONG)
    assert launch.returncode == 0, launch.stderr + launch.stdout
    info = json.loads(launch.stdout.strip().splitlines()[-1])
    run_id = info["run_id"]
    # While the run is live (agent, job monitor, start.sh, trainer): the key in no argv.
    argv_leaks = grep_secret(ctl_env, secret, *[f"/proc/{p}/cmdline" for p in sh(
        ctl_env, "sh", "-c", "ls -1d /proc/[0-9]* | cut -d/ -f3").split()])
    live = sh(ctl_env, "ps", "-eo", "args=")

    proxy = CuttingProxy(sim_node.node_config()["port"])
    proxy_env = dict(ctl_env, DFLASH_CTL_CONFIG=str(proxied_config(ctl_config, proxy.port, tmp)))
    tail = subprocess.Popen(CTL + ["tail", "--container", str(CT), "--run", run_id, "--follow", "--json"],
                            env=proxy_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out_lines: list[str] = []
    reader = threading.Thread(target=lambda: out_lines.extend(tail.stdout), daemon=True)
    reader.start()
    drops = 0
    deadline = time.monotonic() + 300
    seen = 0
    while drops < 10 and tail.poll() is None and time.monotonic() < deadline:
        # Cut once the tail is connected again (it reconnected after the last cut) and has
        # received records since, so every cut interrupts a live, half-delivered stream.
        time.sleep(0.05)
        if len(out_lines) > seen:
            seen = len(out_lines)
            if proxy.cut():
                drops += 1
    try:
        tail.wait(timeout=600)
    finally:
        proxy.close()
    reader.join(10)
    return {"run_id": run_id, "launch": launch, "tail_rc": tail.returncode, "tail_err": tail.stderr.read(),
            "tail_lines": out_lines, "drops": drops, "secret": secret, "argv_leaks": argv_leaks, "live": live,
            "proxy_connections": proxy.accepted}


# --- the must-shows ----------------------------------------------------------------------------

def test_launch_then_tail_shows_steps_and_the_run_completes_with_its_checkpoint(good_run, ctl_env):
    run_id = good_run["run_id"]
    assert good_run["tail_rc"] == 0, good_run["tail_err"]
    human = ctl(ctl_env, "tail", "--container", CT, "--run", run_id)
    assert human.returncode == 0, human.stderr
    assert f"step {LAST}/{LAST}" in human.stdout and "== run completed" in human.stdout
    assert f"-- step {LAST}/{LAST} | loss" in human.stdout  # the one-line status
    status = ctl(ctl_env, "status", "--container", CT, "--run", run_id)
    assert status.returncode == 0, status.stderr
    assert "state    completed" in status.stdout
    doc = json.loads(ctl(ctl_env, "status", "--container", CT, "--json").stdout)  # default: the latest run
    ours = json.loads(ctl(ctl_env, "status", "--container", CT, "--run", run_id, "--json").stdout)
    assert doc["latest"] and (doc["run_id"] == run_id or doc["spec"]["created"] >= ours["spec"]["created"])
    assert ours["status"]["state"] == "completed"
    ckpt = f"{WS}/runs/{run_id}/output/step_{LAST}/checkpoint.pt"
    assert sh(ctl_env, "sh", "-c", f"test -f {ckpt} && echo yes").strip() == "yes"
    listing = ctl(ctl_env, "runs", "--container", CT)
    assert any(line.startswith(run_id) and "completed" in line for line in listing.stdout.splitlines())


def test_tail_through_10_ssh_drops_reproduces_the_exact_stream(good_run, ctl_env):
    assert good_run["drops"] == 10
    assert good_run["proxy_connections"] >= 11  # it really reconnected after every drop
    assert good_run["tail_err"].count("reconnecting") >= 10
    got = [json.loads(l) for l in good_run["tail_lines"] if l.strip()]
    stream = sh(ctl_env, "cat", f"{WS}/runs/{good_run['run_id']}/stream.jsonl")
    want = []
    for line in stream.splitlines():
        rec = json.loads(line)
        rec.pop("src", None)  # the agent's bookkeeping, not part of the contract
        want.append(rec)
    assert [r["seq"] for r in got] == list(range(1, len(want) + 1))
    assert got == want


def test_the_secret_is_only_in_its_own_root_only_file(good_run, ctl_env):
    secret, run_id = good_run["secret"], good_run["run_id"]
    own = f"{WS}/.dflash-ctl/secrets/{run_id}.env"
    assert sh(ctl_env, "stat", "-c", "%a %u", own).split() == ["600", "0"]
    assert grep_secret(ctl_env, secret, "/workspace", "/tmp", "/root") == [own]
    assert f"{WS}/runs/{run_id}" in good_run["live"]  # the check ran while the run's processes were up
    assert good_run["argv_leaks"] == []  # and none had the key in its argv
    everything = good_run["launch"].stdout + good_run["launch"].stderr + "".join(good_run["tail_lines"]) + good_run["tail_err"]
    assert secret not in everything
    start_sh = sh(ctl_env, "cat", f"{WS}/runs/{run_id}/start.sh")
    assert own in start_sh and secret not in start_sh


def test_the_good_run_becomes_the_known_good_baseline(good_run, ctl_env):
    assert ctl(ctl_env, "status", "--container", CT, "--run", good_run["run_id"]).returncode == 0  # folds it in
    doc = json.loads(sh(ctl_env, "cat", f"{WS}/.dflash-ctl/known-good.json"))
    assert doc["configs"][NAME]["run_id"] == good_run["run_id"]
    assert doc["env"]["fingerprint"]["packages"][PROBE] == "1.0"
    assert doc["configs"][NAME]["data"]["samples"] == 320
    assert doc["configs"][NAME]["steady"]["tokens_per_s"] > 0


def _refused_and_nothing_left(env, args, expect: str, code: int = 3):
    runs_before = runs_now(env)
    secrets_before = sh(env, "sh", "-c", f"ls -1 {WS}/.dflash-ctl/secrets 2>/dev/null || true")
    p = ctl(env, "launch", "--container", CT, "--config", TINY, *args)
    assert p.returncode == code, p.stdout + p.stderr
    assert expect in p.stderr, p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    assert runs_now(env) == runs_before
    assert sh(env, "sh", "-c", f"ls -1 {WS}/.dflash-ctl/secrets 2>/dev/null || true") == secrets_before
    assert job_processes(env) == []
    return p


def test_launch_without_a_start_decision_explains_the_three_choices(prepared, ctl_env):
    p = _refused_and_nothing_left(ctl_env, [], START_DECISION_HELP, code=2)
    assert p.stderr.count("\n") <= 2  # one clear message


def test_overlapping_gpu_roles_are_refused_before_anything_runs(prepared, ctl_env):
    _refused_and_nothing_left(ctl_env, ["--from-scratch", "--target-gpus", "0,1", "--drafter-gpus", "1,2"],
                              "--target-gpus 0,1 and --drafter-gpus 1,2 overlap on 1", code=2)


def test_a_missing_data_dir_fails_in_preflight(prepared, ctl_env):
    _refused_and_nothing_left(ctl_env, ["--from-scratch", "--data-dir", f"{WS}/no-such-data"],
                              f"--data-dir {WS}/no-such-data: no such directory in this container")


def test_resume_from_a_missing_checkpoint_fails_in_preflight(prepared, ctl_env):
    _refused_and_nothing_left(ctl_env, ["--resume-from", f"{WS}/runs/nope/output/step_5"],
                              f"--resume-from {WS}/runs/nope/output/step_5: no such checkpoint")


def test_resume_from_an_incompatible_checkpoint_fails_in_preflight(good_run, ctl_env):
    ckpt = f"{WS}/runs/{good_run['run_id']}/output/step_{LAST}"
    _refused_and_nothing_left(ctl_env, ["--resume-from", ckpt, "--set", "num-draft-layers=2", "--accept-drift"],
                              "the checkpoint was trained with --num-draft-layers 1, this launch says 2")


def test_env_drift_names_the_changed_package_and_needs_accept_drift(good_run, prepared, ctl_env):
    install_probe(ctl_env, "1.1", prepared["wheels"])
    try:
        p = _refused_and_nothing_left(ctl_env, ["--from-scratch"], f"package {PROBE}: 1.0 → 1.1")
        assert "--accept-drift" in p.stderr
        assert "env drift (against known-good run " in p.stdout
        drift_lines = [l for l in p.stdout.splitlines() if l.startswith("  ! ")]
        assert drift_lines == [f"  ! package {PROBE}: 1.0 → 1.1"]  # exactly that change
        ok = ctl(ctl_env, "launch", "--container", CT, "--config", TINY, "--from-scratch", "--accept-drift",
                 "--set", "max-steps=2", "--follow")
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert "run completed" in ok.stdout
    finally:
        install_probe(ctl_env, "1.0", prepared["wheels"])


def test_data_drift_reports_mean_length_and_loss_fraction_both_sides(good_run, ctl_env, tmp_path):
    # Longer samples with a larger share of loss tokens than the tiny data (mean ~126, ~84 %).
    import random

    rng = random.Random(1)
    lines = []
    for _ in range(400):
        n = rng.randint(200, 240)
        prompt = 8
        lines.append(json.dumps({"input_ids": [rng.randrange(500) for _ in range(n)],
                                 "loss_mask": [0] * prompt + [1] * (n - prompt)}))
    src = f"/tmp/drift-{secrets.token_hex(4)}.jsonl"
    out = f"{WS}/drift-data-{secrets.token_hex(4)}"
    p = subprocess.run(CTL + ["exec", "-c", str(CT), "--stdin", "--", "sh", "-c", 'cat > "$1"', "sh", src],
                       env=ctl_env, input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    bundle = sh(ctl_env, "sh", "-c", f"ls -1td {WS}/.dflash-ctl/bundles/*/ | head -1").strip()
    prep = ctl(ctl_env, "exec", "-c", CT, "--", "env", f"PYTHONPATH={bundle}", "/root/venv/bin/python3", "-m",
               "trainer", "prepare", "--input", src, "--out", out)
    assert prep.returncode == 0, prep.stderr
    try:
        p = _refused_and_nothing_left(ctl_env, ["--from-scratch", "--data-dir", out], "data mean length: 12")
        import re

        assert re.search(r"data loss-token fraction: 8\d\.\d % → 9\d\.\d %", p.stdout), p.stdout
        assert "data sample count: 320 → 400" in p.stdout
        assert re.search(r"data mean length: 12\d\.\d → 2\d\d\.\d", p.stdout), p.stdout
        assert "--accept-drift" in p.stderr
    finally:
        sh(ctl_env, "rm", "-rf", "--", out, src, check=False)


def test_the_controller_side_runs_with_torch_not_importable(prepared, ctl_env):
    blocked = subprocess.run([sys.executable, "-c", "import torch"], env=ctl_env, capture_output=True, text=True)
    assert blocked.returncode != 0 and "torch is blocked" in blocked.stderr
    # launch preflight (refused on a missing data dir, after the full preflight) and status
    _refused_and_nothing_left(ctl_env, ["--from-scratch", "--data-dir", f"{WS}/absent"], "no such directory")
    status = ctl(ctl_env, "status", "--container", CT)
    assert status.returncode == 0 and "state    " in status.stdout, status.stderr


def test_ctrl_c_detaches_the_tail_and_leaves_the_run_alone(good_run, ctl_env):
    import signal

    launch = ctl(ctl_env, "launch", "--container", CT, "--config", TINY, "--from-scratch", "--accept-drift",
                 "--json", "--set", "max-steps=8")
    assert launch.returncode == 0, launch.stderr
    run_id = json.loads(launch.stdout.strip().splitlines()[-1])["run_id"]
    tail = subprocess.Popen(CTL + ["tail", "--container", str(CT), "--run", run_id, "--follow"], env=ctl_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in tail.stdout:  # wait for training to be under way
        if line.startswith("step "):
            break
    tail.send_signal(signal.SIGINT)
    rest, err = tail.communicate(timeout=60)
    assert tail.returncode == 0 and "detached at seq" in err and "the run goes on" in err, err
    doc = json.loads(ctl(ctl_env, "status", "--container", CT, "--run", run_id, "--json").stdout)
    assert doc["status"]["state"] in ("running", "completed")  # not stopped by the detach
    done = ctl(ctl_env, "tail", "--container", CT, "--run", run_id, "--follow")  # re-attach to the end
    assert done.returncode == 0 and "run completed" in done.stdout
