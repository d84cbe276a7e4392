"""The pattern model of :mod:`symtrace.passes.matcher`: :class:`Match`, loading (and caching)
pattern graphs, the prepared pattern node and the literal and value comparisons both searches use."""
from __future__ import annotations

import operator
import re
import types
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..graph.graph import Graph
from ..graph.graph_module import GraphModule
from ..graph.node import Node, iter_nodes


#: (op, target) pairs whose first two operands may be swapped when ``commutative=True``.
COMMUTATIVE_TARGETS = frozenset({
    ("call_function", operator.add), ("call_function", operator.mul),
    ("call_function", torch.add), ("call_function", torch.mul),
    ("call_function", torch.Tensor.add), ("call_function", torch.Tensor.mul),
    ("call_function", torch.Tensor.__add__), ("call_function", torch.Tensor.__mul__),
    ("call_method", "add"), ("call_method", "mul"), ("call_method", "__add__"), ("call_method", "__mul__"),
})
_LITERAL_MODES = ("exact", "ignore", "capture")
_CALLS = ("call_function", "call_method")
_ATOMS = frozenset({int, float, bool, str, type(None), complex})
_FAIL = object()
_POSITIONAL_NAME = re.compile(r"^arg\d+$")
_MISSING = object()

# kinds of pattern argument slots
_PH, _NODE, _LIT, _STRUCT = 0, 1, 2, 3


def _unpacked(slot: str) -> tuple:
    """Getter and setter of the :class:`Match` attribute kept in ``slot``, which a packed
    match makes on first access."""
    def get(self):
        if self._packed is not None:
            self._unpack()
        return getattr(self, slot)

    def put(self, value) -> None:
        if self._packed is not None:
            self._unpack()
        setattr(self, slot, value)
    return get, put


class Match:
    """One instance of a pattern in a graph.

    ``anchor``: the graph node matched by the pattern's (first) output. ``nodes_map``: pattern
    node name -> graph node, for every node the pattern computes. ``bindings``: pattern input
    name -> the graph node or literal it stands for. ``literals``: captured literals
    (``literals="capture"``), by parameter name or ``lit0``, ``lit1``... ``outputs``: the graph
    nodes of the pattern's outputs, in order. ``nodes``: the matched graph nodes in graph
    order. ``moves``: outside nodes that read an output but come before the last matched node,
    in graph order; a rewriter moves them after the replacement (always empty for
    single-output patterns).

    A match the compiled search found keeps its nodes and inputs in one tuple, and makes these
    dicts and lists when one of them is first read (most matches are only spliced: fewer
    objects to make, and for the garbage collector to scan).
    """

    __slots__ = ("anchor", "moves", "_nodes_map", "_bindings", "_literals", "_outputs", "_nodes",
                 "_packed", "_layout")

    def __init__(self, anchor: Node, nodes_map: Dict[str, Node], bindings: Dict[str, Any],
                 literals: Optional[Dict[str, Any]] = None, outputs: Optional[List[Node]] = None,
                 nodes: Optional[List[Node]] = None, moves: Optional[List[Node]] = None):
        self.anchor = anchor
        self._nodes_map = nodes_map
        self._bindings = bindings
        self._literals = {} if literals is None else literals
        self._outputs = [anchor] if outputs is None else outputs
        self._nodes = list(nodes_map.values()) if nodes is None else nodes
        self.moves = () if moves is None else moves
        self._packed = None

    def _unpack(self) -> None:
        """Make the dicts and lists of a match kept as a tuple (see :meth:`_pack`)."""
        p = self._packed
        names, inputs = self._layout
        k = len(names)
        self._nodes_map = dict(zip(names, p))
        self._bindings = dict(zip(inputs, p[k:]))
        self._literals = {}
        self._outputs = [self.anchor]
        self._nodes = list(p[k + len(inputs):])
        self._packed = None

    def _pack(self, layout: tuple) -> tuple:
        """The tuple a single-output match is kept as with ``layout`` (pattern node names, the
        anchor's first; input names): those nodes, those inputs' values, then the matched nodes
        in graph order."""
        p = self._packed
        if p is not None and self._layout is layout:
            return p
        names, inputs = layout
        nodes_map, bindings = self.nodes_map, self.bindings
        return (*[nodes_map[n] for n in names], *[bindings[n] for n in inputs], *self.nodes)

    nodes_map = property(*_unpacked("_nodes_map"))
    bindings = property(*_unpacked("_bindings"))
    literals = property(*_unpacked("_literals"))
    outputs = property(*_unpacked("_outputs"))
    nodes = property(*_unpacked("_nodes"))

    @property
    def insert_point(self) -> Node:
        """The last matched node: a replacement block goes just before it."""
        p = self._packed
        return self.nodes[-1] if p is None else p[-1]

    def __repr__(self) -> str:
        binds = ", ".join(f"{k}={v.name}" if type(v) is Node else f"{k}={v!r}" for k, v in self.bindings.items())
        return f"Match(anchor={self.anchor.name}, nodes={[n.name for n in self.nodes]}, {binds})"


# --- loading patterns ------------------------------------------------------------------------
_TRACED: "weakref.WeakKeyDictionary[Any, GraphModule]" = weakref.WeakKeyDictionary()
_TRACED_CODE: Dict[tuple, GraphModule] = {}  # functions by code, globals, defaults and closure
_TRACED_CODE_MAX = 512


def load_pattern(obj: Any) -> Tuple[Graph, Optional[nn.Module]]:
    """The graph of a pattern or replacement, and the module owning its ``call_module`` and
    ``get_attr`` targets. Functions and modules are traced symbolically once and cached by
    identity (a function is assumed not to change behaviour between calls); a function is
    also found again by its code when its closure holds only hashable values, so
    ``lambda m: lambda x: ...`` in a rule traces its inner function once, not per match."""
    if isinstance(obj, GraphModule):
        return obj.graph, obj
    if isinstance(obj, Graph):
        return obj, None
    if not (isinstance(obj, nn.Module) or callable(obj)):
        raise TypeError(f"a pattern must be a function, an nn.Module, a GraphModule or a Graph, "
                        f"not {type(obj).__name__}")
    try:
        gm = _TRACED.get(obj)
    except TypeError:
        gm = None
    key = _code_key(obj) if gm is None else None
    if key is not None:
        gm = _TRACED_CODE.get(key)
    if gm is None:
        from ..trace import Tracer, symbolic_trace
        gm = symbolic_trace(obj, tracer=Tracer(watch_closures=False))  # a template: closure values baked in
        if key is not None:
            if len(_TRACED_CODE) >= _TRACED_CODE_MAX:
                _TRACED_CODE.clear()
            _TRACED_CODE[key] = gm
    try:
        _TRACED[obj] = gm
    except TypeError:
        pass
    return gm.graph, gm


def _code_key(fn: Any) -> Optional[tuple]:
    """A key that identifies what tracing a plain function records, or None: its code, its
    globals and its defaults and closure values, when those are atoms (compared with their
    type, so ``1`` is not ``1.0``) or objects compared by identity (functions, modules...)."""
    if not isinstance(fn, types.FunctionType):
        return None
    try:
        cells = [c.cell_contents for c in fn.__closure__ or ()]
    except ValueError:  # an empty cell
        return None
    kw = sorted((fn.__kwdefaults__ or {}).items())
    parts = []
    for v in list(fn.__defaults__ or ()) + [v for _, v in kw] + cells:
        t = type(v)
        if t not in _ATOMS and t.__eq__ is not object.__eq__ and t is not types.BuiltinFunctionType:
            return None
        parts.append((t, v))
    return (fn.__code__, id(fn.__globals__), tuple(k for k, _ in kw), tuple(parts))


# --- compiled pattern ------------------------------------------------------------------------
class _PNode:
    """A computed pattern node, prepared for matching."""

    __slots__ = ("node", "name", "op", "allowed", "module_type", "internal", "n_users", "pred",
                 "nargs", "kwkeys", "fast", "pos_items", "norm_items", "norm_keys", "norm_defaults", "comm_pos",
                 "simple", "plain", "target",
                 "comm_norm", "check_alpha")

    def __repr__(self) -> str:
        return f"<pattern node {self.name}>"


def _has_node(v: Any) -> bool:
    t = type(v)
    if t is Node:
        return True
    if t in _ATOMS:
        return False
    return next(iter_nodes(v), None) is not None


def _lit_eq(a: Any, b: Any) -> bool:
    """Literal equality, strict about types (``1`` is not ``1.0`` or ``True``); lists and tuples
    compare alike; NaN equals NaN."""
    if a is b:
        return True
    ta, tb = type(a), type(b)
    if ta in (tuple, list) and tb in (tuple, list):
        return len(a) == len(b) and all(_lit_eq(x, y) for x, y in zip(a, b))
    if ta is not tb:
        return False
    if ta is float:
        return a == b or (a != a and b != b)
    if ta is dict:
        return a.keys() == b.keys() and all(_lit_eq(a[k], b[k]) for k in a)
    if ta is slice:
        return _lit_eq((a.start, a.stop, a.step), (b.start, b.stop, b.step))
    if isinstance(a, torch.Tensor) or ta is Node:
        return False
    try:
        return bool(a == b)
    except Exception:
        return False


def _same_value(a: Any, b: Any) -> bool:
    """Whether two bindings of one placeholder agree: the same node, or equal literals."""
    if type(a) is Node or type(b) is Node:
        return a is b
    if type(a) in (tuple, list) and type(b) in (tuple, list):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return _lit_eq(a, b)


class _Slot:
    """A sentinel standing for one argument slot while probing how a pattern call binds."""

    __slots__ = ("key",)

    def __init__(self, key):
        self.key = key


def _literal_leaves(v: Any, name: str, acc: List[str]) -> None:
    """Add the capture names of the literals inside a pattern argument (as ``_struct`` names
    them) to ``acc``."""
    t = type(v)
    if t is Node:
        return
    if t in (tuple, list) and _has_node(v):
        for i, x in enumerate(v):
            _literal_leaves(x, f"{name}_{i}", acc)
    elif t is dict and _has_node(v):
        for k, x in v.items():
            _literal_leaves(x, f"{name}_{k}", acc)
    elif t is slice and _has_node(v):
        _literal_leaves((v.start, v.stop, v.step), name, acc)
    elif name not in acc:
        acc.append(name)


def _call_pred(pred: Callable[[Any], bool], name: str, value: Any) -> bool:
    try:
        return bool(pred(value))
    except Exception as e:
        what = value.name if type(value) is Node else repr(value)
        e.add_note(f"raised by the matcher predicate for pattern node {name!r} on {what!r}")
        raise
