"""`python -m trainer tiny`: a loadable tiny Qwen3 target + its own greedy data (trainer/synth/tiny.py)."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainer.synth import tiny  # noqa: E402
from trainer.data import PreparedData  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = 24  # enough for all four prompt-length groups; keeps the test to a few seconds


@pytest.fixture(scope="module", autouse=True)
def small_chunks():
    """Several decode chunks even for a few samples, so the chunk → sample mapping is tested."""
    saved, tiny.CHUNK = tiny.CHUNK, 10
    yield
    tiny.CHUNK = saved


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, small_chunks):
    root = tmp_path_factory.mktemp("tiny")
    tiny.write_tiny(str(root / "a"), seed=5, samples=SAMPLES)
    return root


def test_target_loads_and_reserves_the_last_id(tiny_dir):
    from transformers import AutoModelForCausalLM

    target = tiny_dir / "a" / "target"
    assert (target / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(str(target))
    cfg = model.config
    assert cfg.model_type == "qwen3" and cfg.tie_word_embeddings is False
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (512, 64, 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, tiny.HEAD_DIM) and tiny.HEAD_DIM >= 32
    assert cfg.max_position_embeddings >= 1024
    assert cfg.mask_token_id == cfg.vocab_size - 1
    info = json.loads((target / tiny.INFO).read_text())
    assert info["mask_token_id"] == cfg.vocab_size - 1 and info["seed"] == 5


def test_data_is_the_targets_greedy_continuation(tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir / "a" / "target")).eval()
    d = PreparedData(str(tiny_dir / "a" / "data"))
    assert len(d) == SAMPLES
    assert d.meta["max_token_id"] < tiny.MASK_TOKEN_ID
    assert tiny.MIN_LEN <= d.lengths.min() and d.lengths.max() <= tiny.MAX_LEN
    assert len(set(d.lengths.tolist())) > 5  # lengths vary
    for i in range(len(d)):
        ids, mask = d.sample(i)
        assert tiny.MASK_TOKEN_ID not in ids
        p = int(np.argmax(mask))
        assert tiny.PROMPT_LEN <= p <= tiny.MAX_LOSS_START and not mask[:p].any() and mask[p:].all()
        with torch.no_grad():  # full forward, no cache: each generated token is the argmax after its prefix
            logits = model(input_ids=torch.from_numpy(ids[None].astype(np.int64))).logits[0]
        # plain argmax, without suppressing the mask id: the zeroed LM-head row keeps it out anyway
        q = tiny.PROMPT_LEN
        np.testing.assert_array_equal(logits.argmax(-1).numpy()[q - 1:-1], ids[q:])
    starts = {int(np.argmax(d.sample(i)[1])) for i in range(len(d))}
    assert len(starts) > 3  # where the loss starts varies


def test_same_seed_same_files_other_seed_other_data(tiny_dir):
    tiny.write_tiny(str(tiny_dir / "b"), seed=5, samples=SAMPLES)
    cmp = filecmp.dircmp(str(tiny_dir / "a"), str(tiny_dir / "b"))
    for sub in ("target", "data"):
        left = sorted(os.listdir(tiny_dir / "a" / sub))
        match, mismatch, errors = filecmp.cmpfiles(str(tiny_dir / "a" / sub), str(tiny_dir / "b" / sub), left,
                                                   shallow=False)
        assert mismatch == [] and errors == [], (sub, mismatch, errors)
    assert cmp.left_list == cmp.right_list == ["data", "target"]
    tiny.write_tiny(str(tiny_dir / "c"), seed=6, samples=SAMPLES)
    fp = lambda name: PreparedData(str(tiny_dir / name / "data")).fingerprint  # noqa: E731
    assert fp("a") == fp("b") != fp("c")


def test_refuses_to_overwrite(tiny_dir, capsys):
    assert tiny.main(["--out", str(tiny_dir / "a"), "--samples", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists" in err


@pytest.mark.slow  # a fresh interpreter importing torch + transformers
def test_cli_through_python_m_trainer(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "trainer", "tiny", "--out", str(tmp_path / "t"), "--samples", "8",
                           "--seed", "1"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert PreparedData(str(tmp_path / "t" / "data")).meta["samples"] == 8
    assert (tmp_path / "t" / "target" / "config.json").is_file()
    assert [p for p in os.listdir(tmp_path / "t") if p.startswith(".")] == []  # temp dir removed
