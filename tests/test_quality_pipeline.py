"""Drafter quality pipeline (bench/quality, trainer/serve/ddtree.py): the tree is the best-first
top-budget set of prefixes, one tree pass gives every node exactly the target's causal
logits, and the CPU-scale pipeline — real byte-level target, self-distilled data through
`python -m trainer prepare`, every drafter variant trained by the trainer — decodes
losslessly (block and tree, every held-out prompt) with τ > 1 after training."""

import importlib
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

from trainer.serve.ddtree import build_tree, target_tree_forward, tree_mask

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUALITY = os.path.join(ROOT, "bench", "quality")
QUALITY_MODULES = ("corpus", "target", "distill", "variants", "measure", "report")


def quality(name: str):
    """Import a bench/quality module without leaving its generic name (corpus, target, …)
    importable by the rest of the test session."""
    before = set(sys.modules)
    sys.path.insert(0, QUALITY)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(QUALITY)
        for mod in set(sys.modules) - before:
            if mod in QUALITY_MODULES:
                del sys.modules[mod]


def test_build_tree_keeps_the_budget_best_prefixes():
    torch.manual_seed(0)
    K, V, budget = 3, 4, 9
    logp = torch.randn(K, V).log_softmax(-1)
    tokens, parents, depths = build_tree(logp, budget)
    assert len(tokens) == budget
    for i, (p, d) in enumerate(zip(parents, depths), start=1):
        assert p < i and (p == 0 and d == 1 or depths[p - 1] == d - 1)  # parents first, depth = parent's + 1

    def path(i):
        out = []
        while i:
            out.append(tokens[i - 1])
            i = parents[i - 1]
        return tuple(reversed(out))

    got = sorted(sum(float(logp[d, t]) for d, t in enumerate(path(i))) for i in range(1, budget + 1))
    every = [sum(float(logp[d, t]) for d, t in enumerate(pre))
             for n in range(1, K + 1) for pre in itertools.product(range(V), repeat=n)]
    assert got == pytest.approx(sorted(every)[-budget:])
    assert len({path(i) for i in range(1, budget + 1)}) == budget  # no prefix twice


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trainer.target import Target

    d = str(tmp_path_factory.mktemp("ddtree") / "target")
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 initializer_range=0.2, tie_word_embeddings=False)).save_pretrained(d)
    return Target(d, [0, 2], "cpu", torch.float32)


def test_tree_pass_gives_each_node_the_targets_causal_logits_and_taps(tiny_target):
    torch.manual_seed(1)
    prefix = torch.randint(0, 64, (11,)).tolist()
    bonus = 5
    tokens, parents, depths = build_tree(torch.randn(4, 64).log_softmax(-1), 12)
    n = len(prefix)
    mask = tree_mask(n, parents, torch.float32, "cpu")
    taps, logits = target_tree_forward(tiny_target, prefix + [bonus] + tokens,
                                       list(range(n + 1)) + [n + d for d in depths], mask, "cpu")
    for i in range(len(tokens) + 1):  # node 0 is the root (the bonus)
        path, j = [], i
        while j:
            path.append(tokens[j - 1])
            j = parents[j - 1]
        seq = prefix + [bonus] + path[::-1]
        ref_taps, ref_logits = tiny_target.forward_logits(torch.tensor([seq]))
        torch.testing.assert_close(logits[0, n + i], ref_logits[0, -1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(taps[0, n + i], ref_taps[0, -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[0, :n], tiny_target.forward_logits(torch.tensor([prefix]))[1][0])


# The reference, the other position weighting, every other objective flag at once (the
# operators' combination) and the other architecture: each flag the variants differ by is
# in one of these, at four sevenths of the suite time of all seven (the flags alone are
# the trainer's own tests).
PIPELINE_VARIANTS = ["decay", "dpace", "operators", "dflash2"]


@pytest.mark.slow
def test_cpu_pipeline_is_lossless_and_trained_drafters_accept_more_than_one_token(tmp_path):
    out = tmp_path / "quality"
    proc = subprocess.run([sys.executable, os.path.join(QUALITY, "run.py"), "--scale", "cpu", "--out", str(out),
                           "--work", str(tmp_path / "work"), "--variants", ",".join(PIPELINE_VARIANTS)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((out / "results.json").read_text())

    # the table is printed last, one row per variant
    lines = proc.stdout.strip().splitlines()
    variants = quality("variants")
    assert set(PIPELINE_VARIANTS) <= set(variants.VARIANTS)
    assert lines[-len(PIPELINE_VARIANTS) - 2].startswith("| variant |")
    assert [ln.split("|")[1].strip() for ln in lines[-len(PIPELINE_VARIANTS):]] == PIPELINE_VARIANTS

    # data made by the trainer's prepare, held-out prompts never in it
    meta = json.loads((tmp_path / "work" / "data" / "meta.json").read_text())
    assert meta["samples"] == r["data"]["samples"] and 0 < meta["loss_fraction"] < 1
    budget = r["config"]["tree_budgets"]
    n_prompts = r["config"]["scale_config"]["eval"]["prompts"]
    assert budget == [16, 32, 64]
    for name, v in r["variants"].items():
        assert v["rc"] == 0, name
        fin = v["final"]
        checks = [fin["block"]] + [fin["tree"][str(b)] for b in budget]
        for c in checks:  # lossless on every prompt, block and every tree budget
            assert c["lossless"] and c["mismatches"] == [] and c["prompts"] == n_prompts, name
        untrained = v["curve"][0][1]
        assert v["curve"][0][0] == 0 and [s for s, _ in v["curve"]][1:] == [20, 40]
        assert fin["block"]["tau"] > 1.0 and fin["block"]["tau"] > untrained, name
        assert all(fin["tree"][str(b)]["tau"] > 1.0 for b in budget), name
        # the served path (export + AutoModel trust_remote_code + its spec_generate): fp32 gives
        # block verification's decodes exactly, bf16 (the default export) is lossless too
        served = fin["served"]
        assert served["fp32"]["equal_to_block"] and served["fp32"]["tau"] == fin["block"]["tau"], name
        assert served["fp32"]["dtype"] == "float32" and served["bf16"]["dtype"] == "bfloat16", name
        assert all(served[k]["lossless"] and served[k]["prompts"] == n_prompts for k in served), name
        card = (tmp_path / "work" / "drafters" / name / f"step_{fin['step']}" / "drafter" / "README.md").read_text()
        assert f"| τ block | {fin['block']['tau']:.3f}" in card and "| τ tree (budget 16) |" in card, name
    assert (out / "tau_vs_steps.png").stat().st_size > 0

    # The drafters evaluated again from the work directory: the same prompts give exactly the
    # same decodes (the first prompts of a larger draw are run.py's own), and the Δτ table
    # against the reference variant is printed last.
    again = tmp_path / "again"
    proc = subprocess.run([sys.executable, os.path.join(QUALITY, "reevaluate.py"), "--results",
                           str(out / "results.json"), "--prompts", str(n_prompts), "--tree-budgets", "16",
                           "--out", str(again)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r2 = json.loads((again / "results.json").read_text())
    for name, v in r["variants"].items():
        fin2 = r2["variants"][name]["final"]
        for kind, before, after in (("block", v["final"]["block"], fin2["block"]),
                                    ("tree 16", v["final"]["tree"]["16"], fin2["tree"]["16"])):
            assert after["per_prompt"] == before["per_prompt"] and after["tau"] == before["tau"], (name, kind)
            assert after["lossless"] and after["prompts"] == n_prompts, (name, kind)
    others = [n for n in PIPELINE_VARIANTS if n != "decay"]
    lines = proc.stdout.strip().splitlines()
    assert lines[-len(others) - 2].startswith("| variant | Δτ block | Δτ tree 16 |")
    assert [ln.split("|")[1].strip() for ln in lines[-len(others):]] == others

    # Another drafter seed on the same target and data: nothing of the first run retrained or
    # overwritten; other settings are refused before anything is written.
    target_cfg = tmp_path / "work" / "target" / "config.json"
    stamp = target_cfg.stat().st_mtime_ns
    seed1 = tmp_path / "seed1"
    proc = subprocess.run([sys.executable, os.path.join(QUALITY, "run.py"), "--scale", "cpu", "--out", str(seed1),
                           "--work", str(tmp_path / "work"), "--reuse-target", "--seed", "1", "--variants", "decay"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r1 = json.loads((seed1 / "results.json").read_text())
    assert r1["config"]["reused_target"] and r1["target"] == r["target"] and r1["data"] == r["data"]
    assert target_cfg.stat().st_mtime_ns == stamp and "target step" not in proc.stdout
    assert "--seed 1" in r1["variants"]["decay"]["command"] and r1["variants"]["decay"]["final"]["block"]["lossless"]
    assert variants.checkpoints(str(tmp_path / "work" / "drafters-seed1" / "decay"))
    def first_step_loss(events):  # another init and data order: another loss at the first logged step
        steps = [json.loads(ln) for ln in events.read_text().splitlines() if '"kind": "step"' in ln]
        return steps[0]["step"], steps[0]["loss"]

    step0, loss0 = first_step_loss(out / "events" / "decay.jsonl")
    step1, loss1 = first_step_loss(seed1 / "events" / "decay.jsonl")
    assert step0 == step1 and loss0 != loss1
    refused = subprocess.run([sys.executable, os.path.join(QUALITY, "run.py"), "--scale", "cpu", "--out",
                              str(tmp_path / "refused"), "--work", str(tmp_path / "work"), "--reuse-target",
                              "--set", "target.seconds=5"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "other corpus/target/distill settings" in refused.stderr
    assert not (tmp_path / "refused").exists()


def _decoded(per_prompt):
    return {"final": {"block": {"per_prompt": per_prompt}, "tree": {}}}


def test_paired_deltas_bound_the_difference_over_prompts():
    report = quality("report")
    base = [[10, 5], [6, 6], [30, 10], [8, 4]]
    r = {"config": {"tree_budgets": []}, "variants": {
        "decay": _decoded(base),
        "same": _decoded([list(c) for c in base]),
        "better": _decoded([[c + 2, f] for c, f in base]),  # 2 more tokens per prompt, same forwards
        "worse": _decoded([[c - 1, f] for c, f in base]),
        "fewer": _decoded(base[:3]),  # decoded other prompts: not comparable, left out
    }}
    d = report.paired_deltas(r, "block", "decay")
    assert set(d) == {"decay", "same", "better", "worse"}
    assert d["same"] == (0.0, 0.0, 0.0) and d["decay"] == (0.0, 0.0, 0.0)
    delta, lo, hi = d["better"]
    assert delta == pytest.approx(8 / 25) and 0 < lo <= delta <= hi  # pooled: 62/25 vs 54/25
    delta, lo, hi = d["worse"]
    assert delta == pytest.approx(-4 / 25) and lo <= delta <= hi < 0
    table = report.delta_table(r, "decay").splitlines()
    assert table[0] == "| variant | Δτ block |" and [ln.split("|")[1].strip() for ln in table[2:]] == \
        ["same", "better", "worse"]
    assert report.paired_deltas(r, "16", "decay") == {}  # no tree decodes recorded


def test_held_out_files_are_never_training_files():
    corpus = quality("corpus")
    split = corpus.load_split(max_bytes=300_000)
    train, held = set(split["names"]["train"]), set(split["names"]["held_out"])
    assert train and held and not train & held
    assert all(corpus.is_held_out(n) for n in held) and not any(corpus.is_held_out(n) for n in train)
    assert len(split["train"]) == len(train) and len(split["held_out"]) == len(held)
