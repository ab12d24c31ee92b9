"""trainer/silu_mul_kernel.py: SiLU(gate)·up and its gradient from the two Triton kernels
against the fp64 reference (within one rounding to the output dtype) and against PyTorch's
autograd, tiles that end inside the rows and the columns; the switch that routes
fused_ops.silu_mul through them; and the chunked drafter step's gradients with it on.

Where a GPU exists the kernels run on it; elsewhere under Triton's interpreter (CPU tensors)."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from _triton_interp import CUDA, kernel_fixture  # noqa: E402
from trainer import silu_mul_kernel as sk  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


interpreted = kernel_fixture(sk, CONFIG=(4, 16, 4))  # several tiles, partial in both directions


def _reference(gu, dy):
    """y and ∂L/∂gu in fp64 by autograd."""
    x = gu.double().detach().requires_grad_(True)
    g, u = x.chunk(2, -1)
    y = F.silu(g) * u
    y.backward(dy.double())
    return y.detach(), x.grad


def _rounding(t: torch.Tensor, dtype) -> torch.Tensor:
    """Half a unit in the last place of ``dtype`` at each value (the error of one rounding)."""
    mant = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[dtype]
    return torch.exp2(torch.floor(torch.log2(t.abs().clamp_min(1e-30))) - mant)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(7, 2 * 37), (2, 5, 2 * 16), (1, 2)])
def test_forward_and_backward_are_the_fp64_ones_rounded_once(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    gu = (torch.randn(shape, generator=g) * 4).to(dtype).to(DEV)
    dy = torch.randn(*shape[:-1], shape[-1] // 2, generator=g).to(dtype).to(DEV)
    y_ref, dgu_ref = _reference(gu, dy)
    y = sk.forward(gu)
    dgu = sk.backward(gu, dy)
    assert y.dtype == dtype and y.shape == y_ref.shape and dgu.shape == gu.shape and dgu.dtype == dtype
    # one rounding of the fp32 result, plus fp32's own error (sigmoid, products) well inside it;
    # Triton's interpreter converts fp32 → bf16 by truncation (a GPU: to nearest), a whole unit
    ulps = 1.01 if CUDA or dtype == torch.float32 else 2.01
    # (fp32's error is relative to the terms, which cancel where dg crosses zero)
    g_, u_ = gu.double().chunk(2, -1)
    terms = (dy.double().abs() * (g_.abs() + u_.abs() + 1)).repeat(*[1] * (gu.dim() - 1), 2)
    tol_y = _rounding(y_ref, dtype) * ulps + 1e-6 * y_ref.abs() + 1e-30
    tol_d = _rounding(dgu_ref, dtype) * ulps + 1e-6 * terms + 1e-30
    assert ((y.double() - y_ref).abs() <= tol_y).all()
    assert ((dgu.double() - dgu_ref).abs() <= tol_d).all()


def test_autograd_through_the_kernels_gives_pytorchs_gradient():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 2 * 24, generator=g, dtype=torch.float32).to(DEV)
    w = torch.randn(3, 4, 24, generator=g).to(DEV)
    a = x.clone().requires_grad_(True)
    (sk.silu_mul(a) * w).sum().backward()
    b = x.clone().requires_grad_(True)
    gate, up = b.chunk(2, -1)
    (F.silu(gate) * up * w).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_an_odd_last_dimension_is_refused_with_its_size():
    with pytest.raises(ValueError, match="last dimension of 7"):
        sk.forward(torch.zeros(2, 7, device=DEV))


def test_fused_ops_takes_the_kernels_only_on_cuda_and_with_the_switch(monkeypatch):
    from trainer import fused_ops as fo

    used = []
    monkeypatch.setattr(sk, "silu_mul", lambda gu: used.append(gu) or gu[..., : gu.shape[-1] // 2])
    gu = torch.randn(3, 8)
    monkeypatch.setattr(sk, "KERNEL", True)
    fo.silu_mul(gu)
    assert not used  # CPU: the eager function
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(fo, "_silu_mul_compiled", fo._silu_mul)
    fo.silu_mul(gu)
    assert len(used) == 1  # "CUDA" and switched on: the kernels
    monkeypatch.setattr(sk, "KERNEL", False)
    fo.silu_mul(gu)
    assert len(used) == 1  # off (the default until measured): Inductor's


def test_the_chunked_step_with_the_kernels_gives_the_eager_gradients(monkeypatch):
    """bf16 compute, fp32 master weights (the GPU step's dtypes) on CPU: the MLP's SiLU·up
    through the kernels against the eager function; the same loss and gradients within bf16's
    rounding of the MLP activations."""
    from test_gpu_blocks import _tiny_chunked_step_inputs

    from trainer import fast_drafter as fd
    from trainer import fused_ops as fo

    def run(kernel):
        monkeypatch.setattr(fo, "silu_mul", sk.silu_mul if kernel else fo._silu_mul)
        d, data, kw = _tiny_chunked_step_inputs("dflash", torch.float32, True, torch.bfloat16)
        out = fd.step_backward(d, data["embed"], data["lm_head"], data["input_ids"], data["taps"], data["loss_mask"],
                               data["lengths"], data["anchors"], data["keep"], dtype=torch.bfloat16, **kw)
        return float(out["loss"]), {n: p.grad for n, p in d.named_parameters()}

    loss_eager, g_eager = run(False)
    loss_kernel, g_kernel = run(True)
    assert loss_kernel == pytest.approx(loss_eager, rel=1e-2)
    for n, g in g_eager.items():
        rel = float((g_kernel[n] - g).norm() / g.norm().clamp_min(1e-12))
        assert rel < 3e-2, (n, rel)
