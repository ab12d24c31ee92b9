"""Memory known before launch, wired into the trainer: --token-budget auto, the refusal
before any step, and the stdlib preflight entry (trainer.probe.plan_run). CPU, small."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _trainer_tiny import events as read_events
from trainer import flags, probe

# Qwen3-8B's config.json numbers: the shapes the memory model was checked against on H200s.
QWEN3_8B_CONFIG = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                   "intermediate_size": 12288, "num_hidden_layers": 36, "vocab_size": 151936,
                   "tie_word_embeddings": False}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def values(**kw):
    v = flags.defaults()
    v.update(target_gpus=(0,), drafter_gpus=(1,), drafter_step="chunked")
    v.update(kw)
    return v


def need_mib(v, budget, gpu):
    return probe.plan_run({**v, "token_budget": budget}, {}, QWEN3_8B_CONFIG)["gpus"][gpu]["need_mib"]


# ---------------------------------------------------------------- auto budget

def test_auto_budget_is_monotone_in_free_memory_and_whole_sequences():
    v = values(token_budget="auto")
    budgets = [probe.plan_run(v, {0: 200_000, 1: free}, QWEN3_8B_CONFIG)["token_budget"]
               for free in range(44_000, 140_001, 8_000)]
    assert budgets == sorted(budgets) and budgets[0] < budgets[-1]
    assert all(b % v["max_seq_len"] == 0 and v["max_seq_len"] <= b <= v["max_batch_size"] * v["max_seq_len"]
               for b in budgets)


def test_auto_budget_respects_the_margin_exactly():
    v = values(token_budget="auto")
    L = v["max_seq_len"]
    free = need_mib(v, 6 * L, 1) + 0.5  # need already includes the margin
    assert probe.plan_run(v, {0: 200_000, 1: free}, QWEN3_8B_CONFIG)["token_budget"] == 6 * L
    assert probe.plan_run(v, {0: 200_000, 1: free - 1}, QWEN3_8B_CONFIG)["token_budget"] == 5 * L
    bigger = probe.plan_run(v, {0: 200_000, 1: free}, QWEN3_8B_CONFIG, margin_mib=probe.MARGIN_MIB + 4096)
    assert bigger["token_budget"] < 6 * L


def test_auto_budget_respects_max_seq_len_and_batch_cap():
    v = values(token_budget="auto", max_seq_len=4096, max_batch_size=3)
    p = probe.plan_run(v, {0: 1e7, 1: 1e7}, QWEN3_8B_CONFIG)
    assert p["token_budget"] == 3 * 4096 and not p["refusals"]


def test_auto_budget_is_the_smallest_over_gpus_and_roles():
    v = values(token_budget="auto")
    roomy = probe.plan_run(v, {0: 140_000, 1: 140_000}, QWEN3_8B_CONFIG)
    tight_target = probe.plan_run(v, {0: 25_000, 1: 140_000}, QWEN3_8B_CONFIG)
    assert tight_target["token_budget"] < roomy["token_budget"]
    assert tight_target["token_budget"] == tight_target["auto_per_gpu"][0]


def test_auto_budget_refused_without_gpu_memory_or_on_the_reference_step():
    cpu = probe.plan_run(values(token_budget="auto"), None, QWEN3_8B_CONFIG)
    assert len(cpu["refusals"]) == 1 and "give a number" in cpu["refusals"][0]
    ref = probe.plan_run(values(token_budget="auto", drafter_step="reference"), {0: 1e6, 1: 1e6}, QWEN3_8B_CONFIG)
    assert len(ref["refusals"]) == 1 and "--drafter-step chunked" in ref["refusals"][0]


# ---------------------------------------------------------------- refusal

def test_refusal_names_gpu_role_shortfall_and_a_budget_that_fits():
    v = values(token_budget=49152)
    free = need_mib(v, 49152, 1) - 300
    p = probe.plan_run(v, {0: 140_000, 1: free}, QWEN3_8B_CONFIG)
    assert len(p["refusals"]) == 1
    line = p["refusals"][0]
    assert line.startswith("GPU 1 (drafter) needs ") and f"free: short by {p['gpus'][1]['short_mib']} MiB;" in line
    assert p["gpus"][1]["short_mib"] in (300, 301)  # need_mib is rounded to 0.1 MiB
    assert "lower --token-budget to 40960" in line  # 5 × 8192: the next whole-sequence budget down


def test_colocated_gpu_is_checked_as_both_roles():
    v = values(token_budget=49152, target_gpus=(0,), drafter_gpus=(0,))
    p = probe.plan_run(v, {0: 20_000}, QWEN3_8B_CONFIG)
    assert p["gpus"][0]["role"] == "colocated" and p["refusals"][0].startswith("GPU 0 (target+drafter) needs ")


# Peaks measured inside `python -m trainer` on H200s (bench/gpu/call4.sh, 2026-11-29;
# docs/benchmarks.md): the operators' flags on a synthetic Qwen3-8B-shaped target, the fast
# target forward and the chunked drafter step; max_memory_allocated in MiB.
MEASURED_H200 = [
    # (target_gpus, drafter_gpus, token budget, grad-accum, GPU, measured peak MiB)
    ((0,), (1,), 49152, 4, 0, 23_633),  # split target, --probe-memory
    ((0,), (1,), 49152, 4, 1, 41_890),  # split drafter, --probe-memory
    ((0,), (0,), 8192, 1, 0, 50_094),  # colocated, 8 steps
    ((0,), (0,), 221184, 1, 0, 86_348),  # colocated at the budget --token-budget auto chose
]


@pytest.mark.parametrize("tg, dg, budget, accum, gpu, measured", MEASURED_H200)
def test_predicted_peaks_are_within_5_percent_of_the_h200_measurements(tg, dg, budget, accum, gpu, measured):
    """The colocated case over-read by 43 % at 221,184 tokens when its peak was the sum of
    both roles' peaks; it is now the larger of the target and the drafter phase."""
    v = values(target_gpus=tg, drafter_gpus=dg, token_budget=budget, grad_accum=accum, use_soft_labels=True,
               noise_start=0.05, noise_end=0.01, cap_lambda=0.1, kl_weight=0.15)
    row = probe.plan_run(v, {}, QWEN3_8B_CONFIG)["gpus"][gpu]
    assert abs(row["peak_mib"] - measured) / measured < 0.05, (row["peak_mib"], measured)


def test_reference_step_is_a_lower_bound_and_says_so():
    v = values(token_budget=49152, drafter_step="reference")
    ok = probe.plan_run(v, {0: 140_000, 1: 140_000}, QWEN3_8B_CONFIG)
    assert ok["gpus"][1]["exact"] is False and ok["gpus"][0]["exact"] is True
    assert len(ok["notes"]) == 1 and "lower bound" in ok["notes"][0]
    short = probe.plan_run(v, {0: 140_000, 1: 20_000}, QWEN3_8B_CONFIG)
    assert "needs at least" in short["refusals"][0]


def test_plan_run_imports_and_runs_without_torch(tmp_path):
    """The controller's preflight has no torch: block it (and numpy) and call plan_run."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B_CONFIG))
    code = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'numpy', 'transformers'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
from trainer import flags, probe
v = flags.defaults(); v.update(target_model={str(tmp_path)!r}, target_gpus=(0,), drafter_gpus=(1,),
                                drafter_step='chunked', token_budget='auto')
p = probe.plan_run(v, {{'0': 140000, '1': 60000}})
assert not p['refusals'] and p['token_budget'] > 0, p
assert not any(m.split('.')[0] in ('torch', 'numpy') for m in sys.modules)
print(p['token_budget'])
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[-1]) % 8192 == 0


# ---------------------------------------------------------------- the trainer

def test_cli_refuses_auto_on_cpu_whatever_the_drafter_step(tmp_path, capsys):
    from trainer.__main__ import main

    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps(QWEN3_8B_CONFIG))
    base = ["--target-model", str(tmp_path / "t"), "--data-dir", str(tmp_path / "d"), "--output-dir",
            str(tmp_path / "out"), "--target-gpus", "0", "--drafter-gpus", "0", "--from-scratch",
            "--device", "cpu", "--token-budget", "auto"]
    assert main(base + ["--drafter-step", "chunked"]) == flags.EXIT_USAGE
    err = capsys.readouterr().err
    assert "--token-budget auto fits the budget to free GPU memory, and this run is on CPU" in err
    for step in ([], ["--drafter-step", "reference"]):  # on CUDA the reference step is refused (plan_run tests)
        assert main(base + step) == flags.EXIT_USAGE
        assert "this run is on CPU" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    pytest.importorskip("torch")
    from tests._trainer_tiny import make_target

    return make_target(str(tmp_path_factory.mktemp("memtiny") / "target"))


def _cuda_rank(monkeypatch, free_mib):
    """A one-rank topology that says CUDA, and a GPU with ``free_mib`` free: the memory
    check is plain arithmetic before any tensor exists, so it runs on a CPU machine."""
    from trainer import topology, train

    monkeypatch.setattr(train, "_gpu_free_mib", lambda dev: free_mib)
    return topology.Topology(0, 1, (0,), (0,), "cuda")


def _args(target, tmp_path, *extra):
    return flags.parse_args(["--target-model", target, "--data-dir", str(tmp_path / "data"), "--output-dir",
                             str(tmp_path / "out"), "--run-dir", str(tmp_path / "run"), "--target-gpus", "0",
                             "--drafter-gpus", "0", "--from-scratch", "--block-size", "8", "--max-anchors", "6",
                             "--num-draft-layers", "2", "--max-seq-len", "48", "--max-batch-size", "4", *extra])


def test_trainer_refuses_before_any_step_with_one_line(tiny_target, tmp_path, monkeypatch, capsys):
    from trainer import train

    topo = _cuda_rank(monkeypatch, 1000.0)  # less than the 2 GiB margin alone
    rc = train.run(_args(tiny_target, tmp_path, "--token-budget", "192", "--drafter-step", "chunked"), topo)
    assert rc == flags.EXIT_USAGE
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln]
    assert len(lines) == 1 and lines[0].startswith("python -m trainer: error: GPU 0 (target+drafter) needs ")
    assert "has 1.0 GiB free: short by" in lines[0] and "MiB" in lines[0]
    errors = read_events(str(tmp_path / "run"), "error")
    assert len(errors) == 1 and errors[0]["error"] == "memory_refused" and errors[0]["gpu"] == 0
    assert errors[0]["short_mib"] > 1000
    assert not (tmp_path / "out").exists()  # nothing written where checkpoints go


def test_trainer_auto_budget_is_chosen_and_reported(tiny_target, tmp_path, monkeypatch):
    from trainer import train
    from trainer.telemetry import Events

    args = _args(tiny_target, tmp_path, "--token-budget", "auto", "--drafter-step", "chunked")
    os.makedirs(tmp_path / "run")
    events = Events(str(tmp_path / "run"), 0, "both", 0)
    assert train.memory_check(args, _cuda_rank(monkeypatch, 80_000.0), events) is None
    events.close()
    assert args.token_budget == 4 * 48  # tiny model: the --max-batch-size cap binds
    (plan,) = read_events(str(tmp_path / "run"), "probe")
    assert plan["budget"] == 192 and plan["auto"] is True and 0 < plan["predicted_peak_mib"] < plan["need_mib"]


def test_each_rank_checks_its_own_gpu_in_its_own_role(tiny_target, tmp_path):
    from trainer import topology, train
    from trainer.target import read_config

    args = _args(tiny_target, tmp_path, "--token-budget", "192", "--drafter-step", "chunked")
    args.target_gpus, args.drafter_gpus = (2,), (5,)
    cfg = read_config(tiny_target)
    for rank, gpu, role in ((0, 2, "target"), (1, 5, "drafter")):
        topo = topology.Topology(rank, 2, (2,), (5,), "cuda")
        p = probe.plan_run(train._rank_values(args, topo), None, cfg)
        assert list(p["gpus"]) == [gpu] and p["gpus"][gpu]["role"] == role


def test_probe_memory_runs_the_selected_drafter_step(tiny_target, tmp_path):
    """--probe-memory measures the step the run would take (here the chunked one); the
    prediction beside it is CUDA's (None on CPU, where the peak is the process's RSS)."""
    from tests._trainer_tiny import make_data
    from trainer.__main__ import main

    make_data(tiny_target, str(tmp_path / "data"), samples=8)
    args = _args(tiny_target, tmp_path, "--token-budget", "192", "--drafter-step", "chunked", "--probe-memory",
                 "--device", "cpu")
    argv = [a for f in flags.FLAGS for a in f.render(getattr(args, f.dest))]
    assert main(argv) == 0
    (p,) = read_events(str(tmp_path / "run"), "probe")
    assert p["drafter_step"] == "chunked" and p["peak_mib"] > 0 and p["predicted_peak_mib"] is None


def test_probe_memory_measures_even_when_predicted_short(tiny_target, tmp_path, monkeypatch, capsys):
    from trainer import train
    from trainer.telemetry import Events

    args = _args(tiny_target, tmp_path, "--token-budget", "192", "--drafter-step", "chunked", "--probe-memory")
    os.makedirs(tmp_path / "run")
    events = Events(str(tmp_path / "run"), 0, "both", 0)
    assert train.memory_check(args, _cuda_rank(monkeypatch, 1000.0), events) is None
    events.close()
    assert "warning: predicted not to fit, probing anyway: GPU 0 (target+drafter)" in capsys.readouterr().err
    assert not read_events(str(tmp_path / "run"), "error")
