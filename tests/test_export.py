"""`python -m trainer export` and each checkpoint's drafter/: config.json holds every field
docs/export.md lists for each serving stack, bf16 by default, world-readable under a
restrictive umask, byte-identical to step_N/drafter/, atomic, and refusals leave nothing."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _trainer_tiny import base_args, tiny_setup
from trainer import checkpoint as ckpt_io
from trainer import drafter_dir
from trainer.serve import export as X

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run trained under umask 077 (in its own process: umask is process-wide)."""
    root = tmp_path_factory.mktemp("export")
    target, data = tiny_setup(str(root))
    out = str(root / "out")
    argv = base_args(target, data, out, "--from-scratch", "--max-steps", "4", "--save-interval", "2")
    code = "import os, sys; os.umask(0o077); from trainer.__main__ import main; sys.exit(main(sys.argv[1:]))"
    p = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    return {"root": root, "target": target, "data": data, "out": out}


def trainer(*argv, umask=None):
    code = (f"import os, sys; os.umask({umask}); " if umask is not None else "import sys; ") + \
        "from trainer.__main__ import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True)


def documented_fields(doc: str = "export.md") -> list[tuple[str, str]]:
    """(field, consumers) of every row of docs/``doc``'s config.json table."""
    rows, inside = [], False
    for line in (ROOT / "docs" / doc).read_text().splitlines():
        if line.startswith("| field | written | consumer"):  # that table only: other tables name other things
            inside = True
        elif inside and not line.startswith("|"):
            break
        m = re.match(r"\| `([a-z_.A-Z]+)` \| [^|]+ \| (.+) \|$", line) if inside else None
        if m:
            rows.append((m.group(1), m.group(2)))
    return rows


def lookup(cfg: dict, dotted: str):
    node = cfg
    for part in dotted.split("."):
        assert isinstance(node, dict) and part in node, f"config.json lacks {dotted}"
        node = node[part]
    return node


def test_config_json_holds_every_field_docs_export_md_lists_for_each_consumer(run, tmp_path):
    dest = tmp_path / "exp"
    assert trainer("export", "--checkpoint", run["out"], "--out", str(dest)).returncode == 0
    cfg = json.loads((dest / "config.json").read_text())
    rows = documented_fields()
    assert len(rows) >= 25
    consumers = {"SGLang", "vLLM", "MLX", "transformers"}
    for field, who in rows:
        lookup(cfg, field)
        assert any(c in who for c in consumers), f"{field}: no consumer named"
    seen = {c for _, who in rows for c in consumers if c in who}
    assert seen == consumers  # every consumer's fields are listed
    # the values each consumer keys on
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert cfg["layer_types"] == ["full_attention"] * cfg["num_hidden_layers"] and cfg["sliding_window"] is None
    assert cfg["max_position_embeddings"] == json.load(open(os.path.join(run["target"], "config.json")))["max_position_embeddings"]
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]]
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    # today's loaders read the block size inside dflash_config, older ones at the top level
    assert cfg["dflash_config"]["block_size"] == cfg["block_size"] == 8


def loader_reads() -> list[dict]:
    """Rows of docs/export.md's per-loader table: loader, field, file:line, the name on that line."""
    rows, inside = [], False
    for line in (ROOT / "docs" / "export.md").read_text().splitlines():
        if line.startswith("| loader | field | read at |"):
            inside = True
        elif inside and not line.startswith("|"):
            break
        m = re.match(r"\| ([^|]+?) \| `([^`]+)` \| `([^`:]+):(\d+)` \| `([^`]+)` \|", line) if inside else None
        if m:
            rows.append({"loader": m.group(1), "field": m.group(2), "file": m.group(3), "line": int(m.group(4)),
                         "name": m.group(5)})
    return rows


def _installed_source(path: str) -> Path | None:
    """Where a recorded source file is on this machine: this repository, or vLLM in .venv-vllm."""
    if path.startswith("trainer/"):
        return ROOT / path
    for site in (ROOT / ".venv-vllm").glob("lib/python*/site-packages"):
        if (site / path).is_file():
            return site / path
    return None


def test_every_loader_field_recorded_in_docs_is_in_the_export(run, run2, tmp_path):
    rows = loader_reads()
    loaders = {r["loader"] for r in rows}
    assert {"transformers + shipped modeling file", "vLLM DFlash", "vLLM DFlash2", "SGLang", "z-lab transformers",
            "MLX (z-lab `load_draft`)"} <= loaders and len(rows) >= 60
    exports = {}
    for name, r in (("dflash", run), ("dflash2", run2)):
        dest = tmp_path / name
        assert trainer("export", "--checkpoint", r["out"], "--out", str(dest)).returncode == 0
        exports[name] = json.loads((dest / "config.json").read_text())
    checked = 0
    for row in rows:
        dflash2_only = row["loader"] == "vLLM DFlash2" or "DFlash2 only" in (row["name"] + row["field"]) or \
            row["field"].split(".")[-1] in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
        lookup(exports["dflash2"], row["field"])  # a DFlash2 export carries every field
        if not dflash2_only:
            lookup(exports["dflash"], row["field"])
        src = _installed_source(row["file"])
        if src is not None:  # the recorded read is really there
            lines = src.read_text().splitlines()
            assert row["name"] in lines[row["line"] - 1], f"{row['file']}:{row['line']} does not name {row['name']}"
            checked += 1
    assert checked >= 25  # this repository's and the installed vLLM's rows, each against its line


@pytest.mark.parametrize("dtype", ["fp8", "int4", "awq"])
def test_a_quantized_export_is_refused_with_the_reason_and_nothing_written(run, tmp_path, dtype):
    dest = tmp_path / "exp"
    p = trainer("export", "--checkpoint", run["out"], "--out", str(dest), "--dtype", dtype)
    assert p.returncode == 2 and not dest.exists()
    line = p.stderr.strip()
    assert "\n" not in line and f"--dtype {dtype}" in line and "vllm-project/vllm#51581" in line


def test_weights_are_bf16_by_default_and_fp32_on_request_equal_to_the_masters(run, tmp_path):
    from safetensors.torch import load_file

    masters = ckpt_io.load(os.path.join(run["out"], "step_4"))["model"]
    default = load_file(str(Path(run["out"]) / "step_4" / "drafter" / "model.safetensors"))
    assert set(default) == set(masters) and {t.dtype for t in default.values()} == {torch.bfloat16}
    for k, v in masters.items():
        assert torch.equal(default[k], v.to(torch.bfloat16))
    assert trainer("export", "--checkpoint", run["out"], "--out", str(tmp_path / "fp32"), "--dtype", "fp32").returncode == 0
    full = load_file(str(tmp_path / "fp32" / "model.safetensors"))
    assert all(full[k].dtype == torch.float32 and torch.equal(full[k], v) for k, v in masters.items())
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["dtype"] == "float32"


def modes(directory: Path) -> dict:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in [directory, *directory.iterdir()]}


def test_files_are_world_readable_even_under_umask_077(run, tmp_path):
    saved = Path(run["out"]) / "step_4" / "drafter"  # written by the trainer under umask 077
    assert modes(saved) == {"drafter": 0o755, "config.json": 0o644, "model.safetensors": 0o644,
                            "modeling_dflash.py": 0o644, "README.md": 0o644, "dflash_eval.json": 0o644}
    assert stat.S_IMODE(saved.parent.stat().st_mode) == 0o755  # step_N/ reachable
    dest = tmp_path / "exp"
    assert trainer("export", "--checkpoint", run["out"], "--out", str(dest), umask="0o077").returncode == 0
    assert modes(dest) == {"exp": 0o755, "config.json": 0o644, "model.safetensors": 0o644,
                           "modeling_dflash.py": 0o644, "README.md": 0o644, "dflash_eval.json": 0o644}


def test_the_export_equals_the_checkpoints_drafter_dir_byte_for_byte(run, tmp_path):
    dest = tmp_path / "exp"
    assert trainer("export", "--checkpoint", os.path.join(run["out"], "step_4"), "--out", str(dest)).returncode == 0
    saved = Path(run["out"]) / "step_4" / "drafter"
    assert drafter_dir.manifest(str(dest))["files"] == drafter_dir.manifest(str(saved))["files"]


def test_checkpoint_forms_and_step_select_the_same_export(run, tmp_path):
    out, s2 = run["out"], os.path.join(run["out"], "step_2")
    assert X.resolve(out) == os.path.join(out, "step_4")  # the newest complete
    assert X.resolve(out, 2) == X.resolve(s2) == X.resolve(os.path.join(s2, "checkpoint.pt")) == s2
    assert X.resolve(out, 2) == s2
    # a run directory: its checkpoint events name the output dir (here the run dir is the output dir)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text(json.dumps({"kind": "checkpoint", "step": 4,
                                                      "path": os.path.join(out, "step_4", "checkpoint.pt")}) + "\n")
    assert X.resolve(str(run_dir)) == os.path.join(out, "step_4")


def refused(argv, expect, tmp_path):
    before = sorted(os.listdir(tmp_path))
    p = trainer("export", *argv)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m trainer export: error: ") and expect in lines[0], p.stderr
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, no temp dir left
    return p


def test_refusals_are_one_line_and_leave_nothing(run, tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    refused(["--checkpoint", run["out"], "--out", str(full)], "is not empty", tmp_path)
    assert os.listdir(full) == ["keep.txt"]
    refused(["--checkpoint", run["out"], "--out", str(tmp_path / "x"), "--step", "3"],
            "--step 3: ", tmp_path)
    half = tmp_path / "half"
    (half / "step_6").mkdir(parents=True)  # a save that died before checkpoint.pt
    refused(["--checkpoint", str(half), "--out", str(tmp_path / "y")], "no complete checkpoint", tmp_path)
    refused(["--checkpoint", str(half / "step_6"), "--out", str(tmp_path / "y")], "holds no checkpoint.pt", tmp_path)
    refused(["--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "y")], "no such checkpoint", tmp_path)


def test_an_export_that_fails_midway_leaves_nothing_at_out(run, tmp_path, monkeypatch):
    import safetensors.torch

    def dying(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", dying)
    with pytest.raises(OSError):
        X.export(run["out"], str(tmp_path / "exp"))
    assert os.listdir(tmp_path) == []  # neither DIR nor its temp directory


def test_an_empty_out_dir_is_filled(run, tmp_path):
    (tmp_path / "exp").mkdir()
    X.export(run["out"], str(tmp_path / "exp"))
    assert sorted(os.listdir(tmp_path / "exp")) == ["README.md", "config.json", "dflash_eval.json", "model.safetensors", "modeling_dflash.py"]


@pytest.mark.parametrize("argv", [["--help"], ["export", "--help"], ["flags", "--help"], ["prepare", "--help"]])
def test_help_exits_0_without_a_traceback(argv):
    p = subprocess.run([sys.executable, "-m", "trainer", *argv], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0 and "Traceback" not in p.stderr and "usage:" in p.stdout, p.stderr


def test_sliding_layers_are_written_generically_and_masked_as_documented():
    """A drafter config with sliding layers (the hybrid trainer's, once merged) is exported as
    it says; the modeling file windows the context and makes the block causal there."""
    from trainer.layers.hf_dflash import block_mask

    base = {"num_hidden_layers": 2, "dflash_config": {"mask_token_id": 5, "target_layer_ids": [1]}, "block_size": 4,
            "rope_theta": 1e4}
    cfg = drafter_dir.hf_config({**base, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3}, {})
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] and cfg["sliding_window"] == 3
    assert cfg["use_sliding_window"] is True
    with pytest.raises(X.ExportError, match="no sliding_window"):
        drafter_dir.hf_config({**base, "layer_types": ["sliding_attention", "full_attention"]}, {})
    anchors, keep = torch.tensor([[6]]), torch.ones(1, 1, dtype=torch.bool)
    full = block_mask(anchors, keep, 6, 4)[0, 0]
    win = block_mask(anchors, keep, 6, 4, window=3)[0, 0]
    assert full[:, :6].all() and full[:, 6:].all()  # all context, the block both ways
    # query j sits at position 6 + j: it sees context positions > 6 + j - 3, i.e. 4.. for j = 0
    assert win[0, :6].tolist() == [False, False, False, False, True, True]
    assert win[3, :6].tolist() == [False] * 6
    assert win[:, 6:].tolist() == torch.ones(4, 4, dtype=torch.bool).tril().tolist()


# -- DFlash2 (docs/dflash2.md): the fields and tensor names its loaders read, and a reload

@pytest.fixture(scope="module")
def run2(tmp_path_factory, run):
    out = str(tmp_path_factory.mktemp("export-dflash2") / "out")
    p = trainer(*base_args(run["target"], run["data"], out, "--from-scratch", "--max-steps", "3",
                           "--drafter-arch", "dflash2", "--lr", "1e-2"))
    assert p.returncode == 0, p.stderr[-2000:]
    return {**run, "out": out}


def test_a_dflash2_export_holds_every_field_docs_dflash2_md_lists_and_the_published_tensor_names(run2, tmp_path):
    from safetensors import safe_open

    from trainer import arch

    dest = tmp_path / "exp"
    assert trainer("export", "--checkpoint", run2["out"], "--out", str(dest)).returncode == 0
    cfg = json.loads((dest / "config.json").read_text())
    rows = documented_fields("dflash2.md")
    assert len(rows) >= 9
    for field, _ in rows + documented_fields():  # DFlash2's fields, and every DFlash field still there
        lookup(cfg, field)
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DFlash2DraftModel"}
    fl = cfg["dflash_config"]
    assert {k: fl[k] for k in arch.DFLASH2_FIELDS} == {"conv_kernel_size": 2, "conv_group_size": 16,
                                                        "selector_rank": 256, "selector_top_k": 16}
    assert fl["block_size"] == cfg["block_size"] == 8 and "is_causal" not in cfg
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    want = {"candidate_selector.predecessor_codebook": [V, 256], "candidate_selector.successor_codebook": [V, 256],
            "candidate_selector.hidden_projection.weight": [256, H]}
    for i in range(L):
        for conv in ("attention_conv", "mlp_conv"):
            want[f"layers.{i}.{conv}.base_kernel"] = [2, 2, H]
            want[f"layers.{i}.{conv}.kernel_projection.weight"] = [4 * H // 16, H]
    with safe_open(str(dest / "model.safetensors"), framework="pt") as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    assert {k: shapes.get(k) for k in want} == want
    dflash = json.loads((Path(run2["root"]) / "out" / "step_4" / "drafter" / "config.json").read_text())
    assert {k for k in shapes if not arch.is_dflash2_only(k)} == set(_tensor_names(Path(run2["root"]) / "out" / "step_4"))
    assert dflash["architectures"] == ["DFlashDraftModel"]
    card = (dest / "README.md").read_text()
    assert "# DFlash2 drafter, step 3" in card and "conv_kernel_size 2, conv_group_size 16" in card


def _tensor_names(step_dir: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(step_dir / "drafter" / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def test_a_dflash2_export_reloads_in_our_loader_with_the_masters_and_their_drafts(run2, tmp_path):
    from trainer.data import PreparedData
    from trainer.serve.evaluate import prompts_from, speculative
    from trainer.model import Drafter, FrozenHead
    from trainer.target import Target

    dest = tmp_path / "exp32"
    assert trainer("export", "--checkpoint", run2["out"], "--out", str(dest), "--dtype", "fp32").returncode == 0
    masters = ckpt_io.load_drafter(os.path.join(run2["out"], "step_3")).eval()
    back = Drafter.from_pretrained(str(dest)).eval()
    assert back.config == masters.config and back.config.arch == "dflash2"
    for name, t in masters.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    target = Target(run2["target"], back.config.target_layer_ids, "cpu", torch.float32)
    head = FrozenHead(target.embed, target.lm_head)
    for p in prompts_from(PreparedData(run2["data"]), 3):
        assert speculative(target, back, head, p, 16) == speculative(target, masters, head, p, 16)
