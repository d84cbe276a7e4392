"""Undoing a captured call that a data guard stopped part-way (used by :mod:`symtrace.capture`).

A captured graph checks some of its assumptions only where the trace met them: a *data guard*
(a branch on a value, a size of a tensor an input object holds) runs in the middle of the
graph. When one fails, capture re-captures and runs again, so whatever the graph changed before
the guard must be undone first, or the second run would change it twice. Two ways:

* an **undo log** (:class:`UndoLog`): the graph calls :func:`record_write` just before each of
  its writes that may have to be undone (nodes :func:`plan_rollback` inserts), which saves what
  the write will overwrite: the rows ``index_copy_`` replaces, the elements ``x[i] = v``
  assigns, else the whole tensor written (often a small view). A KV cache's step writes one
  position per layer, so the log holds a few rows where a copy of the inputs held the cache;
* a **snapshot** (:class:`Snapshot`): copies of every tensor the call's arguments hold (also
  inside plain objects), the module's buffers and the RNG state, taken before the call. The
  fallback, for graphs whose writes before a guard the log cannot see (inside a module call,
  an inner graph, or an op that writes without saying where).

Both restore the RNG state. Neither undoes writes of Python objects (attributes, lists): those
are replayed after the graph's guards (see ``docs/capture_semantics.md``).

A guard on dtypes and devices only needs no rollback: the entry guards fix every input's. A
guard on sizes does (a tensor an input object holds has no size guard at entry).
"""
from __future__ import annotations

import operator
import threading
import types
from typing import Any, List, Optional, Tuple

import torch
from torch import nn

from .graph.effects import GRAD_MODE_SWITCHES, effects_of, is_impure, may_alias_inputs, register_side_effect
from .graph.graph_module import GraphModule
from .graph.guards import check_data_guard
from .graph.node import Node
from .graph.replay import read_cell, read_state
from .graph.tree import tree_iter, tree_map

__all__ = ["record_write", "UndoLog", "Snapshot", "plan_rollback", "effects_before_data_guard"]

#: helpers graphs call that are kept like effects (never dropped or moved) but change nothing
_READS_ONLY = {read_cell, read_state}
#: grad-mode switches (``with torch.no_grad()`` inside the program): they write no tensor, and
#: :class:`UndoLog` and :class:`Snapshot` put grad mode back as it was when the call began
_READS_ONLY |= GRAD_MODE_SWITCHES

_ACTIVE = threading.local()


# --------------------------------------------------------------------------- the undo log

class UndoLog:
    """What the writes of one call overwrote, restored newest first. Active (for
    :func:`record_write`) inside ``with log:``; the RNG state and grad mode are saved on entry."""

    def __init__(self):
        self.entries: List[Tuple[str, torch.Tensor, Any, torch.Tensor]] = []
        self.rng = None
        self.grad = True
        self._outer = None

    def __enter__(self) -> "UndoLog":
        self.rng = torch.get_rng_state()
        self.grad = torch.is_grad_enabled()
        self._outer = getattr(_ACTIVE, "log", None)
        _ACTIVE.log = self
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.log = self._outer

    def restore(self) -> None:
        with torch.no_grad():
            for how, target, where, saved in reversed(self.entries):
                if how == "index":
                    target.index_copy_(where[0], where[1], saved)
                elif how == "item":
                    target[where] = saved
                else:
                    target.copy_(saved)
        self.entries.clear()
        torch.set_rng_state(self.rng)
        torch.set_grad_enabled(self.grad)


def record_write(how: str, target: Any, *where: Any) -> None:
    """Save what the next node will overwrite in ``target`` into the active :class:`UndoLog`
    (no log active: nothing). ``how``: ``"index"`` (``where = (dim, index)`` of an
    ``index_copy_``), ``"item"`` (``where = (key,)`` of ``target[key] = v``) or ``"all"``."""
    log = getattr(_ACTIVE, "log", None)
    if log is None or not isinstance(target, torch.Tensor):
        return
    with torch.no_grad():
        if how == "index":   # (index tensors copied: a later write could change them)
            dim, index = where
            log.entries.append((how, target, (dim, index.clone()), target.index_select(dim, index)))
        elif how == "item":
            key = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, where[0])
            log.entries.append((how, target, key, target[key].clone()))
        else:
            log.entries.append((how, target, None, target.clone()))


register_side_effect(record_write)
_READS_ONLY.add(record_write)


# --------------------------------------------------------------------------- the snapshot

class Snapshot:
    """Copies of what a call may change (tensor inputs, also inside plain objects, the model's
    buffers, the RNG state, grad mode)."""

    def __init__(self, owner: Optional[nn.Module], args: tuple, kwargs: dict):
        tensors = list(_tensors((args, kwargs)))
        if owner is not None:
            tensors.extend(owner.buffers())
        self.saved = [(t, t.detach().clone()) for t in tensors]
        self.rng = torch.get_rng_state()
        self.grad = torch.is_grad_enabled()

    def restore(self) -> None:
        with torch.no_grad():
            for t, copy in self.saved:
                t.copy_(copy)
        torch.set_rng_state(self.rng)
        torch.set_grad_enabled(self.grad)


def _tensors(a: Any):
    """The tensors a call's arguments hold: in containers, and in the attributes of plain
    objects among them (a KV cache's layers), which the graph may write in place."""
    seen: set = set()
    stack = [(a, 0)]
    while stack:
        v, depth = stack.pop()
        for x in tree_iter(v, subclasses=True):
            if isinstance(x, torch.Tensor):
                if id(x) not in seen:
                    seen.add(id(x))
                    yield x
            elif depth < 4 and _plain_object(x) and id(x) not in seen:
                seen.add(id(x))
                stack.append((list(vars(x).values()), depth + 1))


def _plain_object(x: Any) -> bool:
    return hasattr(x, "__dict__") and not isinstance(x, (type, nn.Module, types.ModuleType, types.FunctionType,
                                                         types.MethodType))


# --------------------------------------------------------------------------- which one

def plan_rollback(gm: GraphModule) -> str:
    """How a call of ``gm`` is undone when a data guard fails part-way: ``"none"`` (nothing
    changes before its last such guard), ``"log"`` (every change before it is a write the undo
    log can record: :func:`record_write` nodes are inserted before those writes) or
    ``"snapshot"``. Decided once per graph (``gm.meta["rollback"]``)."""
    plan = gm.meta.get("rollback")
    if plan is not None:
        return plan
    effects: List[Tuple[Any, GraphModule, int]] = []
    before_guard: List[Tuple[Any, GraphModule, int]] = []
    _scan(gm, effects, before_guard, 0)
    if not before_guard:
        plan = "none"
    else:
        hows = [_how(node, owner) if depth == 0 else None for node, owner, depth in before_guard]
        if all(h is not None for h in hows):
            for (node, owner, _), (how, target, where) in zip(before_guard, hows):
                if how is None or _fresh(target):   # writes no tensor (print, an object's attribute),
                    continue                        # or one this call made: nothing to undo
                with owner.graph.inserting_before(node):
                    owner.graph.call_function(record_write, (how, target) + tuple(where))
            gm.recompile()
            plan = "log"
        else:
            plan = "snapshot"
    gm.meta["rollback"] = plan
    gm.meta["_effects_before_data_guard"] = plan != "none"
    return plan


def effects_before_data_guard(gm: GraphModule) -> bool:
    """Whether running ``gm`` can change state before one of its data guards fails (then a
    call whose data guard fails must be rolled back before it runs again). Graphs a node runs
    whole (a lowered region, ``captured_graph``) are looked into in place. Cached on the module."""
    cached = gm.meta.get("_effects_before_data_guard")
    if cached is None:
        effects: list = []
        before: list = []
        _scan(gm, effects, before, 0)
        cached = bool(before)
        gm.meta["_effects_before_data_guard"] = cached
    return cached


def _scan(gm: GraphModule, effects: list, before_guard: list, depth: int) -> None:
    """Collect, in order, the effect nodes (``effects``) and those that run before a guard
    that can fail (``before_guard``: every effect seen when such a guard comes)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is check_data_guard:
            if effects and not _dtype_only(node.args[0] if node.args else None):
                before_guard.extend(e for e in effects[len(before_guard):])
            continue
        inner = _inner_graph(gm, node) if depth < 8 else None
        if inner is not None:
            _scan(inner, effects, before_guard, depth + 1)
        elif node.op not in ("placeholder", "output", "get_attr") and is_impure(node, gm) and \
                not (node.op == "call_function" and node.target in _READS_ONLY):
            effects.append((node, gm, depth))


#: in-place methods whose written region the log knows (else: the whole tensor written)
_INDEX_WRITES = frozenset({"index_copy_"})
#: ``x += y`` and its kind: write their first argument whole
_INPLACE_OPERATORS = frozenset(getattr(operator, f"i{op}") for op in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift", "rshift"))


def _how(node, owner: GraphModule) -> Optional[Tuple[Optional[str], Any, tuple]]:
    """``(how, target, where)`` for :func:`record_write` before ``node``; ``(None, None, ())``
    when the node writes no tensor the log must save; None when the log cannot follow it."""
    eff = effects_of(node, owner)
    if eff.other:
        return None
    if node.op == "call_function" and node.target is operator.setitem and len(node.args) == 3:
        return "item", node.args[0], (node.args[1],)
    if node.op == "call_function" and node.target in _INPLACE_OPERATORS and len(eff.writes) == 1 \
            and node.args and node.args[0] is eff.writes[0] and not node.kwargs:
        return "all", node.args[0], ()
    if not eff.writes:
        # random draws (the log restores the RNG state) and registered effects that write no
        # tensor (print, an object's attribute, a list's contents)
        return None if node.op == "call_method" else (None, None, ())
    if len(eff.writes) != 1 or node.op != "call_method" or not node.args or node.args[0] is not eff.writes[0]:
        return None
    if node.kwargs and set(node.kwargs) - {"alpha", "value"}:
        return None
    if node.target in _INDEX_WRITES and len(node.args) == 4:
        return "index", node.args[0], (node.args[1], node.args[2])
    return "all", node.args[0], ()


def _fresh(node: Any, depth: int = 0) -> bool:
    """Whether ``node``'s value is certainly a tensor the call itself made (its schema says the
    result aliases no input), or a view of one; placeholders, attribute reads and anything
    without a schema may be the caller's."""
    if not isinstance(node, Node) or node.op not in ("call_function", "call_method") or depth > 32:
        return False
    if not may_alias_inputs(node):
        return True
    if node.target is operator.getitem or node.op == "call_method" and node.target in _VIEW_METHODS:
        return bool(node.args) and _fresh(node.args[0], depth + 1)
    return False


#: methods whose result is a view of their tensor (``self``)
_VIEW_METHODS = frozenset({"view", "view_as", "reshape", "transpose", "permute", "t", "narrow", "select",
                           "unsqueeze", "squeeze", "flatten", "unflatten", "expand", "expand_as", "as_strided",
                           "diagonal", "unfold", "movedim", "swapaxes", "split", "chunk", "unbind"})


def _inner_graph(gm: GraphModule, node) -> Optional[GraphModule]:
    """The captured graph a ``call_module`` node runs whole: a GraphModule, or a module that
    says which one it runs (``captured_graph``: a lowered region, a lowered module)."""
    if node.op != "call_module":
        return None
    try:
        sub = gm.get_submodule(node.target)
    except AttributeError:
        return None
    inner = sub if isinstance(sub, GraphModule) else getattr(sub, "captured_graph", None)
    return inner if isinstance(inner, GraphModule) else None


#: what a tensor says of its dtype and device (never of its sizes or strides)
_DTYPE_ATTRS = frozenset({"dtype", "device", "is_cuda", "layout"})
_DTYPE_METHODS = frozenset({"is_floating_point", "is_complex", "element_size", "get_device"})
_COMPARISONS = frozenset({operator.eq, operator.ne, operator.is_, operator.is_not, operator.not_,
                          operator.and_, operator.or_})


def _dtype_only(value: Any, depth: int = 0) -> bool:
    """Whether a guarded value is computed from tensors' dtypes and devices and constants only."""
    if not hasattr(value, "op"):   # a constant
        return True
    if depth > 16:
        return False
    if value.op == "call_method":
        return value.target in _DTYPE_METHODS
    if value.op != "call_function":
        return False
    if value.target is getattr:
        return len(value.args) > 1 and value.args[1] in _DTYPE_ATTRS
    return value.target in _COMPARISONS and all(_dtype_only(a, depth + 1)
                                                for a in tree_iter((value.args, value.kwargs)))
