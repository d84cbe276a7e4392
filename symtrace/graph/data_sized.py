"""Which calls give a result whose size (or Python value) depends on their inputs' *data*, not
only on their sizes: ``nonzero``, boolean-mask indexing, ``unique``, ``.item()``... A lowering
that fixes every size per input signature must not fix these (:mod:`symtrace.lower.lowering`
runs what reads them through torch).

:func:`data_sized_op` answers from the call's name and its arguments' dtypes and shapes, for
targets with or without a schema: torch functions and methods, ``torch.ops`` overloads
(``nms``) and Python functions of those names. What it cannot see (a user function that
returns ``x[x > 0]``) is caught where the result is used: the lowering checks the sizes torch
returned against the recorded ones.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Optional

import torch

from .tree import tree_iter

__all__ = ["data_sized_op", "scalar_operands_only", "sizes_of_first_argument", "op_name", "reads_metadata_only",
           "DATA_SIZED_NAMES", "DATA_READING_NAMES", "FULL_REDUCTION_NAMES"]

#: ops whose result's sizes depend on the data of their inputs
DATA_SIZED_NAMES = frozenset({
    "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "unique_dim", "bincount",
    "nms", "batched_nms", "_pack_padded_sequence", "pack_padded_sequence", "_pad_packed_sequence",
    "pad_packed_sequence", "pack_sequence"})
#: calls that turn tensor data into Python values (which then size or choose what follows)
DATA_READING_NAMES = frozenset({
    "item", "tolist", "_local_scalar_dense", "__int__", "__float__", "__bool__", "__index__"})
#: reductions: a result of shape () has that shape for any input of the same rank
FULL_REDUCTION_NAMES = frozenset({
    "sum", "mean", "amax", "amin", "max", "min", "prod", "norm", "std", "var", "all", "any", "logsumexp",
    "count_nonzero", "nansum", "nanmean", "median", "nanmedian", "argmax", "argmin", "dot", "vdot"})
#: ops that take a size from an argument: name -> the arguments that are sizes (a 0-d integer
#: tensor there sizes the result by its value; other arguments, a fill value or a shift, do not)
_SIZE_ARGUMENTS = {
    "arange": lambda a, k: (a, k.get("end"), k.get("start"), k.get("step")),
    "zeros": lambda a, k: (a, k.get("size")), "ones": lambda a, k: (a, k.get("size")),
    "empty": lambda a, k: (a, k.get("size")), "rand": lambda a, k: (a, k.get("size")),
    "randn": lambda a, k: (a, k.get("size")), "eye": lambda a, k: (a, k.get("m")),
    "full": lambda a, k: (a[:1], k.get("size")),
    "randint": lambda a, k: ([v for v in a if isinstance(v, (tuple, list))], k.get("size")),
    "new_zeros": lambda a, k: (a[1:], k.get("size")), "new_ones": lambda a, k: (a[1:], k.get("size")),
    "new_empty": lambda a, k: (a[1:], k.get("size")), "new_full": lambda a, k: (a[1:2], k.get("size")),
    "view": lambda a, k: (a[1:], k.get("size")), "reshape": lambda a, k: (a[1:], k.get("shape")),
    "expand": lambda a, k: (a[1:], k.get("size")), "broadcast_to": lambda a, k: (a[1:], k.get("size")),
    "repeat": lambda a, k: (a[1:],), "tile": lambda a, k: (a[1:], k.get("dims")),
    "resize_": lambda a, k: (a[1:],), "unflatten": lambda a, k: (a[2:], k.get("sizes")),
    "narrow": lambda a, k: (a[3:], k.get("length")), "topk": lambda a, k: (a[1:2], k.get("k")),
    "split": lambda a, k: (a[1:2], k.get("split_size_or_sections"), k.get("split_size")),
    "tensor_split": lambda a, k: (a[1:2], k.get("sections"), k.get("indices")),
    "linspace": lambda a, k: (a[2:3], k.get("steps")), "logspace": lambda a, k: (a[2:3], k.get("steps")),
    # (dims given as tensors: which dims, so the result's sizes, follow their values)
    "chunk": lambda a, k: (a[1:], k.get("chunks"), k.get("dim")), "squeeze": lambda a, k: (a[1:], k.get("dim")),
    "unsqueeze": lambda a, k: (a[1:], k.get("dim")), "flatten": lambda a, k: (a[1:], k),
    "transpose": lambda a, k: (a[1:], k), "swapaxes": lambda a, k: (a[1:], k), "permute": lambda a, k: (a[1:], k),
    "movedim": lambda a, k: (a[1:], k), "diagonal": lambda a, k: (a[1:], k), "unbind": lambda a, k: (a[1:], k),
}
#: calls that read only a tensor's metadata (their Python result is fixed by the variant)
_METADATA_NAMES = frozenset({
    "numel", "nelement", "dim", "ndimension", "size", "stride", "is_floating_point", "is_complex", "element_size",
    "is_contiguous", "get_device", "storage_offset", "is_tensor", "isinstance", "is_nonzero_size", "len"})
_MASK_DTYPES = (torch.bool, torch.uint8)


def op_name(target: Any) -> str:
    """A call's name without its overload: ``"nms"`` for ``torch.ops.torchvision.nms.default``."""
    if isinstance(target, str):
        return target
    name = getattr(target, "__name__", "") or ""
    return name.split(".")[0] if name else ""


def _int_scalar(shape: Optional[tuple], dtype: Optional[torch.dtype]) -> bool:
    return dtype is not None and not dtype.is_floating_point and not dtype.is_complex and dtype is not torch.bool \
        and shape == ()


def data_sized_op(kind: str, target: Any, args: tuple, kwargs: dict,
                  dtype_of: Callable[[Any], Optional[torch.dtype]],
                  shape_of: Callable[[Any], Optional[tuple]] = lambda v: None) -> bool:
    """Whether a call (``kind``: ``"function"``, ``"method"``, ``"module"``) may size its result
    by its inputs' data. ``dtype_of(arg)`` / ``shape_of(arg)``: a tensor argument's dtype and
    shape, None for anything else (the caller's representation of tensors)."""
    if kind == "module":
        return False
    name = op_name(target)
    if name in DATA_SIZED_NAMES or name in DATA_READING_NAMES:
        return True
    if target in (int, float, bool, complex, operator.index) and args and dtype_of(args[0]) is not None:
        return True   # int(t): a value read from data
    if name == "where" and len(args) + len(kwargs) == 1:
        return True   # torch.where(cond): nonzero
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return repeats is None or dtype_of(repeats) is not None   # (repeat_interleave(t): t are the counts)
    if name == "one_hot":
        classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
        return not isinstance(classes, int) or classes < 0   # (-1: the largest value + 1)
    if target is operator.getitem or name == "__getitem__":
        index = args[1] if len(args) > 1 else None
        for item in index if type(index) is tuple else (index,):
            if isinstance(item, slice):
                if any(dtype_of(b) is not None for b in (item.start, item.stop, item.step)):
                    return True   # (x[:k] with k a tensor: its value is the bound)
            elif any(dtype_of(v) in _MASK_DTYPES for v in tree_iter(item)):
                return True
        return False
    sizes = _SIZE_ARGUMENTS.get(name)
    if sizes is not None:
        return any(_int_scalar(shape_of(v), dtype_of(v)) for v in tree_iter(sizes(tuple(args), kwargs or {})))
    return False


def reads_metadata_only(target: Any) -> bool:
    """Whether a call's Python result comes from its tensor arguments' metadata only
    (``torch.numel(x)``, ``x.dim()``): fixed by a variant, not read from data."""
    return op_name(target) in _METADATA_NAMES


#: pointwise ops whose non-tensor arguments are operands, never sizes: a Python number read from
#: data (``x / t.max().item()``) changes their values only
_SCALAR_OPERAND_NAMES = frozenset({
    "add", "sub", "mul", "div", "true_divide", "floor_divide", "truediv", "floordiv", "remainder", "fmod", "pow",
    "rsub", "clamp", "clamp_min", "clamp_max", "clip", "masked_fill", "fill", "fill_", "full_like", "lerp", "where",
    "eq", "ne", "lt", "le", "gt", "ge", "maximum", "minimum", "mod", "neg", "abs", "add_", "sub_", "mul_", "div_",
    "clamp_", "masked_fill_", "leaky_relu", "leaky_relu_", "softplus", "hardtanh", "hardtanh_", "threshold",
    "threshold_", "elu", "elu_", "celu", "selu", "hardshrink", "softshrink", "addcmul", "addcdiv", "nan_to_num",
    "nan_to_num_", "logit", "round", "xlogy", "copysign", "atan2", "hypot", "float_power", "pow_", "lerp_",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__floordiv__", "__rfloordiv__", "__pow__", "__rpow__", "__mod__", "__eq__", "__ne__", "__lt__",
    "__le__", "__gt__", "__ge__", "__iadd__", "__isub__", "__imul__", "__itruediv__"})
#: ops whose result has the sizes of their first argument, whatever the others
_SIZES_OF_FIRST_NAMES = frozenset({
    "index_add", "index_copy", "index_fill", "index_put", "scatter", "scatter_add", "scatter_reduce",
    "put", "index_reduce", "copy_", "setitem"})
#: in-place forms that take their sizes from another argument
_RESIZING_INPLACE = frozenset({"set_", "resize_", "resize_as_"})


def scalar_operands_only(kind: str, target: Any) -> bool:
    """Whether a call is a pointwise op whose Python-number arguments can only be operands (its
    result has its tensor arguments' broadcast sizes, whatever the numbers)."""
    return kind != "module" and op_name(target) in _SCALAR_OPERAND_NAMES


def sizes_of_first_argument(kind: str, target: Any) -> bool:
    """Whether a call's result has the sizes of its first argument whatever its other arguments
    (``index_add``, ``scatter``, and any in-place form ``op_``, which returns its first argument)."""
    if kind == "module":
        return False
    name = op_name(target)
    if name in _RESIZING_INPLACE:
        return False
    inplace = name.endswith("_") and not name.endswith("__")   # (an in-place op cannot broadcast its first argument)
    return name in _SIZES_OF_FIRST_NAMES or inplace or name in ("__iadd__", "__isub__", "__imul__", "__itruediv__")
