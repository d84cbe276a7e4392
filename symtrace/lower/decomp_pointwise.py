"""Pointwise decomposition rules: arithmetic, comparisons, logic, ``where``, unary ops and
activations, casts and copies."""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from ..graph.node import TensorMeta
from .ir import HALF_DTYPES, compute_type
from .values import BufferValue, LValue, Pointwise, broadcast_shapes, broadcast_to, dense_in_order, strided_probe
from .decomp_registry import (METHOD_RULES, Unsupported, _arg, _check_dtype, _float_ty, _is_scalar, _reg,
                              _tensor, elementwise, promoted)


# --------------------------------------------------------------------------- arithmetic

def _operands(args, reflected: bool):
    """The two operands of a binary op (swapped for a reflected one); one must be a tensor."""
    a, b = (args[1], args[0]) if reflected else (args[0], args[1])
    if not isinstance(a, LValue) and not isinstance(b, LValue):
        raise Unsupported("no tensor operand")
    return a, b


def _binary_rule(op: str, reflected: bool = False):
    def rule(lw, node, args, kwargs):
        a, b = _operands(args, reflected)
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
        a, b = _operands(args, reflected)
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


def _device_of(lw, node):
    """The device a node's recorded tensor result is on (None when unknown)."""
    m = lw.meta_of(node) if hasattr(node, "op") else None
    return m.device if isinstance(m, TensorMeta) else None


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
    src = _device_of(lw, node.args[0]) if node.args else None
    if src is None or src != _device_of(lw, node):   # (to the device the value is on already: a cast)
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
    fmt = _arg(args, kwargs, 1, "memory_format", torch.contiguous_format)
    if fmt is not torch.contiguous_format:
        if isinstance(a, BufferValue) and _in_format(a, fmt):
            return a
        raise Unsupported(f"contiguous(memory_format={fmt}): a layout conversion, run by torch")
    if isinstance(a, BufferValue):
        from .values import contiguous_strides
        # (torch's is_contiguous: a size-1 dimension's stride does not matter, and eager's
        # contiguous() returns such a tensor itself: a decode step's (1, 32, 1, 64) attention
        # output transposed to (1, 1, 32, 64) is not copied)
        if all(st == c for st, c, n in zip(a.strides, contiguous_strides(a.shape), a.shape)
               if not (type(n) is int and n == 1)) or (isinstance(a.numel, int) and a.numel <= 1):
            return a
        return copy_value(lw, node, a)
    probe = strided_probe(lw.meta_of(node.args[0]))
    if probe is not None:
        # as eager: its input itself where that is contiguous (size-1 dims' strides aside), else a
        # copy, a value of its own (which later writes to the input's memory do not reach)
        return a if probe.is_contiguous() else copy_value(lw, node, a)
    if lw.eager_layout(a) is not None:   # it may be stored channels-last (for a torch call)
        return copy_value(lw, node, a)
    return a


def _in_format(a: BufferValue, fmt) -> bool:
    """Whether the buffer view ``a`` is already laid out as ``fmt`` (channels_last: dims in
    memory order C, W, H, N, size-1 dims anywhere)."""
    if fmt is torch.preserve_format:
        return True
    return fmt is torch.channels_last and len(a.shape) == 4 and dense_in_order(a.shape, a.strides, (1, 3, 2, 0))


@_reg([torch.detach], ["detach"])
def _detach(lw, node, args, kwargs):
    return _tensor(args[0])
