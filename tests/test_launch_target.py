"""The launch preflight's word on the target itself (controller/launch.py target_report): a
family the trainer cannot load refuses before anything starts, naming the field; on GPUs a
Qwen3.5/3.6 target whose Gated DeltaNet kernels are missing from the container venv gets a
line saying what that costs and how to add them as a new env generation."""

from __future__ import annotations

from controller.launch import target_report
from trainer import family
from trainer import flags as F

QWEN36_27B_VL = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
                 "text_config": family.QWEN3_6_27B_TEXT}


def _values():
    v = F.defaults()
    v.update(target_model="/dev/shm/Qwen3.6-27B", data_dir="/data", output_dir="/out")
    return v


def _preflight(config: dict, device: str = "cuda", packages: dict | None = None) -> dict:
    return {"device": device, "model": {"dir": "/dev/shm/Qwen3.6-27B", "config": config},
            "fingerprint": {"packages": packages or {"torch": "2.11.0", "transformers": "5.17.0"}}}


def test_a_qwen36_target_without_the_kernels_says_what_it_costs_and_how_to_add_them():
    lines, refusals = target_report(_values(), _preflight(QWEN36_27B_VL))
    assert refusals == [] and len(lines) == 1
    line = lines[0]
    assert line.startswith("kernels  flash-linear-attention is not importable")
    assert "27-30 % MFU" in line and "61 %" in line  # docs/benchmarks.md's two H200 figures
    assert "ctl env install 'fla-core==0.6.0' 'flash-linear-attention==0.6.0' --container ID" in line


def test_with_the_kernels_in_the_venv_or_on_cpu_there_is_nothing_to_say():
    with_fla = {"torch": "2.11.0", "fla_core": "0.6.0", "flash_linear_attention": "0.6.0"}
    assert target_report(_values(), _preflight(QWEN36_27B_VL, packages=with_fla)) == ([], [])
    assert target_report(_values(), _preflight(QWEN36_27B_VL, device="cpu")) == ([], [])
    qwen3_8b = {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936}
    assert target_report(_values(), _preflight(qwen3_8b)) == ([], [])  # a dense target needs no extra kernels


def test_an_unsupported_family_refuses_naming_the_field():
    lines, refusals = target_report(_values(), _preflight({"model_type": "llama", "num_hidden_layers": 2}))
    assert lines == [] and len(refusals) == 1
    assert refusals[0].startswith("--target-model /dev/shm/Qwen3.6-27B: ") and "model_type 'llama'" in refusals[0]
