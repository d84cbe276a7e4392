"""Plain helpers of tracing: which Python values are simple constants, how a value becomes a
guard expression, copies of inputs that keep their layout, and walks over nested values that
may hold proxies."""
from __future__ import annotations

import contextlib
import enum
import operator
import types
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..graph.guard_expr import Attr, Call, Const, GExpr, Global, Item, Method, Root, TorchState
from ..graph.tree import tree_iter, tree_map
from ..proxy import Attribute, Proxy
from ..shadow import is_shadow, real_module

_TENSOR_METHODS = frozenset(n for n in dir(torch.Tensor) if callable(getattr(torch.Tensor, n, None)))
# tensor properties whose value is Python data, not a tensor: read concretely, with a guard
_CONCRETE_ATTRS = frozenset({"dtype", "device", "layout", "is_cuda", "is_sparse", "is_quantized",
                             "is_meta", "is_mkldnn", "is_nested", "requires_grad", "is_leaf", "ndim",
                             "is_floating_point", "is_complex"})
_CONCRETE_METHODS = frozenset({"dim", "ndimension", "is_contiguous", "is_floating_point", "is_complex",
                               "element_size", "get_device", "is_pinned", "storage_offset",
                               "stride", "has_names", "is_signed", "data_ptr", "nelement"})
_SHAPE_METHODS = frozenset({"size", "numel"})
#: tensor methods whose result is Python data, not a tensor
_NUMBER_METHODS = _CONCRETE_METHODS | _SHAPE_METHODS | {"item", "tolist", "__len__", "nelement"}
_SIMPLE = (bool, int, float, str, type(None), torch.dtype, torch.device, enum.Enum, complex)
_BIN_SYMBOLS = {operator.add: "+", operator.sub: "-", operator.mul: "*", operator.floordiv: "//",
                operator.truediv: "/", operator.mod: "%", operator.pow: "**", operator.eq: "==",
                operator.ne: "!=", operator.lt: "<", operator.le: "<=", operator.gt: ">",
                operator.ge: ">=", operator.and_: "&", operator.or_: "|"}
_NN_MODULE_INTERNALS = frozenset(vars(nn.Module()).keys()) - {"training"}


def _layout_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of input ``t`` with the same sizes, strides and autograd standing, so that layout
    questions (``is_contiguous()``, ``stride()``) answer as for ``t`` itself while tracing."""
    leaf = t.is_leaf
    src = t.detach() if leaf else t
    if t.layout is not torch.strided or t.is_contiguous() or t.numel() == 0 or type(t) is not torch.Tensor \
            and type(t) is not nn.Parameter:
        copy = src.clone()
    else:
        span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
        copy = torch.as_strided(src, (span,), (1,), t.storage_offset()).clone().as_strided(t.shape, t.stride(), 0)
        if leaf:
            copy = copy.detach()
    if leaf and type(t) is nn.Parameter:  # the input's class is part of what the program may ask
        return nn.Parameter(copy, requires_grad=t.requires_grad)
    return copy.requires_grad_(t.requires_grad) if leaf else copy


def _is_simple(v: Any, depth: int = 0) -> bool:
    if type(v) is Proxy or type(v) is Attribute:  # isinstance would see the value's class
        return False
    if isinstance(v, _SIMPLE):
        return not (isinstance(v, float) and v != v)
    if depth < 3 and type(v) in (tuple, list, frozenset, set) and len(v) <= 64:
        return all(_is_simple(x, depth + 1) for x in v)
    if depth < 3 and type(v) is dict and len(v) <= 64:
        return all(isinstance(k, (str, int)) and _is_simple(x, depth + 1) for k, x in v.items())
    return False


def _literal_expr(v: Any) -> Optional[GExpr]:
    """The guard expression of a traced value or simple constant, or None."""
    if type(v) is Proxy or type(v) is Attribute:
        return v.expr if type(v) is Proxy else None
    t = type(v)
    if t in (bool, int, str, type(None)) or (t is float and v == v and abs(v) != float("inf")) \
            or isinstance(v, torch.dtype):
        return Const(v)
    if t is torch.Size and all(type(x) is int for x in v):
        return Const(v)
    if t is slice or t is tuple:
        parts = [_literal_expr(x) for x in ((v.start, v.stop, v.step) if t is slice else v)]
        if any(type(p) is not Const for p in parts):
            return None
        values = [p.value for p in parts]
        return Const(slice(*values) if t is slice else tuple(values))
    return None


def _guard_kind(expr: GExpr) -> str:
    base = expr
    while type(base) in (Attr, Item, Method):
        base = base.obj
    if type(base) is Root:
        return "training" if type(expr) is Attr and expr.name == "training" else "module"
    if type(base) is Global:
        return "global"
    nodes = list(expr.walk())
    if any(type(e) is TorchState and e.fn == "is_grad_enabled" for e in nodes):
        return "grad_mode"
    attrs = {e.name for e in nodes if type(e) is Attr}
    methods = {e.name for e in nodes if type(e) is Method}
    calls = {e.fn for e in nodes if type(e) is Call}
    for kind, present in (("dtype", "dtype" in attrs), ("device", "device" in attrs),
                          ("ndim", "ndim" in attrs or "dim" in methods),
                          ("shape", "shape" in attrs or bool(methods & {"size", "numel"}) or "len" in calls)):
        if present:
            return kind
    return "value"


@contextlib.contextmanager
def _no_torch_function():
    with torch._C.DisableTorchFunction():
        yield


def _contains_proxy(a: Any) -> bool:
    for x in tree_iter(a):
        if type(x) is Proxy or type(x) is Attribute:
            return True
    return False


def _unwrap_leaf(a: Any) -> Any:
    if type(a) is Proxy or type(a) is Attribute:
        return a.value
    if is_shadow(a):
        return real_module(a)
    return a


def _unwrap(a: Any) -> Any:
    """``a`` with traced values replaced by their values, shadow modules by the real ones."""
    return tree_map(_unwrap_leaf, a)


def _viewable(obj: Any) -> bool:
    """Plain objects with attributes (configs, namespaces), not containers or extension types."""
    return isinstance(getattr(obj, "__dict__", None), dict) and not isinstance(
        obj, (list, tuple, dict, set, frozenset, str, bytes))


def _holds(obj: Any, pred: Callable[[Any], bool], budget: int = 2000) -> bool:
    """Whether ``pred`` holds for something reachable from ``obj`` through containers and
    instance attributes (a bounded walk)."""
    stack, seen = [obj], set()
    while stack and budget > 0:
        x = stack.pop()
        budget -= 1
        if pred(x):
            return True
        if id(x) in seen or isinstance(x, (str, bytes, int, float, bool, type(None), type, torch.dtype,
                                            torch.device, nn.Module)) or callable(x):
            continue
        seen.add(id(x))
        if isinstance(x, (list, tuple, set, frozenset)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        else:
            d = getattr(x, "__dict__", None)
            if isinstance(d, dict):
                stack.extend(d.values())
            for slot in getattr(type(x), "__slots__", ()):
                if isinstance(slot, str) and hasattr(x, slot):
                    stack.append(getattr(x, slot))
    return False


def rebuild_object(cls: type, attributes: dict) -> Any:
    """An instance of ``cls`` with these attributes, made without calling ``__init__``: what a
    graph returns for a plain object the traced program built around traced values."""
    obj = object.__new__(cls)
    obj.__dict__.update(attributes)
    return obj


def is_plain_object(v: Any) -> bool:
    """An instance of a Python class with a ``__dict__`` (no module, tensor, class or function)."""
    t = type(v)
    return (t.__module__ not in ("builtins",) and isinstance(getattr(v, "__dict__", None), dict)
            and not isinstance(v, (nn.Module, torch.Tensor, type, types.FunctionType, types.MethodType, enum.Enum))
            and "__slots__" not in vars(t) and t.__new__ is object.__new__)

