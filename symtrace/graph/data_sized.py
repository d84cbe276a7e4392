"""Which calls give a result whose size (or Python value) depends on their inputs' *data*, not
only on their sizes: ``nonzero``, boolean-mask indexing, ``unique``, ``.item()``... A lowering
that fixes every size per input signature must not fix these (:mod:`symtrace.lower.lowering`
runs what reads them through torch).

:func:`data_sized_op` answers from the call's name and its arguments' dtypes, for targets with
or without a schema: torch functions and methods, ``torch.ops`` overloads (``nms``) and Python
functions of those names.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Optional

import torch

from .tree import tree_iter

__all__ = ["data_sized_op", "scalar_operands_only", "DATA_SIZED_NAMES", "DATA_READING_NAMES"]

#: ops whose result's sizes depend on the data of their inputs
DATA_SIZED_NAMES = frozenset({
    "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "unique_dim", "bincount",
    "nms", "batched_nms", "masked_scatter_sizes"})
#: calls that turn tensor data into Python values (which then size or choose what follows)
DATA_READING_NAMES = frozenset({
    "item", "tolist", "_local_scalar_dense", "__int__", "__float__", "__bool__", "__index__"})
_MASK_DTYPES = (torch.bool, torch.uint8)


def _name(target: Any) -> str:
    if isinstance(target, str):
        return target
    name = getattr(target, "__name__", "") or ""
    return name.split(".")[0] if name else ""


def data_sized_op(kind: str, target: Any, args: tuple, kwargs: dict,
                  dtype_of: Callable[[Any], Optional[torch.dtype]]) -> bool:
    """Whether a call (``kind``: ``"function"``, ``"method"``, ``"module"``) may size its result
    by its inputs' data. ``dtype_of(arg)``: the dtype of a tensor argument, None for anything
    else (the caller's representation of tensors)."""
    if kind == "module":
        return False
    name = _name(target)
    if name in DATA_SIZED_NAMES or name in DATA_READING_NAMES:
        return True
    if target in (int, float, bool, complex) and args and dtype_of(args[0]) is not None:
        return True   # int(t): a value read from data
    if name == "where" and len(args) + len(kwargs) == 1:
        return True   # torch.where(cond): nonzero
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return repeats is None or dtype_of(repeats) is not None   # (repeat_interleave(t): t are the counts)
    if name in ("tensor_split", "split") and len(args) > 1:
        return dtype_of(args[1]) is not None and name == "tensor_split"
    if target is operator.getitem or name == "__getitem__":
        index = args[1] if len(args) > 1 else None
        return any(dtype_of(v) in _MASK_DTYPES for v in tree_iter(index))
    return False


#: pointwise ops whose non-tensor arguments are operands, never sizes: a Python number read from
#: data (``x / t.max().item()``) changes their values only
_SCALAR_OPERAND_NAMES = frozenset({
    "add", "sub", "mul", "div", "true_divide", "floor_divide", "truediv", "floordiv", "remainder", "fmod", "pow",
    "rsub", "clamp", "clamp_min", "clamp_max", "clip", "masked_fill", "fill", "fill_", "full_like", "lerp", "where",
    "eq", "ne", "lt", "le", "gt", "ge", "maximum", "minimum", "mod", "neg", "abs", "add_", "sub_", "mul_", "div_",
    "clamp_", "masked_fill_", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__floordiv__", "__rfloordiv__", "__pow__", "__rpow__", "__mod__", "__eq__", "__ne__", "__lt__",
    "__le__", "__gt__", "__ge__", "__iadd__", "__isub__", "__imul__", "__itruediv__"})


def scalar_operands_only(kind: str, target: Any) -> bool:
    """Whether a call is a pointwise op whose Python-number arguments can only be operands (its
    result has its tensor arguments' broadcast sizes, whatever the numbers)."""
    return kind != "module" and _name(target) in _SCALAR_OPERAND_NAMES
