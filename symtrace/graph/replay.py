"""Python side effects of a traced program, replayed by its graph at run time.

While tracing, writes to Python state — module attributes (``self.counter += 1``), plain
objects a module holds, and lists, dicts and sets read from module attributes or module globals
(``self.history.append(n)``, ``CACHE[key] = v``) — land in copies the tracer keeps, never in
the user's objects. At the end of the trace each change becomes one node calling a helper of
this module, placed before the output, so every call of the graph leaves Python state as an
eager call would. Reads of that state are guarded as usual, so a graph whose writes change
what it read stops matching (``capture`` then re-captures).

A helper receives the object the graph runs against (``root``: ``guard_root`` when set, else
the module itself) as its first argument; code generation and the interpreter pass it (see
:data:`ROOT_HELPERS`). Where a write goes is a :class:`~symtrace.graph.guard_expr.GExpr`
(``root.sub``, ``sys.modules['pkg'].CACHE``), so it reads only checked names.
"""
from __future__ import annotations

import sys
from typing import Any

from .effects import register_side_effect
from .guard_expr import Attr, GExpr, Global, Item, Member, Root

__all__ = ["assign_attribute", "delete_attribute", "assign_global", "replace_contents", "refill", "read_cell",
           "set_cell", "set_attributes", "set_class_attributes", "read_state", "ROOT_HELPERS", "STATE_WRITES",
           "evaluate_target", "describe_effect"]


def evaluate_target(e: GExpr, root: Any) -> Any:
    """The object ``e`` names (``root``, attributes and items below it, module globals)."""
    t = type(e)
    if t is Root:
        return root
    if t is Attr:
        return getattr(evaluate_target(e.obj, root), e.name)
    if t is Item:
        return evaluate_target(e.obj, root)[e.key.value]
    if t is Member:   # (where the module keeps it, else wherever the attribute now is)
        obj = evaluate_target(e.obj, root)
        table = getattr(obj, "__dict__", {}).get(e.table)
        return table[e.name] if isinstance(table, dict) and e.name in table else getattr(obj, e.name)
    if t is Global:
        return getattr(sys.modules[e.module], e.name)
    raise TypeError(f"a side effect cannot write to {e}")


@register_side_effect
def assign_attribute(root: Any, owner: GExpr, name: str, value: Any) -> None:
    """``<owner>.name = value``: an attribute the traced program assigned. On a GraphModule
    (which holds only the submodules its graph calls) missing owners along a chain of module
    attributes are made as plain container modules."""
    try:
        obj = evaluate_target(owner, root)
    except AttributeError:
        obj = _make_owner(owner, root)
    setattr(obj, name, value)


def _make_owner(owner: GExpr, root: Any) -> Any:
    if type(owner) is Root:
        return root
    if type(owner) is not Attr and type(owner) is not Member:
        raise AttributeError(f"cannot assign below {owner.shown()}: it does not exist")
    parent = _make_owner(owner.obj, root)
    if not hasattr(parent, owner.name):
        import torch.nn as nn
        if not isinstance(parent, nn.Module):
            raise AttributeError(f"cannot assign below {owner}: it does not exist")
        parent.add_module(owner.name, nn.Module())
    return getattr(parent, owner.name)


@register_side_effect
def delete_attribute(root: Any, owner: GExpr, name: str) -> None:
    """``del <owner>.name``."""
    obj = evaluate_target(owner, root)
    if hasattr(obj, name):
        delattr(obj, name)


@register_side_effect
def assign_global(root: Any, module: str, name: str, value: Any) -> None:
    """``module.name = value``: a global the traced program rebound."""
    setattr(sys.modules[module], name, value)


@register_side_effect
def replace_contents(root: Any, target: GExpr, contents: Any) -> None:
    """Give the list, dict or set ``target`` names the ``contents`` the traced program left in
    it, in place (its identity, and so every other reference to it, is kept)."""
    refill(evaluate_target(target, root), contents)


@register_side_effect
def refill(obj: Any, contents: Any) -> None:
    """Give the list, dict or set ``obj`` (a graph value, e.g. an input) the ``contents`` the
    traced program left in it, in place (its identity, and so every reference to it, is kept)."""
    if isinstance(obj, list):
        obj[:] = contents
    elif isinstance(obj, (dict, set)):
        obj.clear()
        obj.update(contents)
    else:
        raise TypeError(f"a {type(obj).__name__} is not the list, dict or set it was when traced")


@register_side_effect
def set_attributes(obj: Any, values: dict, deleted: tuple = ()) -> None:
    """Give ``obj``, an object the graph was given, the instance attributes ``values`` (name ->
    value) and remove those named ``deleted``: the changes the program made to its stand-in's
    ``__dict__``, made to ``obj``'s (the class's own ``__setattr__`` ran on the stand-in; a frozen
    dataclass's ``object.__setattr__`` writes land too)."""
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        d.update(values)
        for name in deleted:
            d.pop(name, None)
        return
    for name, value in values.items():
        setattr(obj, name, value)
    for name in deleted:
        if hasattr(obj, name):
            delattr(obj, name)


@register_side_effect
def set_class_attributes(cls: type, values: dict, deleted: tuple = ()) -> None:
    """Give the class ``cls`` the attributes ``values`` and remove those named ``deleted``: what
    the program assigned to the class of a module or input it was traced with (``type(self).calls
    += 1``; the graph's guards hold that the class is still this one)."""
    for name, value in values.items():
        setattr(cls, name, value)
    for name in deleted:
        if name in vars(cls):
            delattr(cls, name)


@register_side_effect  # (never merged with another read, nor moved across a set_cell)
def read_cell(cell: Any) -> Any:
    """The current value of a closure variable the traced program reads."""
    return cell.cell_contents


@register_side_effect
def set_cell(cell: Any, value: Any) -> None:
    """``nonlocal v; v = value``: a closure variable the traced program assigned."""
    cell.cell_contents = value


def read_state(root: Any, target: GExpr) -> Any:
    """The object ``target`` names when the graph runs: Python state holding tensors (a plain
    object's list of tensors, its tensor attribute) that the program reads, read afresh at
    every call rather than frozen at tracing."""
    return evaluate_target(target, root)


#: helpers that take the graph's root object as their first argument
ROOT_HELPERS = frozenset({assign_attribute, delete_attribute, assign_global, replace_contents, read_state})
#: the helpers that write Python state (attributes, globals, containers, closure cells)
STATE_WRITES = frozenset({assign_attribute, delete_attribute, assign_global, replace_contents, refill,
                          set_attributes, set_class_attributes, set_cell})


def describe_effect(node) -> str:
    """One line saying what an effect node does, e.g. ``root.counter = add``."""
    fn = node.target
    args = tuple(a.shown() if isinstance(a, GExpr) else a for a in node.args)
    if fn is assign_attribute:
        return f"{args[0]}.{args[1]} = {_short(args[2])}"
    if fn is delete_attribute:
        return f"del {args[0]}.{args[1]}"
    if fn is assign_global:
        return f"{args[0]}.{args[1]} = {_short(args[2])}"
    if fn is refill:
        return f"{args[0]} now holds {_short(args[1])}"
    if fn is set_cell:
        return f"a closure variable = {_short(args[1])}"
    if fn is read_state:
        return f"reads {args[0]}"
    if fn is set_class_attributes:
        return f"the class {getattr(args[0], '__qualname__', args[0])} gets {_short(args[1])}"
    return f"{args[0]} now holds {_short(args[1])}"


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
