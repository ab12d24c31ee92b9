"""Triton kernels on a machine without a GPU: Triton's interpreter runs them on CPU tensors
(TRITON_INTERPRET=1), block by block in numpy. Shared by the kernel tests."""

from __future__ import annotations

import torch

CUDA = torch.cuda.is_available()


def interpret_jit_functions(monkeypatch, *modules) -> None:
    """Triton decides when a function is decorated whether @triton.jit makes it interpreted.
    When triton.language was imported before TRITON_INTERPRET was set (transformers'
    modeling_utils imports torch._dynamo and with it triton: any test module that imports
    trainer.model at collection does so), its own functions (tl.zeros, tl.sum, ...) are
    compiled-only, and a kernel that calls them fails under the interpreter ("Cannot call
    @triton.jit'd outside of the scope of a kernel"); so do the kernels of ``modules`` when
    they were imported early. Each such function is wrapped in the interpreter's for the test,
    and TRITON_INTERPRET is set for its launches."""
    import triton.language as tl
    import triton.language.standard as tl_standard
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for module in (tl, tl_standard, *modules):
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                monkeypatch.setattr(module, name, InterpretedFunction(value.fn))


def kernel_fixture(module, **small):
    """An autouse fixture for a kernel module's tests: without a GPU, its kernels (and
    triton's own functions) interpreted, and its tile settings ``small`` (the interpreter runs
    each program in numpy: small tiles, several per input)."""
    import pytest

    @pytest.fixture(autouse=True)
    def _interpreted(monkeypatch):
        if not CUDA:
            interpret_jit_functions(monkeypatch, module)
            for name, value in small.items():
                monkeypatch.setattr(module, name, value)
    return _interpreted
