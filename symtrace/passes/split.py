"""Split a graph into submodules: ``split_module`` and the outlining machinery behind
``fuse_partitions``.

``split_module(gm, partition_of)`` returns a new top-level :class:`GraphModule` whose graph
calls one submodule ``submod_<p>`` per partition ``p``; each submodule is a ``GraphModule``
with its own placeholders (the values it reads from outside) and output (the values other
partitions or the top level read). The original ``gm`` is not changed; parameters and
submodules are shared with it (as ``GraphModule`` shares them with the traced model).

Rules (the same for ``fuse_partitions``):

* ``partition_of`` is called once per ``call_function``/``call_method``/``call_module`` node,
  in graph order. Returning ``None`` keeps the node in the top-level graph.
* Placeholders stay in the top-level graph (same names, defaults and order, so the signature
  and the entry guards are unchanged). ``get_attr`` nodes are not assigned: each is copied into
  every submodule (and the top level) that reads it, so parameters are never passed as inputs.
* Values crossing partitions become submodule inputs/outputs, in order of first use and of
  definition respectively (never set order). One output is returned bare, several as a tuple
  unpacked with ``getitem`` nodes named after the original nodes.
* Partitions run in a topological order of the partition graph; ties are broken by the
  position of each partition's first node, so the result is deterministic.
* Side effects keep their order (see :func:`ordering_inputs`): nodes with observable effects
  (random draws, prints, asserts, data guards) keep their relative order, and *barriers*
  (in-place/mutating ops, ``inplace=True`` modules, grad-mode switches, anything else impure)
  run after every node before them and before every node after them. A partitioning that
  would need to reorder them - or one whose partitions depend on each other in a cycle - is
  refused with :class:`SplitError` naming the nodes and the user's source lines. Aliasing is
  not analysed: a mutation is conservatively treated as possibly touching any value.
* Copied nodes keep their ``meta`` (source line, module path, tensor metadata); submodule
  placeholders and the ``getitem`` nodes carry the ``tensor_meta`` of the value they stand for.
* Entry guards stay on the top-level graph; when they read module state (``root....``), the new
  module's ``guard_root`` is the original module (or its ``guard_root``), which owns that state.
"""
from __future__ import annotations

import heapq
import operator
import re
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..errors import SymtraceError
from ..graph.effects import is_impure, is_inplace, is_pure_target, is_random
from ..graph.graph import Graph
from ..graph.graph_module import GraphModule
from ..graph.guards import check_data_guard, needs_live_root
from ..graph.replay import read_cell
from ..graph.node import Node

__all__ = ["split_module", "SplitError", "effect_kind", "ordering_inputs", "CALL_OPS"]

#: Opcodes of the nodes that are assigned to partitions.
CALL_OPS = frozenset({"call_function", "call_method", "call_module"})

# impure calls whose only effect is to observe values (or the outside world / RNG stream):
# they must keep their relative order, but do not change any tensor the graph reads
# (read_cell: a closure cell's current value, kept in order with the set_cell writes)
_ORDERED_ONLY = (print, torch._assert, check_data_guard, read_cell)


class SplitError(SymtraceError, ValueError):
    """The requested partitioning cannot be expressed as a sequence of submodule calls:
    partitions depend on each other in a cycle, or running them would reorder side effects."""


def _describe(node: Node) -> str:
    loc = node.meta.get("source")
    where = f" ({loc.describe()})" if loc is not None else ""
    return f"{node.name!r} = {node.op}[{node.format_target()}]{where}"


def effect_kind(node: Node, module: Optional[nn.Module] = None) -> Optional[str]:
    """How a call node constrains reordering: ``None`` (pure), ``"ordered"`` (observes values,
    draws random numbers: keeps its order among effectful nodes) or ``"barrier"`` (may mutate
    something or change global state: nothing may move across it).

    ``module`` is the graph's owning module (needed to classify ``call_module`` nodes)."""
    op = node.op
    if op not in CALL_OPS:
        return None
    if op == "call_module":
        sub = None
        if module is not None:
            try:
                sub = module.get_submodule(node.target)
            except AttributeError:
                sub = None
        if sub is None or getattr(sub, "inplace", False) is True:
            return "barrier"
        return "barrier" if is_impure(node, module) else None
    if not is_impure(node, module):
        return None
    if is_inplace(node):
        return "barrier"
    if op == "call_function":
        try:
            if any(node.target is f for f in _ORDERED_ONLY):
                return "ordered"
        except TypeError:
            pass
    if is_random(node):
        return "ordered"
    return "barrier"


_MISS = object()
_BY_CALL = object()  # cached for targets whose calls must each be classified


def _kind_cached(node: Node, module, cache: Dict[Any, Optional[str]]) -> Optional[str]:
    # a call_module's classification depends on its target alone; a call's may depend on its
    # arguments (training=, inplace=, dropout's probability, batch norm's running statistics)
    # unless every call of its target without keyword arguments is pure (is_pure_target)
    op, target = node.op, node._target
    if op != "call_module" and node._kwargs:
        return effect_kind(node, module)
    try:
        hit = cache.get((op, target), _MISS)
    except TypeError:  # unhashable target
        return effect_kind(node, module)
    if hit is _MISS:
        if op == "call_module":
            hit = cache[(op, target)] = effect_kind(node, module)
        else:
            hit = cache[(op, target)] = None if is_pure_target(node) else _BY_CALL
    return effect_kind(node, module) if hit is _BY_CALL else hit


def ordering_inputs(graph: Graph, module: Optional[nn.Module] = None) -> Dict[Node, List[Node]]:
    """Extra predecessors that keep side effects in order, for the call nodes that need them.

    * every effectful node (``effect_kind`` not None) comes after the previous effectful node;
    * a barrier comes after every call node since the previous barrier, and every call node
      after a barrier comes after it.

    Together with the data edges this is the dependency graph that partitioning and splitting
    respect. It has O(n) edges: each call node gets at most two, each barrier one per node of
    the stretch before it. Placeholders and ``get_attr`` nodes take no part (they are read
    lazily: the consumer's position is what matters).
    """
    extra: Dict[Node, List[Node]] = {}
    cache: Dict[Any, Optional[str]] = {}
    prev_effect: Optional[Node] = None
    last_barrier: Optional[Node] = None
    stretch: List[Node] = []
    for n in graph.nodes:
        if n.op not in CALL_OPS:
            continue
        if n._kwargs and n.op != "call_module":
            kind = effect_kind(n, module)
        else:
            try:
                kind = cache.get((n.op, n._target), _MISS)
            except TypeError:  # unhashable target
                kind = _MISS
            if kind is _MISS or kind is _BY_CALL:
                kind = _kind_cached(n, module, cache)
        if kind is None:
            if last_barrier is not None:
                extra[n] = [last_barrier]
            stretch.append(n)
            continue
        preds: Dict[Node, None] = {}
        if prev_effect is not None:
            preds[prev_effect] = None
        prev_effect = n
        if kind == "barrier":
            for m in stretch:
                preds[m] = None
            if last_barrier is not None:
                preds[last_barrier] = None
            stretch = []
            last_barrier = n
        else:
            if last_barrier is not None:
                preds[last_barrier] = None
            stretch.append(n)
        if preds:
            extra[n] = list(preds)
    return extra


# ----------------------------------------------------------------------------------------
# outlining: the shared core of split_module and fuse_partitions
# ----------------------------------------------------------------------------------------

def _sanitize(key: Any) -> str:
    s = re.sub(r"\W", "_", str(key))
    return s or "p"


def _unit_cycle_message(cyclic: List[int], succ: List[Dict[int, tuple]], label: Callable[[int], str]) -> str:
    """Describe one cycle among the units left over by Kahn's algorithm."""
    remaining = set(cyclic)
    # drop units with no successor left (they lie downstream of a cycle, not on one)
    changed = True
    while changed:
        changed = False
        for u in list(remaining):
            if not any(w in remaining for w in succ[u]):
                remaining.discard(u)
                changed = True
    start = min(remaining)
    # walk successors inside the remaining set until a unit repeats
    seen: Dict[int, int] = {}
    path: List[int] = []
    u = start
    while u not in seen:
        seen[u] = len(path)
        path.append(u)
        u = next(w for w in succ[u] if w in remaining)
    cycle = path[seen[u]:] + [u]
    steps = []
    for a, b in zip(cycle, cycle[1:]):
        src, dst, why = succ[a][b]
        if why == "data":
            steps.append(f"  {label(b)} reads {src.name!r} from {label(a)}: {_describe(dst)}")
        else:
            steps.append(f"  {label(b)} must run after {label(a)} to keep side effects in order: "
                         f"{_describe(dst)} must follow {_describe(src)}")
    return "\n".join(steps)


def _outline(gm: GraphModule, assign: Dict[Node, Hashable], names: Dict[Hashable, str],
             created_by: str, what: str) -> GraphModule:
    """Move the call nodes assigned to each key into a submodule named ``names[key]``; nodes
    without a key stay in the top-level graph. Returns the new top-level module."""
    graph = gm.graph
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}

    # --- units: one per key, one per inline call node ----------------------------------
    unit_of: Dict[Node, int] = {}
    unit_key: List[Optional[Hashable]] = []
    unit_nodes: List[List[Node]] = []
    key_unit: Dict[Hashable, int] = {}
    for n in nodes:
        if n.op not in CALL_OPS:
            continue
        k = assign.get(n)
        if k is None:
            u = len(unit_nodes)
            unit_nodes.append([n])
            unit_key.append(None)
        else:
            u = key_unit.get(k)
            if u is None:
                u = key_unit[k] = len(unit_nodes)
                unit_nodes.append([])
                unit_key.append(k)
            unit_nodes[u].append(n)
        unit_of[n] = u

    def label(u: int) -> str:
        return f"{what} {unit_key[u]!r}" if unit_key[u] is not None else f"node {unit_nodes[u][0].name!r}"

    # --- the unit graph: data edges and side-effect order ------------------------------
    extra = ordering_inputs(graph, gm)
    nu = len(unit_nodes)
    succ: List[Dict[int, tuple]] = [{} for _ in range(nu)]
    indeg = [0] * nu

    def edge(src: Node, dst: Node, why: str) -> None:
        a = unit_of.get(src)
        b = unit_of[dst]
        if a is None or a == b or b in succ[a]:
            return
        succ[a][b] = (src, dst, why)
        indeg[b] += 1

    for n in nodes:
        if n not in unit_of:
            continue
        for i in n.all_input_nodes:
            edge(i, n, "data")
        for i in extra.get(n, ()):
            edge(i, n, "order")

    first = [pos[un[0]] for un in unit_nodes]
    heap = [(first[u], u) for u in range(nu) if indeg[u] == 0]
    heapq.heapify(heap)
    order: List[int] = []
    while heap:
        _, u = heapq.heappop(heap)
        order.append(u)
        for w in succ[u]:
            indeg[w] -= 1
            if indeg[w] == 0:
                heapq.heappush(heap, (first[w], w))
    if len(order) < nu:
        cyclic = [u for u in range(nu) if indeg[u] > 0]
        raise SplitError(f"cannot split the graph: these {what}s would have to run before each "
                         f"other (a cycle in the {what} graph):\n"
                         + _unit_cycle_message(cyclic, succ, label)
                         + f"\nAssign the nodes on this cycle to one {what}, or split them differently.")

    # --- submodules ----------------------------------------------------------------------
    subs: Dict[int, Tuple[str, List[Node], List[Node]]] = {}
    sub_modules: Dict[str, GraphModule] = {}
    effect_cache: Dict[Any, Optional[str]] = {}
    for u in range(nu):
        key = unit_key[u]
        if key is None:
            continue
        members = unit_nodes[u]
        inputs: Dict[Node, None] = {}
        outputs: List[Node] = []
        for n in members:
            for i in n.all_input_nodes:
                if unit_of.get(i) != u and i.op != "get_attr":
                    inputs[i] = None
            if any(unit_of.get(w) != u for w in n.users):
                outputs.append(n)
        g = Graph()
        g.created_by = created_by
        env: Dict[Node, Node] = {}
        for i in inputs:
            p = g.placeholder(i.name)
            if i.meta.get("tensor_meta") is not None:
                p.meta["tensor_meta"] = i.meta["tensor_meta"]
            env[i] = p

        def lookup(x: Node, env=env, g=g) -> Node:
            got = env.get(x)
            if got is None:
                if x.op != "get_attr":  # pragma: no cover - inputs were collected above
                    raise AssertionError(f"{x.name} is not available in the submodule")
                got = env[x] = g.node_copy(x)
            return got

        impure = False
        for n in members:
            env[n] = g.node_copy(n, lookup)
            impure = impure or _kind_cached(n, gm, effect_cache) is not None
        outs = [env[o] for o in outputs]
        g.output(outs[0] if len(outs) == 1 else (tuple(outs) if outs else None))
        name = names[key]
        sub = GraphModule(gm, g, class_name=name)
        if impure:
            sub._is_impure = True  # keeps dead-code elimination from dropping the call
        sub_modules[name] = sub
        subs[u] = (name, list(inputs), outputs)

    # --- the top-level graph -----------------------------------------------------------
    top = Graph()
    top.created_by = created_by
    tenv: Dict[Node, Node] = {}
    for n in nodes:
        if n.op == "placeholder":
            tenv[n] = top.node_copy(n)

    def tlookup(x: Node) -> Node:
        got = tenv.get(x)
        if got is None:
            if x.op != "get_attr":  # pragma: no cover
                raise AssertionError(f"{x.name} used before it is computed")
            got = tenv[x] = top.node_copy(x)
        return got

    for u in order:
        if unit_key[u] is None:
            n = unit_nodes[u][0]
            tenv[n] = top.node_copy(n, tlookup)
            continue
        name, ins, outs = subs[u]
        call = top.call_module(name, tuple(tlookup(i) for i in ins), name=name)
        if len(outs) == 1:
            tenv[outs[0]] = call
            if outs[0].meta.get("tensor_meta") is not None:
                call.meta["tensor_meta"] = outs[0].meta["tensor_meta"]
        else:
            for j, o in enumerate(outs):
                meta = {"tensor_meta": o.meta["tensor_meta"]} if o.meta.get("tensor_meta") is not None else None
                tenv[o] = top.call_function(operator.getitem, (call, j), name=o.name, meta=meta)
    out = graph.output_node()
    if out is not None:
        top.node_copy(out, tlookup)
    live_root = getattr(gm, "guard_root", None)
    # guards about the live model (identity, structure) apply only where gm ran against one;
    # the split module reads gm's state through guard_root, which must not switch them on
    top.guards = [g for g in graph.guards if live_root is not None or not needs_live_root(g)]

    new = GraphModule(gm, top, class_name=getattr(gm, "_class_name", "GraphModule"), attrs=sub_modules)
    new.meta = dict(getattr(gm, "meta", {}) or {})
    if any(gd.reads_root() for gd in top.guards):
        new.guard_root = live_root or gm
    return new


def _unique_names(keys: Sequence[Hashable], prefix: str, taken: set) -> Dict[Hashable, str]:
    out: Dict[Hashable, str] = {}
    for k in keys:
        base = prefix + _sanitize(k)
        name, i = base, 0
        while name in taken:
            i += 1
            name = f"{base}_{i}"
        taken.add(name)
        out[k] = name
    return out


def _taken_names(gm: nn.Module) -> set:
    return set(gm._modules) | set(gm._parameters) | set(gm._buffers) | {
        k for k in vars(gm) if not k.startswith("_")}


def split_module(gm: GraphModule, partition_of: Callable[[Node], Union[int, str, None]]) -> GraphModule:
    """Split ``gm`` into submodules ``submod_<p>``, one per value ``p`` of ``partition_of``.

    ``partition_of(node)`` is called for every call node in graph order and returns the
    partition (an ``int`` or ``str``; ``None`` keeps the node in the top-level graph). The
    result computes what ``gm`` computes, with the same signature and entry guards; ``gm``
    itself is not modified. Raises :class:`SplitError` when the partitions would depend on
    each other in a cycle or when running them one after the other would reorder side
    effects (see the module docstring).

    >>> parts = split_module(gm, lambda n: 0 if n.meta.get("module_path", "").startswith("stem") else 1)
    >>> parts.submod_0, parts.submod_1
    """
    assign: Dict[Node, Hashable] = {}
    keys: Dict[Hashable, None] = {}
    for n in gm.graph.nodes:
        if n.op in CALL_OPS:
            p = partition_of(n)
            if p is None:
                continue
            if isinstance(p, bool) or not isinstance(p, (int, str)):
                raise TypeError(f"partition_of must return an int, a str or None, got {p!r} "
                                f"for node {n.name!r}")
            assign[n] = p
            keys[p] = None
    names = _unique_names(list(keys), "submod_", _taken_names(gm))
    return _outline(gm, assign, names, created_by="split_module", what="partition")
