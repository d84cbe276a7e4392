"""split_module, the capability-based partitioner and fuse_partitions.

The partitioner is checked against brute-force definitions on random DAGs (hypothesis):
acyclic quotient graph (data edges plus the documented side-effect order), coverage,
connectivity and the maximality it promises; fused and split modules are run against the
original graph."""
import operator

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st
from torch import nn

import symtrace
from symtrace.graph import Graph, GraphModule
from symtrace.passes.partition import fuse_partitions, partition
from symtrace.passes.split import CALL_OPS, SplitError, effect_kind, split_module

from examples.models import build, example_inputs


def _lint_all(gm):
    gm.graph.lint()
    for m in gm.modules():
        if isinstance(m, GraphModule):
            m.graph.lint()


def _trace(name):
    model = build(name)
    x = example_inputs(name)
    return model, x, symtrace.symbolic_trace(model, example_inputs=x)


# ------------------------------------------------------------------------------------------
# split_module on the example models
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["resnet", "transformer"])
@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_split_module_example_models_match_eager(name, chunk):
    model, x, gm = _trace(name)
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    split = split_module(gm, lambda n: pos[n] // chunk)
    _lint_all(split)
    with torch.no_grad():
        torch.testing.assert_close(split(*x), model(*x), rtol=0, atol=0)
    subs = [k for k in split._modules if k.startswith("submod_")]
    n_calls = sum(1 for n in gm.graph.nodes if n.op in CALL_OPS)
    assert len(subs) == len({pos[n] // chunk for n in gm.graph.nodes if n.op in CALL_OPS})
    # every call node ends up in exactly one submodule, with its meta
    copied = [n for k in subs for n in getattr(split, k).graph.nodes if n.op in CALL_OPS]
    assert len(copied) == n_calls
    by_name = {n.name: n for n in gm.graph.nodes}
    for n in copied:
        assert n.meta.get("source") == by_name[n.name].meta.get("source")
        assert n.meta.get("tensor_meta") == by_name[n.name].meta.get("tensor_meta")
    # the signature and guards are kept; the original graph is untouched
    assert [p.name for p in split.graph.placeholders()] == [p.name for p in gm.graph.placeholders()]
    assert len(split.graph.guards) == len(gm.graph.guards)
    gm.graph.lint()
    with torch.no_grad():
        torch.testing.assert_close(gm(*x), model(*x), rtol=0, atol=0)


def test_split_module_by_module_path_and_order():
    model, x, gm = _trace("resnet")

    def by_stage(n):
        path = n.meta.get("module_path") or ""
        return path.split(".")[0] or "head"

    split = split_module(gm, by_stage)
    _lint_all(split)
    calls = [n.target for n in split.graph.nodes if n.op == "call_module"]
    assert calls == ["submod_stem", "submod_layer1", "submod_layer2", "submod_layer3", "submod_pool",
                     "submod_head", "submod_fc"]
    # get_attr / call_module targets live in the submodule that uses them, shared with the model
    assert split.submod_layer1.get_submodule("layer1.0.conv1") is model.layer1[0].conv1
    assert not hasattr(split, "layer1")
    with torch.no_grad():
        torch.testing.assert_close(split(*x), model(*x), rtol=0, atol=0)


def test_split_module_keeps_guards_working():
    model, x, gm = _trace("transformer")
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    split = split_module(gm, lambda n: "a" if pos[n] < len(pos) // 2 else "b")
    assert split.guard_root is gm
    with torch.no_grad():
        torch.testing.assert_close(split(*x), model(*x))
    with pytest.raises(symtrace.GuardError):
        split(torch.randn(2, 8, 64, dtype=torch.float64))


def test_split_module_none_keeps_node_at_top_level_and_cycle_is_refused():
    g = Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.sin, (x,))
    b = g.call_function(torch.cos, (a,))
    c = g.call_function(torch.add, (a, b))
    g.output(c)
    gm = GraphModule(nn.Module(), g)
    inp = torch.randn(4)
    top = split_module(gm, lambda n: None if n is c else 0)
    assert [n.op for n in top.graph.nodes].count("call_module") == 1
    assert any(n.op == "call_function" and n.target is torch.add for n in top.graph.nodes)
    torch.testing.assert_close(top(inp), gm(inp))
    # a and c in one partition, b (between them) in another: a cycle
    with pytest.raises(SplitError, match="cycle") as err:
        split_module(gm, lambda n: 1 if n is b else 0)
    assert "'cos'" in str(err.value)
    with pytest.raises(SplitError, match="cycle"):
        split_module(gm, lambda n: None if n is b else 0)


def test_split_module_refuses_to_reorder_side_effects():
    class M(nn.Module):
        def forward(self, x):
            y = x * 2          # reads x before the in-place update
            x.add_(1)          # mutation: a barrier
            z = x * 3          # reads the updated x
            return y + z

    m = M()
    gm = symtrace.symbolic_trace(m, example_inputs=(torch.randn(3),))
    before = str(gm.graph)
    names = {n.name: n for n in gm.graph.nodes}
    mul, add_ = names["mul"], names["add_"]
    assert effect_kind(add_, gm) == "barrier"
    # y and z in one partition, the in-place add in another: would run add_ before or after both
    with pytest.raises(SplitError, match="side effects") as err:
        split_module(gm, lambda n: 1 if n is add_ else 0)
    assert "test_split_partition.py" in str(err.value)
    # a split that respects the order is fine and computes the same thing
    ok = split_module(gm, lambda n: 0 if n is mul else 1)
    x = torch.randn(3)
    torch.testing.assert_close(ok(x.clone()), m(x.clone()))
    assert ok.submod_1._is_impure
    assert str(gm.graph) == before  # the original is untouched
    gm.graph.lint()


def test_split_single_and_no_output_partitions():
    g = Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.relu, (x,))
    p = g.call_function(print, ("hello",))
    b = g.call_function(torch.neg, (a,))
    g.output((a, b))
    gm = GraphModule(nn.Module(), g)
    top = split_module(gm, lambda n: {a: 0, p: 1, b: 2}[n])
    _lint_all(top)
    assert top.submod_1._is_impure
    out = top(torch.randn(3))
    assert isinstance(out, tuple) and len(out) == 2
    assert top.graph.eliminate_dead_code(module=top) is False  # the print partition survives DCE


# ------------------------------------------------------------------------------------------
# partitioner: fixed shapes
# ------------------------------------------------------------------------------------------

def _graph(spec):
    """spec: list of (kind, inputs) where inputs index earlier values (0, 1 = placeholders)."""
    g = Graph()
    vals = [g.placeholder("x"), g.placeholder("y")]
    for kind, ins in spec:
        args = [vals[i] for i in ins]
        if kind == "inplace":
            node = g.call_method("mul_", (args[0], 1.5))
        elif kind == "random":
            node = g.call_function(torch.rand_like, (args[0],))
        elif len(args) == 1:
            node = g.call_function(torch.sin if kind == "s" else torch.cos, (args[0],))
        elif len(args) == 2:
            node = g.call_function(torch.add if kind == "s" else torch.sub, tuple(args))
        else:
            node = g.call_function(torch.addcmul, tuple(args[:3]), {"value": 0.5})
        vals.append(node)
    calls = vals[2:]
    g.output(tuple(v for v in calls if not v.users) or vals[0])
    return GraphModule(nn.Module(), g), calls


def _sup(nodes):
    s = set(nodes)
    return lambda n: n in s


def test_partition_chain_and_diamond_all_supported_is_one_partition():
    gm, c = _graph([("s", [0]), ("s", [2]), ("s", [2]), ("s", [3, 4]), ("s", [5, 1])])
    parts = partition(gm, _sup(c))
    assert parts == [c]


def test_partition_side_input_from_other_partition_is_merged():
    # A: a1 -> a2;  B: b1 -> u (unsupported);  n reads a2 and u.  {a1, a2, n} is cycle-free.
    gm, c = _graph([("s", [0]), ("s", [2]), ("s", [1]), ("u", [4]), ("s", [3, 5])])
    a1, a2, b1, u, n = c
    parts = partition(gm, _sup([a1, a2, b1, n]), allow_single_node=True)
    assert [a1, a2, n] in parts and [b1] in parts


def test_partition_refuses_path_through_unsupported_node():
    # a -> u (unsupported) -> c and a -> c: {a, c} would be a cycle
    gm, c = _graph([("s", [0]), ("u", [2]), ("s", [2, 3])])
    a, u, cc = c
    parts = partition(gm, _sup([a, cc]), allow_single_node=True)
    assert parts == [[a], [cc]]
    assert partition(gm, _sup([a, cc])) == []


def test_partition_dropped_singletons_and_determinism():
    gm, c = _graph([("s", [0]), ("u", [2]), ("s", [3]), ("s", [4]), ("u", [5]), ("s", [6])])
    sup = _sup([c[0], c[2], c[3], c[5]])
    assert partition(gm, sup) == [[c[2], c[3]]]
    assert partition(gm, sup, allow_single_node=True) == [[c[0]], [c[2], c[3]], [c[5]]]


def test_partition_all_supported_after_merges_is_components():
    # found by hypothesis: merged partitions must not look reachable from their old ids
    spec = [("s", [0])] * 12 + [("s", [2, 7]), ("s", [0]), ("s", [0]), ("s", [3, 6]), ("s", [0]),
                                 ("s", [4, 7]), ("s", [5, 17]), ("s", [0]), ("s", [0]), ("s", [2, 17])]
    gm, calls = _graph(spec)
    parts = partition(gm, lambda n: True, allow_single_node=True)
    _check(gm, calls, [True] * len(calls), parts, True)
    assert max(len(p) for p in parts) == 11


@pytest.mark.parametrize("shift", [1, -1])
def test_partition_grid_graph(shift):
    """A grid where every value feeds two nodes of the next layer, every other node supported:
    dependencies spiral around the columns, so whole columns would form cycles."""
    width, layers = 8, 12
    spec, prev = [], []
    for j in range(width):
        spec.append(("s", [0]))
        prev.append(len(spec) + 1)
    for _ in range(layers):
        cur = []
        for j in range(width):
            spec.append(("s", [prev[j], prev[(j + shift) % width]]))
            cur.append(len(spec) + 1)
        prev = cur
    gm, calls = _graph(spec)
    supported = [i % 2 == 0 for i in range(len(calls))]
    parts = partition(gm, _sup([c for c, s in zip(calls, supported) if s]), allow_single_node=True)
    _check(gm, calls, supported, parts, True)
    assert len(parts) <= 2 * width  # far from one partition per node
    fused = fuse_partitions(gm, parts)
    x, y = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(fused(x, y), gm(x, y))


def test_fuse_partitions_example_models():
    for name in ("resnet", "transformer"):
        model, x, gm = _trace(name)
        sup = lambda n: n.op == "call_module" or n.target in (operator.add, torch.flatten)  # noqa: E731
        parts = partition(gm, sup)
        assert parts
        fused = fuse_partitions(gm, parts)
        _lint_all(fused)
        assert sum(1 for n in fused.graph.nodes if n.op == "call_module") == len(parts) + sum(
            1 for n in gm.graph.nodes if n.op == "call_module" and not any(n in p for p in parts))
        with torch.no_grad():
            torch.testing.assert_close(fused(*x), model(*x), rtol=0, atol=0)
    # resnet: every node is a module call, an add or flatten: one region
    model, x, gm = _trace("resnet")
    parts = partition(gm, lambda n: True)
    assert len(parts) == 1 and len(parts[0]) == sum(1 for n in gm.graph.nodes if n.op in CALL_OPS)


def test_fuse_partitions_rejects_bad_input():
    gm, c = _graph([("s", [0]), ("u", [2]), ("s", [2, 3])])
    with pytest.raises(ValueError, match="partitions 0 and 1"):
        fuse_partitions(gm, [[c[0]], [c[0]]])
    with pytest.raises(SplitError, match="cycle"):
        fuse_partitions(gm, [[c[0], c[2]]])


# ------------------------------------------------------------------------------------------
# partitioner vs brute force on random DAGs
# ------------------------------------------------------------------------------------------

@st.composite
def random_dags(draw, effects=True):
    n = draw(st.integers(1, 24))
    spec, sup = [], []
    kinds = ["s", "u"] + (["inplace", "random"] if effects else [])
    for i in range(n):
        avail = i + 2
        k = draw(st.integers(1, 3))
        ins = draw(st.lists(st.integers(0, avail - 1), min_size=k, max_size=k))
        kind = draw(st.sampled_from(kinds)) if effects and draw(st.integers(0, 5)) == 0 else "s"
        spec.append((kind, ins))
        sup.append(draw(st.booleans()))
    return spec, sup


def _brute_edges(gm, calls):
    """Dependency edges from the documented rules, computed pairwise (O(n^2))."""
    idx = {n: i for i, n in enumerate(calls)}
    kinds = [effect_kind(n, gm) for n in calls]
    edges = set()
    for j, n in enumerate(calls):
        for u in n.all_input_nodes:
            if u in idx:
                edges.add((idx[u], j))
        for i in range(j):
            if kinds[i] and kinds[j]:
                edges.add((i, j))
            if kinds[i] == "barrier" or kinds[j] == "barrier":
                edges.add((i, j))
    return edges


def _quotient_acyclic(n, edges, label):
    """Whether contracting each partition (``label``: node index -> partition) to one node
    leaves an acyclic graph; other nodes stay single units."""
    unit = [label.get(i, ("node", i)) for i in range(n)]
    succ, indeg = {}, {u: 0 for u in unit}
    for a, b in edges:
        ua, ub = unit[a], unit[b]
        if ua != ub and ub not in succ.setdefault(ua, set()):
            succ[ua].add(ub)
            indeg[ub] += 1
    todo = [u for u, d in indeg.items() if d == 0]
    done = 0
    while todo:
        u = todo.pop()
        done += 1
        for w in succ.get(u, ()):
            indeg[w] -= 1
            if indeg[w] == 0:
                todo.append(w)
    return done == len(indeg)


def _check(gm, calls, supported, parts, allow_single):
    idx = {n: i for i, n in enumerate(calls)}
    n = len(calls)
    label = {}
    for k, p in enumerate(parts):
        assert p == sorted(p, key=idx.__getitem__)
        assert allow_single or len(p) > 1
        for v in p:
            assert v not in label, "node in two partitions"
            assert supported[idx[v]], "unsupported node in a partition"
            label[idx[v]] = k
    if allow_single:
        assert all(i in label for i in range(n) if supported[i]), "supported node left out"
    edges = _brute_edges(gm, calls)
    assert _quotient_acyclic(n, edges, label), "the partitions depend on each other in a cycle"
    # connected through data edges inside the partition
    for p in parts:
        members = set(p)
        seen, todo = {p[0]}, [p[0]]
        while todo:
            v = todo.pop()
            for w in list(v.all_input_nodes) + list(v.users):
                if w in members and w not in seen:
                    seen.add(w)
                    todo.append(w)
        assert seen == members, "partition not connected"
    # promised maximality: a supported node whose only dependency is a data input from a
    # supported node is in that node's partition
    preds = {j: {a for a, b in edges if b == j} for j in range(n)}
    for j in range(n):
        if supported[j] and len(preds[j]) == 1:
            (i,) = preds[j]
            if supported[i] and calls[i] in calls[j].all_input_nodes and (allow_single or i in label):
                assert label.get(i) == label.get(j), f"{calls[j].name} not merged with its only input"
    # all supported and no effects: partitions are the weakly connected components
    kinds = [effect_kind(v, gm) for v in calls]
    if all(supported) and not any(kinds) and allow_single:
        comp = list(range(n))

        def find(a):
            while comp[a] != a:
                a = comp[a]
            return a
        for a, b in edges:
            comp[find(a)] = find(b)
        assert len(parts) == len({find(a) for a in range(n)})
    return edges


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_dags(), st.booleans())
# a graph on which the greedy's bounds missed a cycle through an outside node (found by this test)
@example(dag=([('s', [0]), ('s', [0]), ('s', [0]), ('s', [0]), ('s', [0, 0, 0]), ('s', [0]), ('s', [5]), ('s', [0]), ('s', [0]), ('s', [0]), ('random', [0]), ('s', [0]), ('s', [0]), ('s', [0]), ('random', [5, 0]), ('s', [0]), ('s', [0]), ('s', [0]), ('s', [0]), ('s', [0]), ('s', [0, 8, 12])], [False, False, False, True, False, False, False, False, False, False, True, False, False, False, True, False, False, False, False, False, True]), allow_single=False)
def test_partition_properties_random_dags(dag, allow_single):
    spec, sup = dag
    gm, calls = _graph(spec)
    supported = [s and kind != "u" for s, (kind, _) in zip(sup, spec)]
    parts = partition(gm, _sup([c for c, s in zip(calls, supported) if s]), allow_single_node=allow_single)
    _check(gm, calls, supported, parts, allow_single)
    # the partitions can always be fused, and the fused module computes the same values
    fused = fuse_partitions(gm, parts)
    _lint_all(fused)
    x, y = torch.randn(3), torch.randn(3)
    torch.manual_seed(0)
    want = gm(x.clone(), y.clone())
    torch.manual_seed(0)
    got = fused(x.clone(), y.clone())
    torch.testing.assert_close(got, want, equal_nan=True)


@settings(max_examples=100, deadline=None)
@given(random_dags(effects=False))
def test_partition_all_supported_is_components(dag):
    spec, _ = dag
    gm, calls = _graph(spec)
    parts = partition(gm, lambda n: True, allow_single_node=True)
    _check(gm, calls, [True] * len(calls), parts, True)


@settings(max_examples=120, deadline=None)
@given(random_dags(), st.integers(1, 4))
def test_split_module_random_partitions(dag, k):
    """Any assignment either splits into an equivalent module or is refused with SplitError,
    and it is refused exactly when the brute-force quotient graph has a cycle."""
    spec, sup = dag
    gm, calls = _graph(spec)
    idx = {n: i for i, n in enumerate(calls)}
    key = {n: (hash((i, k, sup[i])) % k) for i, n in enumerate(calls)}
    edges = _brute_edges(gm, calls)
    if not _quotient_acyclic(len(calls), edges, {idx[n]: key[n] for n in calls}):
        with pytest.raises(SplitError):
            split_module(gm, key.__getitem__)
        return
    top = split_module(gm, key.__getitem__)
    _lint_all(top)
    x, y = torch.randn(3), torch.randn(3)
    torch.manual_seed(0)
    want = gm(x.clone(), y.clone())
    torch.manual_seed(0)
    got = top(x.clone(), y.clone())
    torch.testing.assert_close(got, want, equal_nan=True)


def test_split_keeps_live_model_guards_off_for_a_standalone_graph():
    # guards about the live model (a traced-through submodule's class) were switched on by the
    # split module's guard_root and failed on the split module itself
    import symtrace
    from symtrace.passes import split_module

    class Sub(torch.nn.Module):
        def forward(self, x):
            return x * 2

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sub, self.fc, self.flag = Sub(), torch.nn.Linear(2, 2), True

        def forward(self, x):
            if isinstance(self.sub, Sub) and self.flag:
                x = x + 1
            return self.fc(self.sub(x))

    m, x = M(), torch.randn(2, 2)
    gm = symtrace.symbolic_trace(m, example_inputs=(x,))
    sp = split_module(gm, lambda n: 0 if n.op != "call_module" else 1)
    assert torch.equal(sp(x), m(x))
    gm.flag = False                        # the split module reads gm's state: its guard holds
    with pytest.raises(symtrace.GuardError, match="flag"):
        sp(x)
