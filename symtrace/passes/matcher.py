"""Find instances of a pattern graph in a graph: ``SubgraphMatcher``.

A pattern is a Python function or ``nn.Module`` (traced symbolically), a ``GraphModule`` or a
``Graph``. Its inputs (placeholders) are wildcards: each binds any node or literal, the same
everywhere it is used. Everything the pattern computes must appear in the graph, op for op,
with arguments compared after normalisation (:mod:`symtrace.passes.normalize`), so
``torch.add(x, y, alpha=1)`` matches ``torch.add(x, y)`` and keyword vs positional agree.

Matching starts at the anchor (the producer of the pattern's first output); its candidates come
from the graph's (op, target) index, never from a scan of every node. From each candidate the
matcher walks the pattern backwards (inputs of matched nodes), backtracking only over
commutative operand orders. Other outputs of a multi-output pattern are found through the users
of nodes matched already.

A match is kept when (greedy in graph order, so matches never overlap):

- its computed nodes belong to no earlier match;
- its internal nodes (all but the outputs) are used by nothing outside the match;
- no pattern input is bound to a node of the match itself;
- when other nodes lie between its first and last node, neither they nor its own nodes
  (but the last) have side effects: the replacement runs at the last node's place (a walk of
  the match's span, only when it is not contiguous);
- replacing it by one block cannot create a cycle: nodes that read a match output and lie
  before the match's last node (found by a forward walk bounded by that position, so only
  inside the match's span) must not lead to a pattern input; they are recorded in
  ``Match.moves`` so a rewriter can move them after the replacement;
- predicates and filters accept it.

Complexity: O(n) once for graph positions, then for each of the k anchor candidates O(p·d)
(p pattern nodes, d their arguments and users), plus, for multi-output patterns only, the nodes
inside the match's span. For local patterns that is O(n + k·p), near-linear in graph size.
(A multi-output pattern whose outputs share no input falls back to the index for its other
outputs: O(k·k') for k' candidates of those.)
"""
from __future__ import annotations

import operator
import re
import types
import weakref
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..graph._gc import gc_paused
from ..graph.graph import Graph
from ..graph.effects import is_impure
from ..graph.graph_module import GraphModule
from ..graph.guards import check_data_guard
from ..graph.node import Node, iter_nodes
from ._compiled import Constants, define
from .normalize import Binding, bind_call

__all__ = ["SubgraphMatcher", "Match", "load_pattern", "COMMUTATIVE_TARGETS"]

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


class SubgraphMatcher:
    """Finds non-overlapping instances of ``pattern`` in graphs.

    ``literals``: how constants written in the pattern compare: ``"exact"`` (equal value and
    type), ``"ignore"`` (any non-node value) or ``"capture"`` (any non-node value, recorded in
    ``Match.literals``). Defaults the pattern did not write are always compared exactly.
    ``commutative``: True to also try swapped operands of ``+``/``*`` (see
    :data:`COMMUTATIVE_TARGETS`), or a collection of extra ``(op, target)`` pairs.
    ``module_match``: ``"type"`` (a pattern ``call_module`` matches graph modules of the same
    type) or ``fn(pattern_module, graph_module) -> bool``. ``predicates``: pattern node (or
    input) name -> ``fn(graph_node_or_value) -> bool``. ``alternatives``: target -> other
    targets it may match (``{torch.relu: [F.relu, "relu"]}``; strings are method names).
    ``filters``: ``fn(match) -> bool`` run on each complete match before it is kept.

    Pattern ``get_attr`` nodes match any graph ``get_attr`` and are treated as inputs (bound in
    ``Match.bindings`` under their name, never erased).
    """

    def __init__(self, pattern: Any, *, literals: str = "exact",
                 commutative: Union[bool, Iterable[Tuple[str, Any]]] = False,
                 module_match: Union[str, Callable[[nn.Module, nn.Module], bool]] = "type",
                 predicates: Optional[Mapping[str, Callable[[Any], bool]]] = None,
                 alternatives: Optional[Mapping[Any, Sequence[Any]]] = None,
                 filters: Sequence[Callable[[Match], bool]] = ()):
        if literals not in _LITERAL_MODES:
            raise ValueError(f"literals must be one of {', '.join(map(repr, _LITERAL_MODES))}, not {literals!r}")
        if module_match != "type" and not callable(module_match):
            raise ValueError("module_match must be 'type' or a callable(pattern_module, graph_module) -> bool")
        self.pattern_graph, self.pattern_module = load_pattern(pattern)
        self.literals = literals
        if commutative is True:
            self.commutative = COMMUTATIVE_TARGETS
        elif commutative:
            self.commutative = COMMUTATIVE_TARGETS | frozenset(commutative)
        else:
            self.commutative = frozenset()
        self.module_match = module_match
        self.predicates = dict(predicates or {})
        self.alternatives = {k: list(v) for k, v in (alternatives or {}).items()}
        self.filters = tuple(filters)
        self._compile()

    # --- preparing the pattern -------------------------------------------------------------
    def _compile(self) -> None:
        g = self.pattern_graph
        out = g.output_node()
        if out is None:
            raise ValueError("the pattern graph has no output")
        self.input_names: List[str] = []   # placeholders and get_attr wildcards, in order
        self._getattr_inputs = set()
        pnodes: Dict[Node, _PNode] = {}
        order: List[Node] = []
        for n in g.nodes:
            if n.op == "placeholder":
                if n.target.startswith("*"):
                    raise ValueError(f"pattern input {n.target!r}: variadic inputs cannot be matched")
                self.input_names.append(n.name)
            elif n.op == "get_attr":
                self.input_names.append(n.name)
                self._getattr_inputs.add(n.name)
            elif n.op != "output":
                order.append(n)
        self._input_checks = frozenset(self._getattr_inputs | (set(self.predicates) & set(self.input_names)))
        unknown = set(self.predicates) - {n.name for n in order} - set(self.input_names)
        if unknown:
            raise ValueError(f"predicates name {sorted(unknown)}, which are not nodes of the pattern; "
                             f"its nodes are {[n.name for n in order] + self.input_names}")
        outs: List[Node] = []
        for v in iter_nodes(out.args[0]):
            if v not in outs:
                outs.append(v)
        if not outs or any(v.op in ("placeholder", "get_attr") for v in outs):
            raise ValueError("every pattern output must be computed by the pattern (not an input or attribute)")
        out_set = set(outs)
        for n in order:
            p = _PNode()
            p.node, p.name, p.op = n, n.name, n.op
            p.internal = n not in out_set
            p.n_users = len(n.users)
            p.pred = self.predicates.get(n.name)
            p.allowed = frozenset(self._allowed(n))
            p.module_type = None
            if n.op == "call_module" and self.pattern_module is not None:
                p.module_type = type(self.pattern_module.get_submodule(n.target))
            pnodes[n] = p
        self._pnodes = pnodes
        self._order = list(pnodes.values())
        # reachability: every computed node must lead to an output
        seen = set()
        stack = list(outs)
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            stack.extend(x for x in v.all_input_nodes if x.op not in ("placeholder", "get_attr"))
        dead = [n.name for n in order if n not in seen]
        if dead:
            raise ValueError(f"pattern nodes {dead} do not contribute to its output")
        self._prepare_args(order)
        self.outputs: List[_PNode] = [pnodes[v] for v in outs]
        self.anchor = self.outputs[0]
        self.internals = [p for p in pnodes.values() if p.internal]
        self._plan_outputs(outs)
        # how a single-output match is kept as one tuple (see Match): the pattern nodes, the
        # anchor first, and the inputs they read
        read = {x.name for n in order for x in n.all_input_nodes if x.op in ("placeholder", "get_attr")}
        self._layout = ((self.anchor.name, *[p.name for p in self._order if p is not self.anchor]),
                        tuple(name for name in self.input_names if name in read))
        self._fast = _compile_fast(self)

    def _allowed(self, n: Node) -> List[Tuple[str, Any]]:
        pairs = [(n.op, n.target)]
        for alt in self.alternatives.get(n.target, ()):
            pairs.append(("call_method", alt) if isinstance(alt, str) else ("call_function", alt))
        return pairs

    def _classify(self, v: Any) -> int:
        if type(v) is Node:
            return _PH if v.op in ("placeholder", "get_attr") else _NODE
        return _STRUCT if _has_node(v) else _LIT

    def _prepare_args(self, order: List[Node]) -> None:
        """Per pattern node: argument slots for the positional fast path and, when the target's
        signature is known, for normalised comparison; names for captured literals."""
        raw: List[Tuple[_PNode, list, Optional[list]]] = []
        for n in order:
            p = self._pnodes[n]
            module = None
            if n.op == "call_module" and self.pattern_module is not None:
                module = self.pattern_module.get_submodule(n.target)
            p.nargs = len(n.args)
            p.kwkeys = tuple(n.kwargs)
            slots = [("a", i) for i in range(len(n.args))] + [("k", k) for k in n.kwargs]
            probe = bind_call((n.op, n.target), tuple(_Slot(s) for s in slots[:p.nargs]),
                              {k: _Slot(("k", k)) for k in n.kwargs}, module=module)
            slot_param: Dict[Any, str] = {}
            packed = False
            if probe is not None:
                for name, val in probe.values.items():
                    if type(val) is _Slot:
                        slot_param[val.key] = name
                    elif type(val) is tuple and any(type(x) is _Slot for x in val):
                        packed = True
            p.fast = not packed
            values = list(n.args) + [n.kwargs[k] for k in n.kwargs]
            pos = [(s, v, slot_param.get(s)) for s, v in zip(slots, values)]
            norm = None
            b = bind_call(n, module=module)
            if b is not None:
                norm = [(k, v, k, k in b.explicit) for k, v in b.values.items()]
            raw.append((p, pos, norm, b.defaults if b is not None else {}))
        # literal names: the parameter name, made unique across the pattern
        wanted: Dict[str, int] = {}
        for p, pos, norm, _ in raw:
            if norm is not None:
                for k, v, _, explicit in norm:
                    if explicit and self._classify(v) in (_LIT, _STRUCT):
                        wanted[k] = wanted.get(k, 0) + 1
        self.literal_names: List[str] = []
        inputs = set(self.input_names)
        counter = 0
        for p, pos, norm, defaults in raw:
            def name_of(param: Optional[str]) -> str:
                nonlocal counter
                if param is None or _POSITIONAL_NAME.match(param):
                    name = f"lit{counter}"
                    counter += 1
                    return name
                unique = wanted.get(param, 0) <= 1 and param not in inputs
                return param if unique else f"{p.name}_{param}"
            names: Dict[Any, str] = {}
            p.pos_items = []
            for s, v, param in pos:
                kind = self._classify(v)
                name = name_of(param) if kind in (_LIT, _STRUCT) else ""
                if param is not None:
                    names[param] = name
                p.pos_items.append((kind, self._item_value(v, kind), name, True))
                _literal_leaves(v, name, self.literal_names)
            if norm is None:
                p.norm_items = p.norm_keys = None
                p.norm_defaults = {}
            else:
                p.norm_items = []
                for k, v, _, explicit in norm:
                    kind = self._classify(v)
                    name = names.get(k) or (name_of(k) if kind in (_LIT, _STRUCT) and explicit else k)
                    p.norm_items.append((kind, self._item_value(v, kind), name, explicit))
                    if explicit:
                        _literal_leaves(v, name, self.literal_names)
                p.norm_keys = tuple(k for k, *_ in norm)
                p.norm_defaults = defaults
            comm = any(pair in self.commutative for pair in p.allowed)
            p.comm_pos = comm and p.nargs >= 2
            p.comm_norm = comm and norm is not None and len(norm) >= 2 and norm[0][3] and norm[1][3]
            p.check_alpha = comm and p.norm_keys is not None and "alpha" in p.norm_keys
            if p.check_alpha:
                alpha = dict(zip(p.norm_keys, p.norm_items))["alpha"]
                if alpha[0] != _LIT or not _lit_eq(alpha[1], 1):
                    p.comm_pos = p.comm_norm = False  # x + alpha*y does not commute
            p.target = p.node.target
            p.simple = p.op in _CALLS and p.pred is None
            # the inline fast path: positional-only calls (alpha, if any, is then the default)
            p.plain = p.fast and p.op in _CALLS and not p.kwkeys

    def _item_value(self, v: Any, kind: int) -> Any:
        if kind == _NODE:
            return self._pnodes[v]
        if kind == _PH:
            return v.name
        return v

    def _plan_outputs(self, outs: List[Node]) -> None:
        """For each output after the first: a pattern node ``q`` matched by then and the chain
        of pattern nodes leading from ``q`` up to the output, to find candidates via users."""
        covered = self._closure(outs[0], set())
        self._extra: List[Tuple[_PNode, Optional[Node], List[_PNode]]] = []
        for o in outs[1:]:
            plan: Tuple[Optional[Node], List[_PNode]] = (None, [])
            if o not in covered:
                # breadth-first down the inputs of ``o`` to the nearest covered node
                parent: Dict[Node, Optional[Node]] = {o: None}
                frontier = [o]
                found = None
                while frontier and found is None:
                    nxt = []
                    for v in frontier:
                        for x in v.all_input_nodes:
                            if x in covered:
                                found = (x, v)
                                break
                            if x not in parent and x.op not in ("placeholder", "get_attr"):
                                parent[x] = v
                                nxt.append(x)
                        if found:
                            break
                    frontier = nxt
                if found is not None:
                    q, v = found
                    chain = []
                    while v is not None:
                        chain.append(self._pnodes[v])
                        v = parent[v]
                    plan = (q, chain)  # chain: from the user of q up to o
            self._extra.append((self._pnodes[o], plan[0], plan[1]))
            covered = self._closure(o, covered)

    @staticmethod
    def _closure(node: Node, acc: set) -> set:
        acc = set(acc)
        stack = [node]
        while stack:
            v = stack.pop()
            if v in acc:
                continue
            acc.add(v)
            stack.extend(v.all_input_nodes)
        return acc

    # --- matching --------------------------------------------------------------------------
    def match(self, graph: Union[GraphModule, Graph], *,
              filters: Sequence[Callable[[Match], bool]] = ()) -> List[Match]:
        """All non-overlapping matches in ``graph`` (greedy in graph order).

        Pass the ``GraphModule`` when the pattern has ``call_module`` nodes: its submodules
        give the types to compare (with a bare ``Graph``, module targets must be equal).
        """
        with gc_paused():  # many small objects: keep the cyclic GC from making this super-linear
            return _Run(self, graph, tuple(self.filters) + tuple(filters)).run()

    def __repr__(self) -> str:
        return f"SubgraphMatcher(anchor={self.anchor.name}, nodes={len(self._pnodes)}, literals={self.literals!r})"


class _Run:
    """The state of one ``SubgraphMatcher.match`` call."""

    def __init__(self, mt: SubgraphMatcher, graph: Union[GraphModule, Graph], filters):
        if isinstance(graph, GraphModule):
            self.owner, self.graph = graph, graph.graph
        elif isinstance(graph, Graph):
            self.owner, self.graph = None, graph
        else:
            raise TypeError(f"match() expects a GraphModule or a Graph, not {type(graph).__name__}")
        self.mt = mt
        self.filters = filters
        self.claimed: set = set()
        self.types: Dict[str, Any] = {}
        self.bindings: Dict[Node, Optional[Binding]] = {}
        self.m: Dict[_PNode, Node] = {}
        self.inv: Dict[Node, _PNode] = {}
        self.bind: Dict[str, Any] = {}
        self.lits: Dict[str, Any] = {}
        self.trail: list = []
        self.moves: Sequence[Node] = ()
        self.capture = mt.literals == "capture"
        self.ignore = mt.literals != "exact"

    @property
    def pos(self) -> Dict[Node, int]:
        """Graph positions (computed when first needed: the compiled fast path does not)."""
        return self.graph.positions()

    def run(self) -> List[Match]:
        found: List[Match] = []
        anchor = self.mt.anchor
        claimed = self.claimed
        m, inv, trail = self.m, self.inv, self.trail
        scan = self.mt._fast
        filters = self.filters
        cands = self._anchor_candidates()
        i, n = 0, len(cands)
        while i < n:
            if scan is not None:  # the compiled loop decides what it can
                i = scan(cands, i, claimed, found, filters)
                if i >= n:
                    break
            c = cands[i]
            i += 1
            if c in claimed:
                continue
            if m:
                m.clear()
                inv.clear()
            if trail:
                trail.clear()
            if self.bind:  # a kept match took the old dicts
                self.bind = {}
            if self.lits:
                self.lits = {}
            if self._solve(((anchor, c), None)):
                match = self._build()
                found.append(match)
                claimed.update(match.nodes)
                if match.moves:
                    claimed.update(match.moves)
        return found

    # candidates
    def _anchor_candidates(self) -> List[Node]:
        a = self.mt.anchor
        g = self.graph
        if a.op == "call_module":
            cands = [n for n in g.find_nodes(op="call_module", sort=False) if self._module_ok(a, n)]
        else:
            cands = []
            for op, target in a.allowed:
                cands.extend(g.find_nodes(op=op, target=target, sort=False))
            if len(a.allowed) > 1:
                cands = list(dict.fromkeys(cands))
        if len(a.allowed) > 1 or a.op == "call_module" or not g._in_order:
            cands.sort(key=self.pos.__getitem__)
        return cands

    def _module_ok(self, p: _PNode, n: Node) -> bool:
        if p.module_type is None or self.owner is None:
            return n.target == p.node.target
        mod = self.types.get(n.target)
        if mod is None:
            try:
                mod = self.owner.get_submodule(n.target)
            except AttributeError:
                return False
            self.types[n.target] = mod
        if self.mt.module_match == "type":
            return type(mod) is p.module_type
        return bool(self.mt.module_match(self.mt.pattern_module.get_submodule(p.node.target), mod))

    def _node_ok(self, p: _PNode, g: Node) -> bool:
        if p.op == "call_module":
            if g.op != "call_module" or not self._module_ok(p, g):
                return False
        else:
            try:
                if (g.op, g.target) not in p.allowed:
                    return False
            except TypeError:
                return False
        if p.internal and len(g.users) != p.n_users:
            return False
        if p.pred is not None and not _call_pred(p.pred, p.name, g):
            return False
        return True

    # search
    def _undo(self, mark: int) -> None:
        trail = self.trail
        while len(trail) > mark:
            entry = trail.pop()
            kind = entry[0]
            if kind == 0:
                del self.m[entry[1]]
                del self.inv[entry[2]]
            elif kind == 1:
                del self.bind[entry[1]]
            else:
                del self.lits[entry[1]]

    def _solve(self, work) -> bool:
        """Match the pending (pattern node, graph node) pairs of the linked list ``work``;
        on success the state holds a complete match. Leaves partial state on failure (callers
        undo to their mark). The common case (plain call, positional layout equal to the
        pattern's) is handled inline: this loop is the matcher's hot path."""
        m, inv, claimed, trail = self.m, self.inv, self.claimed, self.trail
        while work is not None:
            (p, g), work = work
            have = m.get(p)
            if have is not None:
                if have is g:
                    continue
                return False
            if g in inv or g in claimed:
                return False
            if p.simple:  # call_function/call_method without predicate
                try:
                    if (g.op, g.target) not in p.allowed:
                        return False
                except TypeError:
                    return False
                if p.internal and len(g.users) != p.n_users:
                    return False
            elif not self._node_ok(p, g):
                return False
            gargs = g.args
            if p.plain and len(gargs) == p.nargs and not g.kwargs and g.target == p.target:
                items, vals, swapped = p.pos_items, gargs, None
                if p.comm_pos:
                    swapped = (gargs[1], gargs[0]) + gargs[2:]
            else:
                lined = self._line_up(p, g)
                if lined is None:
                    return False
                items, vals, swapped = lined
            m[p] = g
            inv[g] = p
            trail.append((0, p, g))
            if swapped is None:
                work = self._expand(items, vals, work)
                if work is _FAIL:
                    return False
            else:
                for vs in (vals, swapped):
                    mark = len(trail)
                    w = self._expand(items, vs, work)
                    if w is not _FAIL and self._solve(w):
                        return True
                    self._undo(mark)
                return False
        return self._finish() if self.mt._extra else self._check()

    def _graph_binding(self, g: Node) -> Optional[Binding]:
        try:
            return self.bindings[g]
        except KeyError:
            pass
        module = None
        if g.op == "call_module" and self.owner is not None:
            module = self.types.get(g.target)
        b = bind_call(g, module=module)
        self.bindings[g] = b
        return b

    def _line_up(self, p: _PNode, g: Node):
        """``(items, values, swapped_values)``: ``p``'s argument slots and ``g``'s values in the
        same order (``swapped_values`` when the operands may commute, else None), or None when
        they cannot line up."""
        gargs, gkw = g.args, g.kwargs
        if p.fast and len(gargs) == p.nargs and len(gkw) == len(p.kwkeys) and \
                (p.op == "call_module" or g.target == p.node.target):
            if gkw:
                try:
                    vals = gargs + tuple([gkw[k] for k in p.kwkeys])
                except KeyError:
                    return self._line_up_normalized(p, g)
            else:
                vals = gargs
            swapped = None
            if p.comm_pos and self._alpha_one(g):
                swapped = (vals[1], vals[0]) + vals[2:]
            return p.pos_items, vals, swapped
        return self._line_up_normalized(p, g)

    def _line_up_normalized(self, p: _PNode, g: Node):
        if p.norm_items is None:
            return None
        b = self._graph_binding(g)
        if b is None:
            return None
        gv = b.values
        vals = []
        items = p.norm_items
        for i, k in enumerate(p.norm_keys):
            v = gv.get(k, _MISSING)
            if v is _MISSING:
                v = gv.get("self" if k == "input" else "input" if k == "self" else k, _MISSING)
                if v is _MISSING:
                    # another target without this parameter: fine if the pattern has its default
                    kind, pv = items[i][0], items[i][1]
                    if kind != _LIT or k not in p.norm_defaults or not _lit_eq(pv, p.norm_defaults[k]):
                        return None
                    if items is p.norm_items:
                        items = list(items[:i])
                    continue
            if items is not p.norm_items:
                items.append(p.norm_items[i])
            vals.append(v)
        if len(gv) > len(vals):  # another target (alternatives): extra parameters must be defaults
            known = set(p.norm_keys) | {"self", "input"}
            for k, v in gv.items():
                if k not in known and not (k in b.defaults and _lit_eq(v, b.defaults[k])):
                    return None
        vals = tuple(vals)
        swapped = None
        if p.comm_norm and self._alpha_one(g) and items is p.norm_items:
            swapped = (vals[1], vals[0]) + vals[2:]
        return items, vals, swapped

    @staticmethod
    def _alpha_one(g: Node) -> bool:
        alpha = g.kwargs.get("alpha", 1) if g.kwargs else 1
        return type(alpha) is not Node and alpha == 1

    def _expand(self, items, vals, work):
        bind, trail, checks = self.bind, self.trail, self.mt._input_checks
        i = 0
        for kind, pv, name, explicit in items:
            gv = vals[i]
            i += 1
            if kind == _NODE:
                if type(gv) is not Node:
                    return _FAIL
                work = ((pv, gv), work)
            elif kind == _PH:
                bound = bind.get(pv, _MISSING)
                if bound is _MISSING and pv not in checks:
                    bind[pv] = gv
                    trail.append((1, pv))
                elif bound is not gv and not self._bind(pv, gv):
                    return _FAIL
            elif kind == _LIT:
                if not self._literal(pv, gv, name, explicit):
                    return _FAIL
            else:
                work = self._struct(pv, gv, name, explicit, work)
                if work is _FAIL:
                    return _FAIL
        return work

    def _bind(self, name: str, gv: Any) -> bool:
        bound = self.bind.get(name, _MISSING)
        if bound is not _MISSING:
            return bound is gv or _same_value(bound, gv)
        mt = self.mt
        if mt._input_checks and name in mt._input_checks:
            if name in mt._getattr_inputs and (type(gv) is not Node or gv.op != "get_attr"):
                return False
            pred = mt.predicates.get(name)
            if pred is not None and not _call_pred(pred, name, gv):
                return False
        self.bind[name] = gv
        self.trail.append((1, name))
        return True

    def _literal(self, pv: Any, gv: Any, name: str, explicit: bool) -> bool:
        if not explicit or not self.ignore:
            return _lit_eq(pv, gv)
        if _has_node(gv):
            return False
        if self.capture:
            self.lits[name] = gv
            self.trail.append((2, name))
        return True

    def _struct(self, pv: Any, gv: Any, name: str, explicit: bool, work):
        t = type(pv)
        if t is Node:
            if pv.op in ("placeholder", "get_attr"):
                return work if self._bind(pv.name, gv) else _FAIL
            if type(gv) is not Node:
                return _FAIL
            return ((self.mt._pnodes[pv], gv), work)
        if t in (tuple, list):
            if type(gv) not in (tuple, list) or len(gv) != len(pv):
                return _FAIL
            for i, (x, y) in enumerate(zip(pv, gv)):
                work = self._struct(x, y, f"{name}_{i}", explicit, work)
                if work is _FAIL:
                    return _FAIL
            return work
        if t is dict:
            if type(gv) is not dict or gv.keys() != pv.keys():
                return _FAIL
            for k in pv:
                work = self._struct(pv[k], gv[k], f"{name}_{k}", explicit, work)
                if work is _FAIL:
                    return _FAIL
            return work
        if t is slice:
            if type(gv) is not slice:
                return _FAIL
            return self._struct((pv.start, pv.stop, pv.step), (gv.start, gv.stop, gv.step), name, explicit, work)
        return work if self._literal(pv, gv, name, explicit) else _FAIL

    def _finish(self) -> bool:
        """Find the remaining outputs (multi-output patterns), then check the whole match."""
        m = self.m
        for out, q, chain in self.mt._extra:
            if out in m:
                continue
            for c in self._extra_candidates(out, q, chain):
                if c in self.inv or c in self.claimed:
                    continue
                mark = len(self.trail)
                if self._solve(((out, c), None)):
                    return True
                self._undo(mark)
            return False
        return self._check()

    def _extra_candidates(self, out: _PNode, q: Optional[Node], chain: List[_PNode]) -> List[Node]:
        start = None
        if q is not None:
            if q.op in ("placeholder", "get_attr"):
                start = self.bind.get(q.name)
            else:
                start = self.m.get(self.mt._pnodes[q])
        if type(start) is not Node:  # disconnected from what is matched: use the index
            cands = []
            for op, target in out.allowed:
                cands.extend(self.graph.find_nodes(op=op, target=target, sort=False))
        else:
            frontier = [start]
            for p in chain:
                nxt = {}
                for f in frontier:
                    for u in f.users:
                        if u not in nxt and self._node_ok(p, u):
                            nxt[u] = None
                frontier = list(nxt)
            cands = frontier
        cands.sort(key=self.pos.__getitem__)
        return cands

    def _check(self) -> bool:
        inv, mt = self.inv, self.mt
        for v in self.bind.values():
            if type(v) is Node:
                if v in inv:
                    return False  # an input of the match is one of its own nodes
            elif type(v) not in _ATOMS:
                for n in iter_nodes(v):
                    if n in inv:
                        return False
        m = self.m
        for p in mt.internals:
            for u in m[p].users:
                if u not in inv:
                    return False  # an internal result is used outside the match
        pos = self.pos
        lo = hi = None
        if len(inv) > 1:
            lo = min(inv, key=pos.__getitem__)
            hi = max(inv, key=pos.__getitem__)
            if pos[hi] - pos[lo] >= len(inv) and not self._movable(lo, hi):
                return False  # the replacement would run after a side effect it used to precede
        moves: Sequence[Node] = ()
        if len(mt.outputs) > 1:
            moves = []
            inputs = {n for v in self.bind.values() for n in iter_nodes(v)}
            hi = pos[hi]
            claimed = self.claimed
            stack = [u for p in mt.outputs for u in m[p].users if u not in inv and pos[u] < hi]
            seen = set()
            while stack:
                w = stack.pop()
                if w in seen:
                    continue
                seen.add(w)
                if w in inputs or w in claimed:
                    return False  # replacing would create a cycle (or touch another match)
                moves.append(w)
                for u in w.users:
                    if u not in inv and u not in seen and pos[u] < hi:
                        stack.append(u)
            moves.sort(key=pos.__getitem__)
        self.moves = moves
        if self.filters:
            mt, m = self.mt, self.m
            match = Match(m[mt.anchor], {p.name: m[p] for p in mt._order}, dict(self.bind), dict(self.lits),
                          [m[p] for p in mt.outputs], sorted(self.inv, key=self.pos.__getitem__), moves)
            for f in self.filters:
                if not f(match):
                    return False
        return True

    def _movable(self, lo: Node, hi: Node) -> bool:
        """Whether the match's computation may move down to ``hi``, its last node, past the
        other nodes in between: none of them, and no matched node but ``hi``, may have side
        effects (in-place writes, randomness; data guards only check, so they may be passed).
        Walks the match's span only."""
        owner = self.owner
        n = lo
        while n is not hi:
            if n.op in _CALLS or n.op == "call_module":
                if is_impure(n, owner) and n.target is not check_data_guard:
                    return False
            n = n.next
        return True

    def _build(self) -> Match:
        mt, m = self.mt, self.m
        nodes = sorted(self.inv, key=self.pos.__getitem__)
        nodes_map = {p.name: m[p] for p in mt._order}
        bind, lits = self.bind, self.lits
        self.bind, self.lits = {}, {}  # the match keeps these
        return Match(m[mt.anchor], nodes_map, bind, lits, [m[p] for p in mt.outputs], nodes, self.moves)


# --- the compiled fast path --------------------------------------------------------------------
def _compile_fast(mt: SubgraphMatcher) -> Optional[Callable]:
    """Compile the pattern into a straight-line Python loop over anchor candidates, for the
    common case: one output, exact literals, no commutativity, alternatives, modules or
    nested node arguments. Returns None when not applicable.

    ``scan(candidates, i, claimed, found, filters)`` decides candidates from index ``i`` on,
    appending each match to ``found`` (and its nodes to ``claimed``); it returns the index of
    the first candidate it cannot decide (the graph writes a call differently from the
    pattern, or the match is not contiguous: the general search decides that one), or
    ``len(candidates)``. It checks what the general search checks (op and target, argument
    layout, literals, consistent inputs, injectivity, claimed nodes, internal users by count,
    inputs outside the match), so both agree; it just avoids the search's bookkeeping (several
    times faster per candidate).
    """
    if len(mt.outputs) != 1 or mt.literals != "exact" or mt.commutative:
        return None
    for p in mt._order:
        if p.op not in _CALLS or len(p.allowed) != 1 or not p.fast:
            return None
        if any(kind == _STRUCT for kind, *_ in p.pos_items):
            return None
    consts = Constants(Node=Node, MISSING=_MISSING, lit_eq=_lit_eq, same=_same_value, call_pred=_call_pred,
                       ATOMS=_ATOMS, Match=Match, new=object.__new__)
    const = consts.name

    NO, SLOW = "continue", "return i - 1"  # noqa: N806 - the two ways a check can fail
    lines = ["def scan(cands, i, claimed, found, filters):",
             "    n = len(cands)",
             "    while i < n:",
             "        c = cands[i]",
             "        i += 1",
             "        if c in claimed: continue"]
    emit = lambda line, depth=0: lines.append("    " * (depth + 2) + line)  # noqa: E731
    var: Dict[_PNode, str] = {mt.anchor: "c"}
    order: List[_PNode] = [mt.anchor]
    bvar: Dict[str, str] = {}

    def node(p: _PNode, v: str) -> None:
        i = order.index(p)
        emit(f"a{i} = {v}._args")
        emit(f"if len(a{i}) != {p.nargs}: {SLOW}")
        if p.kwkeys:
            emit(f"kw{i} = {v}._kwargs")
            emit(f"if len(kw{i}) != {len(p.kwkeys)}: {SLOW}")
        else:
            emit(f"if {v}._kwargs: {SLOW}")
        if p.internal:
            emit(f"if len({v}.users) != {p.n_users}: {NO}")
        if p.pred is not None:
            emit(f"if not call_pred({const(p.pred)}, {p.name!r}, {v}): {NO}")
        for j, (kind, pv, _, _) in enumerate(p.pos_items):
            if j < p.nargs:
                expr = f"a{i}[{j}]"
            else:
                expr = f"x{i}_{j}"
                emit(f"{expr} = kw{i}.get({p.kwkeys[j - p.nargs]!r}, MISSING)")
                emit(f"if {expr} is MISSING: {SLOW}")
            if kind == _LIT:
                emit(f"if not lit_eq({const(pv)}, {expr}): {NO}")
            elif kind == _PH:
                if pv in bvar:
                    b = bvar[pv]
                    emit(f"if {expr} is not {b} and not same({b}, {expr}): {NO}")
                    continue
                b = bvar[pv] = f"b{len(bvar)}"
                emit(f"{b} = {expr}")
                if pv in mt._getattr_inputs:
                    emit(f"if type({b}) is not Node or {b}.op != 'get_attr': {NO}")
                pred = mt.predicates.get(pv)
                if pred is not None:
                    emit(f"if not call_pred({const(pred)}, {pv!r}, {b}): {NO}")
            elif pv in var:  # a pattern node used twice
                emit(f"if {expr} is not {var[pv]}: {NO}")
            else:
                x = var[pv] = f"v{len(order)}"
                emit(f"{x} = {expr}")
                emit(f"if type({x}) is not Node or {x} in claimed: {NO}")
                emit(f"if {x}.op != {pv.op!r} or {x}._target != {const(pv.target)}: {NO}")
                emit(f"if {' or '.join(f'{x} is {var[q]}' for q in order)}: {NO}")
                order.append(pv)
                node(pv, x)

    node(mt.anchor, "c")
    mapped = [var[p] for p in order]
    for b in bvar.values():  # an input may not be one of the match's own nodes
        emit(f"if type({b}) is Node:")
        emit(f"if {' or '.join(f'{b} is {v}' for v in mapped)}: {NO}", 1)
        emit(f"elif type({b}) not in ATOMS: {SLOW}")
    # contiguous (the p - 1 nodes before the candidate are the other matched nodes; else the
    # general search checks side effects in between): their graph order comes with it
    walk = ["c"]
    for k in range(1, len(mapped)):
        emit(f"w{k} = {walk[-1]}._prev")
        emit(f"if {' and '.join(f'w{k} is not {v}' for v in mapped[1:])}: {SLOW}")
        walk.append(f"w{k}")
    names, inputs = mt._layout
    if set(inputs) != set(bvar):
        return None
    by_name = {p.name: var[p] for p in order}
    packed = [by_name[name] for name in names] + [bvar[name] for name in inputs] + walk[::-1]
    emit("m = new(Match)")  # (kept as one tuple: see Match)
    emit("m.anchor = c")
    emit("m.moves = ()")
    emit(f"m._layout = {const(mt._layout)}")
    emit(f"m._packed = ({', '.join(packed)},)")
    emit("if filters and not all(f(m) for f in filters): continue")
    emit("found.append(m)")
    emit(f"claimed.update(({', '.join(mapped)},))")
    lines.append("    return n")
    return define("\n".join(lines), f"pattern-{mt.anchor.name}", "scan", consts.namespace)


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
