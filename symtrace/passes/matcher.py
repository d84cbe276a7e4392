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

This module holds :class:`SubgraphMatcher` (preparing a pattern); the pattern model lives in
:mod:`.match_pattern`, the general search in :mod:`.match_search` and the compiled fast path
in :mod:`.match_compiled`.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from torch import nn

from ..graph._gc import gc_paused
from ..graph.graph import Graph
from ..graph.graph_module import GraphModule
from ..graph.node import Node, iter_nodes
from .normalize import bind_call
from .match_compiled import _compile_fast
from .match_pattern import (_CALLS, _LIT, _LITERAL_MODES, _NODE, _PH, _POSITIONAL_NAME, _STRUCT,
                            COMMUTATIVE_TARGETS, Match, _PNode, _Slot, _has_node, _lit_eq, _literal_leaves,
                            load_pattern)
from .match_search import _Run

__all__ = ["SubgraphMatcher", "Match", "load_pattern", "COMMUTATIVE_TARGETS"]


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
