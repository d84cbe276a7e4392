"""Merge parallel convolution branches that are summed into one convolution.

``merge_conv_branches(gm)`` rewrites, in place, sums such as RepVGG's and MobileOne's
(after :func:`~symtrace.passes.fold_bn.fold_batch_norm`)::

    conv3x3(x) + conv1x1(x) + bn(x)         becomes   conv3x3'(x)
    dwconv3x3(x) + x                        becomes   dwconv3x3'(x)          (a position encoding)

A sum (a tree of ``+``, ``torch.add``, ``.add`` or in-place ``+=`` on a fresh value, each
intermediate read by the next add alone) is split into terms; terms that read the same input
``x`` are merged when at least one is a 2-D convolution with constant weights (a plain
``nn.Conv2d`` without hooks, or ``F.conv2d`` over ``get_attr`` tensors; zero padding) and the
others are such convolutions, eval-mode batch norms of ``x`` (running statistics), ``x``
itself, or Python numbers. The convolutions must share stride, dilation and groups and put
their taps on one grid (their paddings differ by a multiple of the dilation); batch norms and
``x`` itself count as a 1x1 tap at the window's centre, so they need stride 1 and as many
output channels as input channels. Each term must be read by the sum alone, and every term and
the sum must have the recorded shape and dtype of the result (no broadcasting); nothing may
write ``x`` (or memory it shares) between the first branch and the sum, where the merged layer
reads it.

The merged weight holds each convolution's kernel at its offset in the union of their windows
(summed where they overlap), a batch norm's scale ``gamma / sqrt(var + eps)`` (``x`` itself: 1)
on the diagonal of the centre tap, and the bias the sum of the biases, the batch norms' shifts
and the numbers; float64 math, cast back. One convolution then reads ``x`` once instead of
several reading it and adds writing and reading their results; a following activation can fuse
into it (:mod:`symtrace.lower.onednn`). The result differs from the sum by rounding on finite
inputs. Where ``x`` holds an infinity it may differ: eager computes ``w1 * inf + w2 * inf``
(NaN for weights of opposite signs), the merged layer ``(w1 + w2) * inf``. ``inputs_finite``
(a callable on the input node, e.g. :meth:`~symtrace.passes.finite_values.FiniteValues.holds`)
restricts merging to inputs it answers True for; None merges wherever the shapes allow.

Like the other folding passes it never changes shared state: the merged weights are new
parameters (``<first weight>_merged``), the terms' nodes are erased and modules or attributes
no node reads any more are removed from the ``GraphModule`` (never from the user's modules).
Returns the names of the sums it rewrote.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..graph.graph_module import GraphModule
from ..graph.node import Node
from .alias import AliasAnalysis
from .fold_bn import (_F_CONV_SIG, _bind, _bn_of, _drop_unused, _free_name, _install, _producer_of,
                      bn_scale_shift)

__all__ = ["merge_conv_branches"]

_ADD_FUNCTIONS = (operator.add, torch.add)
_IN_PLACE = (operator.iadd,)


class _Conv(NamedTuple):
    node: Node
    x: Node
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    stride: Tuple[int, int]
    padding: Tuple[int, int]
    dilation: Tuple[int, int]
    groups: int
    source: Optional[str]   # the module or weight attribute, for naming the merged weight


class _Scale(NamedTuple):
    """A per-channel ``x * scale + shift`` term: a batch norm of ``x``, or ``x`` itself."""
    node: Node
    x: Node
    scale: Optional[torch.Tensor]   # None: x itself
    shift: Optional[torch.Tensor]


def _pair(v: Any) -> Optional[Tuple[int, int]]:
    if type(v) is int:
        return (v, v)
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(type(a) is int for a in v):
        return (v[0], v[1])
    if isinstance(v, (tuple, list)) and len(v) == 1 and type(v[0]) is int:
        return (v[0], v[0])
    return None


def _padding(v: Any, kernel: Tuple[int, int], dilation: Tuple[int, int]) -> Optional[Tuple[int, int]]:
    if v == "valid":
        return (0, 0)
    if v == "same":
        spans = [d * (k - 1) for k, d in zip(kernel, dilation)]
        return None if any(s % 2 for s in spans) else (spans[0] // 2, spans[1] // 2)
    return _pair(v)


def _add_kind(n: Any) -> Optional[str]:
    """``"add"`` for a plain add of two operands (no alpha), ``"in place"`` for ``+=`` /
    ``.add_``, else None."""
    if type(n) is not Node or n.kwargs or len(n.args) != 2:
        return None
    if n.op == "call_function":
        if any(n.target is f for f in _IN_PLACE):
            return "in place"
        return "add" if any(n.target is f for f in _ADD_FUNCTIONS) else None
    if n.op == "call_method":
        return "in place" if n.target == "add_" else "add" if n.target in ("add", "__add__") else None
    return None


def _add_operands(gm: GraphModule, n: Node, memo: Dict[Node, bool]) -> Optional[Tuple[Any, Any]]:
    """The two operands of a plain add, else None; an in-place add only into a fresh value
    nothing else reads (a view would carry the write to memory others read: an effect the
    merge would drop)."""
    kind = _add_kind(n)
    if kind is None or (kind == "in place" and not _fresh(gm, n.args[0], memo)):
        return None
    return n.args[0], n.args[1]


def _fresh(gm: GraphModule, a: Any, memo: Dict[Node, bool]) -> bool:
    """Whether ``a`` is a fresh value nothing else reads: a convolution's or batch norm's
    result, an out-of-place add, or an in-place add into such a value (a chain of them is
    walked in a loop, answers kept in ``memo``: a long ``acc += y`` chain must not recurse)."""
    chain: List[Node] = []
    answer = False
    while type(a) is Node and len(a.users) == 1:
        if a in memo:
            answer = memo[a]
            break
        chain.append(a)
        kind = _add_kind(a)
        if kind != "in place":
            answer = kind == "add" or _producer_of(gm, a) is not None or _bn_of(gm, a) is not None
            break
        a = a.args[0]
    for n in chain:
        memo[n] = answer
    return answer


def _meta(n: Any):
    return n.meta.get("tensor_meta") if type(n) is Node else None


def _conv_term(gm: GraphModule, t: Node) -> Optional[_Conv]:
    prod = _producer_of(gm, t)
    if prod is None or prod.linear or prod.spatial != 2:
        return None
    w = prod.weight
    if w.dim() != 4 or not w.is_floating_point():
        return None
    if prod.kind == "module":
        mod = prod.module
        if mod.padding_mode != "zeros":
            return None
        x, stride, pad, dil, groups = t.args[0], mod.stride, mod.padding, mod.dilation, mod.groups
        source = t.target
    else:
        a = _bind(_F_CONV_SIG, t)
        x, stride, pad, dil, groups = a["input"], a["stride"], a["padding"], a["dilation"], a["groups"]
        source = prod.weight_node.target
    stride, dil = _pair(stride), _pair(dil)
    if type(x) is not Node or stride is None or dil is None or type(groups) is not int:
        return None
    pad = _padding(pad, tuple(w.shape[2:]), dil)
    if pad is None:
        return None
    return _Conv(t, x, w.detach(), None if prod.bias is None else prod.bias.detach(), stride, pad, dil, groups, source)


def _scale_term(gm: GraphModule, t: Node) -> Optional[_Scale]:
    bn = _bn_of(gm, t)
    if bn is None or bn.training is not False or type(bn.input) is not Node or bn.mean is None \
            or bn.var is None or not isinstance(bn.eps, (int, float)) or isinstance(bn.eps, bool):
        return None
    def d(v):
        return None if v is None else v.detach()
    scale, shift = bn_scale_shift(bn.mean.detach(), bn.var.detach(), d(bn.gamma), d(bn.beta), bn.eps)
    return _Scale(t, bn.input, scale, shift)


def _sum_tree(gm: GraphModule, root: Node, memo: Dict[Node, bool]) -> Optional[Tuple[List[Node], List[Any]]]:
    """``(adds, terms)`` of the sum ending at ``root``: the add nodes (root first) and the
    operands that are not adds read by the sum alone."""
    adds, terms = [], []
    stack = [root]
    while stack:
        n = stack.pop()
        ops = _add_operands(gm, n, memo)
        if ops is None:
            return None
        adds.append(n)
        for a in reversed(ops):
            if type(a) is Node and a is not root and len(a.users) == 1 and _add_operands(gm, a, memo) is not None:
                stack.append(a)
            else:
                terms.append(a)
    terms.reverse()
    return adds, terms


def _group_fits(convs: List[_Conv], scales: List[_Scale], x: Node, out_shape) -> Optional[Tuple]:
    """``(lo, kernel, padding)`` of the merged layer, or None when the terms cannot merge."""
    first = convs[0]
    cout, cin_g = first.weight.shape[0], first.weight.shape[1]
    if any(c.stride != first.stride or c.dilation != first.dilation or c.groups != first.groups
           or c.weight.shape[:2] != first.weight.shape[:2] or c.weight.dtype != first.weight.dtype
           or c.weight.device != first.weight.device
           or (c.bias is not None and (c.bias.dtype != c.weight.dtype or c.bias.shape != (cout,)))
           for c in convs):
        return None
    xm = _meta(x)
    xshape = getattr(xm, "shape", None)
    if xshape is None or len(xshape) != 4 or not all(type(s) is int for s in xshape) \
            or xshape[1] != cin_g * first.groups or len(out_shape) != 4:
        return None
    if scales and (first.stride != (1, 1) or cout != xshape[1]
                   or any(s.scale is not None and s.scale.shape != (cout,) for s in scales)):
        return None
    d = first.dilation
    lo, hi = [], []
    for j in range(2):
        starts = [-c.padding[j] for c in convs] + [0] * bool(scales)
        ends = [-c.padding[j] + (c.weight.shape[2 + j] - 1) * d[j] for c in convs] + [0] * bool(scales)
        low = min(starts)
        if any((s - low) % d[j] for s in starts):
            return None
        lo.append(low)
        hi.append(max(ends))
    kernel = tuple((hi[j] - lo[j]) // d[j] + 1 for j in range(2))
    padding = (-lo[0], -lo[1])
    if min(padding) < 0:
        return None
    for j in range(2):
        size = (xshape[2 + j] + 2 * padding[j] - d[j] * (kernel[j] - 1) - 1) // first.stride[j] + 1
        if size != out_shape[2 + j]:
            return None
    return lo, kernel, padding


def _merged_weights(convs: List[_Conv], scales: List[_Scale], numbers: List[float], lo, kernel):
    first = convs[0]
    cout, cin_g = first.weight.shape[0], first.weight.shape[1]
    d = first.dilation
    w = torch.zeros((cout, cin_g) + tuple(kernel), dtype=torch.float64, device=first.weight.device)
    b = torch.zeros(cout, dtype=torch.float64, device=first.weight.device)
    for c in convs:
        o0, o1 = ((-c.padding[j] - lo[j]) // d[j] for j in range(2))
        k0, k1 = c.weight.shape[2:]
        w[:, :, o0:o0 + k0, o1:o1 + k1] += c.weight.to(torch.float64)
        if c.bias is not None:
            b += c.bias.to(torch.float64)
    if scales:
        c0, c1 = (-lo[0]) // d[0], (-lo[1]) // d[1]
        channels = torch.arange(cout, device=w.device)
        for s in scales:
            diag = torch.ones(cout, dtype=torch.float64, device=w.device) if s.scale is None else s.scale.to(w.device)
            w[channels, channels % cin_g, c0, c1] += diag
            if s.shift is not None:
                b += s.shift.to(w.device)
    for v in numbers:
        b += v
    return w.to(first.weight.dtype), b.to(first.weight.dtype)


def _written_before_sum(alias: AliasAnalysis, x: Node, convs: List[_Conv], scales: List[_Scale],
                        adds: List[Node], root: Node) -> bool:
    """Whether something may write ``x`` between the first branch reading it (a convolution,
    a batch norm, or an add of ``x`` itself) and the sum, where the merged layer reads it (it
    would see the write; the branches did not)."""
    reads = [c.node for c in convs] + [s.node for s in scales if s.scale is not None]
    if any(s.scale is None for s in scales):
        reads += [a for a in adds if x in a.args]
    return alias.written_across(x, reads + [root])


def merge_conv_branches(gm: GraphModule, inputs_finite: Optional[Callable[[Node], bool]] = None) -> List[str]:
    """Merge summed parallel convolution branches (in place; see the module doc). Returns the
    names of the sums rewritten."""
    graph = gm.graph
    done: List[str] = []
    dropped: List[str] = []
    seen = set()
    alias = AliasAnalysis(graph, gm)
    memo: Dict[Node, bool] = {}
    for root in reversed(list(graph.nodes)):
        if root._erased or root in seen or _add_operands(gm, root, memo) is None:
            continue
        tree = _sum_tree(gm, root, memo)
        if tree is None:
            continue
        adds, terms = tree
        seen.update(adds)
        rewritten = _merge_sum(gm, root, adds, terms, inputs_finite, dropped, alias)
        if rewritten:
            done.append(root.name)
    if done:
        _drop_unused(gm, dropped)
    return done


def _merged_conv(gm: GraphModule, root: Node, x: Node, convs: List[_Conv], scales: List[_Scale],
                 numbers: List[float], shape: Tuple) -> Node:
    """The ``F.conv2d`` node (before ``root``) over new parameters holding the merged weights."""
    lo, kernel, padding = shape
    w, b = _merged_weights(convs, scales, numbers, lo, kernel)
    first = convs[0]
    rg = first.weight.requires_grad
    w_name = _free_name(gm, first.source + "_merged")
    _install(gm, w_name, nn.Parameter(w, requires_grad=rg))
    b_name = _free_name(gm, first.source + "_merged_bias")
    _install(gm, b_name, nn.Parameter(b, requires_grad=rg))
    graph = gm.graph
    with graph.inserting_before(root):
        args = (x, graph.get_attr(w_name), graph.get_attr(b_name), first.stride, padding, first.dilation, first.groups)
        new = graph.call_function(F.conv2d, args, name=first.node.name + "_merged")
    new.meta.update({k: v for k, v in first.node.meta.items() if k in ("source", "module_path")})
    new.meta["tensor_meta"] = root.meta.get("tensor_meta")
    return new


def _merge_sum(gm: GraphModule, root: Node, adds: List[Node], terms: List[Any],
               inputs_finite: Optional[Callable[[Node], bool]], dropped: List[str], alias: AliasAnalysis) -> bool:
    rm = _meta(root)
    out_shape = tuple(getattr(rm, "shape", ()))
    dtype = getattr(rm, "dtype", None)
    if len(out_shape) != 4 or dtype is None or not dtype.is_floating_point:
        return False
    nodes = [t for t in terms if type(t) is Node]
    if len(set(nodes)) != len(nodes):
        return False   # (a value summed twice)

    def fits(t: Node) -> bool:   # (the result's shape and dtype: no broadcasting, no promotion)
        return tuple(getattr(_meta(t), "shape", ())) == out_shape and getattr(_meta(t), "dtype", None) == dtype
    convs: Dict[Node, List[_Conv]] = {}
    scales: Dict[Node, List[_Scale]] = {}
    for t in nodes:
        if len(t.users) != 1 or not fits(t):
            continue
        c = _conv_term(gm, t)
        if c is not None:
            convs.setdefault(c.x, []).append(c)
            continue
        s = _scale_term(gm, t)
        if s is not None and fits(s.x):
            scales.setdefault(s.x, []).append(s)
    numbers = [float(t) for t in terms if type(t) is not Node]
    if not all(type(t) in (int, float) and math.isfinite(t) for t in terms if type(t) is not Node):
        return False
    merged: List[Tuple[Node, List[Any], Node]] = []   # (x, terms it replaces, new node)
    graph = gm.graph
    for x, group in convs.items():
        group_scales = list(scales.get(x, []))
        if x in nodes and fits(x):
            group_scales.append(_Scale(x, x, None, None))
        if len(group) + len(group_scales) < 2 or _written_before_sum(alias, x, group, group_scales, adds, root):
            continue
        shape = _group_fits(group, group_scales, x, out_shape)
        if shape is None or (inputs_finite is not None and not inputs_finite(x)):
            continue
        new = _merged_conv(gm, root, x, group, group_scales, numbers if not merged else [], shape)
        merged.append((x, [c.node for c in group] + [s.node for s in group_scales], new))
    if not merged:
        return False
    replaced = {t for _, ts, _ in merged for t in ts}
    rest = [t for t in terms if type(t) is Node and t not in replaced]
    # the numbers went into the first merged bias; the sum's other terms are added after it
    with graph.inserting_before(root):
        acc = merged[0][2]
        for _, _, new in merged[1:]:
            acc = graph.call_function(operator.add, (acc, new))
            acc.meta["tensor_meta"] = rm
        for t in rest:
            acc = graph.call_function(operator.add, (acc, t))
            acc.meta["tensor_meta"] = rm
    acc.meta.update({k: v for k, v in root.meta.items() if k != "tensor_meta"})
    alias.same_as(acc, root)
    root.replace_all_uses_with(acc)
    for a in adds:   # (root first: each add's only user is the one before it)
        graph.erase_node(a)
    for _, ts, _ in merged:
        for t in ts:
            if t.users or t.op not in ("call_module", "call_function"):
                continue   # (x itself)
            attrs = [a for a in t.all_input_nodes if a.op == "get_attr"]
            if t.op == "call_module":
                dropped.append(t.target)
            graph.erase_node(t)
            for a in attrs:   # (a functional layer's weights, a batch norm's statistics)
                if not a.users and not a._erased:
                    dropped.append(a.target)
                    graph.erase_node(a)
    return True
