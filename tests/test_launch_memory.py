"""The launch preflight uses the memory model: a GPU that cannot hold its role's predicted
peak refuses the launch before anything starts, naming the GPU, role and shortfall."""

from __future__ import annotations

from controller.launch import memory_report
from trainer import flags as F

QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
            "tie_word_embeddings": False}


def _values(**kw):
    v = F.defaults()
    v.update(target_model="/models/qwen3-8b", data_dir="/data", output_dir="/out", target_gpus=(0,),
             drafter_gpus=(1,), from_scratch=True, token_budget=16384, max_seq_len=8192, block_size=16,
             max_anchors=512, drafter_step="chunked")
    v.update(kw)
    return v


def _preflight(free_mib: dict) -> dict:
    return {"device": "cuda", "model": {"dir": "/models/qwen3-8b", "config": QWEN3_8B},
            "gpu": {"gpus": [{"index": g, "name": "H200", "memory_free_mib": f} for g, f in free_mib.items()]}}


def test_roomy_gpus_pass_and_each_gets_a_line():
    lines, refusals, _ = memory_report(_values(), _preflight({0: 140_000, 1: 140_000}))
    assert refusals == []
    assert any(line.startswith("memory   GPU 0 (target)") and line.endswith("fits") for line in lines)
    assert any(line.startswith("memory   GPU 1 (drafter)") and line.endswith("fits") for line in lines)


def test_a_gpu_short_of_its_roles_peak_refuses_with_the_gpu_role_and_shortfall():
    roomy = memory_report(_values(), _preflight({0: 140_000, 1: 140_000}))[0]
    need = float(next(l for l in roomy if "GPU 1 (drafter)" in l).split("needs ")[1].split(" GiB")[0]) * 1024
    # 200 MiB less than the drafter GPU needs: the story's shortfall, caught at launch
    lines, refusals, _ = memory_report(_values(), _preflight({0: 140_000, 1: int(need) - 200}))
    assert len(refusals) == 1
    assert refusals[0].startswith("GPU 1 (drafter) needs") and "short by" in refusals[0]
    short = int(refusals[0].split("short by ")[1].split(" MiB")[0])
    assert 150 <= short <= 260  # the 200 MiB, give or take the rounding of the printed figure
    assert "lower --token-budget" in refusals[0]


def test_cpu_runs_have_nothing_to_check():
    assert memory_report(_values(device="cpu"), {"device": "cpu", "gpu": {"gpus": []}}) == ([], [], None)


def test_auto_is_decided_at_launch_and_every_container_trains_with_the_smallest_answer():
    """--token-budget auto is decided once, by the launch: the memory model's answer per
    container, the smallest of them written into every start script as a number."""
    from types import SimpleNamespace

    from controller.job import pin_auto_budget

    roomy, tight = _preflight({0: 140_000, 1: 140_000}), _preflight({0: 140_000, 1: 35_000})
    auto = _values(token_budget="auto", max_seq_len=2048)
    answers = [memory_report(auto, pf)[2] for pf in (roomy, tight)]
    assert all(isinstance(a, int) for a in answers) and answers[1] < answers[0]
    lines = memory_report(auto, tight)[0]
    assert f"memory   --token-budget auto → {answers[1]}" in "\n".join(lines)
    launchers = [SimpleNamespace(auto_budget=a, values={"token_budget": "auto"}) for a in answers]
    said = []
    pin_auto_budget(launchers, said.append)
    assert [ln.values["token_budget"] for ln in launchers] == [answers[1]] * 2
    assert said == [f"memory   --token-budget auto → {answers[1]} for every rank (the smallest of the containers' answers)"]
    assert memory_report(_values(token_budget=16384), roomy)[2] is None  # a named budget stays the run's own
