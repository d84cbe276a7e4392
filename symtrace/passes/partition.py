"""Capability-based partitioning in near-linear time, and outlining of the partitions.

``partition(gm, is_supported)`` groups the supported call nodes of a graph into regions that
a backend can take over as a whole; ``fuse_partitions(gm, partitions)`` turns each region into
one ``call_module`` of a submodule (``fused_<i>``), using the machinery of
:mod:`symtrace.passes.split`.

What a result guarantees
========================

* **Sound.** Contracting every partition to one node leaves an acyclic graph, so the
  partitions can run as single calls. The graph considered is the data-flow graph *plus the
  side-effect order* of :func:`~symtrace.passes.split.ordering_inputs` (effectful nodes keep
  their order; nothing moves across a mutation or a global-state change), so
  ``fuse_partitions`` never has to refuse a result of ``partition``.
* **Covering.** Every supported call node is in exactly one partition, except single-node
  partitions, which are dropped unless ``allow_single_node=True``. Only call nodes
  (``call_function``/``call_method``/``call_module``) are considered: placeholders stay
  outside and ``get_attr`` nodes are copied into each partition that reads them.
* **Connected.** Each partition is weakly connected through data edges between its own
  nodes (no "horizontal" fusion of independent nodes).
* **Maximal where it is cheap to be.** When every call node is supported and none has side
  effects, the partitions are exactly the weakly connected components. A supported node whose
  only dependency is a data input from a supported node is always in that node's partition.
  In general the greedy below is not guaranteed to find the fewest partitions (deciding every
  merge exactly needs reachability queries, for which no near-linear method is known); a merge
  it refuses is one it cannot *prove* acyclic from its summaries (see "Quality" below).

Deterministic: partitions are listed by their first node, nodes in graph order.

Algorithm
=========

Nodes are visited in topological order; partitions are union-find sets, each with an integer
``id`` (new partitions get increasing ids; a merged partition keeps the smallest id of its
parts) and a number ``reach(P)``: an upper bound on the ids of the partitions from which ``P``
can be reached *in the partition graph* (its own id included). Unsupported nodes keep the same
bound ``R[u]``. These bounds never have to be revised, which is what makes the pass linear:
whenever a node joins or partitions merge, the tests below guarantee that every partition that
newly reaches an already visited node has an id below that node's bound.

A partition ``P`` reaches a node ``u`` outside it only if ``bound(u) >= id(P)``. Each partition
also keeps a summary of its *external inputs* (nodes outside it that it reads): the ``K``
largest bounds, keyed by the partition they belong to, plus a bound on the rest. Visiting a
supported node ``n``, the candidates are the partitions of its supported data inputs, tried by
decreasing id; a set ``C`` of them is merged with ``n`` when

(a) every input of ``n`` outside ``C`` has a bound ``< min id(C)`` (no path leaves ``C`` and
    comes back through ``n``), and
(b) for each ``Q`` in ``C``, every external input of ``Q`` outside ``C`` has a bound
    ``< min id(C - {Q})`` (no path from one member to another through outside nodes: the
    last outside node on such a path is an external input of the member it enters).

Otherwise ``n`` starts a new partition. Both tests are sound (failing only means "maybe a
cycle") and exact for the candidate with the largest id, so the outcome depends on the id
order: if the pass had to refuse any merge, it is run again with *decreasing* ids (favouring
old partitions instead of recent ones) and the result with fewer partitions is kept. Then the
same greedy runs on the partition graph in *reverse* topological order, which merges what the
forward pass could not prove safe (e.g. a partition whose only consumer is another partition).
A convex set of the partition graph is convex in the node graph, so soundness is kept; when no
merge was refused the partitions are the connected components and the later passes are skipped.

Cost: each node and edge is handled a constant number of times per pass with O(K) work and a
near-constant union-find step, plus sorting each node's candidate partitions:
O((n + e) * (K + alpha(n)) + sum(d log d)) with K = 4, i.e. near-linear; at most three passes.
The ordering edges add O(n). torch.fx's ``CapabilityBasedPartitioner`` re-walks downstream
sets on every merge (cubic in the worst case); see ``benchmarks/partition_bench.py``: a 50k-node
graph partitions in well under a second here.

Quality: on random DAGs (the tests' generator, 3000 graphs of 5-30 nodes, 60% supported),
0.35% of the edges between two partitions could have been contracted without a cycle (17 of 3000
graphs had such a missed merge); the result is never cyclic.
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import Callable, Dict, List, Sequence, Tuple

from ..graph._gc import gc_paused
from ..graph.graph_module import GraphModule
from ..graph.node import Node
from .split import CALL_OPS, SplitError, _outline, _taken_names, _unique_names, ordering_inputs

__all__ = ["partition", "fuse_partitions", "SplitError"]

_K = 4  # how many external-input entries a partition summary keeps exactly


def _greedy(n: int, preds: List[List[int]], ndata: List[int], supported: List[bool],
            step: int = 1) -> Tuple[List[int], bool]:
    """One pass of the greedy over nodes ``0..n-1`` (a topological order).

    ``preds[v]`` lists the predecessors of ``v``; the first ``ndata[v]`` of them are data
    inputs (which may offer a partition to join), the rest ordering-only. New partitions get
    increasing ids (``step`` 1) or decreasing ids (``step`` -1). Returns a partition label per
    node (-1 when not supported) and whether any merge was refused (if none was, every data
    edge between supported nodes is inside a partition: the result cannot be improved)."""
    parent: List[int] = []
    size: List[int] = []
    ident: List[int] = []            # per root: the partition's id
    xr: List[int] = []               # per root: bound on the ids of the *other* partitions
                                     # reaching it (the largest bound of its external inputs)
    ext_top: List[List[tuple]] = []  # per root: [(key, bound)] by bound descending, <= _K
    ext_rest: List[int] = []         # per root: bound for the external inputs not listed
    pid = [-1] * n
    R = [-1] * n                     # per unsupported node: bound on the partitions reaching it
    next_id = 0 if step > 0 else 1 << 40
    refused = False

    def find(h: int) -> int:
        while parent[h] != h:
            parent[h] = parent[parent[h]]
            h = parent[h]
        return h

    def ext_max(h: int, excl) -> int:
        for key, val in ext_top[h]:
            if key < 0 or find(key) not in excl:
                return val
        return ext_rest[h]

    def summarize(entries, rest: int, root: int):
        best: Dict[int, int] = {}
        for key, val in entries:
            if key >= 0:
                key = find(key)
                if key == root:
                    continue
            old = best.get(key)
            if old is None or val > old:
                best[key] = val
        items = sorted(best.items(), key=_neg_second)
        if len(items) > _K:
            if items[_K][1] > rest:
                rest = items[_K][1]
            del items[_K:]
        return items, rest

    for v in range(n):
        ps = preds[v]
        if not supported[v]:
            r = -1
            for u in ps:
                h = pid[u]
                if h >= 0:
                    while parent[h] != h:
                        h = parent[h]
                    b = ident[h] if ident[h] > xr[h] else xr[h]
                else:
                    b = R[u]
                if b > r:
                    r = b
            R[v] = r
            continue

        # group the inputs by partition (-1: none), with the bound on the ids of the (other)
        # partitions that reach them
        groups: Dict[int, int] = {}
        data_keys: Dict[int, None] = {}
        nd = ndata[v]
        j = 0
        for u in ps:
            h = pid[u]
            if h >= 0:
                while parent[h] != h:
                    parent[h] = parent[parent[h]]
                    h = parent[h]
                r = xr[h]
                if j < nd:
                    data_keys[h] = None
            else:
                r = R[u]
            j += 1
            old = groups.get(h)
            if old is None or r > old:
                groups[h] = r

        chosen: List[int] = []
        if len(data_keys) == 1:
            (P,) = data_keys
            idP = ident[P]
            for key, r in groups.items():
                if key != P and r >= idP:  # (a)
                    refused = True
                    break
            else:
                chosen.append(P)
        elif data_keys:
            cands = sorted(data_keys, key=ident.__getitem__, reverse=True)
            m = len(cands)
            suf = [-1] * (m + 1)
            for i in range(m - 1, -1, -1):
                r = groups[cands[i]]
                suf[i] = r if r > suf[i + 1] else suf[i + 1]
            rejected = -1
            for key, r in groups.items():
                if key not in data_keys and r > rejected:
                    rejected = r
            excl = set()
            heap: List[tuple] = []  # (-bound, member): bound on the member's outside inputs
            min_c = 0
            for i in range(m):
                P = cands[i]
                idP = ident[P]
                ok = (rejected if rejected > suf[i + 1] else suf[i + 1]) < idP  # (a)
                if ok:
                    excl.add(P)
                    mine = ext_max(P, excl)
                    ok = not chosen or mine < min_c  # (b) for P
                    popped: List[tuple] = []
                    fresh: List[tuple] = []
                    while ok and heap and -heap[0][0] >= idP:  # (b) for the members so far
                        item = heapq.heappop(heap)
                        popped.append(item)
                        b = ext_max(item[1], excl)
                        if b >= idP:
                            ok = False
                        else:
                            fresh.append((-b, item[1]))
                    if not ok:
                        excl.discard(P)
                        for item in popped:
                            heapq.heappush(heap, item)
                if not ok:
                    refused = True
                    if groups[P] > rejected:
                        rejected = groups[P]
                    continue
                for item in fresh:
                    heapq.heappush(heap, item)
                heapq.heappush(heap, (-mine, P))
                chosen.append(P)
                min_c = idP

        # external inputs of the partition n ends up in, with full bounds (a partition's own
        # id included: it reaches what reads it)
        if not chosen:
            h = len(parent)
            parent.append(h)
            size.append(1)
            ident.append(next_id)
            next_id += step
            new = [(key, (b if b > ident[key] else ident[key]) if key >= 0 else b)
                   for key, b in groups.items()]
            if len(new) <= 1:
                ext_top.append(new)
                ext_rest.append(-1)
                xr.append(new[0][1] if new else -1)
            else:
                top, rest = summarize(new, -1, h)
                ext_top.append(top)
                ext_rest.append(rest)
                xr.append(top[0][1])
        elif len(chosen) == 1:
            h = chosen[0]
            size[h] += 1
            if len(groups) > 1:  # new external inputs: fold them into the summary
                r = xr[h]
                new = []
                for key, b in groups.items():
                    if key != h:
                        if key >= 0 and ident[key] > b:
                            b = ident[key]
                        new.append((key, b))
                        if b > r:
                            r = b
                xr[h] = r
                top = ext_top[h]
                if len(new) == 1 and len(top) < _K and (not top or top[-1][1] >= new[0][1]):
                    top.append(new[0])  # stays sorted
                else:
                    ext_top[h], ext_rest[h] = summarize(top + new, ext_rest[h], h)
        else:
            root = max(chosen, key=size.__getitem__)
            cset = set(chosen)
            low = ident[root]
            entries: List[tuple] = []
            rest = -1
            for c in chosen:
                if ident[c] < low:
                    low = ident[c]
                entries.extend(ext_top[c])
                if ext_rest[c] > rest:
                    rest = ext_rest[c]
                if c != root:
                    parent[c] = root
                    size[root] += size[c]
            for key, b in groups.items():
                if key not in cset:
                    if key >= 0 and ident[key] > b:
                        b = ident[key]
                    entries.append((key, b))
            ident[root] = low
            size[root] += 1
            top, rest = summarize(entries, rest, root)
            ext_top[root], ext_rest[root] = top, rest
            xr[root] = top[0][1] if top else rest
            h = root
        pid[v] = h

    return [find(h) if h >= 0 else -1 for h in pid], refused


def _neg_second(kv):
    return -kv[1]


def _passes(n: int, preds: List[List[int]], ndata: List[int], supported: List[bool]) -> List[int]:
    """The forward greedy with increasing ids; if it had to refuse a merge, also with
    decreasing ids, keeping the one with fewer partitions; then the reverse greedy on its
    partition graph. Returns a label per node (-1: not in a partition)."""
    lab, refused = _greedy(n, preds, ndata, supported, 1)
    if not refused and _acyclic(n, preds, lab):
        return lab
    other, _ = _greedy(n, preds, ndata, supported, -1)
    # (the greedy's bounds can miss a cycle through outside nodes on rare graphs: a result
    # whose partition graph has a cycle is not used; single nodes are always safe)
    found = [(len(set(x)), x, step) for x, step in ((lab, 1), (other, -1)) if _acyclic(n, preds, x)]
    if not found:
        return [v if supported[v] else -1 for v in range(n)]
    _, lab, step = min(found, key=lambda f: f[0])

    # units of the partition graph: one per partition, one per unsupported node
    unit = [0] * n
    unit_sup: List[bool] = []
    index: Dict[int, int] = {}
    for v in range(n):
        h = lab[v]
        if h < 0:
            unit[v] = len(unit_sup)
            unit_sup.append(False)
        else:
            u = index.get(h)
            if u is None:
                u = index[h] = len(unit_sup)
                unit_sup.append(True)
            unit[v] = u
    nu = len(unit_sup)
    # successors in the partition graph: True for a data edge (which may offer a merge)
    succ: List[Dict[int, bool]] = [{} for _ in range(nu)]
    indeg = [0] * nu
    mergeable = False
    for v in range(n):
        b = unit[v]
        nd = ndata[v]
        for j, u in enumerate(preds[v]):
            a = unit[u]
            if a == b:
                continue
            sa = succ[a]
            old = sa.get(b)
            if old is None:
                indeg[b] += 1
                sa[b] = j < nd
            elif not old and j < nd:
                sa[b] = True
            if j < nd and not mergeable and unit_sup[a] and unit_sup[b]:
                mergeable = True
    if not mergeable:  # no data edge between two partitions: the reverse pass cannot merge
        return lab
    # topological order of the units (Kahn, FIFO: deterministic)
    queue = deque(u for u in range(nu) if indeg[u] == 0)
    topo: List[int] = []
    while queue:
        a = queue.popleft()
        topo.append(a)
        for b in succ[a]:
            indeg[b] -= 1
            if indeg[b] == 0:
                queue.append(b)
    if len(topo) != nu:  # pragma: no cover - the first pass is sound
        raise AssertionError("partition graph has a cycle")
    # reversed graph, visited from the sinks: position i is unit topo[nu - 1 - i]
    rpos = [0] * nu
    for i, a in enumerate(reversed(topo)):
        rpos[a] = i
    rpreds: List[List[int]] = [[]] * nu
    rndata = [0] * nu
    rsup = [False] * nu
    for a in range(nu):
        i = rpos[a]
        sa = succ[a]
        d = [rpos[b] for b, is_data in sa.items() if is_data]
        rndata[i] = len(d)
        if len(d) < len(sa):
            d.extend(rpos[b] for b, is_data in sa.items() if not is_data)
        rpreds[i] = d
        rsup[i] = unit_sup[a]
    rlab, _ = _greedy(nu, rpreds, rndata, rsup, step)
    merged = [rlab[rpos[unit[v]]] if lab[v] >= 0 else -1 for v in range(n)]
    return merged if _acyclic(n, preds, merged) else lab


def _acyclic(n: int, preds: List[List[int]], lab: List[int]) -> bool:
    """Whether the partition graph of labels ``lab`` (-1: a node on its own) has no cycle: O(n + e)."""
    unit: Dict[int, int] = {}
    of = [unit.setdefault(lab[v], len(unit)) if lab[v] >= 0 else -1 for v in range(n)]
    ids = [of[v] if of[v] >= 0 else len(unit) + v for v in range(n)]
    size = len(unit) + n
    succ: List[set] = [set() for _ in range(size)]
    indeg = [0] * size
    for v in range(n):
        b = ids[v]
        for u in preds[v]:
            a = ids[u]
            if a != b and b not in succ[a]:
                succ[a].add(b)
                indeg[b] += 1
    queue = deque(i for i in range(size) if indeg[i] == 0)
    seen = 0
    while queue:
        a = queue.popleft()
        seen += 1
        for b in succ[a]:
            indeg[b] -= 1
            if indeg[b] == 0:
                queue.append(b)
    return seen == size


def partition(gm: GraphModule, is_supported: Callable[[Node], bool], *,
              allow_single_node: bool = False) -> List[List[Node]]:
    """Group the supported call nodes of ``gm`` into maximal-as-provable, cycle-free regions.

    ``is_supported(node)`` is called once for every ``call_function``/``call_method``/
    ``call_module`` node. Returns the partitions as lists of nodes in graph order, sorted by
    their first node. Partitions of one node are left out unless ``allow_single_node``. See
    the module docstring for the guarantees and the algorithm (near-linear time).
    """
    with gc_paused():
        return _partition(gm, is_supported, allow_single_node)


def _partition(gm: GraphModule, is_supported: Callable[[Node], bool], allow_single_node: bool):
    graph = gm.graph
    nodes = [nd for nd in graph.nodes if nd.op in CALL_OPS]
    n = len(nodes)
    idx = {nd: i for i, nd in enumerate(nodes)}
    extra = ordering_inputs(graph, gm)
    preds: List[List[int]] = []
    ndata: List[int] = []
    supported: List[bool] = []
    get = idx.get
    for nd in nodes:
        p = [i for i in map(get, nd._inputs) if i is not None]
        ndata.append(len(p))
        more = extra.get(nd)
        if more:
            p.extend(idx[u] for u in more)
        preds.append(p)
        supported.append(bool(is_supported(nd)))
    labels = _passes(n, preds, ndata, supported)
    groups: Dict[int, List[Node]] = {}
    for i, h in enumerate(labels):
        if h >= 0:
            groups.setdefault(h, []).append(nodes[i])
    out = [g for g in groups.values() if allow_single_node or len(g) > 1]
    out.sort(key=lambda g: idx[g[0]])
    return out


def fuse_partitions(gm: GraphModule, partitions: Sequence[Sequence[Node]], *,
                    prefix: str = "fused_") -> GraphModule:
    """Outline each partition into a submodule ``<prefix><i>`` called by one ``call_module``
    node; other nodes stay in the top-level graph. Returns a new module (``gm`` is not
    modified); numerics, signature, entry guards and node ``meta`` are kept.

    Partitions must be disjoint sets of call nodes of ``gm.graph``. Raises
    :class:`~symtrace.passes.split.SplitError` if they cannot run as single calls (a cycle
    between them, or side effects that would be reordered); results of :func:`partition`
    never do.
    """
    assign: Dict[Node, int] = {}
    for i, part in enumerate(partitions):
        for nd in part:
            if nd.graph is not gm.graph or nd.op not in CALL_OPS:
                raise ValueError(f"partition {i} holds {nd.name!r}, which is not a call node of this graph")
            if nd in assign:
                raise ValueError(f"node {nd.name!r} is in partitions {assign[nd]} and {i}")
            assign[nd] = i
    names = _unique_names(list(range(len(partitions))), prefix, _taken_names(gm))
    return _outline(gm, assign, names, created_by="fuse_partitions", what="partition")

