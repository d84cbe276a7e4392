"""Windowed pooling rules: ``max_pool`` and ``avg_pool`` in 1, 2 and 3 dimensions (functions
and modules), as values of the pooled tensor that later kernels fuse.

An output element reads the input at ``o * stride - padding + k * dilation`` for each tap ``k``
of the window: an affine index per tap. Taps that can fall outside the input for some output
positions are *masked loads* (:meth:`~symtrace.lower.ir.ExprBuilder.load` with a mask built by
:meth:`~symtrace.lower.ir.ExprBuilder.in_range`), so padding costs no memory and no copy: a
masked max tap reads as -Inf, a masked sum tap as 0. Taps that cannot fall outside are plain
loads, and a tap that is outside for every output position is dropped. Average pooling divides
by what torch divides by: ``divisor_override``; else the number of taps inside the padded input
(``count_include_pad``, clipped where ``ceil_mode`` windows run past it) or inside the input.

The input is read from memory (a value that is not in a buffer yet is stored first): every
element is read by several windows. What stays in torch, with the reason in the report:
``return_indices``, integer tensors, sizes known only per call, a recorded shape that does not
match torch's size formula.
"""
from __future__ import annotations

import itertools
import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..graph.symbols import SizeExpr
from .values import BufferValue, LValue, Pointwise
from .decomp_views import load_at
from .decomp_registry import MODULE_RULES, Unsupported, _arg, _float_ty, _reg, _tensor

__all__ = ["pool_value", "pooled_size"]


def _per_dim(v, rank: int, what: str) -> Tuple[int, ...]:
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,) * rank
    v = tuple(v)
    if len(v) == 1:
        v = v * rank
    if len(v) != rank or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise Unsupported(f"pooling {what} {v!r}")
    return v


def pooled_size(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """The output length torch gives one pooled dimension."""
    span = size + 2 * p - d * (k - 1) - 1
    out = (span + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:   # the last window would start in the padding
        out -= 1
    return out


def pool_value(lw, node, x, op: str, rank: int, kernel_size, stride, padding, dilation, ceil_mode: bool,
               count_include_pad: bool = True, divisor_override: Optional[int] = None) -> LValue:
    """``op`` (``"max"`` or ``"avg"``) pooling of ``x`` over its last ``rank`` dimensions."""
    x = _tensor(x)
    ty = _float_ty(x.dtype)
    shape = tuple(x.shape)
    if any(isinstance(n, SizeExpr) for n in shape):
        raise Unsupported("pooling with sizes known only per call")
    if len(shape) not in (rank + 1, rank + 2):
        raise Unsupported(f"{op} pooling of a rank-{len(shape)} tensor")
    k = _per_dim(kernel_size, rank, "kernel size")
    s = _per_dim(stride if stride not in (None, (), []) else k, rank, "stride")
    p = _per_dim(padding, rank, "padding")
    d = _per_dim(dilation, rank, "dilation")
    if min(k + s + d) < 1 or min(p) < 0 or any(2 * pp > kk for pp, kk in zip(p, k)):
        raise Unsupported("pooling parameters torch rejects")
    if divisor_override is not None and (isinstance(divisor_override, bool) or not isinstance(divisor_override, int)
                                         or divisor_override == 0):
        raise Unsupported(f"avg pooling divisor_override {divisor_override!r}")
    lead = len(shape) - rank
    sizes = shape[lead:]
    out_sizes = tuple(pooled_size(n, *a, ceil_mode) for n, *a in zip(sizes, k, s, p, d))
    out_shape = shape[:lead] + out_sizes
    if tuple(lw.shape_of(node)) != out_shape:
        raise Unsupported(f"pooled shape {tuple(lw.shape_of(node))} is not torch's {out_shape}")
    if min(out_shape, default=1) == 0 or min(sizes) == 0:
        raise Unsupported("pooling of an empty tensor")
    src = x if isinstance(x, BufferValue) else lw.materialize(x)

    # per pooled dimension: each tap's input position (an offset from o * stride) and whether
    # it can leave [lo, hi) for some output position o (then it is tested per element)
    def taps(j: int, lo: int, hi: int) -> List[Tuple[int, bool]]:
        out = []
        for t in range(k[j]):
            off = t * d[j] - p[j]
            first, last = off, (out_sizes[j] - 1) * s[j] + off
            if last < lo or first >= hi:
                out.append((off, None))       # outside for every o: never read
            else:
                out.append((off, first < lo or last >= hi))
        return out

    inside = [taps(j, 0, sizes[j]) for j in range(rank)]
    padded = [taps(j, -p[j], sizes[j] + p[j]) for j in range(rank)]
    fill = float("-inf") if op == "max" else 0.0

    def fn(kb, idx):
        eb = kb.eb
        pos = [idx[lead + j].scale(s[j]) for j in range(rank)]
        other = eb.const(fill, ty)
        acc = None if op == "max" else eb.const(0.0, ty)
        for tap in itertools.product(*inside):
            if any(masked is None for _, masked in tap):
                continue
            at = list(idx[:lead]) + [pos[j] + off for j, (off, _) in enumerate(tap)]
            v = eb.cast(load_at(eb, src, at, [False] * lead + [masked for _, masked in tap], other), ty)
            acc = v if acc is None else eb.binary("max" if op == "max" else "add", acc, v)
        if op == "max":   # (a dilated window can miss the input altogether: torch gives -Inf there)
            return other if acc is None else acc
        return eb.binary("div", acc, _divisor(eb, ty, pos, inside if not count_include_pad else padded,
                                              divisor_override, sizes, p, count_include_pad))

    return Pointwise(out_shape, x.dtype, fn, [src], (node.name,), cost=math.prod(k) + 1)


def _divisor(eb, ty, pos, per_dim, override, sizes, p, count_include_pad):
    """Average pooling's divisor at output position ``pos``: the product over dimensions of the
    number of taps inside the input (or the padded input), unless ``override`` is given."""
    if override is not None:
        return eb.const(override, ty)
    total = None
    for j, taps in enumerate(per_dim):
        lo, hi = (-p[j], sizes[j] + p[j]) if count_include_pad else (0, sizes[j])
        fixed = sum(1 for _, masked in taps if masked is False)
        count = eb.const(fixed, ty)
        for off, masked in taps:
            if masked:
                count = eb.binary("add", count, eb.where(eb.in_range(pos[j] + off, lo, hi),
                                                          eb.const(1, ty), eb.const(0, ty)))
        total = count if total is None else eb.binary("mul", total, count)
    return total


# --------------------------------------------------------------------------- functions and modules

def _max_rule(rank: int, aten: bool = False):
    def rule(lw, node, args, kwargs):
        if not aten and _arg(args, kwargs, 6, "return_indices", False):
            raise Unsupported("max pooling that returns indices")
        return pool_value(lw, node, args[0], "max", rank, _arg(args, kwargs, 1, "kernel_size"),
                          _arg(args, kwargs, 2, "stride"), _arg(args, kwargs, 3, "padding", 0),
                          _arg(args, kwargs, 4, "dilation", 1), bool(_arg(args, kwargs, 5, "ceil_mode", False)))
    return rule


def _avg_rule(rank: int):
    def rule(lw, node, args, kwargs):
        return pool_value(lw, node, args[0], "avg", rank, _arg(args, kwargs, 1, "kernel_size"),
                          _arg(args, kwargs, 2, "stride"), _arg(args, kwargs, 3, "padding", 0), 1,
                          bool(_arg(args, kwargs, 4, "ceil_mode", False)),
                          bool(_arg(args, kwargs, 5, "count_include_pad", True)),
                          _arg(args, kwargs, 6, "divisor_override") if rank > 1 else None)
    return rule


for _rank, _f, _aten in ((1, F.max_pool1d, torch.max_pool1d), (2, F.max_pool2d, torch.max_pool2d),
                         (3, F.max_pool3d, torch.max_pool3d)):
    _reg([_f], [])(_max_rule(_rank))
    _reg([_aten], [])(_max_rule(_rank, aten=True))
for _rank, _f in ((1, F.avg_pool1d), (2, F.avg_pool2d), (3, F.avg_pool3d)):
    _reg([_f], [])(_avg_rule(_rank))


def _m_max_pool(lw, node, m, args, kwargs):
    if m.return_indices:
        raise Unsupported("max pooling that returns indices")
    rank = {nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3}[type(m)]
    return pool_value(lw, node, args[0], "max", rank, m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode)


def _m_avg_pool(lw, node, m, args, kwargs):
    rank = {nn.AvgPool1d: 1, nn.AvgPool2d: 2, nn.AvgPool3d: 3}[type(m)]
    return pool_value(lw, node, args[0], "avg", rank, m.kernel_size, m.stride, m.padding, 1, m.ceil_mode,
                      m.count_include_pad, getattr(m, "divisor_override", None))


for _cls in (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d):
    MODULE_RULES[_cls] = _m_max_pool
for _cls in (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d):
    MODULE_RULES[_cls] = _m_avg_pool
