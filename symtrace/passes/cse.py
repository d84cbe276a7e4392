"""Common-subexpression elimination: compute each pure value once.

Before (``(x + 1) * (x + 1)``)::

    %x : [users=2] = placeholder[x]
    %add : [users=1] = call_function[operator.add](%x, 1)
    %add_1 : [users=1] = call_function[operator.add](%x, 1)
    %mul : [users=1] = call_function[operator.mul](%add, %add_1)
    %output : [users=0] = output[output](%mul)

After ``common_subexpression_elimination(gm)``::

    graph():  # made by common_subexpression_elimination
    %x : [users=1] = placeholder[x]
    %add : [users=1] = call_function[operator.add](%x, 1)
    %mul : [users=1] = call_function[operator.mul](%add, %add)
    %output : [users=0] = output[output](%mul)

Two nodes merge when they have the same opcode, target, arguments and keyword arguments:
input nodes by identity, literals by type and value (``1``, ``1.0`` and ``True`` differ, so
do ``0.0`` and ``-0.0``), tensors and other objects by identity. Never merged:

* impure nodes (:func:`~symtrace.graph.effects.is_impure`): in-place, random, side effects;
* a node whose inputs may be written in place between the two occurrences
  (``a = x + 1; x.add_(1); b = x + 1`` keeps both), aliasing through views included;
* a node whose own memory is written anywhere (sharing it would make the write visible twice);
* across a global-state switch (``torch._C._set_grad_enabled``, ``manual_seed``, user-
  registered side effects): the table starts afresh after one;
* ``call_module`` of modules not from ``torch.nn`` (user leaf modules may keep state), or of
  modules whose calls run forward hooks (their own or global ones: hooks may count calls).

One forward sweep with a dict keyed by a hashable signature: linear time. Merged values are
the same object: if the graph returns both, the caller gets one tensor twice (as torch.fx).
"""
from __future__ import annotations

import operator
from typing import Any, Dict

import torch

from ..graph.graph_module import GraphModule
from ..graph.guards import check_data_guard
from ..graph.node import Node
from .infra import graph_pass
from ..graph.effects import has_registered_side_effect, is_torch_module
from .alias import AliasAnalysis
from .module_hooks import runs_forward_hooks

__all__ = ["common_subexpression_elimination"]

#: registered side effects that change no state a pure node could read
_NOT_BARRIERS = frozenset({print, torch._assert, check_data_guard, operator.setitem, operator.delitem})
_ATOMS = (bool, int, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


@graph_pass
def common_subexpression_elimination(gm: GraphModule) -> bool:
    """Merge repeated pure computations into their first occurrence (see the module doc).
    Returns whether any node was merged."""
    graph = gm.graph
    alias = AliasAnalysis(graph, gm)
    last_write: Dict[Any, int] = {}  # alias group -> position of the latest write seen
    table: Dict[tuple, Node] = {}
    changed = False
    for node in graph.nodes:
        pos = alias.positions[node]
        for w in alias.writes.get(node, ()):
            last_write[alias.find(w)] = pos
        op = node.op
        if op in ("placeholder", "output"):
            continue
        if node in alias.impure:
            if _is_barrier(node):
                table.clear()
            continue
        if op == "call_module" and not _trusted_module(gm, node.target):
            continue
        if alias.is_written(node):
            continue
        key = _signature(node, alias, last_write)
        first = table.setdefault(key, node)
        if first is not node:
            node.replace_all_uses_with(first, propagate_meta=True)
            graph.erase_node(node)
            changed = True
    return changed


def _is_barrier(node: Node) -> bool:
    if node.op == "call_module" or not has_registered_side_effect(node):
        return False
    try:
        return node.target not in _NOT_BARRIERS
    except TypeError:
        return True


def _trusted_module(gm: GraphModule, target: str) -> bool:
    try:
        sub = gm.get_submodule(target)
    except AttributeError:
        return False
    return is_torch_module(sub) and not runs_forward_hooks(sub)   # (hooks may count calls)


def _signature(node: Node, alias: AliasAnalysis, last_write: Dict[Any, int]) -> tuple:
    target = node.target
    try:
        hash(target)
    except TypeError:
        target = ("<id>", id(target))
    args = _lit(node.args)
    kwargs = tuple(sorted((k, _lit(v)) for k, v in node.kwargs.items()))
    if not last_write:
        return (node.op, target, args, kwargs)
    versions = tuple(last_write.get(alias.find(n), -1) for n in node.all_input_nodes)
    return (node.op, target, args, kwargs, versions)


def _lit(v: Any) -> Any:
    """A hashable key for an argument: nodes by identity, literals by type and value."""
    t = type(v)
    if t is Node:
        return v
    if t in _ATOMS:
        return (t, v)
    if t is float:
        return (float, v.hex())  # tells 0.0 from -0.0; nan equals nan (same result)
    if t is complex:
        return (complex, v.real.hex(), v.imag.hex())
    if t is tuple or t is list or isinstance(v, tuple):
        return (t, tuple(_lit(x) for x in v))
    if t is dict:
        return (dict, tuple((_lit(k), _lit(x)) for k, x in v.items()))
    if t is slice:
        return (slice, _lit(v.start), _lit(v.stop), _lit(v.step))
    if v is Ellipsis:
        return (t,)
    return ("<id>", id(v))  # tensors and other objects: only the very same object matches
