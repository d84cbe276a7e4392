"""Decompositions: graph ops -> lazy values over the primitive expression set.

Each rule takes the lowering context, the node and its arguments (tensors as
:class:`~symtrace.lower.values.LValue`, everything else as Python values) and returns a lazy
value (or a tuple of them), or raises :class:`Unsupported` with a reason; the node then runs
through torch unchanged (an *extern*). Rules cover arithmetic, comparisons, ``where``, casts,
activations (relu, gelu (erf and tanh), silu, sigmoid, tanh, ...), views (permute, transpose,
expand, slicing, reshape of strided buffers, split/chunk), reductions over the last dimension
or over everything (sum, mean, amax, amin, var, std), softmax/log_softmax, layer_norm,
rms_norm, and ``linear``/``conv`` as a torch call followed by a fusible bias add.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .ir import HALF_DTYPES, Affine, compute_type
from .values import (BufferValue, FullReduce, LValue, Pointwise, RowReduce, broadcast_shapes, broadcast_to,
                     make_view)

__all__ = ["Unsupported", "FUNCTION_RULES", "METHOD_RULES", "MODULE_RULES", "rule_for"]


class Unsupported(Exception):
    """This node is not lowered; the message says why (shown in reports)."""


Rule = Callable[..., Any]
FUNCTION_RULES: Dict[Any, Rule] = {}
METHOD_RULES: Dict[str, Rule] = {}
MODULE_RULES: Dict[type, Rule] = {}


def _reg(functions=(), methods=()):
    def deco(fn):
        for f in functions:
            if f is not None:
                FUNCTION_RULES[f] = fn
        for m in methods:
            METHOD_RULES[m] = fn
        return fn
    return deco


def rule_for(node) -> Optional[Rule]:
    if node.op == "call_function":
        try:
            return FUNCTION_RULES.get(node.target)
        except TypeError:
            return None
    if node.op == "call_method":
        return METHOD_RULES.get(node.target)
    return None


# --------------------------------------------------------------------------- helpers

def _arg(args, kwargs, i: int, name: str, default=None):
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _is_scalar(x) -> bool:
    return isinstance(x, (bool, int, float)) and not isinstance(x, LValue)


def _tensor(x, what="argument") -> LValue:
    if not isinstance(x, LValue):
        raise Unsupported(f"{what} is not a tensor this lowering can read ({type(x).__name__})")
    return x


def _check_dtype(*dtypes):
    from .ir import SUPPORTED_DTYPES
    for d in dtypes:
        if d not in SUPPORTED_DTYPES:
            raise Unsupported(f"dtype {d} has no kernel support")


def _stand_in(x):
    """A meta tensor of ``x``'s dtype and rank (torch.result_type depends on both), or the scalar."""
    if isinstance(x, LValue):
        return torch.empty((1,) * len(x.shape), dtype=x.dtype, device="meta")
    return x


def promoted(a, b) -> torch.dtype:
    """torch's result dtype for an elementwise op on two operands (tensors and scalars)."""
    return torch.result_type(_stand_in(a), _stand_in(b))


def elementwise(lw, node, operands: Sequence[Any], body: Callable, compute_ty: str, out_dtype=None, cost: int = 1,
                common_dtype=None, opmath_second: bool = False) -> Pointwise:
    """A pointwise value of ``body(eb, *exprs)`` over broadcast ``operands`` (tensors read and
    cast to ``compute_ty``, scalars as constants), stored as ``out_dtype`` (default: the
    node's dtype).

    ``common_dtype`` (default ``out_dtype``): the dtype eager computes in. When it is fp16/bf16,
    a tensor operand of another dtype (an int32 tensor times a half tensor) is converted to it
    first, as eager does (65536 -> inf, 2049 -> 2048), except, with ``opmath_second`` (mul,
    div), a 0-d second operand, which eager's CPU-scalar path reads in float32."""
    out_dtype = out_dtype or lw.dtype_of(node)
    common_dtype = common_dtype or out_dtype
    _check_dtype(out_dtype, *[o.dtype for o in operands if isinstance(o, LValue)])
    tensors = [o for o in operands if isinstance(o, LValue)]
    shape = broadcast_shapes(*[t.shape for t in tensors]) if tensors else ()
    ops = [broadcast_to(o, shape) if isinstance(o, LValue) else o for o in operands]
    out_ty = compute_type(out_dtype)

    rounded = [isinstance(o, LValue) and common_dtype in HALF_DTYPES and o.dtype != common_dtype and
               not (opmath_second and j == 1 and o.shape == ()) for j, o in enumerate(operands)]

    def fn(kb, idx):
        eb = kb.eb
        vals = []
        for o, r in zip(ops, rounded):
            if isinstance(o, LValue):
                x = eb.cast(kb.read(o, idx), compute_ty)
                vals.append(eb.round_to(x, common_dtype) if r else x)
            elif o is None:
                vals.append(None)
            else:
                vals.append(eb.const(o, compute_ty))
        return eb.cast(body(eb, *vals), out_ty)
    return Pointwise(shape, out_dtype, fn, tensors, (node.name,), cost)


def _float_ty(dtype) -> str:
    ty = compute_type(dtype)
    if ty not in ("f32", "f64"):
        raise Unsupported(f"needs a floating-point result, got {dtype}")
    return ty


# --------------------------------------------------------------------------- arithmetic

def _binary_rule(op: str, reflected: bool = False):
    def rule(lw, node, args, kwargs):
        a, b = args[0], args[1]
        if reflected:
            a, b = b, a
        if not isinstance(a, LValue) and not isinstance(b, LValue):
            raise Unsupported("no tensor operand")
        for x in (a, b):
            if not isinstance(x, LValue) and not _is_scalar(x):
                raise Unsupported(f"operand of type {type(x).__name__}")
        alpha = kwargs.get("alpha", args[2] if len(args) > 2 and op in ("add", "sub") else 1)
        if kwargs.get("out") is not None:
            raise Unsupported("out= is not lowered")
        if op == "div" and kwargs.get("rounding_mode") is not None:
            raise Unsupported("div with rounding_mode is not lowered")
        out = lw.dtype_of(node)
        ty = compute_type(out)
        if op in ("add", "sub", "mul") and ty == "b" and op != "mul":
            raise Unsupported("bool add/sub")

        def body(eb, x, y):
            if alpha != 1:
                y = eb.binary("mul", y, eb.const(alpha, ty))
            return eb.binary(op, x, y)
        return elementwise(lw, node, [a, b], body, ty, opmath_second=op in ("mul", "div") and not reflected)
    return rule


for _name, _op in (("add", "add"), ("sub", "sub"), ("mul", "mul"), ("div", "div"), ("true_divide", "div"),
                   ("multiply", "mul"), ("subtract", "sub"), ("divide", "div")):
    _reg([getattr(torch, _name, None)], [_name])(_binary_rule(_op))
_reg([operator.add, operator.iadd if False else None], ["__add__"])(_binary_rule("add"))
_reg([operator.sub], ["__sub__"])(_binary_rule("sub"))
_reg([operator.mul], ["__mul__"])(_binary_rule("mul"))
_reg([operator.truediv], ["__truediv__"])(_binary_rule("div"))
_reg([], ["__radd__"])(_binary_rule("add", reflected=True))
_reg([], ["__rsub__"])(_binary_rule("sub", reflected=True))
_reg([], ["__rmul__"])(_binary_rule("mul", reflected=True))
_reg([], ["__rtruediv__"])(_binary_rule("div", reflected=True))
_reg([torch.rsub], [])(_binary_rule("sub", reflected=True))


def _max_min_rule(op):
    def rule(lw, node, args, kwargs):
        a, b = _tensor(args[0]), args[1] if len(args) > 1 else kwargs.get("other")
        if not isinstance(b, LValue):
            raise Unsupported(f"{op}imum needs two tensors")
        ty = compute_type(lw.dtype_of(node))
        return elementwise(lw, node, [a, b], lambda eb, x, y: eb.binary(op, x, y), ty)
    return rule


_reg([torch.maximum], ["maximum"])(_max_min_rule("max"))
_reg([torch.minimum], ["minimum"])(_max_min_rule("min"))


@_reg([torch.pow], ["pow", "__pow__"])
def _pow(lw, node, args, kwargs):
    a, b = args[0], _arg(args, kwargs, 1, "exponent")
    ty = compute_type(lw.dtype_of(node))
    if isinstance(a, LValue) and _is_scalar(b):
        special = {1: lambda eb, x: x, 2: lambda eb, x: eb.binary("mul", x, x),
                   3: lambda eb, x: eb.binary("mul", eb.binary("mul", x, x), x)}
        if ty in ("f32", "f64"):
            special.update({0.5: lambda eb, x: eb.unary("sqrt", x), -0.5: lambda eb, x: eb.unary("rsqrt", x),
                            -1: lambda eb, x: eb.unary("reciprocal", x)})
        if b in special:
            return elementwise(lw, node, [a], special[b], ty)
    if ty not in ("f32", "f64"):
        raise Unsupported("integer pow is not lowered")
    if not isinstance(a, LValue) and not isinstance(b, LValue):
        raise Unsupported("no tensor operand")
    return elementwise(lw, node, [a, b], lambda eb, x, y: eb.binary("pow", x, y), ty, cost=4)


@_reg([], ["__rpow__"])
def _rpow(lw, node, args, kwargs):
    return _pow(lw, node, (args[1], args[0]), {})


def _compare_rule(op, reflected=False):
    def rule(lw, node, args, kwargs):
        a, b = args[0], args[1]
        if reflected:
            a, b = b, a
        if not isinstance(a, LValue) and not isinstance(b, LValue):
            raise Unsupported("no tensor operand")
        if not (isinstance(b, LValue) or _is_scalar(b)) or not (isinstance(a, LValue) or _is_scalar(a)):
            raise Unsupported("comparison with a non-scalar")
        dt = promoted(a, b)
        _check_dtype(dt)
        if dt in HALF_DTYPES:  # eager compares in fp16/bf16: a Python scalar is rounded (1e5 -> inf) first
            a, b = [float(torch.tensor(v, dtype=dt)) if _is_scalar(v) else v for v in (a, b)]
        return elementwise(lw, node, [a, b], lambda eb, x, y: eb.binary(op, x, y), compute_type(dt), common_dtype=dt)
    return rule


for _op, _fns, _methods in (("eq", [torch.eq, operator.eq], ["eq", "__eq__"]), ("ne", [torch.ne, operator.ne], ["ne", "__ne__"]),
                            ("lt", [torch.lt, operator.lt, torch.less], ["lt", "__lt__", "less"]),
                            ("le", [torch.le, operator.le], ["le", "__le__"]),
                            ("gt", [torch.gt, operator.gt, torch.greater], ["gt", "__gt__", "greater"]),
                            ("ge", [torch.ge, operator.ge], ["ge", "__ge__"])):
    _reg(_fns, _methods)(_compare_rule(_op))


def _logical_rule(op):
    def rule(lw, node, args, kwargs):
        a, b = args[0], args[1]
        if not all(isinstance(x, LValue) and x.dtype == torch.bool for x in (a, b)):
            raise Unsupported(f"{op} of non-bool tensors")
        return elementwise(lw, node, [a, b], lambda eb, x, y: eb.binary(op, x, y), "b")
    return rule


_reg([torch.logical_and, operator.and_], ["logical_and", "__and__"])(_logical_rule("and"))
_reg([torch.logical_or, operator.or_], ["logical_or", "__or__"])(_logical_rule("or"))
_reg([torch.logical_xor, operator.xor], ["logical_xor", "__xor__"])(_logical_rule("xor"))


@_reg([torch.logical_not], ["logical_not"])
def _logical_not(lw, node, args, kwargs):
    a = _tensor(args[0])
    ty = compute_type(a.dtype)
    return elementwise(lw, node, [a], lambda eb, x: eb.unary("not", eb.cast(x, "b")), ty)


@_reg([operator.invert], ["__invert__", "bitwise_not"])
def _invert(lw, node, args, kwargs):
    a = _tensor(args[0])
    if a.dtype != torch.bool:
        raise Unsupported("bitwise not of integers is not lowered")
    return elementwise(lw, node, [a], lambda eb, x: eb.unary("not", x), "b")


@_reg([torch.where], ["where"])
def _where(lw, node, args, kwargs):
    if node.op == "call_method":
        c, a, b = args[1], args[0], args[2]
    else:
        if len(args) < 3:
            raise Unsupported("where(cond) with one argument returns indices")
        c, a, b = args[0], args[1], args[2]
    return where_value(lw, node, c, a, b)


def where_value(lw, node, c, a, b) -> Pointwise:
    c = _tensor(c, "condition")
    if c.dtype != torch.bool:
        raise Unsupported("where with a non-bool condition")
    for x in (a, b):
        if not isinstance(x, LValue) and not _is_scalar(x):
            raise Unsupported(f"where operand of type {type(x).__name__}")
    out_dtype = lw.dtype_of(node)
    _check_dtype(out_dtype)
    ty = compute_type(out_dtype)
    ops = [c, a, b]
    tensors = [o for o in ops if isinstance(o, LValue)]
    shape = broadcast_shapes(*[t.shape for t in tensors])
    cc, aa, bb = [broadcast_to(o, shape) if isinstance(o, LValue) else o for o in ops]

    def fn(kb, idx):
        eb = kb.eb
        x = eb.cast(kb.read(aa, idx), ty) if isinstance(aa, LValue) else eb.const(aa, ty)
        y = eb.cast(kb.read(bb, idx), ty) if isinstance(bb, LValue) else eb.const(bb, ty)
        return eb.where(eb.cast(kb.read(cc, idx), "b"), x, y)
    return Pointwise(shape, out_dtype, fn, tensors, (node.name,), 1)


@_reg([torch.masked_fill], ["masked_fill"])
def _masked_fill(lw, node, args, kwargs):
    x, mask, value = _tensor(args[0]), _arg(args, kwargs, 1, "mask"), _arg(args, kwargs, 2, "value")
    if isinstance(value, LValue):
        raise Unsupported("masked_fill with a tensor value")
    return where_value(lw, node, mask, value, x)


# --------------------------------------------------------------------------- unary ops

def _unary_rule(op: str, float_only: bool = True, cost: int = 1):
    """``op`` elementwise; ``float_only``: refuse integer/bool results; arithmetic ops
    (neg, relu) always refuse bool, as torch does."""
    def rule(lw, node, args, kwargs):
        a = _tensor(args[0] if args else kwargs.get("input"))
        if kwargs.get("out") is not None:
            raise Unsupported("out= is not lowered")
        out = lw.dtype_of(node)
        ty = compute_type(out)
        if (float_only and ty not in ("f32", "f64")) or (ty == "b" and op in ("neg", "relu")):
            raise Unsupported(f"{op} of {out}")
        return elementwise(lw, node, [a], lambda eb, x: eb.unary(op, x), ty, cost=cost)
    return rule


for _op, _cost in (("exp", 4), ("log", 4), ("log1p", 4), ("expm1", 4), ("sqrt", 1), ("rsqrt", 1), ("sigmoid", 4),
                   ("tanh", 4), ("erf", 4), ("reciprocal", 1), ("sin", 4), ("cos", 4)):
    _reg([getattr(torch, _op, None), getattr(torch.special, _op, None) if _op in ("expm1", "erf", "log1p") else None,
          getattr(F, _op, None) if _op in ("sigmoid", "tanh") else None], [_op])(_unary_rule(_op, cost=_cost))
_reg([torch.special.expit], [])(_unary_rule("sigmoid", cost=4))
for _op in ("floor", "ceil", "trunc", "sign", "abs"):
    _reg([getattr(torch, _op)], [_op])(_unary_rule(_op, float_only=False))
_reg([operator.abs, torch.absolute], ["absolute", "__abs__"])(_unary_rule("abs", float_only=False))
_reg([operator.neg, torch.neg, torch.negative], ["neg", "__neg__", "negative"])(_unary_rule("neg", float_only=False))


@_reg([torch.round], ["round"])
def _round(lw, node, args, kwargs):
    if _arg(args, kwargs, 1, "decimals", 0):
        raise Unsupported("round(decimals=...) is not lowered")
    return _unary_rule("round", float_only=False)(lw, node, args[:1], {})


@_reg([torch.square], ["square"])
def _square(lw, node, args, kwargs):
    a = _tensor(args[0])
    ty = compute_type(lw.dtype_of(node))
    return elementwise(lw, node, [a], lambda eb, x: eb.binary("mul", x, x), ty)


@_reg([torch.isnan], ["isnan"])
def _isnan(lw, node, args, kwargs):
    a = _tensor(args[0])
    ty = compute_type(a.dtype)
    if ty not in ("f32", "f64"):
        return elementwise(lw, node, [a], lambda eb, x: eb.const(False, "b"), "b")
    return elementwise(lw, node, [a], lambda eb, x: eb.unary("isnan", x), ty)


_relu = _reg([torch.relu, F.relu], ["relu"])(_unary_rule("relu", float_only=False))


@_reg([F.gelu], ["gelu"])
def _gelu(lw, node, args, kwargs):
    a = _tensor(args[0])
    approx = _arg(args, kwargs, 1, "approximate", "none")
    ty = _float_ty(lw.dtype_of(node))
    op = {"none": "gelu_erf", "tanh": "gelu_tanh"}.get(approx)
    if op is None:
        raise Unsupported(f"gelu(approximate={approx!r})")
    return elementwise(lw, node, [a], lambda eb, x: eb.unary(op, x), ty, cost=5)


@_reg([F.silu], [])
def _silu(lw, node, args, kwargs):
    a = _tensor(args[0])
    return elementwise(lw, node, [a], lambda eb, x: eb.unary("silu", x), _float_ty(lw.dtype_of(node)), cost=5)


def _clamp_body(ty, lo, hi):
    def body(eb, x):
        if lo is not None:
            x = eb.binary("max", x, eb.const(lo, ty))
        if hi is not None:
            x = eb.binary("min", x, eb.const(hi, ty))
        return x
    return body


@_reg([torch.clamp, torch.clip], ["clamp", "clip"])
def _clamp(lw, node, args, kwargs):
    a = _tensor(args[0])
    lo, hi = _arg(args, kwargs, 1, "min"), _arg(args, kwargs, 2, "max")
    if isinstance(lo, LValue) or isinstance(hi, LValue):
        raise Unsupported("clamp with tensor bounds")
    ty = compute_type(lw.dtype_of(node))
    if ty == "b":
        raise Unsupported("clamp of bool")
    return elementwise(lw, node, [a], _clamp_body(ty, lo, hi), ty)


@_reg([torch.clamp_min], ["clamp_min"])
def _clamp_min(lw, node, args, kwargs):
    return _clamp(lw, node, (args[0], _arg(args, kwargs, 1, "min"), None), {})


@_reg([torch.clamp_max], ["clamp_max"])
def _clamp_max(lw, node, args, kwargs):
    return _clamp(lw, node, (args[0], None, _arg(args, kwargs, 1, "max")), {})


@_reg([F.hardtanh], [])
def _hardtanh(lw, node, args, kwargs):
    return _clamp(lw, node, (args[0], _arg(args, kwargs, 1, "min_val", -1.0), _arg(args, kwargs, 2, "max_val", 1.0)), {})


@_reg([F.relu6], [])
def _relu6(lw, node, args, kwargs):
    return _clamp(lw, node, (args[0], 0.0, 6.0), {})


@_reg([F.leaky_relu], [])
def _leaky_relu(lw, node, args, kwargs):
    a = _tensor(args[0])
    slope = _arg(args, kwargs, 1, "negative_slope", 0.01)
    ty = _float_ty(lw.dtype_of(node))

    def body(eb, x):
        return eb.where(eb.binary("gt", x, eb.const(0, ty)), x, eb.binary("mul", x, eb.const(slope, ty)))
    return elementwise(lw, node, [a], body, ty)


def _hardsigmoid_expr(eb, x, ty):
    t = eb.binary("add", x, eb.const(3, ty))
    t = eb.binary("min", eb.binary("max", t, eb.const(0, ty)), eb.const(6, ty))
    return eb.binary("div", t, eb.const(6, ty))


@_reg([F.hardsigmoid], [])
def _hardsigmoid(lw, node, args, kwargs):
    ty = _float_ty(lw.dtype_of(node))
    return elementwise(lw, node, [_tensor(args[0])], lambda eb, x: _hardsigmoid_expr(eb, x, ty), ty)


@_reg([F.hardswish], [])
def _hardswish(lw, node, args, kwargs):
    ty = _float_ty(lw.dtype_of(node))
    return elementwise(lw, node, [_tensor(args[0])], lambda eb, x: eb.binary("mul", x, _hardsigmoid_expr(eb, x, ty)), ty)


@_reg([F.dropout, torch.dropout], [])
def _dropout(lw, node, args, kwargs):
    p = _arg(args, kwargs, 1, "p", 0.5)
    training = _arg(args, kwargs, 2, "training", True if node.target is F.dropout else False)
    if training and p > 0:
        raise Unsupported("dropout in training mode draws random numbers")
    return _tensor(args[0])


# --------------------------------------------------------------------------- casts & copies

def cast_value(lw, node, a: LValue, dtype) -> LValue:
    if dtype == a.dtype:
        return a
    _check_dtype(dtype, a.dtype)
    out_ty = compute_type(dtype)

    def fn(kb, idx):
        eb = kb.eb
        x = kb.read(a, idx)
        if out_ty == "b":
            return eb.cast(x, "b")
        y = eb.cast(x, out_ty, dtype if out_ty == "i64" else None)
        if dtype in (torch.float16, torch.bfloat16) or (out_ty == "i64" and dtype != torch.int64) or \
                (dtype == torch.float32 and x.ty == "f64"):
            y = eb.round_to(y, dtype)
        return y
    return Pointwise(a.shape, dtype, fn, [a], (node.name,), 1)


def _dtype_arg(args, kwargs, start=1):
    for a in list(args[start:]) + [kwargs.get("dtype")]:
        if isinstance(a, torch.dtype):
            return a
        if isinstance(a, LValue):
            return a.dtype
    return None


@_reg([], ["to", "type"])
def _to(lw, node, args, kwargs):
    a = _tensor(args[0])
    for x in list(args[1:]) + list(kwargs.values()):
        if isinstance(x, (torch.device, str)) and not isinstance(x, torch.dtype):
            if torch.device(x) != torch.device("cpu") if isinstance(x, (torch.device, str)) else False:
                raise Unsupported("device copy")
    if kwargs.get("memory_format") is not None or kwargs.get("copy"):
        raise Unsupported("to(memory_format=/copy=)")
    dt = _dtype_arg(args, kwargs)
    if dt is None:
        dt = lw.dtype_of(node)
    return cast_value(lw, node, a, dt)


for _m, _dt in (("float", torch.float32), ("double", torch.float64), ("half", torch.float16),
                ("bfloat16", torch.bfloat16), ("int", torch.int32), ("long", torch.int64), ("bool", torch.bool),
                ("short", torch.int16), ("char", torch.int8), ("byte", torch.uint8)):
    METHOD_RULES[_m] = (lambda dt: lambda lw, node, args, kwargs: cast_value(lw, node, _tensor(args[0]), dt))(_dt)


@_reg([], ["type_as"])
def _type_as(lw, node, args, kwargs):
    return cast_value(lw, node, _tensor(args[0]), _tensor(args[1]).dtype)


def copy_value(lw, node, a: LValue) -> LValue:
    return Pointwise(a.shape, a.dtype, lambda kb, idx: kb.read(a, idx), [a], (node.name,), 0)


@_reg([torch.clone], ["clone"])
def _clone(lw, node, args, kwargs):
    if kwargs.get("memory_format") not in (None, torch.preserve_format, torch.contiguous_format):
        raise Unsupported("clone(memory_format=...)")
    return copy_value(lw, node, _tensor(args[0]))


@_reg([], ["contiguous"])
def _contiguous(lw, node, args, kwargs):
    a = _tensor(args[0])
    if isinstance(a, BufferValue):
        from .values import contiguous_strides
        if a.strides == contiguous_strides(a.shape) or a.numel <= 1:
            return a
        return copy_value(lw, node, a)
    return a


@_reg([torch.detach], ["detach"])
def _detach(lw, node, args, kwargs):
    return _tensor(args[0])


# --------------------------------------------------------------------------- views

def _norm_dim(d: int, n: int) -> int:
    if not isinstance(d, int):
        raise Unsupported(f"dimension {d!r}")
    if n == 0 and d in (0, -1):
        return 0
    if d < -n or d >= n:
        raise Unsupported(f"dimension {d} out of range for rank {n}")
    return d % n


def _view_of(lw, node, a: LValue, shape, index_map) -> LValue:
    return make_view(a, shape, index_map, (node.name,))


@_reg([torch.permute], ["permute"])
def _permute(lw, node, args, kwargs):
    a = _tensor(args[0])
    dims = args[1:] if len(args) > 2 or (len(args) == 2 and isinstance(args[1], int)) else (args[1] if len(args) > 1 else kwargs["dims"])
    dims = [_norm_dim(d, len(a.shape)) for d in dims]
    shape = tuple(a.shape[d] for d in dims)
    inv = [0] * len(dims)
    for i, d in enumerate(dims):
        inv[d] = i
    return _view_of(lw, node, a, shape, lambda idx: tuple(idx[inv[k]] for k in range(len(dims))))


@_reg([torch.transpose, torch.swapaxes, torch.swapdims], ["transpose", "swapaxes", "swapdims"])
def _transpose(lw, node, args, kwargs):
    a = _tensor(args[0])
    n = len(a.shape)
    d0, d1 = _norm_dim(_arg(args, kwargs, 1, "dim0"), n), _norm_dim(_arg(args, kwargs, 2, "dim1"), n)
    perm = list(range(n))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return _permute(lw, node, (a, *perm), {}) if n else a


@_reg([torch.t], ["t"])
def _t(lw, node, args, kwargs):
    a = _tensor(args[0])
    if len(a.shape) < 2:
        return a
    return _permute(lw, node, (a, 1, 0), {})


@_reg([], ["expand"])
def _expand(lw, node, args, kwargs):
    a = _tensor(args[0])
    sizes = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)) else args[1:]
    lead = len(sizes) - len(a.shape)
    shape = tuple(a.shape[k - lead] if s == -1 else s for k, s in enumerate(sizes))
    if tuple(shape) != tuple(lw.shape_of(node)):
        raise Unsupported("expand sizes do not match the recorded shape")
    return broadcast_to(a, shape, (node.name,))


@_reg([], ["expand_as"])
def _expand_as(lw, node, args, kwargs):
    return broadcast_to(_tensor(args[0]), _tensor(args[1]).shape, (node.name,))


@_reg([torch.broadcast_to], [])
def _broadcast_to(lw, node, args, kwargs):
    return broadcast_to(_tensor(args[0]), tuple(lw.shape_of(node)), (node.name,))


@_reg([torch.unsqueeze], ["unsqueeze"])
def _unsqueeze(lw, node, args, kwargs):
    a = _tensor(args[0])
    d = _norm_dim(_arg(args, kwargs, 1, "dim"), len(a.shape) + 1)
    shape = a.shape[:d] + (1,) + a.shape[d:]
    return _view_of(lw, node, a, shape, lambda idx: tuple(idx[:d]) + tuple(idx[d + 1:]))


@_reg([torch.squeeze], ["squeeze"])
def _squeeze(lw, node, args, kwargs):
    a = _tensor(args[0])
    target = tuple(lw.shape_of(node))
    return _reshape_unit_dims(lw, node, a, target)


def _reshape_unit_dims(lw, node, a: LValue, shape) -> Optional[LValue]:
    """A reshape that only adds or removes size-1 dimensions, as an index map."""
    src = [(k, s) for k, s in enumerate(a.shape) if s != 1]
    dst = [(k, s) for k, s in enumerate(shape) if s != 1]
    if [s for _, s in src] != [s for _, s in dst]:
        raise Unsupported("not a size-1 reshape")
    zero = Affine(0)
    pos = {sk: dk for (sk, _), (dk, _) in zip(src, dst)}

    def index_map(idx):
        return tuple(idx[pos[k]] if k in pos else zero for k in range(len(a.shape)))
    return _view_of(lw, node, a, shape, index_map)


def reshape_value(lw, node, a: LValue, shape) -> LValue:
    shape = tuple(shape)
    if shape == a.shape:
        return a
    try:
        return _reshape_unit_dims(lw, node, a, shape)
    except Unsupported:
        pass
    if not isinstance(a, BufferValue):
        a = lw.materialize(a)
    base = torch.empty(0, dtype=torch.uint8, device="meta").as_strided(a.shape, a.strides, 0)
    try:
        v = base.view(shape)
    except RuntimeError:
        if node.op == "call_method" and node.target == "view":
            raise Unsupported("view of a non-viewable layout")
        a = lw.materialize(copy_value(lw, node, a))
        base = torch.empty(0, dtype=torch.uint8, device="meta").as_strided(a.shape, a.strides, 0)
        v = base.view(shape)
    return BufferValue(a.buffer, shape, tuple(v.stride()), a.offset, (node.name,))


@_reg([torch.reshape], ["view", "reshape"])
def _reshape(lw, node, args, kwargs):
    a = _tensor(args[0])
    if len(args) > 1 and isinstance(args[1], torch.dtype):
        raise Unsupported("view(dtype)")
    return reshape_value(lw, node, a, lw.shape_of(node))


@_reg([torch.flatten], ["flatten"])
def _flatten(lw, node, args, kwargs):
    return reshape_value(lw, node, _tensor(args[0]), lw.shape_of(node))


@_reg([], ["view_as", "reshape_as"])
def _view_as(lw, node, args, kwargs):
    return reshape_value(lw, node, _tensor(args[0]), _tensor(args[1]).shape)


@_reg([torch.narrow], ["narrow"])
def _narrow(lw, node, args, kwargs):
    a = _tensor(args[0])
    d = _norm_dim(_arg(args, kwargs, 1, "dim"), len(a.shape))
    start, length = _arg(args, kwargs, 2, "start"), _arg(args, kwargs, 3, "length")
    if not isinstance(start, int):
        raise Unsupported("narrow with a tensor start")
    start = start % a.shape[d] if start < 0 else start
    return _slice_dim(lw, node, a, d, start, 1, length)


def _slice_dim(lw, node, a, d, start, step, length):
    shape = a.shape[:d] + (length,) + a.shape[d + 1:]

    def index_map(idx):
        return tuple(idx[:d]) + (idx[d].scale(step) + start,) + tuple(idx[d + 1:])
    return _view_of(lw, node, a, shape, index_map)


@_reg([torch.select], ["select"])
def _select(lw, node, args, kwargs):
    a = _tensor(args[0])
    d = _norm_dim(_arg(args, kwargs, 1, "dim"), len(a.shape))
    i = _arg(args, kwargs, 2, "index")
    if not isinstance(i, int):
        raise Unsupported("select with a tensor index")
    i = i % a.shape[d]
    shape = a.shape[:d] + a.shape[d + 1:]
    return _view_of(lw, node, a, shape, lambda idx: tuple(idx[:d]) + (Affine(i),) + tuple(idx[d:]))


@_reg([operator.getitem], ["__getitem__"])
def _getitem(lw, node, args, kwargs):
    a, key = args[0], args[1]
    if isinstance(a, (tuple, list)):
        if isinstance(key, int):
            return a[key]
        raise Unsupported("getitem of a sequence with a non-int key")
    a = _tensor(a)
    if not isinstance(key, tuple):
        key = (key,)
    if any(isinstance(k, (LValue, list)) or (not isinstance(k, (int, slice)) and k is not None and k is not Ellipsis) for k in key):
        raise Unsupported("advanced indexing")
    n_real = sum(1 for k in key if k is not None and k is not Ellipsis)
    if Ellipsis in key:
        e = key.index(Ellipsis)
        key = key[:e] + (slice(None),) * (len(a.shape) - n_real) + key[e + 1:]
    key = key + (slice(None),) * (len(a.shape) - sum(1 for k in key if k is not None))
    # build the map: output dims -> input index
    out_shape: List[int] = []
    plan = []  # per input dim: ('int', i) or ('slice', out_pos, start, step)
    for k in key:
        if k is None:
            out_shape.append(1)
            continue
        d = len(plan)
        size = a.shape[d]
        if isinstance(k, int):
            if not -size <= k < size:
                raise Unsupported("index out of range")
            plan.append(("int", k % size))
        else:
            start, stop, step = k.indices(size)
            if step <= 0:
                raise Unsupported("slice step")
            length = max(0, (stop - start + step - 1) // step)
            plan.append(("slice", len(out_shape), start, step))
            out_shape.append(length)
    if tuple(out_shape) != tuple(lw.shape_of(node)):
        raise Unsupported("indexing result shape differs from the recorded one")

    def index_map(idx):
        out = []
        for p in plan:
            if p[0] == "int":
                out.append(Affine(p[1]))
            else:
                out.append(idx[p[1]].scale(p[3]) + p[2])
        return tuple(out)
    return _view_of(lw, node, a, tuple(out_shape), index_map)


def _split_sizes(lw, node):
    metas = lw.meta_of(node)
    if not isinstance(metas, (tuple, list)):
        raise Unsupported("split result was not recorded as a tuple")
    return [m.shape for m in metas]


@_reg([torch.split, torch.chunk, torch.unbind, torch.tensor_split], ["split", "chunk", "unbind", "tensor_split"])
def _split(lw, node, args, kwargs):
    a = _tensor(args[0])
    name = node.target if isinstance(node.target, str) else node.target.__name__
    n = len(a.shape)
    d = _norm_dim(_arg(args, kwargs, 2 if name != "unbind" else 1, "dim", 0), n)
    shapes = _split_sizes(lw, node)
    out = []
    start = 0
    for s in shapes:
        if name == "unbind":
            i = start
            out.append(_view_of(lw, node, a, tuple(s), lambda idx, i=i: tuple(idx[:d]) + (Affine(i),) + tuple(idx[d:])))
            start += 1
        else:
            out.append(_slice_dim(lw, node, a, d, start, 1, s[d]))
            start += s[d]
    return tuple(out)


# --------------------------------------------------------------------------- reductions

def _dims(dim, n):
    if dim is None:
        return None
    if isinstance(dim, int):
        dim = [dim]
    dims = sorted({_norm_dim(d, n) for d in dim})
    return dims


def reduce_value(lw, node, a: LValue, op: str, dim, keepdim: bool, dtype, mean: bool = False) -> LValue:
    n = len(a.shape)
    dims = _dims(dim, n)
    _check_dtype(dtype, a.dtype)
    if dtype != a.dtype and compute_type(dtype) != compute_type(a.dtype):
        a = cast_value(lw, node, a, dtype)
    if not dims or dims == list(range(n)):
        full = FullReduce(a, op, dtype, float(a.numel) if mean else None, (node.name,))
        return _reshape_unit_dims(lw, node, full, (1,) * n) if keepdim and n else full
    if dims != [n - 1]:
        raise Unsupported(f"reduction over dims {dims} (only the last dimension or all of them are lowered)")
    return RowReduce(a, op, dtype, keepdim, float(a.shape[-1]) if mean else None, (node.name,))


def _sum_dtype(a: LValue, dtype):
    if dtype is not None:
        return dtype
    if a.dtype in (torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        return torch.int64
    return a.dtype


@_reg([torch.sum], ["sum"])
def _sum(lw, node, args, kwargs):
    a = _tensor(args[0])
    dim = _arg(args, kwargs, 1, "dim")
    if isinstance(dim, torch.dtype):
        return reduce_value(lw, node, a, "sum", None, False, dim)
    keepdim = _arg(args, kwargs, 2, "keepdim", False)
    return reduce_value(lw, node, a, "sum", dim, keepdim, lw.dtype_of(node))


@_reg([torch.mean], ["mean"])
def _mean(lw, node, args, kwargs):
    a = _tensor(args[0])
    dim = _arg(args, kwargs, 1, "dim")
    keepdim = _arg(args, kwargs, 2, "keepdim", False)
    out = lw.dtype_of(node)
    if compute_type(out) not in ("f32", "f64"):
        raise Unsupported("mean of an integer tensor")
    return reduce_value(lw, node, a, "sum", dim, keepdim, out, mean=True)


def _minmax_rule(op):
    def rule(lw, node, args, kwargs):
        a = _tensor(args[0])
        dim = _arg(args, kwargs, 1, "dim", None)
        keepdim = _arg(args, kwargs, 2, "keepdim", False)
        if a.numel == 0:
            raise Unsupported("max/min of an empty tensor")
        return reduce_value(lw, node, a, op, dim if dim != () else None, keepdim, lw.dtype_of(node))
    return rule


_reg([torch.amax], ["amax"])(_minmax_rule("max"))
_reg([torch.amin], ["amin"])(_minmax_rule("min"))


@_reg([torch.max], ["max"])
def _max(lw, node, args, kwargs):
    if len(args) == 1 and not kwargs:
        return _minmax_rule("max")(lw, node, args, kwargs)
    if len(args) == 2 and isinstance(args[1], LValue):
        return _max_min_rule("max")(lw, node, args, kwargs)
    raise Unsupported("max(dim) returns indices")


@_reg([torch.min], ["min"])
def _min(lw, node, args, kwargs):
    if len(args) == 1 and not kwargs:
        return _minmax_rule("min")(lw, node, args, kwargs)
    if len(args) == 2 and isinstance(args[1], LValue):
        return _max_min_rule("min")(lw, node, args, kwargs)
    raise Unsupported("min(dim) returns indices")


def var_value(lw, node, a: LValue, dim, correction, keepdim, std: bool) -> LValue:
    out = lw.dtype_of(node)
    ty = _float_ty(out)
    n = len(a.shape)
    dims = _dims(dim, n)
    if dims is None or dims == list(range(n)):
        raise Unsupported("var/std over all elements is not lowered")
    if dims != [n - 1]:
        raise Unsupported("var/std over a dimension other than the last")
    N = a.shape[-1]
    mean = RowReduce(a, "sum", out, True, float(N), (node.name,))

    def sq(kb, idx):
        eb = kb.eb
        x = eb.cast(kb.read(a, idx), ty)
        m = kb.read(mean, tuple(idx[:-1]) + (Affine(0),))
        d = eb.binary("sub", x, m)
        return eb.binary("mul", d, d)
    centered = Pointwise(a.shape, out, sq, [a, mean], (node.name,), 3)
    denom = max(N - correction, 0)
    var = RowReduce(centered, "sum", out, keepdim, float(denom) if denom else 0.0, (node.name,))
    if not std:
        return var
    return Pointwise(var.shape, out, lambda kb, idx: kb.eb.unary("sqrt", kb.read(var, idx)), [var], (node.name,), 1)


def _correction(args, kwargs):
    if "correction" in kwargs and kwargs["correction"] is not None:
        return kwargs["correction"]
    unbiased = kwargs.get("unbiased", args[2] if len(args) > 2 and isinstance(args[2], bool) else True)
    if len(args) > 1 and isinstance(args[1], bool):
        unbiased = args[1]
    return 1 if unbiased else 0


@_reg([torch.var], ["var"])
def _var(lw, node, args, kwargs):
    a = _tensor(args[0])
    dim = _arg(args, kwargs, 1, "dim") if not (len(args) > 1 and isinstance(args[1], bool)) else None
    return var_value(lw, node, a, dim, _correction(args, kwargs), kwargs.get("keepdim", args[3] if len(args) > 3 else False), False)


@_reg([torch.std], ["std"])
def _std(lw, node, args, kwargs):
    a = _tensor(args[0])
    dim = _arg(args, kwargs, 1, "dim") if not (len(args) > 1 and isinstance(args[1], bool)) else None
    return var_value(lw, node, a, dim, _correction(args, kwargs), kwargs.get("keepdim", args[3] if len(args) > 3 else False), True)


def softmax_value(lw, node, a: LValue, dim, dtype, log: bool) -> LValue:
    out = lw.dtype_of(node)
    ty = _float_ty(out)
    if dtype is not None and dtype != a.dtype:
        a = cast_value(lw, node, a, dtype)
    n = len(a.shape)
    if n == 0:
        raise Unsupported("softmax of a 0-d tensor")
    if _norm_dim(dim, n) != n - 1:
        raise Unsupported("softmax over a dimension other than the last")
    mx = RowReduce(a, "max", out, True, None, (node.name,))

    def shifted(kb, idx):
        eb = kb.eb
        x = eb.cast(kb.read(a, idx), ty)
        return eb.binary("sub", x, kb.read(mx, tuple(idx[:-1]) + (Affine(0),)))

    def exp_shifted(kb, idx):
        return kb.eb.unary("exp", shifted(kb, idx))
    e = Pointwise(a.shape, out, exp_shifted, [a, mx], (node.name,), 5)
    s = RowReduce(e, "sum", out, True, None, (node.name,))

    def result(kb, idx):
        eb = kb.eb
        row = tuple(idx[:-1]) + (Affine(0),)
        if log:
            return eb.binary("sub", shifted(kb, idx), eb.unary("log", kb.read(s, row)))
        # times the row's reciprocal, as torch's CPU softmax does: a division per element costs
        # about as much as the exp on AVX-512 (error: +1 ulp at most)
        return eb.binary("mul", kb.read(e, idx), eb.unary("reciprocal", kb.read(s, row)))
    return Pointwise(a.shape, out, result, [a, mx, e, s], (node.name,), 6)


@_reg([F.softmax, torch.softmax], ["softmax"])
def _softmax(lw, node, args, kwargs):
    return softmax_value(lw, node, _tensor(args[0]), _arg(args, kwargs, 1, "dim"), kwargs.get("dtype", args[3] if len(args) > 3 else None), False)


@_reg([F.log_softmax, torch.log_softmax], ["log_softmax"])
def _log_softmax(lw, node, args, kwargs):
    return softmax_value(lw, node, _tensor(args[0]), _arg(args, kwargs, 1, "dim"), kwargs.get("dtype", args[3] if len(args) > 3 else None), True)


def norm_value(lw, node, x: LValue, normalized_shape, weight, bias, eps, rms: bool) -> LValue:
    out = lw.dtype_of(node)
    ty = _float_ty(out)
    ns = tuple(normalized_shape) if isinstance(normalized_shape, (tuple, list, torch.Size)) else (normalized_shape,)
    if len(ns) != 1 or x.shape[-1:] != ns:
        raise Unsupported("normalisation over more than the last dimension")
    for t in (weight, bias):
        if t is not None and not isinstance(t, LValue):
            raise Unsupported("weight/bias that are not tensors")
    N = ns[0]
    if rms:
        def sq(kb, idx):
            eb = kb.eb
            v = eb.cast(kb.read(x, idx), ty)
            return eb.binary("mul", v, v)
        ms = RowReduce(Pointwise(x.shape, out, sq, [x], (node.name,), 1), "sum", out, True, float(N), (node.name,))
        if eps is None:
            eps = torch.finfo(x.dtype).eps
        mean = None
    else:
        mean = RowReduce(x, "sum", out, True, float(N), (node.name,))

        def csq(kb, idx):
            eb = kb.eb
            d = eb.binary("sub", eb.cast(kb.read(x, idx), ty), kb.read(mean, tuple(idx[:-1]) + (Affine(0),)))
            return eb.binary("mul", d, d)
        ms = RowReduce(Pointwise(x.shape, out, csq, [x, mean], (node.name,), 2), "sum", out, True, float(N), (node.name,))
    w = broadcast_to(weight, x.shape) if weight is not None else None
    b = broadcast_to(bias, x.shape) if bias is not None else None

    def result(kb, idx):
        eb = kb.eb
        row = tuple(idx[:-1]) + (Affine(0),)
        v = eb.cast(kb.read(x, idx), ty)
        if mean is not None:
            v = eb.binary("sub", v, kb.read(mean, row))
        r = eb.unary("rsqrt", eb.binary("add", kb.read(ms, row), eb.const(eps, ty)))
        v = eb.binary("mul", v, r)
        if w is not None:
            v = eb.binary("mul", v, eb.cast(kb.read(w, idx), ty))
        if b is not None:
            v = eb.binary("add", v, eb.cast(kb.read(b, idx), ty))
        return v
    inputs = [x, ms] + [t for t in (w, b) if t is not None]
    return Pointwise(x.shape, out, result, inputs, (node.name,), 4)


@_reg([F.layer_norm], [])
def _layer_norm(lw, node, args, kwargs):
    return norm_value(lw, node, _tensor(args[0]), _arg(args, kwargs, 1, "normalized_shape"), _arg(args, kwargs, 2, "weight"),
                      _arg(args, kwargs, 3, "bias"), _arg(args, kwargs, 4, "eps", 1e-5), False)


if hasattr(F, "rms_norm"):
    @_reg([F.rms_norm], [])
    def _rms_norm(lw, node, args, kwargs):
        return norm_value(lw, node, _tensor(args[0]), _arg(args, kwargs, 1, "normalized_shape"), _arg(args, kwargs, 2, "weight"),
                          None, _arg(args, kwargs, 3, "eps", None), True)


# --------------------------------------------------------------------------- extern + epilogue

def bias_epilogue(lw, node, y: LValue, bias: Optional[LValue], channel_dim: Optional[int]) -> LValue:
    """``y + bias`` with ``bias`` broadcast along ``channel_dim`` (None: the last dim)."""
    if bias is None:
        return y
    n = len(y.shape)
    if channel_dim is None or channel_dim == n - 1:
        bb = broadcast_to(bias, y.shape)
    else:
        view = _view_of(lw, node, bias, (bias.shape[0],) + (1,) * (n - channel_dim - 1),
                        lambda idx: (idx[0],))
        bb = broadcast_to(view, y.shape)
    ty = compute_type(y.dtype)
    out = Pointwise(y.shape, y.dtype, lambda kb, idx: kb.eb.binary("add", kb.read(y, idx), kb.eb.cast(kb.read(bb, idx), ty)),
                    [y, bb], (node.name,), 1)
    # when this would be stored by a kernel of its own, the lowering passes the bias to the
    # torch call that made ``y`` instead (``Lowering._fold_bias``)
    out.bias_fold = (y, bias, channel_dim)
    return out


@_reg([F.linear], [])
def _linear(lw, node, args, kwargs):
    x, w, b = args[0], _arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias")
    if b is None or not isinstance(b, LValue):
        raise Unsupported("linear without bias runs through torch")
    y = lw.extern(node, F.linear, (x, w), {}, label="linear (bias fused into the next kernel)")
    return bias_epilogue(lw, node, y, b, None)


def _conv_rule(fn):
    def rule(lw, node, args, kwargs):
        x, w = args[0], _arg(args, kwargs, 1, "weight")
        b = _arg(args, kwargs, 2, "bias")
        if b is None or not isinstance(b, LValue):
            raise Unsupported("convolution without bias runs through torch")
        rest = list(args[3:])
        kw = {k: v for k, v in kwargs.items() if k not in ("weight", "bias")}
        y = lw.extern(node, fn, (x, w, None, *rest), kw, label=f"{fn.__name__} (bias fused into the next kernel)")
        return bias_epilogue(lw, node, y, b, 1)
    return rule


_reg([F.conv1d], [])(_conv_rule(F.conv1d))
_reg([F.conv2d], [])(_conv_rule(F.conv2d))


# --------------------------------------------------------------------------- modules

def _module_rule(cls):
    def deco(fn):
        if cls is not None:
            MODULE_RULES[cls] = fn
        return fn
    return deco


@_module_rule(nn.ReLU)
def _m_relu(lw, node, m, args, kwargs):
    return _relu(lw, node, args, {})


@_module_rule(nn.GELU)
def _m_gelu(lw, node, m, args, kwargs):
    return _gelu(lw, node, (args[0], m.approximate), {})


@_module_rule(nn.SiLU)
def _m_silu(lw, node, m, args, kwargs):
    return _silu(lw, node, args, {})


@_module_rule(nn.Sigmoid)
def _m_sigmoid(lw, node, m, args, kwargs):
    return _unary_rule("sigmoid")(lw, node, args, {})


@_module_rule(nn.Tanh)
def _m_tanh(lw, node, m, args, kwargs):
    return _unary_rule("tanh")(lw, node, args, {})


@_module_rule(nn.Softmax)
def _m_softmax(lw, node, m, args, kwargs):
    if m.dim is None:
        raise Unsupported("nn.Softmax(dim=None)")
    return softmax_value(lw, node, _tensor(args[0]), m.dim, None, False)


@_module_rule(nn.LogSoftmax)
def _m_log_softmax(lw, node, m, args, kwargs):
    if m.dim is None:
        raise Unsupported("nn.LogSoftmax(dim=None)")
    return softmax_value(lw, node, _tensor(args[0]), m.dim, None, True)


@_module_rule(nn.LayerNorm)
def _m_layer_norm(lw, node, m, args, kwargs):
    w = lw.param_value(node, m, "weight")
    b = lw.param_value(node, m, "bias")
    return norm_value(lw, node, _tensor(args[0]), m.normalized_shape, w, b, m.eps, False)


if hasattr(nn, "RMSNorm"):
    @_module_rule(nn.RMSNorm)
    def _m_rms_norm(lw, node, m, args, kwargs):
        w = lw.param_value(node, m, "weight")
        return norm_value(lw, node, _tensor(args[0]), m.normalized_shape, w, None, m.eps, True)


@_module_rule(nn.Dropout)
def _m_dropout(lw, node, m, args, kwargs):
    if m.training and m.p > 0:
        raise Unsupported("dropout in training mode draws random numbers")
    return _tensor(args[0])


@_module_rule(nn.Identity)
def _m_identity(lw, node, m, args, kwargs):
    return _tensor(args[0])


@_module_rule(nn.LeakyReLU)
def _m_leaky(lw, node, m, args, kwargs):
    return _leaky_relu(lw, node, (args[0], m.negative_slope), {})


@_module_rule(nn.Hardtanh)
def _m_hardtanh(lw, node, m, args, kwargs):
    return _clamp(lw, node, (args[0], m.min_val, m.max_val), {})


MODULE_RULES[nn.ReLU6] = _m_hardtanh


@_module_rule(nn.Hardswish)
def _m_hardswish(lw, node, m, args, kwargs):
    return _hardswish(lw, node, args, {})


@_module_rule(nn.Hardsigmoid)
def _m_hardsigmoid(lw, node, m, args, kwargs):
    return _hardsigmoid(lw, node, args, {})


@_module_rule(nn.Flatten)
def _m_flatten(lw, node, m, args, kwargs):
    return reshape_value(lw, node, _tensor(args[0]), lw.shape_of(node))


@_module_rule(nn.Linear)
def _m_linear(lw, node, m, args, kwargs):
    if m.bias is None:
        raise Unsupported("nn.Linear without bias runs through torch")
    w = lw.param_value(node, m, "weight")
    b = lw.param_value(node, m, "bias")
    y = lw.extern(node, F.linear, (args[0], w), {}, label="linear (bias fused into the next kernel)")
    return bias_epilogue(lw, node, y, b, None)


def _m_conv(fn):
    def rule(lw, node, m, args, kwargs):
        if m.bias is None:
            raise Unsupported(f"{type(m).__name__} without bias runs through torch")
        if m.padding_mode != "zeros" or isinstance(m.padding, str) and m.padding not in ("valid", "same"):
            raise Unsupported("non-zero padding mode")
        w = lw.param_value(node, m, "weight")
        b = lw.param_value(node, m, "bias")
        y = lw.extern(node, fn, (args[0], w, None, m.stride, m.padding, m.dilation, m.groups), {},
                      label=f"{fn.__name__} (bias fused into the next kernel)")
        return bias_epilogue(lw, node, y, b, 1)
    return rule


MODULE_RULES[nn.Conv1d] = _m_conv(F.conv1d)
MODULE_RULES[nn.Conv2d] = _m_conv(F.conv2d)


def _channel_view(lw, node, t: Optional[LValue], x: LValue) -> Optional[LValue]:
    if t is None:
        return None
    if not isinstance(t, LValue) or len(t.shape) != 1 or len(x.shape) < 2 or t.shape[0] != x.shape[1]:
        raise Unsupported("batch-norm statistics do not match the channel dimension")
    n = len(x.shape)
    view = _view_of(lw, node, t, (t.shape[0],) + (1,) * (n - 2), lambda idx: (idx[0],))
    return broadcast_to(view, x.shape)


def batch_norm_value(lw, node, x: LValue, mean, var, weight, bias, eps) -> LValue:
    """Inference batch norm: ``(x - mean) * rsqrt(var + eps) * weight + bias`` per channel."""
    out = lw.dtype_of(node)
    ty = _float_ty(out)
    x = _tensor(x)
    m, v = _channel_view(lw, node, mean, x), _channel_view(lw, node, var, x)
    if m is None or v is None:
        raise Unsupported("batch norm without running statistics")
    w, b = _channel_view(lw, node, weight, x), _channel_view(lw, node, bias, x)

    def fn(kb, idx):
        eb = kb.eb
        y = eb.binary("sub", eb.cast(kb.read(x, idx), ty), eb.cast(kb.read(m, idx), ty))
        r = eb.unary("rsqrt", eb.binary("add", eb.cast(kb.read(v, idx), ty), eb.const(eps, ty)))
        y = eb.binary("mul", y, r)
        if w is not None:
            y = eb.binary("mul", y, eb.cast(kb.read(w, idx), ty))
        if b is not None:
            y = eb.binary("add", y, eb.cast(kb.read(b, idx), ty))
        return y
    inputs = [t for t in (x, m, v, w, b) if t is not None]
    return Pointwise(x.shape, out, fn, inputs, (node.name,), 4)


@_reg([F.batch_norm], [])
def _batch_norm(lw, node, args, kwargs):
    training = _arg(args, kwargs, 5, "training", False)
    if training:
        raise Unsupported("batch norm in training mode updates running statistics")
    return batch_norm_value(lw, node, args[0], _arg(args, kwargs, 1, "running_mean"), _arg(args, kwargs, 2, "running_var"),
                            _arg(args, kwargs, 3, "weight"), _arg(args, kwargs, 4, "bias"), _arg(args, kwargs, 7, "eps", 1e-5))


def _m_batch_norm(lw, node, m, args, kwargs):
    if m.training or m.running_mean is None or m.running_var is None:
        raise Unsupported(f"{type(m).__name__} in training mode (or without running statistics)")
    return batch_norm_value(lw, node, args[0], lw.param_value(node, m, "running_mean"), lw.param_value(node, m, "running_var"),
                            lw.param_value(node, m, "weight"), lw.param_value(node, m, "bias"), m.eps)


for _cls in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d):
    MODULE_RULES[_cls] = _m_batch_norm
