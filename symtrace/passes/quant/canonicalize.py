"""Normalise a traced graph before quantization patterns are matched.

The same computation can be written many ways -- ``nn.ReLU()``, ``F.relu``, ``torch.relu``,
``x.relu()``, ``x.relu_()``; ``out += x`` or ``out + x``; ``x.view(x.size(0), -1)`` or
``torch.flatten(x, 1)`` -- and a pattern table should not have to list them all (PT2E's x86
quantizer, for one, misses ``add_`` where it expects ``add``). :func:`canonicalize` rewrites
each spelling to one canonical ``call_function``:

=====================  =====================================================================
canonical target       rewritten from
=====================  =====================================================================
``torch.relu``         ``nn.ReLU``, ``F.relu``, ``x.relu()``, and in place: ``relu_``, ``inplace=True``
``operator.add``       ``torch.add``, ``x.add(y)`` (``alpha`` 1), ``x += y``, ``x.add_(y)``
``torch.flatten``      ``nn.Flatten``, ``x.flatten(...)``, ``x.view(x.size(0), -1)``, ``reshape`` alike
``F.max_pool2d``       ``nn.MaxPool2d`` (without ``return_indices``)
``F.avg_pool2d``       ``nn.AvgPool2d``
``F.adaptive_avg_pool2d``  ``nn.AdaptiveAvgPool2d``
``torch.sigmoid``/``tanh``  ``nn.Sigmoid``/``nn.Tanh``, ``F.sigmoid``/``F.tanh``, methods
(removed)              ``nn.Dropout``/``nn.Identity`` and ``F.dropout(training=False)`` in eval mode
=====================  =====================================================================

**In place to out of place, only where safe.** An in-place op writes its input; rewriting it
out of place is exact only when no other node can see that write. The input must be a fresh
value (made by an op whose result aliases nothing: not a graph input, parameter, or view), no
other user may alias it, and users of the input *after* the in-place op are redirected to
the new result (they expected the written value). Otherwise the node is left alone, and it
simply does not match any quantization pattern.

Convolution and Linear modules stay ``call_module`` nodes (the quantizer reads their weights).
:func:`op_kind` names the canonical operation of a node (``"conv2d"``, ``"relu"``, ...).
"""
from __future__ import annotations

import operator
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...graph.graph_module import GraphModule
from ...graph.node import Node
from ...graph.effects import may_alias_inputs
from ..module_hooks import runs_forward_hooks

__all__ = ["canonicalize", "op_kind", "KIND_TARGETS"]

#: canonical call_function target of each op kind
KIND_TARGETS = {
    "relu": torch.relu, "add": operator.add, "flatten": torch.flatten, "max_pool2d": F.max_pool2d,
    "avg_pool2d": F.avg_pool2d, "adaptive_avg_pool2d": F.adaptive_avg_pool2d, "sigmoid": torch.sigmoid,
    "tanh": torch.tanh, "cat": torch.cat,
}
_FUNCTION_KINDS = {
    torch.relu: "relu", operator.add: "add", torch.flatten: "flatten", F.max_pool2d: "max_pool2d",
    F.avg_pool2d: "avg_pool2d", F.adaptive_avg_pool2d: "adaptive_avg_pool2d", torch.sigmoid: "sigmoid",
    torch.tanh: "tanh", torch.cat: "cat", torch.concat: "cat", torch.reshape: "reshape",
    F.conv2d: "conv2d", F.linear: "linear",
}
_METHOD_KINDS = {"view": "view", "reshape": "reshape", "contiguous": "contiguous", "squeeze": "squeeze",
                 "unsqueeze": "unsqueeze"}
_MODULE_KINDS = {nn.Conv2d: "conv2d", nn.Linear: "linear"}
# modules whose result is a new tensor (never a view of the input)
_FRESH_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
                  nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.LayerNorm, nn.GroupNorm, nn.Embedding,
                  nn.Sigmoid, nn.Tanh, nn.GELU, nn.SiLU, nn.Softmax)


def _module(gm: nn.Module, node: Node) -> Optional[nn.Module]:
    try:
        return gm.get_submodule(node.target)
    except AttributeError:
        return None


def op_kind(gm: nn.Module, node: Node) -> Optional[str]:
    """The canonical operation a (canonicalized) node performs, or None."""
    op = node.op
    if op == "call_function":
        try:
            return _FUNCTION_KINDS.get(node.target)
        except TypeError:
            return None
    if op == "call_method":
        return _METHOD_KINDS.get(node.target)
    if op == "call_module":
        m = _module(gm, node)
        return _MODULE_KINDS.get(type(m)) if m is not None and not runs_forward_hooks(m) else None
    return None


def _fresh(gm: nn.Module, v: Any) -> bool:
    """Whether ``v`` is a value no other value shares memory with (by construction)."""
    if type(v) is not Node or v.op in ("placeholder", "get_attr", "output"):
        return False
    if v.op == "call_module":
        m = _module(gm, v)
        return m is not None and isinstance(m, _FRESH_MODULES) and not runs_forward_hooks(m) \
            and getattr(m, "inplace", False) is not True
    return not may_alias_inputs(v)


def _aliasing_user(gm: nn.Module, user: Node) -> bool:
    if user.op == "call_module":
        m = _module(gm, user)
        return not (m is not None and isinstance(m, _FRESH_MODULES) and getattr(m, "inplace", False) is not True)
    if user.op == "output":
        return False
    return may_alias_inputs(user)


def _can_write_out_of_place(gm: nn.Module, node: Node, v: Any) -> bool:
    if not _fresh(gm, v):
        return False
    return all(u is node or not _aliasing_user(gm, u) for u in v.users)


def _replace(gm: GraphModule, node: Node, target: Any, args: tuple, kwargs: Optional[dict] = None,
             written: Optional[Node] = None) -> Node:
    """Replace ``node`` by ``call_function[target](*args, **kwargs)``; when ``node`` wrote
    ``written`` in place, later readers of ``written`` read the new node instead."""
    g = gm.graph
    with g.inserting_before(node):
        new = g.call_function(target, tuple(args), kwargs or {}, meta=dict(node.meta))
    node.replace_all_uses_with(new)
    if written is not None:
        pos = g.positions()
        here = pos[node]
        for u in list(written.users):
            if u is not node and u is not new and pos.get(u, -1) > here:
                u.args = _swap(u.args, written, new)
                u.kwargs = _swap(u.kwargs, written, new)
    g.erase_node(node)
    return new


def _swap(a, old, new):
    from ...graph.node import map_arg
    return map_arg(a, lambda n: new if n is old else n)


def _is_batch_size(node: Any, x: Node) -> bool:
    """``node`` computes ``x.size(0)`` / ``x.shape[0]``."""
    if type(node) is not Node:
        return False
    if node.op == "call_method" and node.target == "size" and node.args[:1] == (x,):
        rest = node.args[1:] or (node.kwargs.get("dim"),)
        return rest == (0,)
    if node.op == "call_function" and node.target is operator.getitem and node.args[1:] == (0,):
        base = node.args[0]
        if type(base) is Node and base.args[:1] == (x,):
            if base.op == "call_function" and base.target is getattr and base.args[1:] == ("shape",):
                return True
            if base.op == "call_method" and base.target == "size" and len(base.args) == 1:
                return True
    return False


def _flatten_like(node: Node) -> Optional[Node]:
    """The input of ``x.view(x.size(0), -1)`` / ``reshape`` spellings of ``flatten(x, 1)``."""
    if node.kwargs or not node.args:
        return None
    x, *shape = node.args
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = list(shape[0])
    if type(x) is not Node or len(shape) != 2 or shape[1] != -1 or not _is_batch_size(shape[0], x):
        return None
    tm = x.meta.get("tensor_meta")
    if tm is not None and getattr(tm, "shape", None) is not None and len(tm.shape) < 2:
        return None
    return x


def _rewrite(gm: GraphModule, node: Node, training: bool) -> bool:
    op, t = node.op, node.target
    if op == "call_module":
        m = _module(gm, node)
        if m is None or runs_forward_hooks(m) or node.kwargs or len(node.args) != 1:
            return False
        x = node.args[0]
        ty = type(m)
        if ty is nn.ReLU:
            if m.inplace and not _can_write_out_of_place(gm, node, x):
                return False
            _replace(gm, node, torch.relu, (x,), written=x if m.inplace else None)
            return True
        if ty in (nn.Sigmoid, nn.Tanh):
            _replace(gm, node, torch.sigmoid if ty is nn.Sigmoid else torch.tanh, (x,))
            return True
        if ty is nn.Flatten:
            _replace(gm, node, torch.flatten, (x, m.start_dim, m.end_dim))
            return True
        if ty is nn.MaxPool2d and not m.return_indices:
            _replace(gm, node, F.max_pool2d, (x, m.kernel_size, m.stride, m.padding, m.dilation),
                     {"ceil_mode": m.ceil_mode})
            return True
        if ty is nn.AvgPool2d:
            _replace(gm, node, F.avg_pool2d, (x, m.kernel_size, m.stride, m.padding, m.ceil_mode,
                                              m.count_include_pad, m.divisor_override))
            return True
        if ty is nn.AdaptiveAvgPool2d:
            _replace(gm, node, F.adaptive_avg_pool2d, (x, m.output_size))
            return True
        if ty is nn.Identity or (ty in (nn.Dropout, nn.Dropout2d) and not m.training and not training):
            node.replace_all_uses_with(x)
            gm.graph.erase_node(node)
            return True
        return False
    if op == "call_function":
        try:
            hash(t)
        except TypeError:
            return False
        if t is F.relu or t is torch.relu_ or t is F.relu_:
            x = node.args[0] if node.args else node.kwargs.get("input")
            inplace = t is not F.relu or bool(node.kwargs.get("inplace", node.args[1] if len(node.args) > 1 else False))
            if inplace and not _can_write_out_of_place(gm, node, x):
                return False
            _replace(gm, node, torch.relu, (x,), written=x if inplace else None)
            return True
        if t in (F.sigmoid, F.tanh):
            _replace(gm, node, torch.sigmoid if t is F.sigmoid else torch.tanh, tuple(node.args), dict(node.kwargs))
            return True
        if t in (torch.add, operator.iadd):
            if len(node.args) != 2 or node.kwargs or not all(type(a) is Node for a in node.args):
                return False
            a, b = node.args
            if t is operator.iadd and not _can_write_out_of_place(gm, node, a):
                return False
            _replace(gm, node, operator.add, (a, b), written=a if t is operator.iadd else None)
            return True
        if t is torch.reshape and _flatten_like(node) is not None:
            _replace(gm, node, torch.flatten, (_flatten_like(node), 1))
            return True
        if t is F.dropout and not training:
            training_arg = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
            if training_arg is False:
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
                return True
        return False
    if op == "call_method":
        x = node.args[0] if node.args else None
        if t in ("relu", "relu_"):
            if len(node.args) != 1 or node.kwargs:
                return False
            if t == "relu_" and not _can_write_out_of_place(gm, node, x):
                return False
            _replace(gm, node, torch.relu, (x,), written=x if t == "relu_" else None)
            return True
        if t in ("sigmoid", "tanh") and len(node.args) == 1 and not node.kwargs:
            _replace(gm, node, torch.sigmoid if t == "sigmoid" else torch.tanh, (x,))
            return True
        if t in ("add", "add_") and len(node.args) == 2 and not node.kwargs and type(node.args[1]) is Node:
            if t == "add_" and not _can_write_out_of_place(gm, node, x):
                return False
            _replace(gm, node, operator.add, (x, node.args[1]), written=x if t == "add_" else None)
            return True
        if t == "flatten":
            args = list(node.args[1:])
            start = node.kwargs.get("start_dim", args[0] if args else 0)
            end = node.kwargs.get("end_dim", args[1] if len(args) > 1 else -1)
            _replace(gm, node, torch.flatten, (x, start, end))
            return True
        if t in ("view", "reshape") and _flatten_like(node) is not None:
            _replace(gm, node, torch.flatten, (x, 1))
            return True
    return False


def canonicalize(gm: GraphModule) -> int:
    """Rewrite ``gm`` in place to the canonical spellings above; returns the number of nodes
    rewritten. Shape helpers left without users (``x.size(0)``) are removed."""
    training = gm.training
    count = 0
    for node in list(gm.graph.nodes):
        if node._erased:
            continue
        inputs = node.all_input_nodes
        if _rewrite(gm, node, training):
            count += 1
            for x in inputs:  # e.g. the x.size(0) feeding a view(...) now gone
                if not x._erased and not x.users and x.op == "call_method" and x.target == "size":
                    gm.graph.erase_node(x)
                elif not x._erased and not x.users and x.op == "call_function" and x.target is operator.getitem:
                    base = x.args[0]
                    gm.graph.erase_node(x)
                    if type(base) is Node and not base.users and base.op in ("call_function", "call_method") \
                            and (base.target is getattr or base.target == "size"):
                        gm.graph.erase_node(base)
    if count:
        gm.graph.lint()
    return count


def counts(gm: GraphModule) -> Dict[str, int]:
    """How many nodes of each op kind ``gm`` has (for summaries)."""
    out: Dict[str, int] = {}
    for n in gm.graph.nodes:
        k = op_kind(gm, n)
        if k is not None:
            out[k] = out.get(k, 0) + 1
    return out
