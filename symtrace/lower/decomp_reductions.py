"""Reduction and row decomposition rules: sum, mean, amax/amin, max/min, all/any, var/std, softmax and
log_softmax, layer_norm, rms_norm and group_norm."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..graph.symbols import SizeExpr, SymbolicSizeError, bounds
from ..passes.fuse_attention import _MATMUL_FUNCS, _MATMUL_METHODS, _is
from .ir import Affine, compute_type
from .values import FullReduce, LValue, Pointwise, RowReduce, broadcast_to
from .decomp_registry import Unsupported, _arg, _check_dtype, _float_ty, _reg, _tensor, normalized
from .decomp_pointwise import _max_min_rule, cast_value
from .decomp_views import _norm_dim, _reshape_unit_dims, make_view, permuted, reshape_value


def _divisor(n):
    """A mean's divisor: a float, or the size expression itself (size-generic kernels divide by
    the size they get as an argument)."""
    return n if isinstance(n, SizeExpr) else float(n)


def at_least_0(n):
    """``max(n, 0)`` for a size that may be symbolic (its whole range must be >= 0)."""
    if not isinstance(n, SizeExpr):
        return max(n, 0)
    if bounds(n)[0] >= 0:
        return n
    raise SymbolicSizeError(f"max({n}, 0) of a size that may be negative")


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
    if not dims or dims == list(range(n)) or n == 0:   # (a 0-d tensor's dim 0 or -1: all of it)
        full = FullReduce(a, op, dtype, _divisor(a.numel) if mean else None, (node.name,))
        return _reshape_unit_dims(lw, node, full, (1,) * n) if keepdim and n else full
    if dims != list(range(dims[0], n)):
        # other dimensions: a view with the reduced ones moved last (in their order), reduced as
        # trailing dimensions; the kept ones stay in their order, as torch's result has them
        kept = [k for k in range(n) if k not in dims]
        r = reduce_value(lw, node, permuted(lw, node, a, kept + dims), op, list(range(len(kept), n)), False,
                         dtype, mean)
        return _reshape_unit_dims(lw, node, r, tuple(1 if k in dims else a.shape[k] for k in range(n))) \
            if keepdim else r
    if len(dims) > 1:   # trailing dims (a pooled H, W): one row per leading index, over their product
        from .decomp_views import reshape_value
        k = dims[0]
        length = 1
        for s in a.shape[k:]:
            length *= s
        if length == 0:
            raise Unsupported("reduction over empty trailing dimensions")
        rows = reshape_value(lw, node, a, a.shape[:k] + (length,))
        r = RowReduce(rows, op, dtype, keepdim, _divisor(length) if mean else None, (node.name,))
        return _reshape_unit_dims(lw, node, r, a.shape[:k] + (1,) * (n - k)) if keepdim else r
    return RowReduce(a, op, dtype, keepdim, _divisor(a.shape[-1]) if mean else None, (node.name,))


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


def _all_any_rule(op):
    """``all``/``any`` (whole tensor or over dims): the minimum/maximum of ``x != 0`` (NaN
    counts as true, as in torch), in the dtype torch answers in (bool; uint8 for uint8)."""
    def rule(lw, node, args, kwargs):
        a = _tensor(args[0])
        dim = _arg(args, kwargs, 1, "dim", None)
        keepdim = _arg(args, kwargs, 2, "keepdim", False)
        if dim == () or dim == []:
            raise Unsupported(f"{'all' if op == 'min' else 'any'} over no dimensions")
        if a.numel == 0 or (isinstance(a.numel, SizeExpr) and bounds(a.numel)[0] == 0):
            raise Unsupported(f"{'all' if op == 'min' else 'any'} of a tensor that may be empty")
        truth = cast_value(lw, node, cast_value(lw, node, a, torch.bool), torch.int64)
        r = reduce_value(lw, node, truth, op, dim, keepdim, torch.int64)
        return cast_value(lw, node, r, lw.dtype_of(node))
    return rule


_reg([torch.all], ["all"])(_all_any_rule("min"))
_reg([torch.any], ["any"])(_all_any_rule("max"))


def _max_or_min_rule(op):
    """``torch.max(x)`` (a full reduction) or ``torch.max(x, y)`` (elementwise); not ``max(x, dim)``."""
    def rule(lw, node, args, kwargs):
        if len(args) == 1 and not kwargs:
            return _minmax_rule(op)(lw, node, args, kwargs)
        if len(args) == 2 and isinstance(args[1], LValue):
            return _max_min_rule(op)(lw, node, args, kwargs)
        raise Unsupported(f"{op}(dim) returns indices")
    return rule


_reg([torch.max], ["max"])(_max_or_min_rule("max"))
_reg([torch.min], ["min"])(_max_or_min_rule("min"))


def var_value(lw, node, a: LValue, dim, correction, keepdim, std: bool) -> LValue:
    out = lw.dtype_of(node)
    ty = _float_ty(out)
    n = len(a.shape)
    dims = _dims(dim, n)
    if dims is None or dims == list(range(n)) or n == 0:
        raise Unsupported("var/std over all elements is not lowered")
    if len(dims) != 1:
        raise Unsupported("var/std over several dimensions")
    if dims != [n - 1]:   # (over the last dimension of a view that moves it last)
        d = dims[0]
        r = var_value(lw, node, permuted(lw, node, a, [k for k in range(n) if k != d] + [d]), -1, correction,
                      False, std)
        return _reshape_unit_dims(lw, node, r, tuple(1 if k == d else a.shape[k] for k in range(n))) \
            if keepdim else r
    N = a.shape[-1]
    mean = RowReduce(a, "sum", out, True, _divisor(N), (node.name,))

    def sq(kb, idx):
        eb = kb.eb
        x = eb.cast(kb.read(a, idx), ty)
        m = kb.read(mean, tuple(idx[:-1]) + (Affine(0),))
        d = eb.binary("sub", x, m)
        return eb.binary("mul", d, d)
    centered = Pointwise(a.shape, out, sq, [a, mean], (node.name,), 3)
    denom = at_least_0(N - correction)
    var = RowReduce(centered, "sum", out, keepdim, _divisor(denom) if denom else 0.0, (node.name,))
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
    d = _norm_dim(dim, n)
    if d != n - 1:   # (over the last dimension of a view that moves ``d`` last, viewed back)
        perm = [k for k in range(n) if k != d] + [d]
        back = list(range(n - 1))
        back.insert(d, n - 1)
        return permuted(lw, node, softmax_value(lw, node, permuted(lw, node, a, perm), -1, None, log), back)
    mx = RowReduce(a, "max", out, True, None, (node.name,))

    def shifted(kb, idx):
        eb = kb.eb
        x = eb.cast(kb.read(a, idx), ty)
        return eb.binary("sub", x, kb.read(mx, tuple(idx[:-1]) + (Affine(0),)))

    def exp_shifted(kb, idx):
        return kb.eb.unary("exp", shifted(kb, idx))
    e = Pointwise(a.shape, out, exp_shifted, [a, mx], (node.name,), 5)
    s = RowReduce(e, "sum", out, True, None, (node.name,))

    # (a matmul's operand: subnormal probabilities stored as 0, see _only_multiplied)
    flush = not log and out in (torch.float32, torch.float64) and lw.device_type == "cpu" and _only_multiplied(node)

    def result(kb, idx):
        eb = kb.eb
        row = tuple(idx[:-1]) + (Affine(0),)
        if log:
            return eb.binary("sub", shifted(kb, idx), eb.unary("log", kb.read(s, row)))
        # times the row's reciprocal, as torch's CPU softmax does: a division per element costs
        # about as much as the exp on AVX-512 (error: +1 ulp at most)
        p = eb.binary("mul", kb.read(e, idx), eb.unary("reciprocal", kb.read(s, row)))
        if not flush:
            return p
        tiny = eb.const(torch.finfo(out).tiny, ty)
        return eb.where(eb.binary("lt", p, tiny), eb.const(0.0, ty), p)
    return Pointwise(a.shape, out, result, [a, mx, e, s], (node.name,), 6)


_VIEWS = frozenset((torch.reshape, torch.permute, torch.transpose, torch.flatten, torch.unflatten))
_VIEW_METHODS = frozenset(("view", "reshape", "permute", "transpose", "flatten", "unflatten", "contiguous",
                           "expand"))


def _only_multiplied(node, depth: int = 0) -> bool:
    """Whether every use of softmax ``node`` is a matrix product (attention's ``p @ v``), through
    views and eval-mode dropout. There the kernel stores a probability below the smallest normal
    number (2^-126 in float32) as 0: it changes the product by less than 2^-126 of |v| per term,
    and a CPU matmul reading subnormals takes the slow path (swin_t's masked window attention:
    (48, 49, 49) @ (48, 49, 32) took 2.15 ms instead of 0.025 through MKL). Any other use (a
    log, a division, the graph's output) sees eager's subnormals."""
    if not node.users or depth > 8:
        return False
    for u in node.users:
        if _is(u, _MATMUL_FUNCS + (torch.mm,), _MATMUL_METHODS) and node in u.args[:2] and not u.kwargs:
            continue
        through = (u.op == "call_function" and u.target in _VIEWS) or \
            (u.op == "call_method" and u.target in _VIEW_METHODS) or \
            (u.op == "call_function" and u.target is F.dropout and u.kwargs.get("training", True) is False)
        if not (through and u.args and u.args[0] is node and _only_multiplied(u, depth + 1)):
            return False
    return True


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
        ms = RowReduce(Pointwise(x.shape, out, sq, [x], (node.name,), 1), "sum", out, True, _divisor(N), (node.name,))
        if eps is None:
            eps = torch.finfo(x.dtype).eps
        mean = None
    else:
        mean = RowReduce(x, "sum", out, True, _divisor(N), (node.name,))

        def csq(kb, idx):
            eb = kb.eb
            d = eb.binary("sub", eb.cast(kb.read(x, idx), ty), kb.read(mean, tuple(idx[:-1]) + (Affine(0),)))
            return eb.binary("mul", d, d)
        ms = RowReduce(Pointwise(x.shape, out, csq, [x, mean], (node.name,), 2), "sum", out, True, _divisor(N), (node.name,))
    w = broadcast_to(weight, x.shape) if weight is not None else None
    b = broadcast_to(bias, x.shape) if bias is not None else None

    def result(kb, idx):
        eb = kb.eb
        row = tuple(idx[:-1]) + (Affine(0),)
        v = eb.cast(kb.read(x, idx), ty)
        if mean is not None:
            v = eb.binary("sub", v, kb.read(mean, row))
        return normalized(kb, v, kb.read(ms, row), eps, ty, w, b, idx)
    inputs = [x, ms] + [t for t in (w, b) if t is not None]
    return Pointwise(x.shape, out, result, inputs, (node.name,), 4)


def group_norm_value(lw, node, x: LValue, groups, weight, bias, eps) -> LValue:
    """``F.group_norm``: per sample and group of channels, ``(x - mean) * rsqrt(var + eps)``
    over the group's channels and every position (biased variance, two passes), times the
    per-channel weight, plus the bias. The statistics are sums of row sums over the trailing
    dimensions of an ``(N, G, ...)`` view of ``x`` whose reduced dimensions (``C / G`` and the
    spatial ones) are ordered by stride, so the first pass reads ``x`` in memory order whatever
    its layout (no copy); they are kept in float32 (float64 for float64) and spread to
    ``(N, C)`` before the elementwise pass, which reads ``x`` in its own layout."""
    out = lw.dtype_of(node)
    ty = _float_ty(out)
    x = _tensor(x)
    if len(x.shape) < 2 or type(groups) is not int or groups <= 0:
        raise Unsupported("group_norm needs an (N, C, ...) input and a positive number of groups")
    n, c, spatial = x.shape[0], x.shape[1], tuple(x.shape[2:])
    if isinstance(c, SizeExpr) or c % groups:
        raise Unsupported("group_norm over a symbolic channel count, or one the groups do not divide")
    for t in (weight, bias):
        if t is not None and not (isinstance(t, LValue) and tuple(t.shape) == (c,)):
            raise Unsupported("group_norm weight/bias that are not per-channel tensors")
    cg = c // groups
    count = cg
    for d in spatial:
        count = count * d
    if not isinstance(count, SizeExpr) and count == 0 or isinstance(count, SizeExpr) and bounds(count)[0] == 0:
        raise Unsupported("group_norm over empty groups")
    stat = torch.float64 if out == torch.float64 else torch.float32
    x = lw.materialize(x)   # (read three times: once, in its own layout)
    # the reduced dims (C/G, *spatial), the one of smallest stride last: reduced first, in memory
    # order (channels-last: over C/G, then W, then H), rows of the first pass contiguous
    strides = (x.strides[1],) + tuple(x.strides[2:])
    order = list(range(len(strides)))
    if all(type(st) is int for st in strides):
        order.sort(key=lambda d: -strides[d])
    sizes = (cg,) + spatial
    shape5 = (n, groups) + tuple(sizes[d] for d in order)
    where = {d: 2 + k for k, d in enumerate(order)}   # reduced dim -> its position in shape5

    def x_index(idx):
        i = [idx[where[d]] for d in range(len(sizes))]
        return (idx[0], idx[1].scale(cg) + i[0]) + tuple(i[1:])
    x5 = make_view(x, shape5, x_index, (node.name,))

    def group_mean(v):   # (N, G, C/G, *spatial) -> (N, G): row sums down to two dims, then / count
        while len(v.shape) > 3:
            v = RowReduce(v, "sum", stat, False, None, (node.name,))
        return RowReduce(v, "sum", stat, False, _divisor(count), (node.name,))
    mean = group_mean(x5)
    mean5 = make_view(mean, shape5, lambda idx: (idx[0], idx[1]), (node.name,))

    def sq_dev(kb, idx):
        eb = kb.eb
        d = eb.binary("sub", eb.cast(kb.read(x5, idx), compute_type(stat)), kb.read(mean5, idx))
        return eb.binary("mul", d, d)
    var = group_mean(Pointwise(shape5, stat, sq_dev, [x5, mean5], (node.name,), 3))

    def per_channel(v):   # (N, G) -> (N, C), then seen at every position of x
        spread = reshape_value(lw, node, make_view(v, (n, groups, cg), lambda idx: (idx[0], idx[1]), (node.name,)),
                               (n, c))
        return make_view(spread, x.shape, lambda idx: (idx[0], idx[1]), (node.name,))
    m, v = per_channel(mean), per_channel(var)
    w, b = (None if t is None else make_view(t, x.shape, lambda idx: (idx[1],), (node.name,)) for t in (weight, bias))

    def fn(kb, idx):
        eb = kb.eb
        y = eb.binary("sub", eb.cast(kb.read(x, idx), ty), eb.cast(kb.read(m, idx), ty))
        return normalized(kb, y, eb.cast(kb.read(v, idx), ty), eps, ty, w, b, idx)
    return Pointwise(x.shape, out, fn, [t for t in (x, m, v, w, b) if t is not None], (node.name,), 4)


@_reg([F.group_norm], [])
def _group_norm(lw, node, args, kwargs):
    return group_norm_value(lw, node, args[0], _arg(args, kwargs, 1, "num_groups"), _arg(args, kwargs, 2, "weight"),
                            _arg(args, kwargs, 3, "bias"), _arg(args, kwargs, 4, "eps", 1e-5))


@_reg([F.normalize], [])
def _normalize(lw, node, args, kwargs):
    """``F.normalize(x, p=2, dim, eps)``: ``x / max(sqrt(sum(x * x, dim)), eps)`` (EdgeNeXt's and
    XCiT's cross-covariance attention normalise q and k; CLIP-style heads), one row reduction over
    ``dim`` (any one dimension) and a pointwise division. p = 2 only; float inputs."""
    a = _tensor(args[0])
    p = _arg(args, kwargs, 1, "p", 2.0)
    dim = _arg(args, kwargs, 2, "dim", 1)
    eps = _arg(args, kwargs, 3, "eps", 1e-12)
    if kwargs.get("out") is not None:
        raise Unsupported("normalize with out=")
    if p != 2 or type(p) not in (int, float) or type(eps) not in (int, float) or not isinstance(dim, int):
        raise Unsupported("normalize other than the 2-norm over one dimension")
    out = lw.dtype_of(node)
    ty = _float_ty(out)
    n = len(a.shape)
    if n == 0 or a.numel == 0:
        raise Unsupported("normalize of a 0-d or empty tensor")
    d = _norm_dim(dim, n)

    def square(kb, idx):
        x = kb.eb.cast(kb.read(a, idx), ty)
        return kb.eb.binary("mul", x, x)
    sq = Pointwise(a.shape, out, square, [a], (node.name,), 1)
    ss = reduce_value(lw, node, sq, "sum", [d], True, out)
    ss = broadcast_to(ss, a.shape, (node.name,))

    # eager's norm and clamp are tensors of the result's dtype: a half norm is rounded, and an
    # eps below half's range is 0 there (a zero row is then 0 / 0)
    eps_rounded = float(torch.tensor(float(eps), dtype=out))

    def result(kb, idx):
        eb = kb.eb
        norm = eb.round_to(eb.unary("sqrt", kb.read(ss, idx)), out)
        denom = eb.binary("max", norm, eb.const(eps_rounded, ty))
        return eb.binary("div", eb.cast(kb.read(a, idx), ty), denom)
    return Pointwise(a.shape, out, result, [a, ss], (node.name,), 3)


@_reg([F.layer_norm], [])
def _layer_norm(lw, node, args, kwargs):
    return norm_value(lw, node, _tensor(args[0]), _arg(args, kwargs, 1, "normalized_shape"), _arg(args, kwargs, 2, "weight"),
                      _arg(args, kwargs, 3, "bias"), _arg(args, kwargs, 4, "eps", 1e-5), False)


if hasattr(F, "rms_norm"):
    @_reg([F.rms_norm], [])
    def _rms_norm(lw, node, args, kwargs):
        return norm_value(lw, node, _tensor(args[0]), _arg(args, kwargs, 1, "normalized_shape"), _arg(args, kwargs, 2, "weight"),
                          None, _arg(args, kwargs, 3, "eps", None), True)
