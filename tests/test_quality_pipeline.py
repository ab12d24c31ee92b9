"""Drafter quality pipeline (bench/quality, trainer/serve/ddtree.py): the tree is the best-first
top-budget set of prefixes, one tree pass gives every node exactly the target's causal
logits, and the CPU-scale pipeline — real byte-level target on a chat mix (code, prose,
math), self-distilled data through `python -m trainer prepare` with each sample's category,
every drafter variant trained by the trainer, one of them on FP8 taps — decodes losslessly
(block and tree, every held-out prompt) with τ > 1 after training, τ reported per category;
the FP8 wiring (flags, verifying targets, the taps' error per layer) works on a tiny case."""

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
PIPELINE_VARIANTS = ["decay", "dpace", "operators", "dflash2", "fp8-taps"]


@pytest.mark.slow
def test_cpu_pipeline_is_lossless_and_trained_drafters_accept_more_than_one_token(tmp_path):
    out = tmp_path / "quality"
    # the FP8 comparison's wiring too (emulated on CPU, a few seconds at this size): the fp8-taps
    # variant, τ with the verifying target loaded as bf16 and as fp8, the taps' error per layer
    proc = subprocess.run([sys.executable, os.path.join(QUALITY, "run.py"), "--scale", "cpu", "--out", str(out),
                           "--work", str(tmp_path / "work"), "--variants", ",".join(PIPELINE_VARIANTS),
                           "--set", 'eval.verify=["bf16","fp8"]', "--set", "eval.tap_error=true"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((out / "results.json").read_text())

    # the table is printed last, one row per variant
    lines = proc.stdout.strip().splitlines()
    variants = quality("variants")
    assert set(PIPELINE_VARIANTS) <= set(variants.VARIANTS)
    assert lines[-len(PIPELINE_VARIANTS) - 2].startswith("| variant |")
    assert [ln.split("|")[1].strip() for ln in lines[-len(PIPELINE_VARIANTS):]] == PIPELINE_VARIANTS

    # data made by the trainer's prepare, held-out prompts never in it, each sample's category kept
    meta = json.loads((tmp_path / "work" / "data" / "meta.json").read_text())
    assert meta["samples"] == r["data"]["samples"] and 0 < meta["loss_fraction"] < 1
    assert [src["file"] for src in meta["sources"]] == ["code.jsonl", "prose.jsonl", "math.jsonl"]
    assert r["data"]["by_category"] == {"code": 32, "prose": 32, "math": 32}
    cats = r["config"]["prompt_categories"]
    assert cats == ["code", "prose", "math"] * (len(cats) // 3) and len(cats) == r["config"]["scale_config"]["eval"]["prompts"]
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
        # τ per category, pooled from the same decodes: the overall τ lies between them
        by = fin["block"]["by_category"]
        assert set(by) == {"code", "prose", "math"} and min(by.values()) <= fin["block"]["tau"] <= max(by.values())
        # verified by the target as --target-precision loads it: bf16 (on CPU the fp32 target
        # itself, so block verification's numbers) and fp8 (emulated), each equal to its own greedy
        ver = fin["verify"]
        assert ver["bf16"]["per_prompt"] == fin["block"]["per_prompt"] and ver["bf16"]["lossless"], name
        assert ver["fp8"]["prompts"] == n_prompts and ver["fp8"]["lossless"] and ver["fp8"]["tau"] > 1.0, name
        assert ("--target-precision fp8" in v["command"]) == (name == "fp8-taps") and v["taps"] in ("bf16", "fp8")
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
    # the taps' error per tapped layer, and the summary with τ per category and the FP8 comparison
    layers = r["tap_error"]["layers"]
    assert [x["layer"] for x in layers] == [1, 2]
    assert all(0 < x["fp8_vs_bf16"]["rel_l2"] < 0.1 and x["fp8_vs_bf16"]["max_abs"] > 0 for x in layers)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tau_block"]["decay"]["all"] == pytest.approx(r["variants"]["decay"]["final"]["block"]["tau"], abs=1e-3)
    assert set(summary["tau_block"]["decay"]) >= {"code", "prose", "math"}
    assert set(summary["fp8"]["tau_by_verifying_target"]["fp8-taps"]) == {"bf16", "fp8"}
    assert [x["layer"] for x in summary["fp8"]["tap_error"]] == [1, 2]
    assert "| tapped layer | FP8 vs bf16: rel L2 |" in proc.stdout and "| variant | taps | seed |" in proc.stdout

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

    def files(part):  # code and prose conversations name their stdlib file; math its problem number
        return {n.split("/", 1)[1] for n in split["names"][part] if not n.startswith("math/")}

    train, held = files("train"), files("held_out")
    assert train and held and not train & held  # a held-out file is in neither category of the training split
    assert all(corpus.is_held_out(n) for n in held) and not any(corpus.is_held_out(n) for n in train)
    for part in ("train", "held_out"):
        assert len(split[part]) == len(split["names"][part]) == len(split["categories"][part])
        assert set(split["categories"][part]) == {"code", "prose", "math"}
    # held-out problems come from another generator seed: no conversation is in both splits
    math = {part: {bytes(d.astype("uint8").tobytes()) for d, c in zip(split[part], split["categories"][part])
                   if c == "math"} for part in ("train", "held_out")}
    assert not math["train"] & math["held_out"]


def test_chat_prompts_end_where_an_answer_starts_and_eval_prompts_take_turns_by_category():
    corpus, distill = quality("corpus"), quality("distill")
    conv = corpus.conversation([("What is 2 + 2?", "2 + 2 = 4."), ("And a list?", "one\ntwo\nthree")])
    assert conv[0] == corpus.BOS and list(conv).count(corpus.USER) == 2 and list(conv).count(corpus.ASSISTANT) == 2
    w = corpus.prompt_windows([conv] * 3, 40, 12, seed=0)
    ids = list(conv)
    first, second = ids.index(corpus.ASSISTANT) + 1, len(ids) - ids[::-1].index(corpus.ASSISTANT)
    # each answer's start, and the second answer's line starts; not the end of the first answer
    # (a USER turn follows: no answer starts there), nor the conversation's last id
    answer_starts = {first, second, second + len(b"one\n"), second + len(b"one\ntwo\n")}
    ends = {next(e for e in range(12, len(ids) + 1) if ids[e - 12:e] == list(row)) for row in w}
    assert ends == answer_starts
    split = corpus.load_split(max_bytes=300_000)
    prompts, cats = distill.eval_prompts(split, 7, 24)
    assert cats == ["code", "prose", "math", "code", "prose", "math", "code"]
    more, more_cats = distill.eval_prompts(split, 10, 24)
    assert more[:7] == prompts and more_cats[:7] == cats  # more prompts extend the same ones
    assert all(len(p) == 24 and p[-1] in (corpus.ASSISTANT, ord("\n")) for p in more)


def test_tau_per_category_pools_each_categorys_rounds():
    measure = quality("measure")
    per_prompt = [[10, 5], [6, 6], [30, 10], [8, 4]]  # [committed tokens, target forwards] per prompt
    by = measure.by_category(per_prompt, ["code", "math", "code", "prose"])
    assert by == {"code": 40 / 15, "math": 1.0, "prose": 2.0}  # pooled, not a mean of per-prompt τ


def test_fp8_variant_trains_on_fp8_taps_and_every_other_pins_bf16():
    from trainer import flags

    variants = quality("variants")
    d = {"epochs": 2, "steps": 4, "lr": 1e-3, "token_budget": 256, "max_seq_len": 64, "max_batch_size": 4,
         "block_size": 8, "max_anchors": 4, "layers": 1, "save_interval": 4, "log_interval": 2}
    for name in variants.VARIANTS:
        args = flags.parse_args(variants.trainer_argv(name, "T", "D", "O", d, seed=1))
        want = "fp8" if name == "fp8-taps" else "bf16"
        assert args.target_precision == want == variants.target_precision(name), name
    # the same objective as the reference: fp8-taps differs from decay by the taps' precision only
    ref, fp8 = (variants.trainer_argv(n, "T", "D", "O", d) for n in ("decay", "fp8-taps"))
    assert sorted(ref) == sorted(a if a != "fp8" else "bf16" for a in fp8)


def test_tap_error_reports_each_tapped_layer_of_fp8_against_bf16(tiny_target):
    from trainer.target import Target

    measure = quality("measure")
    target_dir = tiny_target.model.config._name_or_path
    torch.manual_seed(3)
    windows = {"a": torch.randint(0, 64, (2, 9)).tolist(), "b": torch.randint(0, 64, (3, 9)).tolist()}
    got = measure.tap_error(target_dir, [0, 2], windows, "cpu")
    assert [r["layer"] for r in got["layers"]] == [0, 2] and got["positions"] == 5 * 9
    for r in got["layers"]:  # each layer's figures are that layer's alone: the tap of a one-layer load
        ref = Target(target_dir, [r["layer"]], "cpu", torch.bfloat16, precision="bf16")
        fp8 = Target(target_dir, [r["layer"]], "cpu", torch.bfloat16, precision="fp8")
        a = torch.cat([fp8.forward(torch.tensor(w), False)[0].double().reshape(-1) for w in windows.values()])
        b = torch.cat([ref.forward(torch.tensor(w), False)[0].double().reshape(-1) for w in windows.values()])
        assert r["fp8_vs_bf16"]["rel_l2"] == pytest.approx(float((a - b).norm() / b.norm()), rel=1e-6)
        assert r["fp8_vs_bf16"]["max_abs"] == pytest.approx(float((a - b).abs().max()), rel=1e-6)
        # e4m3 rounds each operand by up to 2^-4: the taps move by percents, never by nothing
        assert 1e-3 < r["fp8_vs_bf16"]["rel_l2"] < 0.2
        assert r["bf16_vs_fp32"]["rel_l2"] < r["fp8_vs_bf16"]["rel_l2"]
        assert set(r["by_category"]) == {"a", "b"}


def test_fp8_summary_says_whether_fp8_taps_lie_within_the_bf16_seeds_spread():
    report = quality("report")

    def drafter(taps, seed, tau):
        counts = [[int(tau * 10), 10]]
        ver = {p: {"tau": tau, "lossless": True, "per_prompt": counts, "by_category": {"code": tau}}
               for p in ("bf16", "fp8")}
        return {"variant": "fp8-taps" if taps == "fp8" else "decay", "taps": taps, "seed": seed,
                "final": {"block": {"tau": tau, "lossless": True, "per_prompt": counts}, "tree": {}, "verify": ver}}

    def results(fp8_taus):
        vs = {"decay@seed0": drafter("bf16", 0, 2.0), "decay@seed1": drafter("bf16", 1, 2.2)}
        vs.update({f"fp8-taps@seed{i}": drafter("fp8", i, t) for i, t in enumerate(fp8_taus)})
        return {"config": {"tree_budgets": [], "categories": ["code"]}, "variants": vs}

    within = report.summary(results([2.05, 2.25]))["fp8"]
    assert within["fp8_taps_within_bf16_spread"] is True
    assert within["bf16_target_spread"]["bf16"] == {"mean": 2.1, "min": 2.0, "max": 2.2, "seeds": 2}
    assert report.summary(results([1.7, 1.8]))["fp8"]["fp8_taps_within_bf16_spread"] is False
    table = report.fp8_tables(results([1.7, 1.8]))
    assert "| variant | taps | seed | τ bf16 target | τ fp8 target |" in table
    assert "fp8 taps 1.75 [1.70, 1.80] (2 seeds)" in table
