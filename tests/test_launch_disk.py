"""The launch's disk verdict (controller/diskcheck.py) from the preflight's facts and the run
config, without a node: one line with need, free and the change that makes it fit."""

from __future__ import annotations

from controller.diskcheck import disk_refusal, saves_here
from trainer import flags
from trainer.plan import ckptsize

GIB = 1 << 30
QWEN3_32B = dict(hidden_size=5120, intermediate_size=25600, num_attention_heads=64, num_key_value_heads=8,
                 head_dim=128, vocab_size=151936, num_hidden_layers=64, model_type="qwen3")
# the operators' data: 1.1M samples, mean length 2,826
DATA = {"samples": 1_100_000, "tokens": 1_100_000 * 2826, "mean_length": 2826.0}


def values(**over):
    v = {**flags.defaults(), "target_gpus": (0, 1, 2, 3, 4), "drafter_gpus": (5, 6, 7), "output_dir": "/workspace/out",
         "from_scratch": True, "target_model": "/m", "data_dir": "/d"}
    v.update(over)
    return v


def pf(free_gib, cfg=QWEN3_32B, data=DATA):
    return {"disk": {"free_bytes": int(free_gib * GIB), "measured_at": "/workspace"},
            "model": {"config": cfg}, "data": {"stats": data}}


def test_the_operators_run_fits_with_the_default_of_three_and_is_refused_when_it_cannot():
    each = ckptsize.checkpoint_bytes(QWEN3_32B, values())
    assert 35e9 < each < 37e9
    assert disk_refusal(values(), pf(4 * each / GIB + 1)) is None  # 3 kept + the one being written
    line = disk_refusal(values(), pf(100))
    print(line)
    assert line.startswith("--output-dir /workspace/out: 4 checkpoints of 33.")
    assert "(--keep-checkpoints 3 + the one being written) need 13" in line and "/workspace has 100.0 GiB free" in line
    assert line.endswith("lower --keep-checkpoints to 1")  # 2 × 33.6 GiB fits in 100


def test_keeping_all_is_counted_from_the_data_and_the_fix_names_the_flag():
    # 1.1M samples × 2,826 tokens / 49,152 a micro-batch ≥ 63,245 micro-batches an epoch; × 6 epochs
    # / (grad-accum 4 × 3 drafter ranks) ≥ 31,622 steps: 16 saves at --save-interval 2000
    assert ckptsize.steps_at_least(values(), DATA, 3) == 31_622
    line = disk_refusal(values(keep_checkpoints=0), pf(400))
    print(line)
    assert ("16 checkpoints of 33.5 GiB each (--keep-checkpoints 0 keeps every one: at least 31622 steps at "
            "--save-interval 2000) need 536.0 GiB") in line
    assert line.endswith("set --keep-checkpoints (e.g. 3)")


def test_keep_every_adds_its_steps_and_the_fix_may_be_to_drop_it():
    v = values(max_steps=20_000, keep_every=4000, keep_checkpoints=1)
    each = ckptsize.checkpoint_bytes(QWEN3_32B, v)
    assert ckptsize.retained_peak(20_000, 2000, 1, 4000) == 6  # 4000 … 20000 kept, plus one being written
    line = disk_refusal(v, pf(3 * each / GIB))
    assert "+ every 4000th step" in line and line.endswith("drop --keep-every 4000")


def test_nothing_fits_says_how_much_to_free():
    line = disk_refusal(values(keep_checkpoints=1), pf(10))
    assert "2 checkpoints of" in line and line.endswith("or choose another --output-dir") and line.split("; ")[-1].startswith("free ")


def test_only_the_container_that_saves_is_checked():
    job = dict(nnodes=2, job_layout="5+0,0+3")
    targets = values(**job, node_rank=0, target_gpus=(0, 1, 2, 3, 4), drafter_gpus=())
    drafters = values(**job, node_rank=1, target_gpus=(), drafter_gpus=(0, 1, 2))
    assert not saves_here(targets) and saves_here(drafters)
    assert disk_refusal(targets, pf(1)) is None
    assert disk_refusal(drafters, pf(1)) is not None
    assert saves_here(values(nnodes=2, job_layout="2,2", node_rank=0, target_gpus=(0, 1), drafter_gpus=(0, 1)))


def test_missing_facts_give_no_verdict_here():
    assert disk_refusal(values(), {"disk": {"free_bytes": 1}, "model": {}}) is None
    assert disk_refusal(values(), {"model": {"config": QWEN3_32B}}) is None


def test_a_run_that_measures_tau_keeps_its_best_too_and_the_verdict_counts_it():
    # --eval-prompts: prune keeps the best by τ besides the newest N, and the best may be an
    # old one; 3 kept + the one being written fit, the best beside them does not
    v = values(eval_prompts=64)
    each = ckptsize.checkpoint_bytes(QWEN3_32B, v)
    assert disk_refusal(values(), pf(4 * each / GIB + 1)) is None
    line = disk_refusal(v, pf(4 * each / GIB + 1))
    print(line)
    assert line.startswith("--output-dir /workspace/out: 5 checkpoints of 33.")
    assert "(--keep-checkpoints 3 + the one being written + the best by τ (--eval-prompts))" in line
    assert line.endswith("lower --keep-checkpoints to 2")
    assert disk_refusal(v, pf(5 * each / GIB + 1)) is None
