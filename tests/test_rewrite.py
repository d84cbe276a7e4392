"""replace_pattern: splicing, rewiring, meta inheritance, numerics against eager."""
import operator
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

import symtrace
from symtrace.graph import Graph, GraphModule
from symtrace.passes.matcher import SubgraphMatcher
from symtrace.passes.rewrite import per_match, replace_pattern

SETTINGS = settings(max_examples=50, deadline=None, derandomize=True)


def histogram(gm) -> Counter:
    """Op histogram of the computing nodes: (op, target name) -> count."""
    def name(n):
        if n.op == "call_module":
            return type(gm.get_submodule(n.target)).__name__
        return n.target if isinstance(n.target, str) else n.target.__name__
    return Counter((n.op, name(n)) for n in gm.graph.nodes if n.op not in ("placeholder", "output"))


def assert_close(actual, expected):
    """Like torch.testing.assert_close, without its slow first import."""
    if isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_close(a, e)
        return
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.allclose(actual, expected, rtol=1e-5, atol=1e-6, equal_nan=True), (actual, expected)


def add_relu(a, b):
    return torch.relu(torch.add(a, b))


def add_clamp(a, b):
    return torch.clamp_min(torch.add(a, b), 0.0)


class AddRelu(nn.Module):
    def forward(self, x, y):
        h = torch.relu(torch.add(x, y))
        return torch.relu(torch.add(h, y)) * 2


class ConvRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 1)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.conv(x))


class ConvClamp(nn.Module):
    """Replacement: ``self.conv`` stands for the conv the pattern matched."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 1)

    def forward(self, x):
        return torch.clamp_min(self.conv(x), 0.0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3)
        self.ra = nn.ReLU()
        self.b = nn.Conv2d(4, 4, 3)
        self.rb = nn.ReLU()

    def forward(self, x):
        return self.rb(self.b(self.ra(self.a(x)))).mean()


class Softmaxes(nn.Module):
    def forward(self, x):
        return F.softmax(x, 1) + x.softmax(dim=1) + F.softmax(x * 2, dim=0)


def mul_by_lit(x):  # captured literal passed to the replacement by name
    return x * 3.0


class MulAdd(nn.Module):
    def forward(self, x):
        return (x * 3.0 + 1) * 5.0


TRIPLES = [
    # module, inputs, pattern, replacement, options, expected histogram after the rewrite
    (AddRelu(), (torch.randn(3, 4), torch.randn(3, 4)), add_relu, add_clamp, {},
     {("call_function", "add"): 2, ("call_function", "clamp_min"): 2, ("call_function", "mul"): 1}),
    (Net(), (torch.randn(1, 3, 9, 9),), ConvRelu(), ConvClamp(), {},
     {("call_module", "Conv2d"): 2, ("call_function", "clamp_min"): 2, ("call_method", "mean"): 1}),
    (Softmaxes(), (torch.randn(3, 4),), lambda t: F.softmax(t, dim=1), lambda t: torch.exp(t) / torch.exp(t).sum(1, keepdim=True), {},
     {("call_function", "softmax"): 1, ("call_method", "softmax"): 1, ("call_function", "exp"): 2,
      ("call_method", "sum"): 1, ("call_function", "truediv"): 1, ("call_function", "add"): 2,
      ("call_function", "mul"): 1}),
    (Softmaxes(), (torch.randn(3, 4),), lambda t: F.softmax(t, dim=1), lambda t: torch.softmax(t, 1),
     {"alternatives": {F.softmax: ["softmax"]}},
     {("call_function", "softmax"): 3, ("call_function", "add"): 2, ("call_function", "mul"): 1}),
    (MulAdd(), (torch.randn(5),), mul_by_lit, lambda x, lit0: x * (lit0 - 1.0) + x, {"literals": "capture"},
     {("call_function", "mul"): 2, ("call_function", "sub"): 2, ("call_function", "add"): 3}),
]


@pytest.mark.parametrize("module, inputs, pattern, replacement, options, expected", TRIPLES,
                         ids=["add_relu", "conv_relu_modules", "softmax_kw_vs_positional",
                              "softmax_alternatives", "captured_literal_argument"])
def test_rewrite_triples(module, inputs, pattern, replacement, options, expected):
    gm = symtrace.symbolic_trace(module)
    done = replace_pattern(gm, pattern, replacement, **options)
    assert done
    assert dict(histogram(gm)) == expected
    assert_close(gm(*inputs), module(*inputs))
    gm.graph.lint()


def test_replacement_reuses_matched_modules():
    net = Net()
    gm = symtrace.symbolic_trace(net)
    replace_pattern(gm, ConvRelu(), ConvClamp())
    convs = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert convs == ["a", "b"] and gm.a is net.a
    gm.graph.lint()


def test_replacement_constants_are_installed():
    bias = torch.tensor([1.0, 2.0, 3.0])
    gm = symtrace.symbolic_trace(lambda x: torch.relu(x) * 2)
    replace_pattern(gm, lambda a: torch.relu(a), lambda a: torch.relu(a + bias))
    x = torch.randn(3)
    assert_close(gm(x), torch.relu(x + bias) * 2)
    gm.graph.lint()


def test_meta_inheritance():
    def f(x, y):
        h = torch.add(x, y)
        return torch.relu(h)  # the line the replacement output must point at

    gm = symtrace.symbolic_trace(f)
    add_line = f.__code__.co_firstlineno + 1
    relu_line = f.__code__.co_firstlineno + 2
    (r,) = replace_pattern(gm, add_relu, lambda a, b: torch.clamp_min(torch.sub(torch.add(a, b), 0.0), 0.0))
    by_name = {n.target.__name__: n for n in r.new_nodes}
    assert by_name["clamp_min"].meta["source"].lineno == relu_line        # output: the output's meta
    assert by_name["add"].meta["source"].lineno == add_line               # same target: that node's
    assert by_name["sub"].meta["source"].lineno == relu_line              # else: the anchor's
    gm.graph.lint()


def test_meta_keys_and_tensor_meta():
    gm = symtrace.symbolic_trace(add_relu, example_inputs=(torch.randn(2, 3), torch.randn(2, 3)))
    relu = gm.graph.find_nodes(op="call_function", target=torch.relu)[0]
    relu.meta["custom"] = "keep me"
    (r,) = replace_pattern(gm, add_relu, lambda a, b: torch.clamp_min(torch.add(a, b), 0.0).neg().neg())
    last = r.new_nodes[-1]
    assert last.meta["custom"] == "keep me" and last.tensor_meta.shape == (2, 3)
    clamp = next(n for n in r.new_nodes if n.target is torch.clamp_min)
    assert "tensor_meta" not in clamp.meta and clamp.meta["custom"] == "keep me"
    gm.graph.lint()


def test_multi_output_pattern_and_replacement():
    def pattern(x):
        return torch.relu(x), torch.sigmoid(x)

    def replacement(x):
        return torch.clamp_min(x, 0.0), torch.special.expit(x)

    def f(x, y):
        return torch.relu(x) * torch.sigmoid(x) + torch.sigmoid(y) + torch.relu(y).sum()

    gm = symtrace.symbolic_trace(f)
    x, y = torch.randn(4), torch.randn(4)
    done = replace_pattern(gm, pattern, replacement)
    assert len(done) == 2
    assert histogram(gm)[("call_function", "relu")] == 0
    assert_close(gm(x, y), f(x, y))
    gm.graph.lint()


def test_interleaved_reader_is_moved_after_the_replacement():
    def pattern(x, c):
        a = torch.relu(x)
        return a, torch.add(a, c)

    def replacement(x, c):
        a = torch.clamp_min(x, 0.0)
        return a, a + c

    def f(x, y):
        a = torch.relu(x)
        u = torch.cos(a)
        c = torch.sin(y)
        return torch.add(a, c) + u

    gm = symtrace.symbolic_trace(f)
    (r,) = replace_pattern(gm, pattern, replacement)
    assert [n.name for n in r.match.moves] == ["cos"]
    gm.graph.lint()
    x, y = torch.randn(5), torch.randn(5)
    assert_close(gm(x, y), f(x, y))


def test_chained_matches_use_earlier_replacements():
    gm = symtrace.symbolic_trace(lambda x, y: torch.relu(torch.add(torch.relu(torch.add(x, y)), y)))
    done = replace_pattern(gm, add_relu, add_clamp)
    assert len(done) == 2
    assert done[1].match.bindings["a"] is done[0].new_nodes[-1]  # bound to the replacement
    x, y = torch.randn(3), torch.randn(3)
    assert_close(gm(x, y), torch.relu(torch.relu(x + y) + y))
    gm.graph.lint()


def test_internal_nodes_recreated_with_the_same_op_are_reused():
    gm = symtrace.symbolic_trace(lambda x, y: torch.relu(torch.add(x, y, alpha=1)) * 2)
    add = gm.graph.find_nodes(op="call_function", target=torch.add)[0]
    relu = gm.graph.find_nodes(op="call_function", target=torch.relu)[0]
    (r,) = replace_pattern(gm, add_relu, lambda a, b: torch.clamp_min(torch.add(b, a), 0.0))
    assert r.new_nodes[0] is add and add.args == (gm.graph.placeholders()[1], gm.graph.placeholders()[0])
    assert add.kwargs == {} and [n.name for n in gm.graph.nodes] == ["x", "y", "add", "clamp_min", "mul", "output"]
    assert r.new_nodes[1] is relu and relu.target is torch.clamp_min  # the output, updated in place
    x, y = torch.randn(3), torch.randn(3)
    assert_close(gm(x, y), torch.relu(x + y) * 2)
    gm.graph.lint()


def test_the_output_is_updated_in_place_and_keeps_its_users():
    gm = symtrace.symbolic_trace(lambda x, y: torch.relu(torch.add(x, y)) * 2 + torch.relu(torch.add(x, y)).sum())
    relu = gm.graph.find_nodes(op="call_function", target=torch.relu)[0]
    users, meta, source = list(relu.users), relu.meta, relu.meta["source"]
    done = replace_pattern(gm, add_relu, add_clamp)
    assert len(done) == 2 and done[0].new_nodes[-1] is relu is done[0].anchor
    # same object, same users and meta: only its target, arguments and name changed
    assert relu.target is torch.clamp_min and relu.args[1] == 0.0 and relu.name == "clamp_min"
    assert list(relu.users) == users and relu.meta is meta and meta["source"] == source
    assert [n.name for n in gm.graph.nodes if n.op.startswith("call_")] == \
        ["add", "clamp_min", "mul", "add_1", "clamp_min_1", "sum_1", "add_2"]
    # the general splicer (keyword arguments are not on the compiled path) does the same
    gm3 = symtrace.symbolic_trace(lambda x, y: torch.relu(torch.add(x, y)) * 2)
    relu3 = gm3.graph.find_nodes(op="call_function", target=torch.relu)[0]
    (r3,) = replace_pattern(gm3, add_relu, lambda a, b: torch.clamp(torch.add(a, b), min=0.0))
    assert r3.new_nodes[-1] is relu3 and relu3.target is torch.clamp and relu3.kwargs == {"min": 0.0}
    assert relu3.name == "clamp" and [u.name for u in relu3.users] == ["mul"]
    # the same target with other arguments keeps the node's name
    gm2 = symtrace.symbolic_trace(lambda x, y: torch.relu(torch.add(x, y)))
    replace_pattern(gm2, add_relu, lambda a, b: torch.relu(torch.sub(a, b)))
    assert [n.name for n in gm2.graph.nodes] == ["x", "y", "sub", "relu", "output"]
    x, y = torch.randn(3), torch.randn(3)
    assert_close(gm(x, y), torch.relu(x + y) * 2 + torch.relu(x + y).sum())
    assert_close(gm2(x, y), torch.relu(x - y))
    assert_close(gm3(x, y), torch.relu(x + y) * 2)
    gm3.graph.lint()
    gm.graph.lint()
    gm2.graph.lint()


def test_an_output_of_another_opcode_is_a_new_node():
    gm = symtrace.symbolic_trace(lambda x, y: torch.relu(torch.add(x, y)) * 2)
    relu = gm.graph.find_nodes(op="call_function", target=torch.relu)[0]
    (r,) = replace_pattern(gm, add_relu, lambda a, b: torch.add(a, b).clamp_min(0.0))
    new = r.new_nodes[-1]
    assert new is not relu and new.op == "call_method" and relu not in list(gm.graph.nodes)
    assert new.meta["source"] == relu.meta["source"] and [u.name for u in new.users] == ["mul"]
    x, y = torch.randn(3), torch.randn(3)
    assert_close(gm(x, y), torch.relu(x + y) * 2)
    gm.graph.lint()


def test_identity_and_constant_replacements():
    gm = symtrace.symbolic_trace(lambda x: (x * 1) + (x * 0).sum())
    replace_pattern(gm, lambda a: a * 1, lambda a: a)
    assert histogram(gm)[("call_function", "mul")] == 1
    x = torch.randn(3)
    assert_close(gm(x), x)
    gm.graph.lint()


def test_per_match_replacement_and_skip():
    gm = symtrace.symbolic_trace(lambda x: x * 2 + x * 3 + x * 4)

    def choose(m):
        k = m.literals["lit0"]
        if k == 3:
            return None  # leave this one
        return lambda a: a + a if k == 2 else a * 4.0

    done = replace_pattern(gm, lambda a: a * 2, per_match(choose), literals="capture")
    assert len(done) == 2
    x = torch.randn(3)
    assert_close(gm(x), x * 2 + x * 3 + x * 4)
    assert [n.args[1] for n in gm.graph.nodes if n.target is operator.mul] == [3, 4.0]
    gm.graph.lint()


def test_filters_choose_matches():
    gm = symtrace.symbolic_trace(lambda x, y: torch.relu(torch.add(x, y)) + torch.relu(torch.add(y, x)))
    done = replace_pattern(gm, add_relu, add_clamp, filters=[lambda m: m.bindings["a"].name == "y"])
    assert [r.match.bindings["a"].name for r in done] == ["y"]
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == \
        [torch.add, torch.relu, torch.add, torch.clamp_min, operator.add]
    gm.graph.lint()


def test_no_recompile_per_match_and_traced_once(monkeypatch):
    gm = symtrace.symbolic_trace(lambda x: x.relu().relu().relu().relu().relu().relu())
    x = torch.randn(4)
    gm(x)  # compiled once
    calls = {"recompile": 0, "trace": 0}
    orig_recompile, orig_trace = GraphModule.recompile, symtrace.trace.symbolic_trace

    def recompile(self):
        calls["recompile"] += 1
        return orig_recompile(self)

    def trace(*a, **k):
        calls["trace"] += 1
        return orig_trace(*a, **k)

    monkeypatch.setattr(GraphModule, "recompile", recompile)
    monkeypatch.setattr(symtrace.trace, "symbolic_trace", trace)
    pattern = lambda a: a.relu().relu()  # noqa: E731  (fresh functions: nothing cached yet)
    replacement = lambda a: a.relu()  # noqa: E731
    done = replace_pattern(gm, pattern, per_match(lambda m: replacement))
    assert len(done) == 3
    assert calls == {"recompile": 0, "trace": 2}  # pattern and replacement, once each
    assert_close(gm(x), x.relu())
    assert calls["recompile"] == 1
    gm.graph.lint()


def test_fresh_closures_are_traced_once_unless_their_values_differ(monkeypatch):
    calls = []
    orig = symtrace.trace.symbolic_trace
    monkeypatch.setattr(symtrace.trace, "symbolic_trace", lambda *a, **k: calls.append(a[0]) or orig(*a, **k))

    def scale(k):
        return lambda a: a * k

    gm = symtrace.symbolic_trace(lambda x: x.relu() + x.sigmoid().relu() + x.exp().relu())
    x = torch.randn(4)
    expected = x * 2 + x.sigmoid() * 2 + x.exp() * 2
    done = replace_pattern(gm, lambda a: a.relu(), per_match(lambda m: scale(2)))
    assert len(done) == 3 and len(calls) == 2  # pattern + one replacement for three closures
    assert_close(gm(x), expected)
    from symtrace.passes.matcher import load_pattern
    g_int, _ = load_pattern(scale(1))
    g_float, _ = load_pattern(scale(1.0))
    assert g_int is not g_float  # 1 and 1.0 trace to different constants
    gm.graph.lint()


def test_errors_are_explained():
    gm = symtrace.symbolic_trace(lambda x: torch.relu(x))
    with pytest.raises(ValueError, match="returns 2 value"):
        replace_pattern(gm, lambda a: torch.relu(a), lambda a: (a, a))
    with pytest.raises(ValueError, match="neither a pattern input .* nor a captured literal"):
        replace_pattern(gm, lambda a: torch.relu(a), lambda a, k: a + k)
    with pytest.raises(TypeError, match="expects a GraphModule"):
        replace_pattern(gm.graph, lambda a: torch.relu(a), lambda a: a)


def test_accepts_a_ready_matcher():
    gm = symtrace.symbolic_trace(lambda x, y: torch.relu(y + torch.relu(x)))
    mt = SubgraphMatcher(lambda a, b: torch.relu(a + torch.relu(b)), commutative=True)
    (r,) = replace_pattern(gm, mt, lambda a, b: torch.clamp_min(a + torch.clamp_min(b, 0.0), 0.0))
    x, y = torch.randn(3), torch.randn(3)
    assert_close(gm(x, y), torch.relu(y + torch.relu(x)))
    gm.graph.lint()


# --- property: rewriting relu(add(a, b)) never changes numerics ------------------------------
@SETTINGS
@given(kinds=st.lists(st.sampled_from(["planted", "leaky", "mul", "sigmoid", "alpha2"]), min_size=1, max_size=25),
       picks=st.lists(st.integers(0, 1000), min_size=25, max_size=25), wide=st.booleans())
def test_rewrite_keeps_numerics(kinds, picks, wide):
    g = Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    values, extra = [x, y], []
    for kind, pick in zip(kinds, picks):
        src = values[pick % len(values)] if wide else values[-1]
        other = values[(pick // 3) % len(values)]
        if kind in ("planted", "leaky", "alpha2"):
            a = g.call_function(torch.add, (src, other), {"alpha": 2} if kind == "alpha2" else None)
            values.append(g.call_function(torch.relu, (a,)))
            if kind == "leaky":
                extra.append(g.call_function(torch.neg, (a,)))
        elif kind == "mul":
            values.append(g.call_function(operator.mul, (src, 0.5)))
        else:
            values.append(g.call_function(torch.sigmoid, (src,)))
    g.output(tuple(values[2:] + extra))
    gm = GraphModule(nn.Module(), g)
    args = (torch.randn(3, 4), torch.randn(3, 4))
    before = gm(*args)
    done = replace_pattern(gm, add_relu, add_clamp)
    assert len(done) == kinds.count("planted")
    gm.graph.lint()
    after = gm(*args)
    assert len(after) == len(before)
    for a, b in zip(after, before):
        assert_close(a, b)


def test_rewrite_leaves_the_insertion_point_alone():
    g = Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    a = g.call_function(torch.add, (x, y))
    r = g.call_function(torch.relu, (a,))
    out = g.output(r)
    gm = GraphModule(nn.Module(), g)
    with g.inserting_before(out):
        replace_pattern(gm, add_relu, add_clamp)
        extra = g.call_function(torch.neg, (x,))
    assert extra.next is out
    g.lint()


def test_replace_input_with_keeps_users_in_sync():
    g = Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    n = g.call_function(operator.mul, (a, a, b))
    k = g.call_function(torch.add, (a,), {"other": b})
    nested = g.call_function(torch.cat, ([a, b],))
    g.output((n, k, nested))
    n.replace_input_with(a, b)  # flat args, the new input already read
    assert n.args == (b, b, b) and n not in a.users and list(n.all_input_nodes) == [b]
    k.replace_input_with(b, a)  # kwargs
    assert k.kwargs == {"other": a} and k not in b.users and k in a.users
    nested.replace_input_with(a, b)  # nested args
    assert nested.args == ([b, b],) and nested not in a.users and nested in b.users
    n.replace_input_with(a, b)  # not an input: nothing changes
    assert n.args == (b, b, b)
    g.lint()
    for node in (nested, k, n):
        node.replace_all_uses_with(a) if node.users else None
    g.output_node().args = (a,)
    for node in (nested, k, n):
        g.erase_node(node)
    assert list(b.users) == [] and list(a.users) == [g.output_node()]
    assert g.find_nodes(op="call_function", target=operator.mul) == []
    g.lint()


def test_erase_and_create_keep_the_index_for_unhashable_targets():
    class Unhashable:
        __hash__ = None

        def __call__(self, v):
            return v

    g = Graph()
    x = g.placeholder("x")
    fn = Unhashable()
    n = g.call_function(fn, (x,))
    g.output(n)
    assert g.find_nodes(op="call_function", target=fn) == [n]
    n.replace_all_uses_with(x)
    g.erase_node(n)
    assert g.find_nodes(op="call_function", target=fn) == [] and g.find_nodes(op="call_function") == []
    g.lint()


def _wide_module(blocks):
    g = Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    outs = []
    for _ in range(blocks):
        a = g.call_function(torch.add, (x, y))
        r = g.call_function(torch.relu, (a,))
        outs.append(g.call_function(operator.mul, (r, 2.0)))
    g.output(tuple(outs))
    return GraphModule(nn.Module(), g)


def test_compiled_splice_matches_general_splice():
    """The straight-line splice of simple templates gives the same graph as the general loop."""
    from symtrace.passes import rewrite as rw

    def pat(a, b):
        return torch.relu(torch.add(a, b))

    def rep(a, b):
        return torch.clamp_min(torch.add(a, b), 0.0)

    fast, slow = _wide_module(4), _wide_module(4)
    for n in fast.graph.nodes:
        n.meta["module_path"] = "blk"
    for n in slow.graph.nodes:
        n.meta["module_path"] = "blk"
    assert rw._Splicer(fast, SubgraphMatcher(pat)).template(rep).fast is not None
    done = replace_pattern(fast, pat, rep)
    compile_splice = rw._compile_splice
    rw._compile_splice = lambda t, matcher: None
    try:
        matcher = SubgraphMatcher(pat)  # (a ready matcher: its templates are made per call)
        assert rw._Splicer(slow, matcher).template(rep).fast is None
        replace_pattern(slow, matcher, rep)
    finally:
        rw._compile_splice = compile_splice
    fast.graph.lint()
    assert [n.format_node() for n in fast.graph.nodes] == [n.format_node() for n in slow.graph.nodes]
    assert all(n.meta.get("module_path") == "blk" for n in fast.graph.nodes if n.op == "call_function")
    assert [[m.name for m in r.new_nodes] for r in done][0] == ["add", "clamp_min"]
    x, y = torch.randn(3), torch.randn(3)
    for a, b in zip(fast(x, y), _wide_module(4)(x, y)):
        assert torch.equal(a, b)


def test_flat_node_creation_checks_graph_and_keeps_users():
    g, other = Graph(), Graph()
    x = g.placeholder("x")
    y = other.placeholder("y")
    with pytest.raises(ValueError, match="belongs to another graph"):
        g._create_flat("call_function", torch.relu, (y,), "relu", {})
    n = g._create_flat("call_function", torch.add, (x, x, 1.0), "add", {"k": 1})
    g.output(n)
    g.lint()
    assert list(x.users) == [n] and n.meta == {"k": 1}
    assert g.find_nodes(op="call_function", target=torch.add) == [n]


def test_repeated_rewrites_reuse_the_prepared_pattern_until_it_is_edited():
    from symtrace.passes import rewrite as rw

    pattern_gm = symtrace.symbolic_trace(add_relu)
    replacement_gm = symtrace.symbolic_trace(lambda a, b: torch.clamp_min(torch.add(a, b), 0.0))
    first, second, third = _wide_module(3), _wide_module(3), _wide_module(3)
    assert len(replace_pattern(first, pattern_gm, replacement_gm)) == 3
    key = (pattern_gm.graph, "exact", False)
    matcher, templates = rw._PREPARED[key]
    assert replacement_gm.graph in templates
    assert len(replace_pattern(second, pattern_gm, replacement_gm)) == 3
    assert rw._PREPARED[key][0] is matcher  # made once
    # editing the replacement drops what was prepared: the next rewrite uses the new graph
    (clamp,) = replacement_gm.graph.find_nodes(op="call_function", target=torch.clamp_min)
    clamp.target = torch.clamp_max
    assert key not in rw._PREPARED
    assert len(replace_pattern(third, pattern_gm, replacement_gm)) == 3
    assert histogram(third)[("call_function", "clamp_max")] == 3
    # editing the pattern: relu no longer matches it
    (relu,) = pattern_gm.graph.find_nodes(op="call_function", target=torch.relu)
    relu.target = torch.sigmoid
    assert key not in rw._PREPARED
    assert replace_pattern(_wide_module(3), pattern_gm, replacement_gm) == []


def test_replacement_attributes_are_installed_in_each_module_rewritten():
    class Rep(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("floor", torch.tensor(0.5))

        def forward(self, a, b):
            return torch.maximum(torch.add(a, b), self.floor)

    rep = Rep()
    x, y = torch.randn(5), torch.randn(5)
    for _ in range(2):  # the second module reuses the prepared template, not the first one's names
        gm = _wide_module(2)
        assert len(replace_pattern(gm, add_relu, rep)) == 2
        gm.graph.lint()
        (target,) = {n.target for n in gm.graph.find_nodes(op="get_attr")}  # installed once
        assert torch.equal(gm.get_buffer(target), torch.tensor(0.5))
        for out in gm(x, y):
            assert torch.equal(out, torch.maximum(x + y, torch.tensor(0.5)) * 2.0)


def test_compiled_splice_reads_matches_of_the_general_search():
    """A matcher without a compiled search (commutative) still gets the straight-line splice:
    it reads the search's matches in the same layout (the anchor first)."""
    from symtrace.passes import rewrite as rw

    matcher = SubgraphMatcher(add_relu, commutative=True)
    assert matcher._fast is None
    gm = _wide_module(3)
    assert rw._Splicer(gm, matcher).template(lambda a, b: torch.clamp_min(torch.add(a, b), 0.0)).fast is not None
    done = replace_pattern(gm, matcher, lambda a, b: torch.clamp_min(torch.add(a, b), 0.0))
    gm.graph.lint()
    assert len(done) == 3 and all(r.anchor.target is torch.clamp_min for r in done)
    assert histogram(gm) == Counter({("call_function", "add"): 3, ("call_function", "clamp_min"): 3,
                                     ("call_function", "mul"): 3})
    x, y = torch.randn(4), torch.randn(4)
    for out in gm(x, y):
        assert torch.equal(out, torch.clamp_min(x + y, 0.0) * 2.0)
    # a new output node (a method call replaces the function call) inherits the matched
    # output's meta, not another matched node's
    gm = _wide_module(2)
    for n in gm.graph.nodes:
        n.meta["tag"] = getattr(n.target, "__name__", n.target)
    done = replace_pattern(gm, matcher, lambda a, b: torch.add(a, b).clamp_min(0.0))
    gm.graph.lint()
    assert [(r.new_nodes[-1].op, r.new_nodes[-1].meta["tag"]) for r in done] == [("call_method", "relu")] * 2
    for out in gm(x, y):
        assert torch.equal(out, torch.clamp_min(x + y, 0.0) * 2.0)
