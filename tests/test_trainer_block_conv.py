"""DFlash2's within-block convolution in the chunked step (trainer/layers/block_conv.py): the same
numbers as the export's formula (trainer/layers/hf_dflash.py), and only what the memory model
counts kept for backward."""

import pytest
import torch

from trainer.layers import block_conv

from trainer.plan import memory
from trainer.plan.flops import ModelShape
from trainer.layers.hf_dflash import grouped_conv as formula
from trainer.model import DrafterConfig, Layer


@pytest.mark.parametrize("taps,block", [(2, 4), (3, 8)])
def test_the_lean_convolution_gives_the_formulas_output_and_autograds_gradients(taps, block):
    g = torch.Generator().manual_seed(taps)
    b, nb, H, gs = 2, 3, 16, 4
    x = torch.randn(b, nb * block, H, generator=g, dtype=torch.float64)
    # the dynamic taps as conv_prepare hands them over: a strided view of both sides' projection
    both = torch.randn(b, nb * block, 2, taps, H // gs, generator=g, dtype=torch.float64)
    base = torch.randn(taps, H, generator=g, dtype=torch.float64)
    grad = torch.randn(b, nb * block, H, generator=g, dtype=torch.float64)

    def run(fn):
        xs, ds, bs = (t.clone().requires_grad_(True) for t in (x, both, base))
        out = fn(xs, ds[..., 0, :, :], bs, gs, block)
        out.backward(grad)
        return out.detach(), xs.grad, ds.grad, bs.grad

    ref, lean = run(formula), run(block_conv.grouped_conv)
    assert torch.equal(ref[0], lean[0])
    for want, got in zip(ref[1:], lean[1:]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert lean[2][..., 1, :, :].abs().max() == 0  # the other side's taps get nothing from this side


def _saved_bytes_per_position(arch: str, blocks: int) -> int:
    """Bytes of the distinct storages one chunked-step layer keeps for backward, on
    ``blocks`` blocks of 8 positions (float32 throughout: no weight casts)."""
    torch.manual_seed(0)
    c = DrafterConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=96, num_hidden_layers=1,
                      num_target_layers=4, target_layer_ids=[1], block_size=8, mask_token_id=95, arch=arch)
    layer = Layer(c)
    if arch == "dflash2":
        layer.add_convolutions(c)
    Q, S = blocks * 8, 16
    x = torch.randn(1, Q, 64, requires_grad=True)
    kv = (torch.randn(1, 2, S, 16, requires_grad=True), torch.randn(1, 2, S, 16, requires_grad=True))
    cos, sin = torch.ones(Q, 16), torch.zeros(Q, 16)

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))

    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer.block_forward(x, kv, cos, sin, {layer.layer_type: attend}, torch.float32, 8)
    return sum(storages.values())


def test_a_dflash2_layer_keeps_for_backward_what_the_memory_model_adds_for_it():
    """Per block position, what a DFlash2 layer of the chunked step keeps beyond a DFlash
    layer is trainer/plan/memory.py's convolution term (the convolved input and the pre-conv output
    of each sublayer, both sides' dynamic taps), not the plain-autograd formula's broadcast
    kernels and shifted copies (5.0 GiB more at the operators' config on an H200)."""
    slope = {a: (_saved_bytes_per_position(a, 12) - _saved_bytes_per_position(a, 4)) / 64 for a in ("dflash", "dflash2")}
    shape = ModelShape(1, 64, 4, 2, 16, 128, 96, "t")
    modelled = (memory.drafter_act_elems_per_position_layer(shape, "dflash2")
                - memory.drafter_act_elems_per_position_layer(shape, "dflash")) * 4
    assert slope["dflash2"] - slope["dflash"] == modelled


def test_the_compiled_convolution_gives_the_eager_numbers(monkeypatch):
    """On CUDA the forward formula and the backward arithmetic run compiled; the
    same compiled functions, here on CPU, against the eager path."""
    monkeypatch.setattr(block_conv, "_COMPILED_ON", {"cuda", "cpu"})
    monkeypatch.setattr(block_conv, "_COMPILED", {})
    g = torch.Generator().manual_seed(5)
    b, nb, block, H, gs, taps = 1, 3, 8, 32, 16, 2
    x = torch.randn(b, nb * block, H, generator=g)
    dyn = torch.randn(b, nb * block, taps, H // gs, generator=g)
    base = torch.randn(taps, H, generator=g)
    grad = torch.randn(b, nb * block, H, generator=g)

    def run(compiled: bool):
        monkeypatch.setattr(block_conv, "EAGER", not compiled)
        xs, ds, bs = (t.clone().requires_grad_(True) for t in (x, dyn, base))
        out = block_conv.grouped_conv(xs, ds, bs, gs, block)
        out.backward(grad)
        return out.detach(), xs.grad, ds.grad, bs.grad

    eager, compiled = run(False), run(True)
    assert len(block_conv._COMPILED) == 2  # the forward formula and the backward, each compiled once
    for want, got in zip(eager, compiled):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
