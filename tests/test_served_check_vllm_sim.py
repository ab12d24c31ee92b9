"""Served τ while training goes on, on the simulated node, as an operator runs it: `ctl launch` of a
CPU training run in container 200 with ``--served-check-every 1`` and ``--eval-prompts``, its run
config naming the container's vLLM (``vllm-python = "/opt/vllm/bin/python"``: the host's vLLM CPU
venv, which the sim mounts read-only into every container, sim/vllm.py). The run saves once; its
agent starts the served check, which serves the checkpoint in that vLLM and records served τ beside
τ at save — in `ctl status` and the checkpoint's meta.json. Then `ctl served-check --run R --best`
checks the best checkpoint on demand, without naming the engine again (the run's own).

Two vLLM engine starts in the container, about a minute each on 2 cores; `ctl` runs without torch.
"""

from __future__ import annotations

import functools
import json
import time

import pytest

import _ctl_subprocess as C

pytestmark = [pytest.mark.sim, pytest.mark.vllm, pytest.mark.slow]

CT = 200
WS = "/workspace"
NAME = "servedsim"
VLLM_PYTHON = "/opt/vllm/bin/python"  # sim/vllm.py PYTHON_IN_CT
STEP = 12
ctl = C.ctl
sh = functools.partial(C.sh, ct=CT)


def check_runs(env) -> set[str]:
    out = sh(env, "sh", "-c", f"ls -1 {WS}/runs 2>/dev/null || true")  # a fresh container has no runs/ yet
    return {n for n in out.split() if n.startswith("served-check-")}


def status_doc(env, run_id: str) -> dict:
    p = ctl(env, "status", "--container", CT, "--run", run_id, "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout)


def meta(env, run_id: str) -> dict:
    return json.loads(sh(env, "cat", f"{WS}/runs/{run_id}/output/step_{STEP}/meta.json"))


@pytest.fixture(scope="module")
def env(ctl_config, tmp_path_factory):
    return C.no_torch_env(ctl_config, tmp_path_factory.mktemp("no-torch"))


@pytest.fixture(scope="module")
def run(sim_node, env, tmp_path_factory):
    """One save at step 12, its served check ended; on teardown our runs, their checks and launch
    records go and .dflash-ctl is put back as found."""
    from controller import config as cfg
    from controller.container import Container
    from controller.provision import provision_tiny
    from controller.session import open_runner

    conf = cfg.load(env["DFLASH_CTL_CONFIG"])
    name, node = conf.node()
    with open_runner(name, node) as runner:
        provision_tiny(Container(runner, name, node, CT))
    has = ctl(env, "exec", "-c", CT, "--", "test", "-x", VLLM_PYTHON)
    assert has.returncode == 0, (f"container {CT} has no {VLLM_PYTHON}: the sim mounts the host's .venv-vllm there "
                                 "(scripts/setup.sh builds it; `ctl sim up` says why it did not)")
    toml = tmp_path_factory.mktemp("cfg") / f"{NAME}.toml"
    toml.write_text((C.REPO / "examples" / "tiny.toml").read_text()
                    .replace('name = "tiny"', f'name = "{NAME}"')
                    .replace('device = "cpu"\n', f'device = "cpu"\neval-prompts = 4\nserved-check-every = 1\n'
                                                 f'vllm-python = "{VLLM_PYTHON}"\n'))
    saved = f"/tmp/dflash-{NAME}-saved"
    sh(env, *C.baseline_aside(WS, saved))
    before = check_runs(env)
    launch = ctl(env, "launch", "--container", CT, "--config", toml, "--from-scratch", "--accept-drift", "--json",
                 "--set", f"max-steps={STEP}", "--set", f"save-interval={STEP}")
    assert launch.returncode == 0, launch.stdout + launch.stderr
    run_id = json.loads(launch.stdout.strip().splitlines()[-1])["run_id"]
    try:
        done = ctl(env, "tail", "--container", CT, "--run", run_id, "--follow")
        assert done.returncode == 0, done.stdout + done.stderr
        deadline = time.monotonic() + 900  # the check starts as the run saves and serves for a minute or two
        while not (status_doc(env, run_id).get("history") or {}).get("served"):
            assert time.monotonic() < deadline, f"no served check recorded for {run_id}: {check_runs(env) - before}"
            time.sleep(3)
        yield {"run_id": run_id, "checks_before": before}
    finally:
        ours = " ".join(f"{WS}/runs/{r}" for r in sorted(check_runs(env) - before))
        sh(env, "sh", "-c", f'rm -rf {WS}/runs/{NAME}-* {ours} {WS}/.dflash-ctl/secrets/{NAME}-*')
        sh(env, *C.baseline_back(WS, saved))


def test_served_tau_is_recorded_beside_tau_at_save_during_a_run_in_the_containers_vllm(run, env):
    from agent.protocol import ServedCheck

    run_id = run["run_id"]
    m = meta(env, run_id)
    rec = ServedCheck.from_json(m["served"])
    at_save = m["eval"]["tau"]
    assert rec.ok and rec.verdict == "pass" and rec.causes == [], m["served"]
    assert rec.step == STEP and rec.checked_run == run_id and rec.device == "cpu" and rec.prompts == 4
    assert rec.tau_at_save == at_save and abs(rec.tau_served - at_save) <= 0.02 * at_save, m["served"]
    # the check served in the engine the run config named: the container's /opt/vllm
    spec = json.loads(sh(env, "cat", f"{WS}/runs/{rec.run_id}/spec.json"))
    argv = spec["argv"]
    assert argv[argv.index("--vllm-python") + 1] == VLLM_PYTHON, argv
    # `ctl status`: served τ under τ at save
    p = ctl(env, "status", "--container", CT, "--run", run_id)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    tau = [ln for ln in lines if ln.startswith("tau ")]
    served = [ln for ln in lines if ln.startswith("served ")]
    assert len(tau) == 1 and f"{at_save:.3f} at step {STEP}" in tau[0], p.stdout
    assert served == [f"served   τ {rec.tau_served:.3f} vs {at_save:.3f} at save "
                      f"({100 * (rec.tau_served / at_save - 1):+.1f} %) at step {STEP} on cpu: PASS"], p.stdout
    assert lines.index(served[0]) == lines.index(tau[0]) + 1


def test_ctl_served_check_best_serves_in_the_engine_the_run_named(run, env):
    run_id = run["run_id"]
    first = meta(env, run_id)["served"]["run_id"]
    p = ctl(env, "served-check", "--container", CT, "--run", run_id, "--best")  # no --vllm-python: the run's own
    assert p.returncode == 0, p.stdout + p.stderr
    m = meta(env, run_id)
    rec = m["served"]
    assert rec["run_id"] != first and rec["step"] == STEP and rec["ok"], rec  # a new check of the only save
    assert p.stdout.splitlines()[-1].startswith(f"served   τ {rec['tau_served']:.3f} vs {m['eval']['tau']:.3f} at save")
    assert p.stdout.splitlines()[-1].endswith(f"at step {STEP} on cpu: PASS"), p.stdout
