"""Fold a constant per-output-channel scale into the convolution or linear layer before it.

``fold_channel_scale(gm)`` rewrites, in place, every ``y = layer(x) * c`` (``*``,
``torch.mul`` or ``.mul``; either operand order) where ``layer`` is a plain convolution or
linear layer (module, or ``F.conv*``/``F.linear`` over ``get_attr`` weights) whose result is
read by that multiply alone, and ``c`` is a finite constant that scales output channels only:
a Python number, or a ``get_attr`` tensor of the result's dtype that broadcasts along the
channel dimension alone (``(C, 1, 1)`` or ``(1, C, 1, 1)`` after a 2-D convolution, ``(C,)``
after a linear layer). The layer becomes one with weight ``W * c`` and bias ``b * c`` (float64
math, cast back), and ``y`` is its result: ConvNeXt's, ConvNeXt-V2's and ViTs' layer scale
("gamma") disappears, and a residual add after it can then accumulate into the layer's output
(``lower``'s oneDNN sum post-op). Results change by rounding only, as with batch-norm folding.
Returns how many multiplies were folded.

Like :func:`~symtrace.passes.fold_bn.fold_batch_norm`, it never changes shared state: the
folded layer is a new module (``<name>_scaled``) or new parameters next to the old ones, and
only the node that fed the multiply is pointed at them.
"""
from __future__ import annotations

import math
import operator
from typing import Any, List, Optional

import torch

from ..graph.graph_module import GraphModule
from ..graph.node import Node
from .fold_bn import (_attr, _drop_unused, _producer_of, _Producer, _reads_metadata, install_refolded_module,
                      point_at_new_weights)
from .finite_values import tensor_is_finite

__all__ = ["fold_channel_scale"]

_MULS = (operator.mul, torch.mul)


def _is_mul(n: Node) -> bool:
    if n.kwargs or len(n.args) != 2:
        return False
    if n.op == "call_function":
        return any(n.target is f for f in _MULS)
    return n.op == "call_method" and n.target == "mul"


def _channel_scale(gm: GraphModule, c: Any, prod: _Producer, out_meta) -> Optional[torch.Tensor]:
    """``c`` as a 1-D tensor of the layer's output channels (or of length 1), or None when it
    is not a finite constant that scales output channels only."""
    if type(c) in (int, float):
        return torch.tensor([float(c)], dtype=torch.float64) if math.isfinite(c) else None
    t = _constant(gm, c)
    if not isinstance(t, torch.Tensor) or not hasattr(out_meta, "shape") or t.dtype != out_meta.dtype:
        return None
    rank = len(out_meta.shape)
    channels = prod.weight.shape[0]
    channel_dim = rank - 1 if prod.linear else 1
    if t.dim() > rank or rank <= channel_dim:
        return None
    shape = (1,) * (rank - t.dim()) + tuple(t.shape)
    if any(s != 1 for d, s in enumerate(shape) if d != channel_dim) or shape[channel_dim] not in (1, channels):
        return None
    if not tensor_is_finite(t):
        return None
    return t.detach().reshape(-1).to(torch.float64)


#: reshaping methods a scale may be read through (timm: ``self.gamma.reshape(1, -1, 1, 1)``;
#: constant folding leaves views of an attribute computed at run time)
_VIEWS = frozenset(("reshape", "view", "unsqueeze", "squeeze", "flatten"))


def _constant(gm: GraphModule, c: Any, depth: int = 0) -> Optional[torch.Tensor]:
    """The tensor ``c`` reads: a ``get_attr``, or a reshaping method of one with literal
    arguments; None otherwise."""
    if type(c) is not Node or depth > 4:
        return None
    if c.op == "get_attr":
        try:
            t = _attr(gm, c.target)
        except AttributeError:
            return None
        return t if isinstance(t, torch.Tensor) else None
    if c.op != "call_method" or c.target not in _VIEWS or c.kwargs or not c.args \
            or any(type(a) is not int for a in c.args[1:]):
        return None
    base = _constant(gm, c.args[0], depth + 1)
    if base is None:
        return None
    try:
        return getattr(base.detach(), c.target)(*c.args[1:])
    except (RuntimeError, IndexError, TypeError):
        return None


def fold_channel_scale(gm: GraphModule) -> int:
    """Fold constant per-output-channel multiplies into the layer before them (in place; see
    the module docstring). Returns how many were folded."""
    graph = gm.graph
    dropped: List[str] = []
    k = 0
    for m in list(graph.nodes):
        if m._erased or not _is_mul(m):
            continue
        for i in (0, 1):
            prod = _producer_of(gm, m.args[i])
            if prod is None:   # (modules: exactly Conv1d/2d/3d or Linear, no hooks)
                continue
            if any(u is not m and not _reads_metadata(u) for u in prod.node.users) or \
                    sum(1 for a in m.args if a is prod.node) != 1:
                continue
            scale = _channel_scale(gm, m.args[1 - i], prod, prod.node.meta.get("tensor_meta"))
            if scale is None or not prod.weight.is_floating_point():
                continue
            _fold(gm, prod, scale, dropped)
            m.replace_all_uses_with(prod.node)
            const = m.args[1 - i]
            graph.erase_node(m)
            while type(const) is Node and not const.users:   # the scale and the views it was read through
                base = const.args[0] if const.op == "call_method" else None
                if const.op == "get_attr":
                    dropped.append(const.target)
                graph.erase_node(const)
                const = base
            k += 1
            break
    if k:
        _drop_unused(gm, dropped)
    return k


def _fold(gm: GraphModule, prod: _Producer, scale: torch.Tensor, dropped: List[str]) -> None:
    w = prod.weight.detach()
    new_w = (w.to(torch.float64) * scale.reshape((-1,) + (1,) * (w.dim() - 1))).to(w.dtype)
    b = prod.bias
    new_b = None if b is None else (b.detach().to(torch.float64) * scale).to(b.dtype)
    if prod.kind == "module":
        dropped.append(prod.node.target)
        prod.node.target = install_refolded_module(gm, prod, new_w, new_b, "_scaled")
    else:
        point_at_new_weights(gm, prod, new_w, new_b, "_scaled", dropped)
