"""trainer/master_grad_linear.py: the chunked step's weight gradients added into the fp32
master ``.grad`` by the backward GEMM itself, instead of a bf16 gradient and an add.

On CPU the product is computed in the master dtype (no fp32-output GEMM of bf16 operands
here); the CUDA case runs where a GPU is (the device calls of issue 29)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from trainer import master_grad_linear as mgl  # noqa: E402
from tests.test_gpu_blocks import _tiny_chunked_step_inputs  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("device", DEVICES)
def test_accumulate_adds_each_parameters_rows_of_the_unrounded_product(device):
    """A fused weight of three parameters (q|k|v-like rows): each .grad gets its own rows of
    dy.t() @ x, written the first time and added after, with fp32 sums (no bf16 rounding of the
    product: closer to the fp64 truth than a bf16 gradient added in fp32, as the hook did)."""
    g = torch.Generator().manual_seed(0)
    N, i = 512, 96
    params = [torch.zeros(r, i, device=device, requires_grad=True) for r in (64, 32, 32)]
    frozen = torch.zeros(16, i, device=device, requires_grad=False)
    rows = mgl.rows_of(params + [frozen])
    dys = [torch.randn(N, 144, generator=g).to(device, torch.bfloat16) for _ in range(2)]
    xs = [torch.randn(N, i, generator=g).to(device, torch.bfloat16) for _ in range(2)]
    hook_path = [None] * 3
    for dy, x in zip(dys, xs):
        mgl.accumulate(rows, None, dy, x)
        for j, r in enumerate(rows[:3]):
            bf16 = (dy[:, r.lo:r.hi].t() @ x)  # what autograd's bf16 GEMM hands the hook
            hook_path[j] = bf16.float() if hook_path[j] is None else hook_path[j] + bf16.float()
    assert frozen.grad is None
    for j, r in enumerate(rows[:3]):
        p = params[j]
        assert p.grad is not None and p.grad.dtype == torch.float32 and p.grad.shape == p.shape
        truth = sum(dy[:, r.lo:r.hi].t().double() @ x.double() for dy, x in zip(dys, xs))
        err, hook_err = _rel(p.grad, truth), _rel(hook_path[j], truth)
        assert err < 1e-6, (j, err)
        assert hook_err > 10 * err, (j, err, hook_err)


def test_accumulate_adds_bias_rows_and_writes_a_first_grad():
    b = [torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)]
    w = [torch.zeros(3, 4, requires_grad=True), torch.zeros(2, 4, requires_grad=True)]
    dy = torch.arange(10.0).view(2, 5)
    x = torch.ones(2, 4)
    mgl.accumulate(mgl.rows_of(w), mgl.rows_of(b), dy, x)
    mgl.accumulate(mgl.rows_of(w), mgl.rows_of(b), dy, x)
    assert torch.equal(b[0].grad, 2 * torch.tensor([5.0, 7.0, 9.0]))
    assert torch.equal(b[1].grad, 2 * torch.tensor([11.0, 13.0]))
    assert torch.equal(w[1].grad, 2 * torch.tensor([[11.0] * 4, [13.0] * 4]))


def test_a_fused_weights_gradients_are_rows_of_one_matrix_and_a_replaced_grad_is_taken_back_in():
    """q|k|v's gradients are row ranges of one fp32 matrix (one GEMM per chunk adds into all
    three); a .grad replaced between chunks (AccumulateGrad adding out of place, a user's
    clone) keeps its value and is made a row range again; a frozen parameter's rows are skipped."""
    torch.manual_seed(2)
    q, k, v = (torch.zeros(r, 3, requires_grad=True) for r in (4, 2, 2))
    rows = mgl.rows_of([q, k, v])
    dys, xs = [torch.randn(5, 8) for _ in range(3)], [torch.randn(5, 3) for _ in range(3)]
    mgl.accumulate(rows, None, dys[0], xs[0])
    storage = q.grad.untyped_storage().data_ptr()
    assert all(p.grad.untyped_storage().data_ptr() == storage for p in (q, k, v))
    assert (k.grad.storage_offset(), v.grad.storage_offset()) == (q.grad.storage_offset() + 12, q.grad.storage_offset() + 18)
    k.grad = k.grad.clone() + 1.0
    mgl.accumulate(rows, None, dys[1], xs[1])
    again = q.grad.untyped_storage().data_ptr()
    mgl.accumulate(rows, None, dys[2], xs[2])
    assert q.grad.untyped_storage().data_ptr() == again  # still one matrix: added into, not remade
    want = sum(dy.t() @ x for dy, x in zip(dys, xs))
    assert torch.allclose(q.grad, want[:4], atol=1e-5) and torch.allclose(v.grad, want[6:], atol=1e-5)
    assert torch.allclose(k.grad, want[4:6] + 1.0, atol=1e-5)
    assert k.grad.untyped_storage().data_ptr() == q.grad.untyped_storage().data_ptr()
    frozen = torch.zeros(2, 3, requires_grad=False)
    w = torch.zeros(4, 3, requires_grad=True)
    mgl.accumulate(mgl.rows_of([w, frozen]), None, dys[0][:, :6], xs[0])
    assert frozen.grad is None and torch.allclose(w.grad, dys[0][:, :4].t() @ xs[0], atol=1e-6)


def test_linear_gives_x_its_gradient_and_the_weight_none():
    torch.manual_seed(1)
    p = torch.randn(6, 5, requires_grad=True)
    bias = torch.randn(6, requires_grad=True)
    x = torch.randn(2, 3, 5, requires_grad=True)
    y = mgl.linear(x, p.detach(), bias.detach(), mgl.rows_of([p]), mgl.rows_of([bias]))
    (y * torch.arange(6.0)).sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    p_ref, b_ref = p.detach().clone().requires_grad_(True), bias.detach().clone().requires_grad_(True)
    (torch.nn.functional.linear(x_ref, p_ref, b_ref) * torch.arange(6.0)).sum().backward()
    assert torch.allclose(x.grad, x_ref.grad) and torch.allclose(p.grad, p_ref.grad, atol=1e-6)
    assert torch.allclose(bias.grad, b_ref.grad)


class _GradAdds(TorchDispatchMode):
    """Counts fp32 += bf16 adds into tensors shaped like a GEMM weight (the hook's adds)."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.adds, self.gemm_into = shapes, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.add_.Tensor and tuple(args[0].shape) in self.shapes \
                and args[0].dtype == torch.float32 and args[1].dtype == torch.bfloat16:
            self.adds += 1
        if func.overloadpacket is torch.ops.aten.addmm_ or func is torch.ops.aten.addmm.dtype_out:
            if tuple(args[0].shape) in self.shapes:  # CPU's fallback, CUDA's fp32-output GEMM
                self.gemm_into += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("arch,param_dtype,dtype,soft,device", [
    ("dflash", torch.float32, torch.bfloat16, False, "cpu"), ("dflash", torch.float32, torch.bfloat16, True, "cpu"),
    ("dflash2", torch.float32, torch.bfloat16, True, "cpu"), ("dflash", torch.float64, torch.float32, True, "cpu")]
    + [("dflash", torch.float32, torch.bfloat16, True, "cuda")] * torch.cuda.is_available())
def test_the_chunked_step_with_gradients_into_grad_gives_the_same_loss_and_the_hooks_gradients(
        arch, param_dtype, dtype, soft, device, monkeypatch):
    """The whole chunked step (two accumulated micro-batches, soft labels + D-PACE, DFlash2's
    convolutions and selector) with the weight GEMMs adding into .grad against the hook path:
    the same loss to the last bit (the forward is unchanged), every parameter's gradient there,
    in the master dtype, the GEMM weights' within the compute dtype's rounding of the hook's and
    the other parameters' bit for bit; and no bf16 weight gradient is added into a .grad."""
    from trainer import fast_drafter as fd

    monkeypatch.setattr(fd, "CAST_ONCE", True)

    def run(into_grad):
        monkeypatch.setattr(mgl, "ENABLED", into_grad)
        d, data, kw = _tiny_chunked_step_inputs(arch, param_dtype, soft, dtype)
        d = d.to(device)
        data = {k: v.to(device) for k, v in data.items()}
        if kw["teacher_final"] is not None:
            kw["teacher_final"] = kw["teacher_final"].to(device)
        shapes = {tuple(p.shape) for n, p in d.layers.named_parameters() if n.endswith("proj.weight")}
        counter = _GradAdds(shapes)
        with counter:
            outs = [fd.step_backward(d, data["embed"], data["lm_head"], data["input_ids"], data["taps"],
                                     data["loss_mask"], data["lengths"], data["anchors"], data["keep"], dtype=dtype,
                                     loss_scale=scale, **kw) for scale in (1.0, 0.5)]
        return [float(o["loss"]) for o in outs], {n: p.grad for n, p in d.named_parameters()}, counter

    loss_hook, g_hook, c_hook = run(False)
    loss_into, g_into, c_into = run(True)
    assert loss_into == loss_hook
    assert g_into.keys() == g_hook.keys()
    rounding = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for n, g in g_hook.items():
        assert g is not None and g_into[n] is not None, n
        assert g_into[n].dtype == param_dtype, n
        if n.startswith("layers.") and n.endswith("proj.weight"):
            assert _rel(g_into[n], g) < rounding, (n, _rel(g_into[n], g))
        else:
            assert torch.equal(g_into[n], g), n
    if dtype == torch.bfloat16:
        assert c_hook.adds > 0 and c_hook.gemm_into == 0
        assert c_into.adds == 0 and c_into.gemm_into > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fp32-output GEMM of bf16 operands is CUDA's")
def test_this_cuda_build_runs_the_fused_gemm():
    """On the device: the trainer takes the fused path only where this probe passes; a build
    without it would quietly keep the hook path, so the device call says which it is."""
    assert mgl.fused_gemm_supported(torch.device("cuda"))
