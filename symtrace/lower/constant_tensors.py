"""Tensors a lowering computes once, at compile time: values made only from sizes the variant
fixes, literals and other such tensors (a positional encoding built from the feature map's size,
position ids, a mask made from sizes). Eager and a plain lowering compute them on every call.

A node is folded when it is a pure, deterministic call (no random numbers, no in-place write, no
registered side effect, no global state read), every input is a folded tensor or a value fixed
by the variant's sizes, its result is at most :data:`MAX_BYTES`, and nothing may write it, return
it to the caller or hand it to code that could keep it (its alias group, as
:class:`~symtrace.passes.alias.AliasAnalysis` sees it, holds no output, no write and no impure
node): the caller must never see, nor change, the one copy every call shares. (A user's function or module is assumed to keep what it is
given: one in the group also stops the fold.)"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional

import torch

from ..graph.effects import (has_registered_side_effect, is_inplace, is_random, may_keep_arguments,
                             reads_global_state)
from ..graph.graph_module import GraphModule
from ..graph.node import Node, TensorMeta, map_arg
from ..passes.alias import AliasAnalysis
from .ir import SUPPORTED_DTYPES

__all__ = ["ConstantTensors", "MAX_BYTES"]

#: the largest result folded (a larger one is computed per call, as before)
MAX_BYTES = 1 << 24

#: calls whose result's contents are not defined by their arguments
_UNDEFINED_CONTENTS = frozenset({torch.empty, torch.empty_like, torch.empty_strided, "new_empty",
                                 "new_empty_strided"})


def _undefined_contents(target: Any) -> bool:
    try:
        return target in _UNDEFINED_CONTENTS
    except TypeError:   # (an unhashable callable)
        return False


class FoldedTensors:
    """The folded tensors, as attributes the generated wrapper reads (``_mod3.c0``)."""

    __module__ = "symtrace.lower.constant_tensors"


class ConstantTensors:
    """Which nodes of ``gm`` a lowering computes once (see the module doc). ``holder`` keeps
    their tensors; :meth:`fold` decides and computes."""

    def __init__(self, gm: GraphModule, device_type: str, alias: Callable[[], AliasAnalysis]):
        self.gm = gm
        self.device_type = device_type
        self._alias = alias   # (the lowering's analysis of the graph, made when first asked)
        self.holder = FoldedTensors()
        self.values: Dict[Node, torch.Tensor] = {}
        self._unsafe: Optional[set] = None   # alias groups a folded value must not be in

    def fold(self, node: Node, meta: Any, fixed: Callable[[Node], bool], env: Dict[Node, Any]) -> Optional[str]:
        """Compute ``node`` now when it qualifies; its attribute name on :attr:`holder`, else None.
        ``meta``: its recorded result; ``fixed(n)``: whether input ``n``'s value is fixed by the
        variant (a size, a value computed from sizes); ``env``: those values."""
        if node.op not in ("call_function", "call_method") or not isinstance(meta, TensorMeta) \
                or not all(i in self.values or fixed(i) for i in node.all_input_nodes):
            return None   # (first: most nodes read a value computed per call)
        if meta.device.type != self.device_type or meta.dtype not in SUPPORTED_DTYPES \
                or math.prod(meta.shape) * meta.dtype.itemsize > MAX_BYTES:
            return None   # (a tensor the kernels cannot read, or a large one: computed per call)
        if _undefined_contents(node.target) or is_random(node) or is_inplace(node) \
                or has_registered_side_effect(node) or reads_global_state(node) or not self._private(node):
            return None
        value = (lambda n: self.values[n] if n in self.values else env[n])
        args, kwargs = map_arg(node.args, value), map_arg(node.kwargs, value)
        try:
            with torch.no_grad():
                if node.op == "call_function":
                    t = node.target(*args, **kwargs)
                else:
                    t = getattr(args[0], node.target)(*args[1:], **kwargs)
        except Exception:   # (it ran when recorded; if not now, it runs per call as before)
            return None
        if not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor or t.requires_grad \
                or t.layout is not torch.strided or t.is_quantized \
                or tuple(t.shape) != tuple(meta.shape) or t.dtype != meta.dtype or t.device != meta.device \
                or (meta.stride and tuple(t.stride()) != tuple(meta.stride)):
            return None
        name = f"c{len(self.values)}"
        setattr(self.holder, name, t)
        self.values[node] = t
        return name

    def release(self, keep) -> None:
        """After the lowering: drop every folded tensor but those in ``keep`` (ids of the ones a
        kernel or torch call reads): the holder keeps only what the wrapper reads."""
        for name in [k for k, v in vars(self.holder).items() if id(v) not in keep]:
            delattr(self.holder, name)
        self.values.clear()

    def _private(self, node: Node) -> bool:
        """Whether no node may write ``node``'s memory, return it or keep it."""
        alias = self._alias()
        if self._unsafe is None:
            self._unsafe = set(alias.written_at)
            for n in self.gm.graph.nodes:
                if n.op == "output":
                    self._unsafe.update(alias.find(a) for a in n.all_input_nodes)
                elif n.op != "placeholder" and (n in alias.impure or self._may_keep(n)):
                    self._unsafe.add(alias.find(n))
        return alias.find(node) not in self._unsafe

    def _may_keep(self, node: Node) -> bool:
        """Whether ``node`` may keep its arguments (the user's functions and modules: it joins
        their alias group, so a group holding one may be changed later from outside)."""
        if node.op == "call_function":
            return may_keep_arguments("function", node.target)
        if node.op == "call_module":
            try:
                return may_keep_arguments("module", self.gm.get_submodule(node.target))
            except AttributeError:
                return True
        return False
