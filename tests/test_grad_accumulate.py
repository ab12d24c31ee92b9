"""trainer/grad_accumulate.py: the Triton kernel that adds a bf16/fp16 gradient into an fp32
accumulator gives PyTorch's ``dst.add_(src)`` to the last bit, leaves what it does not cover to
PyTorch, and the chunked step's gradients are unchanged when every add it covers goes through it.

Where a GPU exists the kernel runs on it; elsewhere under Triton's interpreter (CPU tensors)."""

import pytest
import torch

pytest.importorskip("triton")

from _triton_interp import CUDA, kernel_fixture  # noqa: E402
from trainer import grad_accumulate as ga  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


interpreted = kernel_fixture(ga, BLOCK=64)  # several programs and a partial last block


def _operands(n, src_dtype, seed):
    """Accumulators across 30 binades and gradients of their size, a thousandth of it and
    below: most sums round, some cancel exactly, some are subnormal."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-20, 10, (n,), generator=g).float())
    dst = torch.randn(n, generator=g) * scale
    src = torch.randn(n, generator=g) * scale * torch.exp2(torch.randint(-12, 1, (n,), generator=g).float())
    src = src.to(src_dtype)
    dst[:4] = -src[:4].float()  # exact cancellation
    dst[4:6] = torch.tensor([1e-40, -3e-39])[:max(0, min(2, n - 4))]  # subnormal accumulators
    return dst.to(DEV), src.to(DEV)


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 63, 64, 1000])
def test_the_kernel_adds_what_torch_adds_bit_for_bit(src_dtype, n):
    dst, src = _operands(n, src_dtype, n)
    want = dst.clone().add_(src)
    got = ga.kernel_add_(dst, src)
    assert got is dst
    assert torch.equal(dst, want)


def test_the_kernel_takes_row_ranges_and_the_context_kv_layout():
    """The step hands it a weight gradient's row range (q/k/v of the fused leaf) and one
    sequence of the context k/v accumulator, [b, S, nkv, hd] memory seen as [b, nkv, S, hd]
    (its gradient has the same strides)."""
    dst, src = _operands(12 * 37, torch.bfloat16, 7)
    dst, src = dst.view(12, 37), src.view(12, 37)
    want = dst.clone()
    want[3:8].add_(src[3:8])
    ga.kernel_add_(dst[3:8], src[3:8])
    assert torch.equal(dst, want)

    dst, src = _operands(3 * 10 * 2 * 4, torch.bfloat16, 8)
    dst, src = dst.view(3, 10, 2, 4).transpose(1, 2), src.view(3, 10, 2, 4).transpose(1, 2)
    assert not dst.is_contiguous()
    want = dst.clone()
    want[1:2].add_(src[1:2])
    ga.kernel_add_(dst[1:2], src[1:2])
    assert torch.equal(dst, want)


@pytest.mark.parametrize("case", ["fp64 dst", "fp32 src", "transposed dst", "other shape", "strided dst"])
def test_what_the_kernel_does_not_cover_is_refused_by_it_and_added_by_torch(case):
    dst, src = _operands(24, torch.bfloat16, 3)
    dst, src = dst.view(4, 6), src.view(4, 6)
    if case == "fp64 dst":
        dst = dst.double()
    elif case == "fp32 src":
        src = src.float()
    elif case == "transposed dst":
        dst, src = dst.view(6, 4).t(), src
    elif case == "other shape":
        src = src[:2]
    else:  # every other column: not one run of memory
        dst, src = torch.cat([dst, dst], 1)[:, ::2], src
    before = dst.clone()
    with pytest.raises(ValueError, match="fp32 dst in one run of memory"):
        ga.kernel_add_(dst, src)
    assert torch.equal(dst, before)  # refused before any write
    if case != "other shape":
        assert torch.equal(ga.add_(dst, src), before.add_(src))  # torch's add, any layout


@pytest.mark.skipif(CUDA, reason="the CPU route; on a GPU the step below runs the kernel itself")
def test_add_sends_cpu_tensors_to_torch_and_the_switch_turns_the_kernel_off(monkeypatch):
    dst, src = _operands(100, torch.bfloat16, 5)
    launched = []
    monkeypatch.setattr(ga, "KERNEL", True)  # DFLASH_ADD_KERNEL=1
    monkeypatch.setattr(ga, "_launch", lambda d, s: launched.append(1))
    ga.add_(dst, src)
    assert not launched  # CPU: torch's add
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    ga.add_(dst, src)
    assert launched == [1]  # "CUDA" and covered: the kernel
    monkeypatch.setattr(ga, "KERNEL", False)
    ga.add_(dst, src)
    assert launched == [1]  # switched off (the default until measured): torch's add


@pytest.mark.parametrize("arch,soft", [("dflash", False), ("dflash2", True)])
def test_the_chunked_step_gives_the_same_gradients_with_every_covered_add_in_the_kernel(arch, soft, monkeypatch):
    """fp32 master weights, bf16 compute, the GEMM weights cast once per step: every weight
    gradient after a chunk's first and every context k/v gradient is an fp32 += bf16 add; run
    through the kernel they give the gradients and loss of PyTorch's adds, bit for bit."""
    from test_gpu_blocks import _tiny_chunked_step_inputs

    from trainer import fast_drafter as fd

    def run(through_kernel):
        calls = []

        def add_(dst, src):
            if through_kernel and ga._covered(dst, src):
                calls.append(tuple(dst.shape))
                return ga.kernel_add_(dst, src)
            return dst.add_(src)
        monkeypatch.setattr(ga, "add_", add_)
        d, data, kw = _tiny_chunked_step_inputs(arch, torch.float32, soft, torch.bfloat16)
        outs = [fd.step_backward(d, data["embed"], data["lm_head"], data["input_ids"], data["taps"],
                                 data["loss_mask"], data["lengths"], data["anchors"], data["keep"],
                                 dtype=torch.bfloat16, loss_scale=scale, **kw) for scale in (1.0, 0.5)]
        return [float(o["loss"]) for o in outs], {n: p.grad for n, p in d.named_parameters()}, calls

    loss_torch, g_torch, _ = run(False)
    loss_kernel, g_kernel, calls = run(True)
    assert loss_kernel == loss_torch
    for n, g in g_torch.items():
        assert torch.equal(g_kernel[n], g), n
    layers = 2
    weight_adds = [s for s in calls if len(s) == 2]
    kv_adds = [s for s in calls if len(s) == 4]
    # 2 micro-batches × 6 chunks × 2 layers × 7 weights, less each weight's first chunk (a copy)
    assert len(weight_adds) == layers * 7 * (2 * 6 - 1)
    assert len(kv_adds) == 2 * 6 * layers * 2  # k and v of every layer in every chunk
