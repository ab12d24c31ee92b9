"""trainer/gpu/head_kernels.py's Triton passes give chunked_head's reference numbers: the
statistics (lse, ce, top-1, lse of z/T and of z_t/T, KL) and the gradient of the logits, hard
and soft, T = 2 (the squared-exponential path) and another T, rows that end in a partial block;
and the whole chunked head loss through them equals the naive head's loss and gradient.

Where a GPU exists the kernels run on it; elsewhere under Triton's interpreter
(TRITON_INTERPRET=1, CPU tensors) when triton is importable; otherwise the tests skip (the CPU
path never uses these kernels)."""

import os

import pytest
import torch

pytest.importorskip("triton")

from _triton_interp import CUDA, kernel_fixture  # noqa: E402
from trainer.gpu import head_kernels as hk  # noqa: E402
from trainer.gpu import chunked_head as ch  # noqa: E402
from trainer.loss import dflash_loss_fn  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


# the interpreter runs block by block in numpy: small blocks, several per row
small_blocks = kernel_fixture(hk, STATS_CONFIG=(256, 4), GRAD_CONFIG=(256, 4), TOPK_CONFIG=(64, 4),
                              SELECT_CONFIG=(128, 4))


def _inputs(R, V, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(R, V, generator=g) * 3).to(dtype)
    zt = (torch.randn(R, V, generator=g) * 3).to(dtype)
    t = torch.randint(0, V, (R,), generator=g)
    t[0] = int(z[0].float().argmax())  # one row whose top-1 is right
    z[1, 7] = z[1, V - 3] = z[1].max() + 1  # a tie for the maximum: the first index wins, as torch.argmax
    t[1] = 7
    return z.to(DEV), zt.to(DEV), t.to(DEV)


def _close(a, b, tol=2e-5):
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all()
    assert float((a - b).norm() / b.norm().clamp_min(1e-30)) < tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [2.0, 1.5])
def test_the_soft_statistics_are_the_reference_ones(dtype, T):
    z, zt, t = _inputs(6, 1000, dtype, 0)
    got = hk.stats_soft(z, zt, t, T)
    want = ch._stats_soft(z, zt, t, T)
    for name, a, b in zip(("lse", "ce", "correct", "lse_s", "lse_t", "kl"), got, want):
        if name == "correct":
            assert a.dtype == torch.bool and a.tolist() == b.tolist()
        else:
            _close(a, b, 1e-4 if name == "kl" else 2e-6)
    assert got[2][:2].tolist() == [True, True]


def test_the_hard_statistics_are_the_reference_ones():
    z, _, t = _inputs(5, 777, torch.bfloat16, 1)
    got, want = hk.stats(z, t), ch._stats(z, t)
    _close(got[0], want[0], 2e-6), _close(got[1], want[1], 2e-6)
    assert got[2].tolist() == want[2].tolist()


@pytest.mark.parametrize("soft", [True, False])
def test_the_gradient_of_the_logits_is_the_reference_one(soft):
    z, zt, t = _inputs(4, 600, torch.bfloat16, 2)
    g = torch.Generator().manual_seed(3)
    g_ce, g_kl = (torch.rand(4, generator=g).to(DEV) for _ in range(2))
    T = 2.0
    lse, _, _, lse_s, lse_t, _ = ch._stats_soft(z, zt, t, T)
    if soft:
        got = hk.grad_soft(z, zt, lse, lse_s, lse_t, t, g_ce, g_kl, T, torch.bfloat16)
        want = ch._grad_soft(z.float(), zt, lse, lse_s, lse_t, t, g_ce, g_kl, T, torch.float32)
    else:
        got = hk.grad(z, lse, t, g_ce, torch.bfloat16)
        want = ch._grad(z.float(), lse, t, g_ce, torch.float32)
    assert got.dtype == torch.bfloat16 and got.shape == z.shape
    _close(got, want, 4e-3)  # bf16 output: its rounding


def test_teacher_rows_read_in_place_are_the_gathered_teacher():
    """One teacher row per distinct position, indexed per drafted row (overlapping blocks):
    both passes read the table in place and give exactly what gathering it first gives."""
    z, zt, t = _inputs(6, 700, torch.bfloat16, 5)
    table = zt[:4]
    rows = torch.tensor([0, 1, 1, 2, 3, 3], device=DEV)
    T = 2.0
    got = hk.stats_soft(z, table, t, T, teacher_rows=rows)
    want = hk.stats_soft(z, table.index_select(0, rows).contiguous(), t, T)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    lse, _, _, lse_s, lse_t, _ = want
    g = torch.Generator().manual_seed(6)
    g_ce, g_kl = (torch.rand(6, generator=g).to(DEV) for _ in range(2))
    gi = hk.grad_soft(z, table, lse, lse_s, lse_t, t, g_ce, g_kl, T, torch.bfloat16, teacher_rows=rows)
    gg = hk.grad_soft(z, table.index_select(0, rows).contiguous(), lse, lse_s, lse_t, t, g_ce, g_kl, T, torch.bfloat16)
    assert torch.equal(gi, gg)


def test_the_chunked_head_through_the_kernels_is_the_naive_head(monkeypatch):
    """Loss and ∂L/∂hidden of the chunked head (soft labels, CAP, chunks of 2 blocks) with the
    kernels in place of the reference passes, against plain autograd over all logits."""
    if not CUDA:
        monkeypatch.setitem(ch._FNS, ("cpu", False), (hk.stats, hk.stats_soft, hk.grad, hk.grad_soft, hk.topk))
    g = torch.Generator().manual_seed(4)
    nb, K, H, V = 6, 7, 32, 900
    h = torch.randn(nb, K, H, generator=g).to(DEV).requires_grad_(True)
    W = (torch.randn(V, H, generator=g) * 0.3).to(DEV)
    teacher = torch.randn(nb, K, H, generator=g).to(DEV)
    t = torch.randint(0, V, (nb, K), generator=g).to(DEV)
    w = torch.rand(nb, K, generator=g).to(DEV)
    fn = dflash_loss_fn(w, kl_weight=0.15, temperature=2.0, cap_lambda=0.1)
    total, ce, kl, _, cand = ch.chunked_head_loss(h, W, t, fn, teacher=teacher, temperature=2.0, chunk_rows=2 * K,
                                                  top_k=16)
    # the same teacher as a table of positions, two blocks sharing rows: spans through the kernels
    table = teacher.reshape(-1, H)
    rows = torch.arange(nb * K, device=DEV).view(nb, K)
    rows[1::2] = rows[0::2]  # each odd block repeats its even neighbour's teacher rows
    spans = ch.span_plan(ch.chunk_spans(rows, torch.ones(nb, dtype=torch.bool, device=DEV), 2 * K).tolist(), nb,
                         2 * K, K)
    assert all(sp is not None for sp in spans)  # each chunk: 7 positions for 14 rows
    fn_r = dflash_loss_fn(w, kl_weight=0.15, temperature=2.0, cap_lambda=0.1)
    total_r = ch.chunked_head_loss(h, W, t, fn_r, teacher=table, teacher_rows=rows, teacher_spans=spans,
                                   temperature=2.0, chunk_rows=2 * K)[0]
    total_g = ch.chunked_head_loss(h, W, t, fn_r, teacher=table[rows], temperature=2.0, chunk_rows=2 * K)[0]
    assert abs(float(total_r.detach()) - float(total_g.detach())) <= 1e-6 * abs(float(total_g.detach()))
    z = (h.detach().reshape(-1, H) @ W.t()).float()
    assert torch.equal(z.gather(-1, cand.reshape(-1, 16)), z.topk(16, dim=-1).values)  # DFlash2's candidates
    (gh,) = torch.autograd.grad(total, h)
    h2 = h.detach().double().requires_grad_(True)
    fn64 = dflash_loss_fn(w.double(), kl_weight=0.15, temperature=2.0, cap_lambda=0.1)
    ref = ch.naive_head_loss(h2, W.double(), t, fn64, teacher=teacher.double(), temperature=2.0)
    (gref,) = torch.autograd.grad(ref, h2)
    assert abs(float(total.detach()) - float(ref.detach())) < 1e-5 * abs(float(ref.detach()))
    _close(gh, gref, 1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_top_k_is_torch_topks_set_up_to_ties(dtype):
    """Each row's k largest, largest first, the same values as torch.topk's (a different index
    only among equal values); rows of equal values (past the buffer) go to torch.topk; the
    answer does not depend on the order the atomics appended in (two runs agree)."""
    g = torch.Generator().manual_seed(5)
    z = (torch.randn(9, 3000, generator=g) * 3).to(dtype)
    z[3] = 1.0  # every element ties at τ: past the buffer, torch.topk's own answer
    z[4, 100:110] = z[4].max() + 1  # ten equal maxima: all of them inside the top 16
    z = z.to(DEV)
    got, want = hk.topk(z, 16), z.topk(16, dim=-1)
    assert got.shape == (9, 16) and got.dtype == torch.long
    assert torch.equal(z.gather(-1, got), want.values)
    assert got[3].tolist() == want.indices[3].tolist()
    assert set(range(100, 110)) <= set(got[4].tolist())
    assert torch.equal(hk.topk(z, 16), got)
    assert hk.topk_fits(16, 151936) and not hk.topk_fits(12, 151936)


@pytest.mark.skipif(CUDA, reason="the interpreter's import order matters only without a GPU")
def test_the_kernels_run_under_the_interpreter_when_triton_was_imported_first():
    """The order CI's collection can produce: triton.language imported (here through
    trainer.model → transformers → torch._dynamo) before this module sets TRITON_INTERPRET.
    Before the fixture wrapped triton's own functions, every kernel test then failed with
    "Cannot call @triton.jit'd outside of the scope of a kernel"."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import sys, trainer.model, pytest; assert 'triton.language' in sys.modules; "
            "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_head_kernels.py', "
            "'-k', 'test_the_hard_statistics_are_the_reference_ones']))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "1 passed" in r.stdout
