"""Argument normalisation and subgraph matching."""
import operator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

import symtrace
from symtrace.graph import Graph, GraphModule
from symtrace.passes.matcher import SubgraphMatcher
from symtrace.passes.normalize import bind_call, normalize_call

SETTINGS = settings(max_examples=50, deadline=None, derandomize=True)


def add_relu(a, b):
    return torch.relu(torch.add(a, b))


def module_of(graph: Graph) -> GraphModule:
    return GraphModule(nn.Module(), graph)


# --- normalize_call ---------------------------------------------------------------------------
class TestNormalize:
    def test_torch_builtin_fills_defaults(self):
        x, y = object(), object()
        assert normalize_call(("call_function", torch.add), (x, y), {}) == {"input": x, "other": y, "alpha": 1}
        b = bind_call(("call_function", torch.add), (x, y), {"alpha": 2})
        assert b.values["alpha"] == 2 and b.explicit == {"input", "other", "alpha"}

    def test_keyword_and_positional_agree(self):
        x = object()
        pos = normalize_call(("call_function", F.softmax), (x, 1), {})
        kw = normalize_call(("call_function", F.softmax), (x,), {"dim": 1})
        assert pos == kw and pos["dim"] == 1 and pos["dtype"] is None
        assert normalize_call(("call_function", torch.add), (), {"input": x, "other": 2.0}) == \
            normalize_call(("call_function", torch.add), (x, 2.0), {})

    def test_methods_bind_self_first(self):
        x = object()
        assert normalize_call(("call_method", "softmax"), (x, -1), {}) == {"self": x, "dim": -1, "dtype": None}
        assert normalize_call(("call_method", "view"), (x, 2, 3), {}) == {"self": x, "size": (2, 3)}
        assert normalize_call(("call_function", torch.Tensor.add), (x, x), {})["alpha"] == 1

    def test_operator_is_positional(self):
        x = object()
        assert normalize_call(("call_function", operator.mul), (x, 2), {}) == {"arg0": x, "arg1": 2}
        assert normalize_call(("call_function", operator.mul), (x,), {"b": 2}) is None

    def test_module_forward_signature(self):
        x = object()
        conv = nn.Conv2d(1, 1, 1)
        assert normalize_call(("call_module", "conv"), (x,), {}, module=conv) == {"input": x}
        assert normalize_call(("call_module", "conv"), (x,), {}) is None  # no module given
        assert normalize_call(("call_module", "m"), (), {"input": x}, module=nn.Linear) == {"input": x}

    def test_unbindable_returns_none(self):
        x = object()
        assert normalize_call(("call_function", torch.relu), (x, x, x), {}) is None
        assert normalize_call(("call_method", "no_such_method_xyz"), (x,), {}) is None
        assert normalize_call(("call_function", torch.add), (x, x), {"bogus": 1}) is None

    def test_node_uses_its_own_arguments(self):
        gm = symtrace.symbolic_trace(lambda x: torch.add(x, 1.0, alpha=3))
        node = gm.graph.find_nodes(op="call_function", target=torch.add)[0]
        assert normalize_call(node)["alpha"] == 3


# --- basic matching ---------------------------------------------------------------------------
def test_finds_instances_and_bindings():
    def f(x, y):
        return torch.relu(torch.add(x, y)) * torch.relu(torch.add(y, 1.0))

    gm = symtrace.symbolic_trace(f)
    matches = SubgraphMatcher(add_relu).match(gm)
    assert len(matches) == 2
    m0, m1 = matches
    assert [n.name for n in m0.nodes] == ["add", "relu"] and m0.anchor.name == "relu"
    assert m0.bindings["a"].name == "x" and m0.bindings["b"].name == "y"
    assert m1.bindings["b"] == 1.0 and m1.nodes_map["add"].name == "add_1"


def test_default_and_keyword_normalisation():
    g = Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    a1 = g.call_function(torch.add, (x, y), {"alpha": 1})
    r1 = g.call_function(torch.relu, (a1,))
    a2 = g.call_function(torch.add, (r1,), {"other": y})
    r2 = g.call_function(torch.relu, (a2,))
    a3 = g.call_function(torch.add, (r2, y), {"alpha": 2})  # not the default: no match
    r3 = g.call_function(torch.relu, (a3,))
    s1 = g.call_function(F.softmax, (r3, 1))                 # positional dim
    s2 = g.call_function(F.softmax, (s1,), {"dim": 0})       # another dim
    g.output(s2)
    gm = module_of(g)
    assert [m.anchor for m in SubgraphMatcher(add_relu).match(gm)] == [r1, r2]
    assert [m.anchor for m in SubgraphMatcher(lambda t: F.softmax(t, dim=1)).match(gm)] == [s1]
    assert [m.anchor for m in SubgraphMatcher(lambda t: F.softmax(t, 0)).match(gm)] == [s2]


def test_placeholders_bind_consistently():
    def f(x, y):
        return torch.add(x, x) + torch.add(x, y)

    gm = symtrace.symbolic_trace(f)
    same = SubgraphMatcher(lambda a: torch.add(a, a)).match(gm)
    assert [m.anchor.name for m in same] == ["add"]
    both = SubgraphMatcher(lambda a, b: torch.add(a, b)).match(gm)
    assert len(both) == 2  # distinct placeholders may bind the same node


class TestLiterals:
    def graph(self):
        def f(x):
            return (x * 2) + (x * 3) + (x * 2.0)
        return symtrace.symbolic_trace(f)

    def test_exact_compares_value_and_type(self):
        ms = SubgraphMatcher(lambda a: a * 2).match(self.graph())
        assert [m.anchor.name for m in ms] == ["mul"]

    def test_ignore(self):
        ms = SubgraphMatcher(lambda a: a * 2, literals="ignore").match(self.graph())
        assert len(ms) == 3 and all(m.literals == {} for m in ms)

    def test_capture_names_positional_literals(self):
        mt = SubgraphMatcher(lambda a: a * 2, literals="capture")
        assert mt.literal_names == ["lit0"]
        assert [m.literals for m in mt.match(self.graph())] == [{"lit0": 2}, {"lit0": 3}, {"lit0": 2.0}]

    def test_capture_names_by_parameter(self):
        gm = symtrace.symbolic_trace(lambda x: torch.clamp_min(x, 0.5).softmax(-1))
        ms = SubgraphMatcher(lambda a: torch.clamp_min(a, 0.0).softmax(0), literals="capture").match(gm)
        assert ms[0].literals == {"min": 0.5, "dim": -1}

    def test_ignored_literal_never_matches_a_node(self):
        gm = symtrace.symbolic_trace(lambda x, y: x * y)
        assert SubgraphMatcher(lambda a: a * 2, literals="ignore").match(gm) == []

    def test_unwritten_defaults_stay_exact(self):
        gm = symtrace.symbolic_trace(lambda x, y: torch.add(x, y, alpha=2))
        assert SubgraphMatcher(lambda a, b: torch.add(a, b), literals="ignore").match(gm) == []
        assert len(SubgraphMatcher(lambda a, b: torch.add(a, b, alpha=1), literals="ignore").match(gm)) == 1

    def test_bad_mode(self):
        with pytest.raises(ValueError, match="literals must be one of"):
            SubgraphMatcher(add_relu, literals="fuzzy")


class TestCommutative:
    def test_swapped_operands(self):
        gm = symtrace.symbolic_trace(lambda x, y: torch.relu(x) + y)
        pattern = lambda a, b: a + torch.relu(b)  # noqa: E731
        assert SubgraphMatcher(pattern).match(gm) == []
        (m,) = SubgraphMatcher(pattern, commutative=True).match(gm)
        assert m.bindings["a"].name == "y" and m.bindings["b"].name == "x"

    def test_methods_and_torch_functions(self):
        gm = symtrace.symbolic_trace(lambda x, y: torch.mul(torch.sigmoid(x), y) + y.add(x.exp()))
        assert len(SubgraphMatcher(lambda a, b: torch.mul(a, torch.sigmoid(b)), commutative=True).match(gm)) == 1
        method = lambda a, b: b.exp().add(a)  # noqa: E731  (the graph has y.add(x.exp()))
        assert SubgraphMatcher(method).match(gm) == []
        (m,) = SubgraphMatcher(method, commutative=True).match(gm)
        assert m.bindings["a"].name == "y" and m.nodes_map["exp"].name == "exp"

    def test_alpha_blocks_swapping(self):
        gm = symtrace.symbolic_trace(lambda x, y: torch.add(torch.relu(x), y, alpha=2))
        pattern = lambda a, b: torch.add(a, torch.relu(b), alpha=2)  # noqa: E731
        assert SubgraphMatcher(pattern, commutative=True).match(gm) == []

    def test_both_orders_are_tried_deeper(self):
        # the swap must be undone when the first order fails further down
        gm = symtrace.symbolic_trace(lambda x, y: torch.relu(x) * torch.sigmoid(y))
        pattern = lambda a, b: torch.sigmoid(a) * torch.relu(b)  # noqa: E731
        (m,) = SubgraphMatcher(pattern, commutative=True).match(gm)
        assert m.bindings == {"a": gm.graph.placeholders()[1], "b": gm.graph.placeholders()[0]}


class ConvRelu(nn.Module):
    def __init__(self, conv=None):
        super().__init__()
        self.conv = conv or nn.Conv2d(1, 1, 1)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.conv(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3)
        self.r1 = nn.ReLU()
        self.c2 = nn.Conv2d(8, 8, 5)
        self.r2 = nn.ReLU()
        self.c3 = nn.Conv1d(8, 8, 1)
        self.r3 = nn.ReLU()

    def forward(self, x):
        y = self.r2(self.c2(self.r1(self.c1(x))))
        return self.r3(self.c3(y.flatten(2)))


class TestModules:
    def test_match_by_type(self):
        gm = symtrace.symbolic_trace(Net())
        ms = SubgraphMatcher(ConvRelu()).match(gm)
        assert [(m.nodes_map["conv"].target, m.anchor.target) for m in ms] == [("c1", "r1"), ("c2", "r2")]

    def test_match_by_callable(self):
        gm = symtrace.symbolic_trace(Net())
        big_kernel = lambda pm, gm_mod: type(pm) is type(gm_mod) and getattr(gm_mod, "kernel_size", (5,))[0] == 5  # noqa: E731
        ms = SubgraphMatcher(ConvRelu(), module_match=big_kernel).match(gm)
        assert [m.anchor.target for m in ms] == ["r2"]

    def test_bare_graph_compares_targets(self):
        gm = symtrace.symbolic_trace(Net())
        assert SubgraphMatcher(ConvRelu()).match(gm.graph) == []


def test_alternatives_and_distinct_targets():
    def f(x):
        return F.relu(x) + torch.relu(x) + x.relu() + F.relu(x, inplace=True)

    gm = symtrace.symbolic_trace(f)
    assert len(SubgraphMatcher(lambda a: torch.relu(a)).match(gm)) == 1
    alt = SubgraphMatcher(lambda a: torch.relu(a), alternatives={torch.relu: [F.relu, "relu"]})
    names = [m.anchor.name for m in alt.match(gm)]
    assert names == ["relu", "relu_1", "relu_2"]  # not the in-place F.relu


def test_predicates_on_tensor_meta():
    def f(x, y):
        return torch.relu(torch.add(x, 1.0)) + torch.relu(torch.add(y, 1.0)).float()

    gm = symtrace.symbolic_trace(f, example_inputs=(torch.randn(2), torch.randn(2, dtype=torch.float64)))
    is_f32 = {"add": lambda n: n.tensor_meta.dtype == torch.float32}
    ms = SubgraphMatcher(add_relu, predicates=is_f32).match(gm)
    assert [m.bindings["a"].name for m in ms] == ["x"]
    on_input = SubgraphMatcher(add_relu, predicates={"a": lambda n: n.tensor_meta.dtype == torch.float64})
    assert [m.bindings["a"].name for m in on_input.match(gm)] == ["y"]
    with pytest.raises(ValueError, match="not nodes of the pattern"):
        SubgraphMatcher(add_relu, predicates={"nope": bool})


def test_predicate_errors_name_the_node():
    gm = symtrace.symbolic_trace(lambda x: torch.relu(torch.add(x, 1.0)))  # no tensor_meta
    mt = SubgraphMatcher(add_relu, predicates={"add": lambda n: n.tensor_meta.dtype == torch.float32})
    with pytest.raises(AttributeError) as info:
        mt.match(gm)
    assert "pattern node 'add'" in "\n".join(getattr(info.value, "__notes__", []))


class TestMultiOutput:
    @staticmethod
    def pattern(x):
        return torch.relu(x), torch.sigmoid(x)

    def test_outputs_found_through_users(self):
        def f(x, y):
            return torch.relu(x) * torch.sigmoid(x) + torch.sigmoid(y) + torch.relu(y).sum()

        gm = symtrace.symbolic_trace(f)
        ms = SubgraphMatcher(self.pattern).match(gm)
        assert [[n.name for n in m.outputs] for m in ms] == [["relu", "sigmoid"], ["relu_1", "sigmoid_1"]]
        # sigmoid(y) is read by `+` before relu(y) exists: that reader must follow the replacement
        assert [[n.name for n in m.moves] for m in ms] == [[], ["add"]]

    def test_would_be_cycle_prevents_match(self):
        # pattern a -> b with b also reading c; in the graph c depends on a (outside the pattern)
        def pattern(x, c):
            a = torch.relu(x)
            return a, torch.add(a, c)

        def cyclic(x):
            a = torch.relu(x)
            c = torch.sigmoid(a)
            return torch.add(a, c)

        def independent(x, y):
            a = torch.relu(x)
            c = torch.sigmoid(y)
            return torch.add(a, c)

        mt = SubgraphMatcher(pattern)
        assert mt.match(symtrace.symbolic_trace(cyclic)) == []
        (m,) = mt.match(symtrace.symbolic_trace(independent))
        assert m.bindings["c"].name == "sigmoid"

    def test_interleaved_reader_is_recorded_as_move(self):
        def pattern(x, c):
            a = torch.relu(x)
            return a, torch.add(a, c)

        def f(x, y):
            a = torch.relu(x)
            u = torch.cos(a)      # reads output a, before the match's last node: to move
            c = torch.sin(y)
            return torch.add(a, c) + u

        gm = symtrace.symbolic_trace(f)
        (m,) = SubgraphMatcher(pattern).match(gm)
        assert [n.name for n in m.moves] == ["cos"]


class TestStructure:
    def test_overlapping_candidates_are_greedy_in_graph_order(self):
        gm = symtrace.symbolic_trace(lambda x: x.relu().relu().relu().relu().relu())
        ms = SubgraphMatcher(lambda a: a.relu().relu()).match(gm)
        assert [[n.name for n in m.nodes] for m in ms] == [["relu", "relu_1"], ["relu_2", "relu_3"]]

    def test_leaked_internal_user_prevents_match(self):
        def f(x, y):
            a = torch.add(x, y)
            return torch.relu(a), a * 2

        assert SubgraphMatcher(add_relu).match(symtrace.symbolic_trace(f)) == []

    def test_input_may_not_be_a_node_of_the_match(self):
        def f(x):
            a = torch.add(x, x)
            return torch.add(a, a)

        gm = symtrace.symbolic_trace(f)
        # pattern add(add(p, p), q): q would bind to the inner add, which the match consumes
        ms = SubgraphMatcher(lambda p, q: torch.add(torch.add(p, p), q)).match(gm)
        assert ms == []

    def test_side_effect_inside_the_span_prevents_match(self):
        def f(x, y):
            a = torch.add(x, y)
            x.mul_(2)  # the replacement would compute add(x, y) after this write
            return torch.relu(a)

        def g(x, y):
            a = torch.add(x, y)
            b = x.mul(2)  # pure: passing it is fine
            return torch.relu(a) + b

        assert SubgraphMatcher(add_relu).match(symtrace.symbolic_trace(f)) == []
        assert len(SubgraphMatcher(add_relu).match(symtrace.symbolic_trace(g))) == 1

    def test_data_guards_in_the_span_do_not_block(self):
        def f(x, y):
            a = torch.add(x, y)
            if x.sum() > -1e9:  # a data guard between add and relu
                return torch.relu(a)
            return a

        gm = symtrace.symbolic_trace(f, example_inputs=(torch.randn(3), torch.randn(3)))
        assert len(SubgraphMatcher(add_relu).match(gm)) == 1

    def test_candidates_come_from_the_index(self, monkeypatch):
        g = Graph()
        x = g.placeholder("x")
        h = x
        for _ in range(500):
            h = g.call_function(torch.sigmoid, (h,))
        r = g.call_function(torch.relu, (g.call_function(torch.add, (h, x)),))
        g.output(r)
        from symtrace.passes import matcher as mod
        seen = []
        orig = mod._Run._anchor_candidates
        monkeypatch.setattr(mod._Run, "_anchor_candidates", lambda self: seen.extend(orig(self)) or list(seen))
        (m,) = SubgraphMatcher(add_relu).match(module_of(g))
        assert m.anchor is r and seen == [r]  # one candidate, not the 500 other nodes

    def test_filters(self):
        gm = symtrace.symbolic_trace(lambda x, y: torch.relu(torch.add(x, y)) + torch.relu(torch.add(y, x)))
        ms = SubgraphMatcher(add_relu, filters=[lambda m: m.bindings["a"].name == "y"]).match(gm)
        assert [m.anchor.name for m in ms] == ["relu_1"]

    def test_bad_patterns(self):
        with pytest.raises(ValueError, match="computed by the pattern"):
            SubgraphMatcher(lambda a: a)
        with pytest.raises(TypeError, match="pattern must be"):
            SubgraphMatcher(42)


# --- property: the matcher finds exactly the planted instances ------------------------------
OPS = ("planted", "add_only", "relu_only", "leaky", "alpha2", "op_add", "sigmoid")


def build_random(ops, picks, wide):
    """A graph of random blocks; returns it and the (add, relu) pairs that must match."""
    g = Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    values = [x, y]
    planted = []
    outs = []
    for op, pick in zip(ops, picks):
        src = values[pick % len(values)] if wide else values[-1]
        other = values[(pick // 7) % len(values)]
        if op == "planted":
            a = g.call_function(torch.add, (src, other))
            r = g.call_function(torch.relu, (a,))
            planted.append((a, r))
            values.append(r)
        elif op == "add_only":  # values never hold a bare torch.add: no accidental instances
            values.append(g.call_function(torch.neg, (g.call_function(torch.add, (src, other)),)))
        elif op == "relu_only":
            values.append(g.call_function(torch.relu, (src,)))
        elif op == "leaky":  # add read by the relu and by something else
            a = g.call_function(torch.add, (src, other))
            values.append(g.call_function(torch.relu, (a,)))
            outs.append(g.call_function(torch.neg, (a,)))
        elif op == "alpha2":
            a = g.call_function(torch.add, (src, other), {"alpha": 2})
            values.append(g.call_function(torch.relu, (a,)))
        elif op == "op_add":
            values.append(g.call_function(torch.relu, (g.call_function(operator.add, (src, other)),)))
        else:
            values.append(g.call_function(torch.sigmoid, (src,)))
    g.output(tuple(values[2:] + outs) if wide else (values[-1], *outs))
    return module_of(g), planted


EXTRA_OPS = ("self_add", "shared_relu", "add_lit", "alpha1_kw", "relu_inplace")


def build_mixed(ops, picks):
    """A random wide graph of many small shapes that the patterns below partly match."""
    g = Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    values = [x, y]
    for op, pick in zip(ops, picks):
        src, other = values[pick % len(values)], values[(pick // 7) % len(values)]
        if op == "self_add":
            v = g.call_function(torch.relu, (g.call_function(torch.add, (src, src)),))
        elif op == "shared_relu":
            r = g.call_function(torch.relu, (src,))
            v = g.call_function(torch.add, (r, r))
        elif op == "add_lit":
            v = g.call_function(torch.relu, (g.call_function(torch.add, (src, 1.0 if pick % 2 else 2)),))
        elif op == "alpha1_kw":  # written differently: the compiled check defers to the search
            v = g.call_function(torch.relu, (g.call_function(torch.add, (src, other), {"alpha": 1}),))
        elif op == "relu_inplace":
            v = g.call_function(torch.relu_, (g.call_function(torch.add, (src, other)),))
        else:
            v = g.call_function(torch.relu, (g.call_function(torch.add, (src, other)),))
        values.append(v)
    g.output(tuple(v for v in values[2:] if not v.users))
    return module_of(g)


MIXED_PATTERNS = [
    add_relu,
    lambda a: torch.relu(torch.add(a, a)),
    lambda a: (lambda r: torch.add(r, r))(torch.relu(a)),  # an internal node used twice
    lambda a: torch.relu(torch.add(a, 1.0)),
    lambda a, b, c: torch.relu(torch.add(torch.relu(torch.add(a, b)), c)),
]


@SETTINGS
@given(ops=st.lists(st.sampled_from(EXTRA_OPS + ("plain",)), min_size=1, max_size=30),
       picks=st.lists(st.integers(0, 10_000), min_size=30, max_size=30), which=st.integers(0, 4))
def test_compiled_check_agrees_with_the_search(ops, picks, which):
    gm = build_mixed(ops, picks)
    fast = SubgraphMatcher(MIXED_PATTERNS[which])
    slow = SubgraphMatcher(MIXED_PATTERNS[which])
    assert fast._fast is not None
    slow._fast = None
    key = lambda ms: [(m.anchor, sorted(m.nodes_map.items()), sorted(m.bindings.items(), key=str), m.nodes,  # noqa: E731
                       m.outputs, m.literals, tuple(m.moves), m.insert_point) for m in ms]
    assert key(fast.match(gm)) == key(slow.match(gm))


def test_compiled_matches_are_kept_packed_until_read_and_edits_stick():
    from symtrace.passes.rewrite import apply_replacements

    g = Graph()
    x, y, z = g.placeholder("x"), g.placeholder("y"), g.placeholder("z")
    g.output(g.call_function(torch.relu, (g.call_function(torch.add, (x, y)),)))
    gm = GraphModule(nn.Module(), g)
    mt = SubgraphMatcher(add_relu)
    (m,) = mt.match(gm)
    assert m._packed is not None  # nothing made yet
    assert m.insert_point is m.anchor and m._packed is not None
    assert m.bindings == {"a": x, "b": y} and m._packed is None  # made on first read
    m.bindings["b"] = z  # an edit before splicing is what the splice uses
    apply_replacements(gm, mt, [m], lambda a, b: torch.clamp_min(torch.add(a, b), 0.0))
    gm.graph.lint()
    (add,) = gm.graph.find_nodes(op="call_function", target=torch.add)
    assert add.args == (x, z)
    t = torch.randn(3)
    assert torch.equal(gm(t, t, 2 * t), torch.clamp_min(t + 2 * t, 0.0))


@SETTINGS
@given(ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=40),
       picks=st.lists(st.integers(0, 10_000), min_size=40, max_size=40), wide=st.booleans())
def test_finds_exactly_the_planted_instances(ops, picks, wide):
    gm, planted = build_random(ops, picks, wide)
    found = [(m.nodes_map["add"], m.anchor) for m in SubgraphMatcher(add_relu).match(gm)]
    assert found == planted


# --- core bugs found while writing the matcher ----------------------------------------------
def test_find_nodes_by_op_sees_unhashable_targets():
    class Unhashable:
        __hash__ = None

        def __call__(self, x):
            return x

    g = Graph()
    x = g.placeholder("x")
    n = g.call_function(Unhashable(), (x,))
    g.output(n)
    assert g.find_nodes(op="call_function") == [n]


# --- greedy order when the index is not in graph order -------------------------------------------------
def relu_relu(a):
    return torch.relu(torch.relu(a))


def test_candidates_are_taken_in_graph_order_after_a_retarget():
    g = Graph()
    x = g.placeholder("x")
    r1 = g.call_function(torch.relu, (x,), name="r1")
    r2 = g.call_function(torch.neg, (r1,), name="r2")
    r3 = g.call_function(torch.relu, (r2,), name="r3")
    g.output(r3)
    r2.target = torch.relu  # listed after r3 by the (op, target) index, but comes before it
    matches = SubgraphMatcher(relu_relu).match(g)
    # greedy in graph order: r2(r1) is found first, which leaves r3(r2) overlapping
    assert [[n.name for n in m.nodes] for m in matches] == [["r1", "r2"]]


def test_fast_path_defers_non_contiguous_matches_to_the_search():
    g = Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    a = g.call_function(torch.add, (x, y), name="a")
    between = g.call_function(torch.neg, (x,), name="between")
    r = g.call_function(torch.relu, (a,), name="r")
    g.output((r, between))
    matches = SubgraphMatcher(add_relu).match(g)
    assert [[n.name for n in m.nodes] for m in matches] == [["a", "r"]]
    # an in-place write in between forbids moving the add down to the relu
    g2 = Graph()
    x, y = g2.placeholder("x"), g2.placeholder("y")
    a = g2.call_function(torch.add, (x, y))
    g2.call_method("add_", (x, 1))
    g2.output(g2.call_function(torch.relu, (a,)))
    assert SubgraphMatcher(add_relu).match(g2) == []


def test_generated_matcher_code_shows_its_lines_in_tracebacks():
    import traceback

    def failing(match):
        raise ValueError("filter failed")

    g = Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    g.output(g.call_function(torch.relu, (g.call_function(torch.add, (x, y)),)))
    with pytest.raises(ValueError, match="filter failed") as ei:
        SubgraphMatcher(add_relu).match(g, filters=[failing])
    frames = [f for f in traceback.extract_tb(ei.value.__traceback__) if f.filename.startswith("<symtrace-pattern-")]
    assert frames and "filters" in frames[0].line
