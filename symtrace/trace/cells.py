"""Closure variables of a traced function: read at run time, guarded, and written by replay.

A function's free variables live in cells shared with the functions that define them
(``nonlocal x; x += 1``). While tracing, the cells reachable from the traced function (its
closure, and the closures of functions and classes held there or in the globals it reads) are
taken over:

* a cell holding a tensor becomes a node reading it at run time
  (:func:`~symtrace.graph.replay.read_cell`), so the graph uses the tensor the cell holds then
  and records what the program does to it;
* a cell holding anything else (a number, None, a string, a function, a class) keeps its value
  for the program and is guarded by equality or identity at the start of the graph;
* a list, dict or set in a cell is changed by the program only through replay.

When the trace ends every cell is put back as it was (also when tracing fails), and what the
program left in it is replayed by :func:`~symtrace.graph.replay.set_cell` or
:func:`~symtrace.graph.replay.refill` after the graph.
"""
from __future__ import annotations

import types
from typing import Any, Iterator, List, Tuple

import torch

from ..graph.guards import Guard, check_data_guard
from ..graph.replay import read_cell, refill, set_cell
from ..proxy import NO_VALUE, Attribute, Proxy
from ..side_effects import MUTABLE_CONTAINERS, holds_same_items, shallow_copy
from .values import _no_torch_function

MAX_CELLS = 256
_EMPTY = object()


def reachable_cells(fn: Any, g: dict = None) -> List[Tuple[Any, str]]:
    """``(cell, variable name)`` for the closure cells reachable from ``fn``: its own, and those
    of the functions, bound methods and classes its cells (and the globals it reads) hold."""
    out: List[Tuple[Any, str]] = []
    seen_fns, seen_cells = set(), set()
    stack = [fn] + ([v for v in _loaded_functions(fn, g)] if g is not None else [])
    while stack and len(out) < MAX_CELLS:
        f = stack.pop()
        for fun in _functions_of(f):
            if id(fun) in seen_fns:
                continue
            seen_fns.add(id(fun))
            for name, cell in zip(fun.__code__.co_freevars, fun.__closure__ or ()):
                if id(cell) in seen_cells:
                    continue
                seen_cells.add(id(cell))
                out.append((cell, name))
                value = _contents(cell)
                if isinstance(value, (types.FunctionType, types.MethodType, type)):
                    stack.append(value)
    return out


def _functions_of(obj: Any) -> Iterator[types.FunctionType]:
    if isinstance(obj, types.MethodType):
        obj = obj.__func__
    if isinstance(obj, types.FunctionType):
        yield obj
    elif isinstance(obj, type) and obj.__module__ not in ("builtins",) and not obj.__module__.startswith("torch"):
        for v in vars(obj).values():
            if isinstance(v, (staticmethod, classmethod)):
                v = v.__func__
            if isinstance(v, types.FunctionType):
                yield v


def _loaded_functions(fn: Any, g: dict) -> Iterator[Any]:
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None:
        return
    for name in code.co_names:
        v = g.get(name)
        if isinstance(v, types.FunctionType) and v.__closure__:
            yield v


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell (a variable not assigned yet)
        return _EMPTY


def _liftable(v: Any) -> bool:
    return isinstance(v, torch.Tensor)


class ClosureCells:
    """The part of :class:`~symtrace.trace.tracer.Tracer` that takes over closure cells."""

    def _watch_cells(self, fn: Any) -> None:
        g = getattr(getattr(fn, "__func__", fn), "__globals__", None)
        for cell, name in reachable_cells(fn, g):
            value = _contents(cell)
            if value is _EMPTY or type(value) in (Proxy, Attribute):
                continue
            self.effects.cells.append((cell, value, shallow_copy(value) if isinstance(value, MUTABLE_CONTAINERS) else None,
                                       name))
            if not (_liftable(value) or self.live):
                continue  # a GraphModule keeps what it read; guarded below only if the program changes it
            node = self.graph.create_node("call_function", read_cell, (cell,), name=f"cell_{name}")
            if _liftable(value):
                if self.has_values:
                    with _no_torch_function():
                        v = value.detach().clone()
                    cell.cell_contents = Proxy(node, self, v)
                else:
                    cell.cell_contents = Proxy(node, self, NO_VALUE, None, torch.Tensor)
                continue
            self._guard_cell(cell, value, name, node)

    def _guard_cell(self, cell: Any, value: Any, name: str, node: Any = None) -> None:
        """A guard that ``cell`` still holds ``value`` when the graph starts (``node``: the node
        reading it, made here when None)."""
        if node is None:
            node = self.graph.create_node("call_function", read_cell, (cell,), name=f"cell_{name}")
        check = "is" if value is None or isinstance(value, (bool, types.FunctionType, type, types.MethodType)) \
            or not _equatable(value) else "eq"
        expected = shallow_copy(value)  # (a copy of a container: replay changes it)
        guard = Guard("closure", f"the closure variable {name}", expected, check, self._input_loc,
                      f"reading the closure variable {name}")
        self.graph.create_node("call_function", check_data_guard, (node, guard), name=f"guard_cell_{name}")
        self.effects.cell_nodes[id(cell)] = node

    def _restore_cells(self) -> List[Tuple[Any, Any, Any]]:
        """Put every watched cell back; returns ``(cell, what the program left, kind)`` for
        those it changed (kind ``"set"`` or ``"refill"``)."""
        changes = []
        for cell, value, snapshot, name in self.effects.cells:
            now = _contents(cell)
            if _liftable(value):
                if not (type(now) is Proxy and now.node.target is read_cell and now.node.args[0] is cell):
                    changes.append((cell, now, "set"))
            elif now is not value:
                changes.append((cell, now, "set"))
            elif snapshot is not None and not holds_same_items(value, snapshot):
                changes.append((cell, shallow_copy(value), "refill"))
                refill(value, snapshot)
            else:
                cell.cell_contents = value
                continue
            cell.cell_contents = value
            if not _liftable(value) and id(cell) not in self.effects.cell_nodes:  # changed, not guarded yet
                with self.graph.inserting_before(_first_step(self.graph)):
                    self._guard_cell(cell, value, name)
        return changes

    def _emit_cells(self, changes, record, note) -> None:
        for cell, now, kind in changes:
            if kind == "refill":
                record(refill, (self.effects.cell_nodes[id(cell)], now))
            elif now is not _EMPTY:
                record(set_cell, (cell, now))
            note("a closure variable is changed (replayed after the graph)")


def _first_step(graph) -> Any:
    for n in graph.nodes:
        if n.op != "placeholder":
            return n
    return None


def _equatable(v: Any) -> bool:
    return isinstance(v, (int, float, str, bytes, tuple, frozenset, complex, list, dict, set))
