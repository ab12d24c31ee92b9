"""The drafter's GEMMs in FP8 training (``--drafter-precision fp8``): torchao's float8 training
with row-wise scales (the better-kept path for FP8 training), over the drafter's own linear layers.

What changes and what does not:

* the converted layers are the drafter's GEMMs — ``fc`` and, per layer, q/k/v/o and gate/up/down
  (:data:`GEMMS`) — where both dimensions are multiples of 16 (``torch._scaled_mm``'s rule);
  DFlash2's kernel projection and selector projection stay as they are (small, and the chunked
  step reads their weights directly), the frozen target and its LM head are never touched;
* each GEMM's three products (output, input gradient, weight gradient) run in e4m3 with a scale
  per row of each operand, taken dynamically on every call (torchao's ``rowwise`` recipe:
  scales rounded down to powers of two), accumulating in fp32, writing the compute dtype;
* the parameters stay what they were: fp32 master weights, AdamW and its state unchanged, the
  same ``state_dict`` keys and tensors — a checkpoint of an FP8-trained drafter is an ordinary
  one (it resumes, initialises and exports as a bf16 run's does);
* the chunked step (trainer/gpu/fast_drafter.py) fuses q|k|v and gate|up and casts the weights
  once per step (model.StepGemmWeights): a fused GEMM goes through :func:`mm` when every part of
  it is converted. Per-row (per-output-channel) weight scales make the fused product the
  parts' products side by side, so fusing changes no number.

torchao is imported only here and only by a run that asks for FP8 (:func:`missing` says why it
cannot, :data:`INSTALL` how to get it). On CUDA each GEMM with its casts is compiled (the casts
fused into one pass per operand: as eager passes of their own they cost more than the FP8 GEMM
saves — trainer/gpu/fp8.py's measurement); on CPU it runs eagerly on torch's CPU scaled matmul.
"""

from __future__ import annotations

import importlib
import logging
import sys

import torch
import torch.nn as nn

from trainer.layers import fused_ops as fo

# The drafter's linear layers that become FP8 (leaf names in trainer/model.py).
GEMMS = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RECIPE = "rowwise"
# The command that gives a container torchao (the trainer's ``fp8`` extra in pyproject.toml pins it);
# torchao 0.18 is built against torch 2.11 and newer.
INSTALL = "ctl env install torchao --container ID"


def missing() -> str | None:
    """Why torchao's float8 training cannot be imported here; None when it can."""
    try:
        _torchao()
    except Exception as exc:  # noqa: BLE001 - the reason is the answer
        return f"torchao's float8 training does not import ({type(exc).__name__}: {str(exc)[:160]})"
    return None


def _torchao():
    """torchao.float8, imported with its logger quieted: its package import tries to load CUDA
    extensions that float8 training does not use and warns once per file where they cannot
    load (a CPU-only torch)."""
    log = logging.getLogger("torchao")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return importlib.import_module("torchao.float8")
    finally:
        log.setLevel(level)


def convertible(name: str, module: nn.Module) -> bool:
    """Whether the drafter's submodule ``name`` becomes an FP8 GEMM."""
    return (type(module) is nn.Linear and name.rsplit(".", 1)[-1] in GEMMS
            and all(d % 16 == 0 for d in module.weight.shape))


def convert(drafter: nn.Module) -> list[str]:
    """The drafter's GEMMs swapped for torchao's Float8Linear in place (the same Parameter
    objects: an optimizer made before or after sees the same tensors). Returns their names."""
    f8 = _torchao()
    chosen = {n for n, m in drafter.named_modules() if convertible(n, m)}
    f8.convert_to_float8_training(drafter, module_filter_fn=lambda m, fqn: fqn in chosen,
                                  config=f8.Float8LinearConfig.from_recipe_name(RECIPE))
    return sorted(chosen)


def is_fp8(module) -> bool:
    mod = sys.modules.get("torchao.float8.float8_linear")
    return mod is not None and isinstance(module, mod.Float8Linear)


def converted(drafter: nn.Module) -> list[str]:
    return [n for n, m in drafter.named_modules() if is_fp8(m)]


_MM: dict = {}
_FN: list = []


def _matmul():
    """torchao's FP8 training matmul (``matmul_with_hp_or_float8_args``) whose backward skips the
    input gradient when the input needs none. The drafter's fc reads the frozen target's taps:
    torchao's own backward would still form their gradient — a GEMM as large as fc's forward
    and a [T, n·H] buffer (2 GiB at 49,152 tokens of Qwen3-8B) — and throw it away."""
    if not _FN:
        _torchao()
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args as base
        from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import GemmInputRole

        def cast(t, cc, mmc, role, dim, pow2):
            return hp_tensor_to_float8_dynamic(t, cc.target_dtype, mmc, gemm_input_role=role,
                                               scaling_granularity=cc.scaling_granularity,
                                               axiswise_dim=get_maybe_axiswise_dim(dim, cc.scaling_granularity),
                                               round_scales_to_power_of_2=pow2)

        # in the graph as torchao's own is (allow_in_graph is per class, not inherited): AOTAutograd
        # traces its casts and GEMMs, and the casts fuse
        @torch._dynamo.allow_in_graph
        class Matmul(base):
            @staticmethod
            def backward(ctx, grad_output):
                if ctx.needs_input_grad[0]:
                    return base.backward(ctx, grad_output)
                # torchao's weight-gradient half, as its backward computes it (row-wise recipe)
                x, _ = ctx.saved_tensors
                c, mmc = ctx.config, ctx.linear_mm_config
                go = cast(grad_output.reshape(-1, grad_output.shape[-1]), c.cast_config_grad_output_for_grad_weight,
                          mmc, GemmInputRole.GRAD_OUTPUT, 0, c.round_scales_to_power_of_2)
                x8 = cast(x.reshape(-1, x.shape[-1]), c.cast_config_input_for_grad_weight, mmc, GemmInputRole.INPUT, 0,
                          c.round_scales_to_power_of_2)
                return None, torch.mm(go.t(), x8).t(), None, None

        _FN.append(Matmul)
    return _FN[0]


def mm(x: torch.Tensor, w: torch.Tensor, like: nn.Module) -> torch.Tensor:
    """``x @ wᵀ`` as the converted linear ``like`` computes it (forward and backward in FP8):
    for the chunked step's fused weights, which are not a module's own. Compiled on CUDA, so
    each operand's amax, scale and cast are one pass."""
    key = (id(like.config), x.device.type)
    if key not in _MM:
        f, mmc, cfg = _matmul(), like.linear_mm_config, like.config

        def run(a, b):
            return f.apply(a, b.t(), mmc, cfg)
        _MM[key] = fo._maybe_compile(run) if x.is_cuda else run
    return _MM[key](x, w)


def runs_here(device: torch.device) -> str | None:
    """Why one FP8 training GEMM (forward and backward) fails on ``device``; None when it runs."""
    try:
        f8 = _torchao()
        net = nn.Sequential(nn.Linear(32, 32, bias=False, device=device))
        f8.convert_to_float8_training(net, config=f8.Float8LinearConfig.from_recipe_name(RECIPE))
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        x = torch.ones(16, 32, device=device, dtype=dtype, requires_grad=True)
        w = net[0].weight.detach().to(dtype).requires_grad_(True)
        mm(x, w, net[0]).float().sum().backward()
    except Exception as exc:  # noqa: BLE001 - the reason is the answer
        return f"torchao's float8 training fails here ({type(exc).__name__}: {str(exc)[:160]})"
    return None
