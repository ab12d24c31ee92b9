"""Drift reports name exactly what changed, with both sides' figures."""

from __future__ import annotations

from agent.knowngood import steady_state
from controller import drift as D


def fp(**packages):
    return {"python": "3.11.2", "torch": {"version": "2.13.0+cu128", "cuda": "12.8"}, "driver": "570.1",
            "packages": {"torch": "2.13.0+cu128", "numpy": "2.1.0", **packages}}


def test_one_changed_package_is_named_with_both_versions():
    findings = D.env_drift(fp(six="1.16.0"), fp(six="1.17.0"))
    assert [f.line() for f in findings] == ["package six: 1.16.0 → 1.17.0"]
    assert findings[0].level == D.DRIFT


def test_added_and_removed_packages_are_named():
    lines = [f.line() for f in D.env_drift(fp(six="1.16.0"), fp(attrs="24.1"))]
    assert lines == ["package attrs: added 24.1", "package six: removed (was 1.16.0)"]


def test_a_torch_cuda_build_change_is_reported_as_torch_and_cuda_not_as_a_package():
    new = fp()
    new["torch"] = {"version": "2.13.0+cu130", "cuda": "13.0"}
    new["packages"]["torch"] = "2.13.0+cu130"
    subjects = {f.subject: f for f in D.env_drift(fp(), new)}
    assert set(subjects) == {"torch", "torch CUDA build"}
    assert subjects["torch CUDA build"].line().startswith("torch CUDA build: 12.8 → 13.0")


def test_no_baseline_no_findings_and_same_env_no_findings():
    assert D.env_drift(None, fp()) == []
    assert D.env_drift(fp(), fp()) == []


def test_package_names_are_compared_canonically():
    assert D.env_drift({"packages": {"Typing_Extensions": "4.0"}}, {"packages": {"typing-extensions": "4.0"}}) == []


def test_drift_reads_the_fingerprint_the_preflight_records():
    # agent/envfp.py's shape, as the launch preflight writes it into the launch record
    from agent import envfp

    here = dict(envfp.collect(), driver="570.1")
    assert D.env_drift(here, here) == []
    older = dict(here, python="3.10.0", packages={**here["packages"], "six": "0.1"})
    assert {f.subject for f in D.env_drift(older, here)} >= {"python", "package six"}


def test_the_story_data_drift_reports_mean_length_and_loss_fraction_both_sides():
    tuned = {"samples": 902_000, "tokens": 902_000 * 2068, "length": {"mean": 2068.0}, "loss_fraction": 0.875}
    new = {"samples": 1_100_000, "tokens": 1_100_000 * 2826, "length": {"mean": 2826.0}, "loss_fraction": 0.96}
    findings = {f.subject: f for f in D.data_drift(tuned, new)}
    assert findings["data mean length"].level == D.DRIFT
    assert "2,068.0 → 2,826.0" in findings["data mean length"].line()
    assert findings["data loss-token fraction"].level == D.DRIFT
    assert "87.5 % → 96.0 %" in findings["data loss-token fraction"].line()
    assert "902,000 → 1,100,000" in findings["data sample count"].line()


def test_data_within_tolerance_is_shown_but_does_not_block():
    a = {"samples": 1000, "mean_length": 100.0, "loss_fraction": 0.5}
    b = {"samples": 1010, "mean_length": 102.0, "loss_fraction": 0.51}
    findings = D.data_drift(a, b)
    assert len(findings) == 3 and all(f.level == D.INFO for f in findings)
    assert D.blocking(findings, accept_drift=False) == []


def test_blocking_respects_accept_drift_but_never_errors():
    findings = [D.Finding(D.DRIFT, "x", "1", "2"), D.Finding(D.ERROR, "y", "1", "2")]
    assert [f.subject for f in D.blocking(findings, accept_drift=True)] == ["y"]
    assert len(D.blocking(findings, accept_drift=False)) == 2


def steps(rates, rank=0):
    return [{"kind": "step", "step": i + 1, "tokens_per_s": r, "rank": rank} for i, r in enumerate(rates)]


def test_steady_state_is_reached_when_the_window_median_settles():
    # step 1 is start-up; then a ramp (100 → 300), then settled around 300 with one outlier
    rates = [5, 100, 150, 200, 300, 290, 310, 30, 305, 300, 295]
    got = steady_state(steps(rates), 3, 0.1)
    assert got is not None and 290 <= got["tokens_per_s"] <= 310 and got["window"][0] >= 5  # after the ramp


def test_a_ramp_is_not_steady():
    assert steady_state(steps([1, 100, 200, 300, 400, 500, 600, 700]), 3, 0.1) is None
    assert steady_state(steps([1, 100, 100]), 3, 0.1) is None


def test_steady_state_reads_one_rank():
    events = steps([1, 100, 100, 100, 100, 100, 100], rank=0) + steps([1, 7, 300, 2, 9, 1000, 3], rank=1)
    assert steady_state(events, 3, 0.1)["tokens_per_s"] == 100


def test_a_run_that_accepted_drift_becomes_known_good_only_once_it_completes(tmp_path):
    """Steady speed on a drifted environment is not enough (the story's run OOMed after its
    ramp-up): a launch made with --accept-drift over real drift counts once its run completed."""
    import json
    import os

    from agent import knowngood
    from agent.protocol import STATUS

    ws = str(tmp_path)
    fast = [{"kind": "step", "step": i, "tokens_per_s": 1000.0} for i in range(1, 11)]

    def launch(run_id, accepted, state):
        run = knowngood.run_dir(ws, run_id)
        os.makedirs(run)
        with open(os.path.join(run, "events.jsonl"), "w") as fh:
            fh.writelines(json.dumps(e) + "\n" for e in fast)
        with open(os.path.join(run, STATUS), "w") as fh:
            json.dump({"state": state}, fh)
        knowngood.write_launch_record(ws, {"run_id": run_id, "ts": len(os.listdir(ws)), "config": "tiny",
                                           "accepted_drift": accepted, "fingerprint": {"id": run_id},
                                           "baseline": {"steady_steps": 3, "throughput_tolerance": 0.5}})

    launch("good", False, "running")
    assert knowngood.update(ws)["env"]["run_id"] == "good"  # steady is enough without drift
    launch("drifted", True, "running")
    assert knowngood.update(ws)["env"]["run_id"] == "good"  # steady, but drifted and not done
    with open(os.path.join(knowngood.run_dir(ws, "drifted"), STATUS), "w") as fh:
        json.dump({"state": "completed"}, fh)
    assert knowngood.update(ws)["env"]["run_id"] == "drifted"
