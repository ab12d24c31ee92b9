"""The trainer's modules under their current names, also in a tree from before they moved.

bench/compare.py runs one benchmark script against two trees: the working tree and a base
commit. A base from before the trainer's modules moved into their wings (trainer/gpu,
trainer/plan, trainer/chat, trainer/regen, trainer/serve, trainer/synth, trainer/layers) has
``trainer.fast_drafter`` where the script imports ``trainer.gpu.fast_drafter``. ``ensure()``
registers each missing new name as an alias of its old module, so the script's ordinary
imports work in both trees; in a tree with the new layout it changes nothing. Delete this
file once no base worth comparing against predates the move.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

# new name -> the name the same code had before the move
OLD_NAMES = {
    "trainer.layers.flex_mask": "trainer.flex_mask",
    "trainer.layers.fused_ops": "trainer.fused_ops",
    "trainer.layers.block_conv": "trainer.block_conv",
    "trainer.layers.hf_dflash": "trainer.hf_dflash",
    "trainer.gpu.fast_drafter": "trainer.fast_drafter",
    "trainer.gpu.chunked_head": "trainer.chunked_head",
    "trainer.gpu.head_kernels": "trainer.head_kernels",
    "trainer.gpu.selector_fused": "trainer.selector_fused",
    "trainer.gpu.fast_target": "trainer.fast_target",
    "trainer.gpu.fast_hybrid": "trainer.fast_hybrid",
    "trainer.gpu.kernel_profile": "trainer.kernel_profile",
    "trainer.gpu.probe": "trainer.probe",
    "trainer.plan.memory": "trainer.memory",
    "trainer.plan.budget": "trainer.budget",
    "trainer.plan.flops": "trainer.flops",
    "trainer.plan.ckptsize": "trainer.ckptsize",
    "trainer.chat.rows": "trainer.chatrows",
    "trainer.chat.template": "trainer.chat_template",
    "trainer.chat.encode": "trainer.chat_prepare",
    "trainer.chat.progress": "trainer.progress",
    "trainer.chat.prepare": "trainer.data",
    "trainer.regen.job": "trainer.regenerate",
    "trainer.regen.client": "trainer.regen_client",
    "trainer.regen.store": "trainer.regen_store",
    "trainer.regen.progress": "trainer.regen_progress",
    "trainer.regen.server": "trainer.regen_serve",
    "trainer.serve.export": "trainer.export",
    "trainer.serve.served": "trainer.served",
    "trainer.serve.vllm_serve": "trainer.vllm_serve",
    "trainer.serve.evaluate": "trainer.evaluate",
    "trainer.serve.ddtree": "trainer.ddtree",
    "trainer.serve.vllm_dflash2_check": "trainer.vllm_dflash2_check",
    "trainer.synth.tiny": "trainer.tiny",
    "trainer.synth.synthetic": "trainer.synthetic",
}


def _exists(name: str) -> bool:
    """Whether ``name`` is a real module of this tree (an alias made here does not count)."""
    mod = sys.modules.get(name)
    if mod is not None:
        return getattr(mod, "__spec__", None) is not None
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def ensure() -> None:
    """Alias every new module name this tree lacks to its old module (imported lazily: an
    alias is a module object that loads the old one on first attribute access)."""
    if _exists("trainer.gpu"):
        return  # the new layout: nothing to do
    trainer = importlib.import_module("trainer")
    for new, old in OLD_NAMES.items():
        if new in sys.modules:
            continue
        pkg_name, _, leaf = new.rpartition(".")
        pkg = sys.modules.get(pkg_name)
        if pkg is None:
            pkg = types.ModuleType(pkg_name, f"{pkg_name}: aliases of the old layout (bench/_layout.py)")
            pkg.__path__ = []
            sys.modules[pkg_name] = pkg
            setattr(trainer, pkg_name.rpartition(".")[2], pkg)
        mod = _LazyAlias(new, old)
        sys.modules[new] = mod
        setattr(pkg, leaf, mod)


class _LazyAlias(types.ModuleType):
    """Stands for ``old`` under the name ``new`` until first used, then forwards to it (old
    modules import torch; a script that never touches one does not pay for it)."""

    def __init__(self, new: str, old: str):
        super().__init__(new)
        self.__dict__["_old"] = old

    def _target(self):
        return importlib.import_module(self.__dict__["_old"])

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            # inspect and pickle probe every module in sys.modules for __file__ and the like:
            # answering them must not import the old module (and its dependencies)
            raise AttributeError(name)
        return getattr(self._target(), name)

    def __setattr__(self, name, value):
        setattr(self._target(), name, value)
