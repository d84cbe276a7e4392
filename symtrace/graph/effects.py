"""Which nodes have effects beyond their result (mutation, randomness, global state).

Dead-code elimination keeps these even without users; passes that reorder or merge nodes
(CSE) must not move or merge them. Behaviour per callable lives in a registry, extended with
:func:`register_side_effect`.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Optional

import torch

__all__ = ["register_side_effect", "has_registered_side_effect", "is_impure", "is_random", "is_inplace"]

_SIDE_EFFECT_FUNCTIONS: set = {
    operator.setitem, operator.delitem, print, torch._assert, torch.manual_seed,
    torch.set_grad_enabled, torch._C._set_grad_enabled, torch.autograd.set_grad_enabled,
}
for _name in ("iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul",
              "iand", "ior", "ixor", "ilshift", "irshift"):
    _SIDE_EFFECT_FUNCTIONS.add(getattr(operator, _name))

_RANDOM_NAMES = frozenset({
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal", "normal_",
    "bernoulli", "bernoulli_", "multinomial", "poisson", "random_", "uniform_", "exponential_",
    "geometric_", "cauchy_", "log_normal_", "rrelu", "rrelu_", "rrelu_with_noise", "native_dropout"})
_INPLACE_DUNDERS = frozenset({"__setitem__", "__delitem__"} | {
    f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and",
                            "or", "xor", "lshift", "rshift")})
_SIDE_EFFECT_METHODS = frozenset({"copy_", "set_", "backward", "retain_grad", "register_hook",
                                  "record_stream", "share_memory_"})


def register_side_effect(fn: Callable) -> Callable:
    """Mark ``fn`` as having side effects, so dead-code elimination keeps calls to it.

    Usable as a decorator."""
    _SIDE_EFFECT_FUNCTIONS.add(fn)
    return fn


def _name_of(target: Any) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", "") or ""


def is_inplace(node) -> bool:
    """Whether the node writes into one of its inputs (``x.add_(y)``, ``x += y``, ``out=``)."""
    op = node.op
    if op not in ("call_function", "call_method"):
        return False
    name = _name_of(node.target)
    if name.endswith("_") and not name.endswith("__"):
        return True
    if name in _INPLACE_DUNDERS:
        return True
    if op == "call_function":
        try:
            if node.target in _SIDE_EFFECT_FUNCTIONS and node.target is not print:
                return name.startswith("i") or node.target is operator.setitem
        except TypeError:
            pass
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return True
    kw = node.kwargs
    return bool(kw) and (kw.get("out") is not None or kw.get("inplace") is True)


def is_random(node) -> bool:
    """Whether the node draws random numbers (so it must be neither merged nor dropped)."""
    if node.op == "call_module":
        return False
    if node.op not in ("call_function", "call_method"):
        return False
    name = _name_of(node.target)
    if "dropout" in name:
        return bool(node.kwargs.get("training", True)) and not _zero_p(node)
    return name in _RANDOM_NAMES


def _zero_p(node) -> bool:
    p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
    return p == 0 or p == 0.0


def has_registered_side_effect(node) -> bool:
    """Whether the node calls a function registered with :func:`register_side_effect` (or a
    known side-effecting method such as ``copy_``)."""
    try:
        if node.op == "call_function":
            return node.target in _SIDE_EFFECT_FUNCTIONS
    except TypeError:
        return True
    return node.op == "call_method" and node.target in _SIDE_EFFECT_METHODS


def _module_has_effects(module: torch.nn.Module) -> bool:
    if getattr(module, "_is_impure", False) or getattr(module, "inplace", False) is True:
        return True
    for m in module.modules():
        if m.training and (next(iter(m._buffers.values()), None) is not None
                           or isinstance(m, torch.nn.modules.dropout._DropoutNd)):
            return True
    return False


def is_impure(node, module: Optional[torch.nn.Module] = None) -> bool:
    """Whether dead-code elimination must keep ``node`` even when nothing reads its result.

    True for placeholders and outputs, in-place ops (methods too: ``x.mul_(2)`` survives),
    random ops, registered side-effecting functions (``print``, ``setitem``, guard checks,
    grad-mode switches), and ``call_module`` nodes whose module updates buffers or draws random
    numbers in training mode. ``module`` is the graph's owning module, for ``call_module``.
    """
    op = node.op
    if op in ("placeholder", "output"):
        return True
    if op == "get_attr":
        return False
    if op == "call_module":
        if module is None:
            return True
        try:
            sub = module.get_submodule(node.target)
        except AttributeError:
            return True
        return _module_has_effects(sub)
    if op == "call_function":
        try:
            if node.target in _SIDE_EFFECT_FUNCTIONS:
                return True
        except TypeError:  # unhashable target
            return True
    elif _name_of(node.target) in _SIDE_EFFECT_METHODS:
        return True
    return is_inplace(node) or is_random(node) or _updates_running_stats(node)


def _updates_running_stats(node) -> bool:
    """``F.batch_norm(..., training=True)`` (and instance norm with running stats) writes its
    running statistics in place."""
    name = _name_of(node.target)
    if name not in ("batch_norm", "instance_norm"):
        return False
    flag = "training" if name == "batch_norm" else "use_input_stats"
    if flag in node.kwargs:
        return node.kwargs[flag] is not False
    return len(node.args) > 5 and node.args[5] is not False
