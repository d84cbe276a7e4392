"""The general search of :mod:`symtrace.passes.matcher`: ``_Run``, the state of one
``SubgraphMatcher.match`` call (anchor candidates, backtracking over operand orders, the checks
that keep a match)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

from ..graph.graph import Graph
from ..graph.effects import is_impure
from ..graph.graph_module import GraphModule
from ..graph.guards import check_data_guard
from ..graph.node import Node, iter_nodes
from .normalize import Binding, bind_call
from .match_pattern import (_ATOMS, _CALLS, _FAIL, _LIT, _MISSING, _NODE, _PH, Match, _PNode, _call_pred,
                            _has_node, _lit_eq, _same_value)


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
