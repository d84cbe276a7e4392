"""Constant folding: compute, once, what does not depend on the inputs.

Before (``x @ (self.w.t() * 2)``)::

    %x : [users=1] = placeholder[x]
    %w : [users=1] = get_attr[w]()
    %t : [users=1] = call_method[t](%w)
    %mul : [users=1] = call_function[operator.mul](%t, 2)
    %matmul : [users=1] = call_function[operator.matmul](%x, %mul)
    %output : [users=0] = output[output](%matmul)

After ``constant_folding(gm)`` (``gm._folded_0`` holds ``w.t() * 2``)::

    graph():  # made by constant_folding
    %x : [users=1] = placeholder[x]
    %folded_0 : [users=1] = get_attr[_folded_0]()
    %matmul : [users=1] = call_function[operator.matmul](%x, %folded_0)
    %output : [users=0] = output[output](%matmul)

A value is constant when it is a ``get_attr`` of something no node writes (in place, through a
view, or by a stateful module), or a pure, non-random ``call_function``/``call_method`` of
known semantics (an ATen op, ``operator``, ``math``, ``getattr``) whose inputs are all
constant nodes or literals. Calls without input nodes (``torch.zeros(3)``) are left alone:
they follow the default dtype and device at run time.

Folded tensors become non-persistent buffers ``_folded_N`` of the ``GraphModule`` (so
``state_dict`` is unchanged), computed under ``no_grad``: they are snapshots, detached from
autograd -- fold for inference, or pass ``fold_parameters=False``. Python values (ints,
floats, shapes, dtypes) are inlined into their users. Not materialised (left computed at run
time): views of an existing attribute (free to recompute), tensors with more than
``max_numel`` elements, and values the graph returns or returns a view of (callers may mutate
them, and eager gives each call fresh memory).
"""
from __future__ import annotations

import builtins
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from ..graph.graph_module import GraphModule
from ..graph.interpreter import Interpreter
from ..graph.effects import is_torch_module
from ..graph.node import Node, TensorMeta
from .infra import graph_pass
from ..graph.op_schema import schema_info
from .alias import AliasAnalysis

__all__ = ["constant_folding"]

_LITERALS = (bool, int, float, complex, str, type(None), torch.dtype, torch.device, torch.Size)
_KNOWN_MODULES = ("torch", "_operator", "operator", "math")
_KNOWN_BUILTINS = frozenset({builtins.getattr, builtins.len, builtins.abs, builtins.min, builtins.max,
                             builtins.round, builtins.int, builtins.float, builtins.bool})


@graph_pass
def constant_folding(gm: GraphModule, *, max_numel: Optional[int] = None,
                     fold_parameters: bool = True, stored_in_state: bool = False) -> bool:
    """Replace input-independent values with precomputed constants (see the module doc).

    ``max_numel``: leave tensors with more elements computed at run time (they are folded
    further downstream when smaller). ``fold_parameters``: also fold values computed from
    ``nn.Parameter`` s (the folded copy does not follow later parameter updates and carries no
    gradient). ``stored_in_state``: also fold a value the graph stores into Python state (a
    cache the program fills from its weights on first use, as timm's ``attention_bias_cache``),
    where nothing in the graph could read a stored value back (see :func:`_store_nodes`): each
    call then stores the one folded tensor, where the graph as traced stored a fresh copy, so an
    in-place change to it through that state would change the constant. Only for callers that
    check their buffers' versions before each call (the lowering's inference pipeline does).
    Returns whether anything was folded.
    """
    graph = gm.graph
    alias = AliasAnalysis(graph, gm)
    stored = _stored_paths(graph)
    values = _evaluate(gm, alias, fold_parameters, stored,
                       _store_nodes(graph, alias, stored) if stored_in_state else frozenset())
    if not values:
        return False
    attr_storages = {_storage(v) for n, v in values.items() if n.op == "get_attr"} - {None}
    # values a returned tensor may be a view of: a folded buffer there would be shared by every
    # call's result (eager returns fresh memory each call), so they stay computed
    returned = {alias.find(a) for out in graph.find_nodes(op="output") for a in out.all_input_nodes}
    had_users = {n for n in values if n.users}
    kept: set = set()
    changed = False
    for node in reversed(list(graph.nodes)):
        if node not in values:
            continue
        if node.op == "get_attr":
            kept.add(node)
            continue
        if not any(u not in values or u in kept for u in node.users):
            continue  # every user is folded: this node dies with them
        value = values[node]
        if _is_literal(value):
            for user in list(node.users):
                user.replace_input_with(node, value)
            changed = True
        elif (isinstance(value, torch.Tensor) and _storage(value) not in attr_storages
              and (max_numel is None or value.numel() <= max_numel)
              and alias.find(node) not in returned):
            _replace_with_buffer(gm, node, value)
            changed = True
        else:
            kept.add(node)
    for node in reversed(list(graph.nodes)):
        if node in had_users and not node.users:
            graph.erase_node(node)
    return changed


def _store_nodes(graph, alias: AliasAnalysis, stored: Tuple[set, bool]) -> frozenset:
    """The nodes replaying a store into Python state, which keep a reference to a value and
    write no tensor's data. None where the graph could read a stored value back (and write it
    in place before anything checks it): it reads Python state (``read_state``, ``read_cell``),
    a ``get_attr`` reads below a stored path, or a store's target is not a path below the module."""
    from ..graph.replay import STATE_WRITES, read_cell, read_state
    if graph.find_nodes(op="call_function", target=read_state) or graph.find_nodes(op="call_function",
                                                                                    target=read_cell):
        return frozenset()
    paths, unknown = stored
    if unknown or any(_under(n.target, paths) for n in graph.find_nodes(op="get_attr")):
        return frozenset()
    if any(_opaque(n, alias.module) for n in graph.nodes):
        return frozenset()
    return frozenset(n for n in alias.writes if n.op == "call_function" and n.target in STATE_WRITES)


def _opaque(node: Node, module) -> bool:
    """A call running the user's code that the graph does not show (a leaf module or function):
    it could read a stored value back from Python state and write it (found in review)."""
    if node.op == "call_module":
        try:
            return not is_torch_module(module.get_submodule(node.target))
        except AttributeError:
            return True
    if node.op == "call_function" and not _known(node):
        return not (getattr(node.target, "__module__", None) or "").startswith("symtrace.")
    return False


def _under(target: str, paths: set) -> bool:
    return any(target == p or target.startswith(p + ".") for p in paths)


def _evaluate(gm: GraphModule, alias: AliasAnalysis, fold_parameters: bool, stored: Tuple[set, bool],
              stores: frozenset = frozenset()) -> Dict[Node, Any]:
    """Values of the constant nodes, in graph order. A computed value whose group only
    ``stores`` write counts as unwritten (a ``get_attr`` never: a store there rebinds it)."""
    written_elsewhere = {alias.find(w) for n, groups in alias.writes.items() if n not in stores for w in groups}

    def written(node: Node) -> bool:
        return alias.is_written(node) and (not stores or alias.find(node) in written_elsewhere)
    interp = Interpreter(gm, gm.graph, garbage_collect_values=False)
    values: Dict[Node, Any] = {}
    interp.env = values
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            if alias.is_written(node):
                continue
            try:
                value = interp.fetch_attr(node.target)
            except AttributeError:
                continue
            if isinstance(value, nn.Module) or (isinstance(value, nn.Parameter) and not fold_parameters):
                continue
            if _reassigned(gm, node.target, stored):
                continue
            values[node] = value
            continue
        if node.op not in ("call_function", "call_method"):
            continue
        inputs = node.all_input_nodes
        if not inputs or any(i not in values for i in inputs):
            continue
        if not _known(node) or node in alias.impure or written(node):
            continue
        try:
            with torch.no_grad():
                values[node] = interp.run_node(node)
        except Exception:  # cannot run ahead of time: leave it to run time
            continue
    interp.current_node = None
    return values


def _stored_paths(graph) -> Tuple[set, bool]:
    """The dotted paths below the module that the graph's replayed Python stores assign, delete
    or refill (``self.state = ...`` gives ``"state"``), and whether some store's target is not
    such a path (a global's attributes, a container item, an input object, a class)."""
    from ..graph.guard_expr import GExpr, Root
    from ..graph.replay import (STATE_WRITES, assign_attribute, assign_global, delete_attribute, refill,
                                replace_contents, set_attributes, set_cell)

    def path(e) -> Optional[str]:   # ("" for root itself)
        if type(e) is Root:
            return ""
        chain = e.root_chain() if isinstance(e, GExpr) else None
        return None if chain is None else ".".join(chain)

    out: set = set()
    unknown = False
    for node in graph.nodes:
        fn = node.target if node.op == "call_function" else None
        if fn not in STATE_WRITES or fn is assign_global or fn is set_cell:
            continue   # (rebinding a global or a closure variable changes no object get_attr reaches)
        a = node.args
        if fn in (assign_attribute, delete_attribute):
            owner = path(a[0]) if len(a) > 1 else None
            where = None if owner is None else (f"{owner}.{a[1]}" if owner else a[1])
        elif fn is replace_contents:
            where = path(a[0]) if a else None
        elif fn in (refill, set_attributes) and a and type(a[0]) is Node and a[0].op == "get_attr":
            where = a[0].target
        else:
            where = None
        if where:
            out.add(where)
        else:
            unknown = True
    return out, unknown


def _reassigned(gm: GraphModule, target: str, stored: Tuple[set, bool]) -> bool:
    """Whether a replayed store of the graph may change what ``get_attr(target)`` reads on the
    next call: a store names ``target`` or an object on its path, or a store's target is unknown
    and ``target`` is not a parameter or buffer."""
    paths, unknown = stored
    if _under(target, paths):
        return True
    if not unknown:
        return False
    owner, _, name = target.rpartition(".")
    try:
        mod = gm.get_submodule(owner)
    except AttributeError:
        return True
    return name not in mod._parameters and name not in mod._buffers


def _known(node: Node) -> bool:
    """Whether the target's result depends only on its arguments (no hidden global state)."""
    if node.op == "call_method" or schema_info(node) is not None:
        return True
    target = node.target
    try:
        if target in _KNOWN_BUILTINS:
            return True
    except TypeError:
        return False
    module = getattr(target, "__module__", None) or ""
    return module.startswith(_KNOWN_MODULES)


def _is_literal(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return False
    if type(v) is tuple or type(v) is torch.Size:
        return all(_is_literal(x) for x in v)
    return type(v) in _LITERALS


def _storage(v: Any) -> Optional[tuple]:
    if not isinstance(v, torch.Tensor):
        return None
    try:
        return (str(v.device), v.untyped_storage().data_ptr())
    except Exception:
        return None


def _replace_with_buffer(gm: GraphModule, node: Node, value: torch.Tensor) -> None:
    i = 0
    while hasattr(gm, f"_folded_{i}"):
        i += 1
    name = f"_folded_{i}"
    buf = value.detach().clone()
    gm.register_buffer(name, buf, persistent=False)
    graph = gm.graph
    with graph.inserting_before(node):
        new = graph.get_attr(name)
    for key in ("source", "module_path"):
        if key in node.meta:
            new.meta[key] = node.meta[key]
    new.meta["tensor_meta"] = TensorMeta.of(buf)
    node.replace_all_uses_with(new)
