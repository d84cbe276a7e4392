"""The compiled fast path of :mod:`symtrace.passes.matcher`: ``_compile_fast`` writes a
single-output pattern as a straight-line Python loop over anchor candidates."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

from ..graph.node import Node
from ._compiled import Constants, define
from .match_pattern import (_ATOMS, _CALLS, _LIT, _MISSING, _PH, _STRUCT, Match, _PNode, _call_pred,
                            _lit_eq, _same_value)


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
