"""The rule registry of the decompositions (:mod:`symtrace.lower.decomp`): ``Unsupported``, the
function/method/module rule tables, ``rule_for``, and the argument and elementwise helpers every
rule module uses."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

import torch

from .ir import HALF_DTYPES, compute_type
from .values import LValue, Pointwise, broadcast_shapes, broadcast_to


class Unsupported(Exception):
    """This node is not lowered; the message says why (shown in reports)."""


Rule = Callable[..., Any]
FUNCTION_RULES: Dict[Any, Rule] = {}
METHOD_RULES: Dict[str, Rule] = {}
MODULE_RULES: Dict[type, Rule] = {}
#: rules for calls of callable objects, by the object's class (the inference pipeline's packed layers)
CALLABLE_RULES: Dict[type, Rule] = {}


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
            rule = FUNCTION_RULES.get(node.target)
        except TypeError:
            rule = None
        return rule if rule is not None else CALLABLE_RULES.get(type(node.target))
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


def normalized(kb, y, variance, eps: float, ty: str, weight, bias, idx):
    """``y * rsqrt(variance + eps)``, then times ``weight`` and plus ``bias`` (read at ``idx``)
    where given: the end of every normalisation (batch, layer, RMS)."""
    eb = kb.eb
    y = eb.binary("mul", y, eb.unary("rsqrt", eb.binary("add", variance, eb.const(eps, ty))))
    if weight is not None:
        y = eb.binary("mul", y, eb.cast(kb.read(weight, idx), ty))
    if bias is not None:
        y = eb.binary("add", y, eb.cast(kb.read(bias, idx), ty))
    return y


def _float_ty(dtype) -> str:
    ty = compute_type(dtype)
    if ty not in ("f32", "f64"):
        raise Unsupported(f"needs a floating-point result, got {dtype}")
    return ty
