"""Which kernels and precisions a run takes, and why: the lines a run starts with.

A faster path that is not taken must never be silent. The trainer once fell back from
flash-attn-4's attention kernels to flex attention's Triton kernels because one of
flash-attn-4's libraries was missing from the container, and nothing in the log or the events
said so (a 7 % slower step, seen on an H100). So the log rank prints one line per choice —
the drafter's attention kernel, the target's forward, the target's precision, the drafter's
precision — each with its reason, and for a faster path that is missing, what is missing and
the command that installs it; the ``phase: training`` event carries the same as ``paths``.

Standard library only (the decisions themselves are trainer/flags.py's ``*_for`` rules);
:func:`gpu_capability` asks NVML, so the parent process never initialises CUDA.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

from trainer import flags


def gpu_capability(index: int = 0) -> tuple[int, int] | str:
    """(major, minor) compute capability of GPU ``index`` from NVML, or one line saying why
    it is unknown (no NVML, no driver, no GPU)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            if pynvml.nvmlDeviceGetCount() <= index:
                return "no CUDA device"
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(pynvml.nvmlDeviceGetHandleByIndex(index))
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 - an unknown GPU is a reason, not a crash
        return f"{type(exc).__name__}: {exc}"
    return int(major), int(minor)


def flash_install(missing: str, cuda_major: int | None) -> str | None:
    """The command that gives this container flash-attn-4's kernels, for the reason
    ``missing`` (trainer/layers/flex_mask.flash_missing's line); None when no install helps
    (the GPU itself is too old). A torch built for CUDA 13 needs the cu13 build of the
    CUTLASS DSL's libraries, which flash-attn-4's ``cu13`` extra pulls in."""
    if "compute capability is" in missing and "unknown" not in missing:
        return None
    pkg = "'flash-attn-4[cu13]'" if cuda_major is not None and cuda_major >= 13 else "flash-attn-4"
    return f"ctl env install {pkg} --container ID"


FP8_INSTALL = ("FP8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); no package adds it to "
               "this one")


@dataclass(frozen=True)
class Facts:
    """What the machine says: CUDA or not, the GPU's compute capability (or why unknown),
    why flash-attn-4 cannot run (None: it can), the major version of torch's CUDA build, the
    target's hidden size."""

    cuda: bool
    capability: Any = None
    flash_missing: str | None = None
    cuda_major: int | None = None
    hidden: int | None = None


@dataclass(frozen=True)
class Paths:
    attention_kernel: str
    attention_why: str
    target_forward: str
    target_forward_why: str
    target_precision: str
    target_precision_why: str
    drafter_precision: str
    drafter_precision_why: str
    missing: tuple[str, ...]  # a faster path not taken: what is missing and how to get it

    def lines(self) -> list[str]:
        out = [f"attention kernel: {self.attention_kernel} ({self.attention_why})",
               f"target forward: {self.target_forward} ({self.target_forward_why})",
               f"target precision: {self.target_precision} ({self.target_precision_why})",
               f"drafter precision: {self.drafter_precision} ({self.drafter_precision_why})"]
        return out + [f"faster path missing: {m}" for m in self.missing]

    def event(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}


# Not a flag: what the command line asked for the choices ``python -m trainer`` resolves
# before the run (auto among them), kept beside the resolved values so the reasons can be said
# (and a checkpoint's config shows both).
REQUESTED = "requested_paths"
RESOLVED = ("attention_kernel", "target_forward", "target_precision")


def requested(values: Mapping[str, Any]) -> dict:
    """The values of the choices resolved before the run, as given (before auto is resolved)."""
    return {k: values.get(k) for k in RESOLVED}


def drafter_precision(values: Mapping[str, Any], cuda: bool) -> tuple[str, str]:
    """(the drafter's precision, why): --drafter-precision has no auto (FP8 training is kept off
    until it is shown faster with τ held), so the reason is the flag and what it means."""
    if (values.get("drafter_precision") or "bf16") == "fp8":
        where = ("" if cuda else ", on torch's CPU scaled matmul (the GPU path's arithmetic, none of its speed)")
        return "fp8", ("--drafter-precision fp8: the drafter's GEMMs (fc, q/k/v/o, gate/up/down) in e4m3 with "
                       "row-wise scales, forward and both gradients (torchao's float8 training), fp32 master weights, "
                       f"AdamW unchanged, the frozen LM head bf16{where}")
    if cuda:
        return "bf16", ("bf16 compute, fp32 master weights, gradients and AdamW state (--drafter-precision bf16; fp8 "
                        "trains the drafter's GEMMs in FP8)")
    return "fp32", "CPU run: fp32 throughout (--drafter-precision bf16)"


def decide(values: Mapping[str, Any], facts: Facts) -> Paths:
    """The run's choices with their reasons, from its flag values (``REQUESTED``: what was
    asked; the flags themselves: what ``python -m trainer`` resolved) and the machine's facts."""
    asked = {**requested(values), **(values.get(REQUESTED) or {})}
    missing: list[str] = []
    cuda = facts.cuda
    kernel = values.get("attention_kernel") or "auto"
    if kernel == "auto":
        kernel = flags.attention_kernel_for(values, cuda, facts.flash_missing)
    by = "auto" if (asked.get("attention_kernel") or "auto") == "auto" else f"--attention-kernel {kernel}"
    if not cuda:
        kernel, a_why = "sdpa", "CPU run: PyTorch's scaled-dot-product attention with the dense DFlash mask"
    elif kernel == "flash":
        a_why = (f"{by}: flash-attn-4's CuTe kernels through flex attention, the step's attention 1.35x the Triton "
                 "kernels', colocated Qwen3-8B 1.05x, measured on an H200")
    elif facts.flash_missing:
        a_why = f"{by}: flex attention's Triton kernels, flash-attn-4 cannot run here: {facts.flash_missing}"
        fix = flash_install(facts.flash_missing, facts.cuda_major)
        if fix:
            missing.append(f"flash-attn-4 ({facts.flash_missing}): the drafter's attention about 1.35x faster; "
                           f"install: {fix}")
    else:
        a_why = f"{by}: flex attention's Triton kernels; flash-attn-4's would run here (--attention-kernel flash)"

    forward = values.get("target_forward") or "auto"
    if forward == "auto":
        forward = flags.target_forward_for(values, cuda)
    f_why = {"fast": "fused q|k|v and gate|up GEMMs, compiled norms, cuDNN attention, stops after the last tapped layer",
             "hf": "transformers' forward with hooks on the tapped layers"}.get(forward, forward)
    f_why = ("auto: " if (asked.get("target_forward") or "auto") == "auto" else f"--target-forward {forward}: ") + f_why

    ask = asked.get("target_precision") or values.get("target_precision") or "bf16"
    precision, p_why = flags.target_precision_for({"target_precision": ask}, cuda, facts.capability, facts.hidden)
    if values.get("target_precision") in ("bf16", "fp8"):
        precision = values["target_precision"]  # what the run loaded, whatever the facts say now
    no_fp8 = flags.fp8_missing(cuda, facts.capability)
    if precision == "fp8":
        where = ("activations quantized per row in their producers" if forward == "fast"
                 else "activations quantized per row in a pass of their own (the transformers forward)")
        p_why = f"{p_why}; e4m3 weights with per-channel scales, {where}"
    elif (cuda and no_fp8 is not None and (facts.hidden or 0) >= flags.FP8_MIN_HIDDEN
          and "capability is unknown" not in no_fp8):
        missing.append(f"FP8 for the target ({no_fp8}): {FP8_INSTALL}")
    if not cuda and precision != "fp8":
        precision, p_why = "fp32", "CPU run: the target in fp32"
    d_prec, d_why = drafter_precision(values, cuda)
    return Paths(kernel, a_why, forward, f_why, precision, p_why, d_prec, d_why, tuple(missing))
