"""Whether calling a module runs forward hooks: its own, or torch's global module hooks
(``nn.modules.module.register_module_forward_hook`` / ``..._pre_hook``), which run around every
module call. A pass that replaces a module call (folds, packs or expands it) must leave such a
call alone: the hooks would not run, or would see another module's result."""
from __future__ import annotations

from torch import nn
from torch.nn.modules import module as _torch_module

__all__ = ["runs_forward_hooks", "global_forward_hooks"]


def global_forward_hooks() -> bool:
    """Whether global forward (pre-)hooks are registered now."""
    return bool(getattr(_torch_module, "_global_forward_hooks", None)
                or getattr(_torch_module, "_global_forward_pre_hooks", None))


def runs_forward_hooks(m: nn.Module) -> bool:
    """Whether a call of ``m`` runs forward hooks: its own or global ones."""
    return bool(m._forward_hooks or m._forward_pre_hooks) or global_forward_hooks()
