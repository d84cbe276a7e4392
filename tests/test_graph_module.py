"""Behaviour tests for GraphModule: copying, pickling, meta, in-place semantics, errors."""
import copy
import inspect
import io
import operator
import os
import pickle

import pytest
import torch
from torch import nn

import symtrace
import symtrace.trace
from symtrace import Graph, GraphModule
from examples.models import build, example_inputs

HERE = os.path.basename(__file__)


def _pickle_rt(gm):
    return pickle.loads(pickle.dumps(gm))


def _torch_save_rt(gm):
    buf = io.BytesIO()
    torch.save(gm, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


ROUND_TRIPS = {"deepcopy": copy.deepcopy, "pickle": _pickle_rt, "torch.save": _torch_save_rt}


@pytest.fixture(scope="module")
def traced_examples():
    out = {}
    for name in ("resnet", "transformer"):
        model, xs = build(name), example_inputs(name)
        if name == "resnet":  # one image is enough, and keeps the file fast on a busy CPU
            xs = (xs[0][:1],)
        with torch.no_grad():
            expected = model(*xs)
        out[name] = (model, xs, symtrace.symbolic_trace(model),
                     symtrace.symbolic_trace(model, example_inputs=xs), expected)
    return out


@pytest.fixture
def no_retrace(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("re-traced during a copy")

    monkeypatch.setattr(symtrace.trace.Tracer, "trace", boom)
    monkeypatch.setattr(symtrace.trace, "symbolic_trace", boom)
    monkeypatch.setattr(symtrace, "symbolic_trace", boom)


# --- copies of the example models --------------------------------------------------------------
@pytest.mark.parametrize("how", list(ROUND_TRIPS))
@pytest.mark.parametrize("name", ["resnet", "transformer"])
def test_example_models_round_trip(traced_examples, no_retrace, name, how):
    model, xs, gm_sym, gm_ex, expected = traced_examples[name]
    for gm in (gm_sym, gm_ex):
        gm2 = ROUND_TRIPS[how](gm)
        assert type(gm2) is type(gm) and gm2 is not gm
        assert str(gm2.graph) == str(gm.graph)
        assert gm2.code == gm.code
        with torch.no_grad():
            torch.testing.assert_close(gm2(*xs), expected)
        assert len(gm2.graph.guards) == len(gm.graph.guards)
        gm2.graph.lint()
        # parameters are copies, equal in value
        p1 = dict(gm.named_parameters())
        p2 = dict(gm2.named_parameters())
        assert p1.keys() == p2.keys()
        for k in p1:
            assert torch.equal(p1[k], p2[k])
            assert p1[k] is not p2[k]


def test_example_model_copy_keeps_training_flags(traced_examples):
    model, xs, gm, _, _ = traced_examples["resnet"]
    for how in ROUND_TRIPS.values():
        gm2 = how(gm)
        assert [m.training for m in gm2.modules()] == [m.training for m in gm.modules()]


# --- meta -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", list(ROUND_TRIPS))
def test_meta_survives_round_trip(traced_examples, no_retrace, how):
    model, xs, _, gm_ex, _ = traced_examples["transformer"]
    gm = copy.deepcopy(gm_ex)  # do not tag the shared fixture
    for i, n in enumerate(gm.graph.nodes):
        n.meta["tag"] = ("tag", i, n.name)
    gm.meta["module_tag"] = 42
    gm2 = ROUND_TRIPS[how](gm)
    nodes1, nodes2 = list(gm.graph.nodes), list(gm2.graph.nodes)
    assert len(nodes1) == len(nodes2)
    for i, (a, b) in enumerate(zip(nodes1, nodes2)):
        assert b.meta["tag"] == ("tag", i, a.name)
        assert b.name == a.name and b.op == a.op
        assert b.meta.get("source") == a.meta.get("source")
        assert b.tensor_meta == a.tensor_meta
    ph = [n for n in nodes2 if n.op == "placeholder"]
    assert ph and all("tag" in n.meta for n in ph)
    assert ph[0].tensor_meta is not None and ph[0].tensor_meta.shape == tuple(xs[0].shape)
    assert gm2.meta["module_tag"] == 42


def test_meta_dicts_are_independent_after_deepcopy():
    def f(x):
        return x + 1

    gm = symtrace.symbolic_trace(f)
    gm2 = copy.deepcopy(gm)
    for a, b in zip(gm.graph.nodes, gm2.graph.nodes):
        assert a.meta is not b.meta
        b.meta["new"] = 1
        assert "new" not in a.meta


# --- in-place semantics --------------------------------------------------------------------------
def inplace_method(x):
    x.add_(1)
    return x * 2


def inplace_operator(x):
    x += 1
    return x * 2


def inplace_setitem(x):
    x[0] = 10.0
    return x.sum()


@pytest.mark.parametrize("fn", [inplace_method, inplace_operator, inplace_setitem])
@pytest.mark.parametrize("how", [None] + list(ROUND_TRIPS))
@pytest.mark.parametrize("example", [False, True])
def test_inplace_on_input_mutates_callers_tensor(fn, how, example):
    ex = torch.zeros(3)
    gm = symtrace.symbolic_trace(fn, example_inputs=(ex,) if example else None)
    assert torch.equal(ex, torch.zeros(3))  # tracing never mutates the example
    if how is not None:
        gm = ROUND_TRIPS[how](gm)
    got_in = torch.zeros(3)
    want_in = torch.zeros(3)
    got = gm(got_in)
    want = fn(want_in)
    assert torch.equal(got_in, want_in), (gm.code, got_in, want_in)
    assert not torch.equal(got_in, torch.zeros(3))
    torch.testing.assert_close(got, want)
    # a second call mutates again (nothing was folded into a constant)
    gm(got_in)
    fn(want_in)
    assert torch.equal(got_in, want_in)


def test_buffer_update_survives_round_trip():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("n", torch.zeros(()))

        def forward(self, x):
            self.n += 1
            return x + self.n

    m = Counter()
    gm = symtrace.symbolic_trace(m)
    for how in ROUND_TRIPS.values():
        gm2 = how(gm)
        start = gm2.n.clone()
        gm2(torch.zeros(1))
        gm2(torch.zeros(1))
        assert gm2.n.item() == start.item() + 2
    assert m.n.item() == 0  # the copies have their own buffer


# --- no re-trace, independence -------------------------------------------------------------------
def test_round_trip_does_not_retrace(no_retrace):
    # the fixture patched tracing to raise; build the module before by hand
    g = Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.relu, (x,)))
    gm = GraphModule(nn.Module(), g)
    for how in ROUND_TRIPS.values():
        gm2 = how(gm)
        assert torch.equal(gm2(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 2.0]))


def test_round_trip_with_patched_trace_method():
    def f(x):
        return torch.sin(x) * 2

    gm = symtrace.symbolic_trace(f)
    calls = []
    orig = symtrace.trace.Tracer.trace

    def counting(self, *a, **k):
        calls.append(1)
        return orig(self, *a, **k)

    symtrace.trace.Tracer.trace = counting
    try:
        gms = [how(gm) for how in ROUND_TRIPS.values()]
        for g2 in gms:
            g2(torch.ones(2))
    finally:
        symtrace.trace.Tracer.trace = orig
    assert calls == []


@pytest.mark.parametrize("how", list(ROUND_TRIPS))
def test_copy_graph_is_independent(how):
    def f(x):
        return torch.relu(x) + 1

    gm = symtrace.symbolic_trace(f)
    t = torch.tensor([-2.0, 3.0])
    gm(t)  # compiled before copying
    gm2 = ROUND_TRIPS[how](gm)
    assert gm2.graph is not gm.graph
    for a, b in zip(gm.graph.nodes, gm2.graph.nodes):
        assert a is not b and b.graph is gm2.graph
    # edit the copy: the original keeps its graph and its code
    add2 = gm2.graph.find_nodes(op="call_function", target=operator.add)[0]
    add2.args = (add2.args[0], 100)
    assert torch.equal(gm2(t), torch.tensor([100.0, 103.0]))
    assert torch.equal(gm(t), torch.tensor([1.0, 4.0]))
    assert "100" not in gm.code and "100" not in str(gm.graph)
    # edit the original: the copy is unaffected
    add1 = gm.graph.find_nodes(op="call_function", target=operator.add)[0]
    with gm.graph.inserting_after(add1):
        neg = gm.graph.call_function(torch.neg, (add1,))
    add1.replace_all_uses_with(neg, delete_user_cb=lambda u: u is not neg)
    assert torch.equal(gm(t), torch.tensor([-1.0, -4.0]))
    assert torch.equal(gm2(t), torch.tensor([100.0, 103.0]))
    gm.graph.lint()
    gm2.graph.lint()


def test_shallow_copy_gets_own_graph():
    def f(x):
        return x * 3

    gm = symtrace.symbolic_trace(f)
    gm2 = copy.copy(gm)
    assert gm2.graph is not gm.graph
    mul = gm2.graph.find_nodes(op="call_function", target=operator.mul)[0]
    mul.args = (mul.args[0], 5)
    assert gm2(torch.ones(1)).item() == 5.0
    assert gm(torch.ones(1)).item() == 3.0


def test_copy_keeps_guards():
    def f(x):
        if x.shape[0] > 2:
            return x + 1
        return x - 1

    gm = symtrace.symbolic_trace(f, example_inputs=(torch.zeros(4),))
    for how in ROUND_TRIPS.values():
        gm2 = how(gm)
        assert gm2(torch.zeros(5)).tolist() == [1.0] * 5
        with pytest.raises(symtrace.GuardError):
            gm2(torch.zeros(1))


# --- construction ---------------------------------------------------------------------------------
def test_graph_module_copies_referenced_attributes_only():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.unused = nn.Linear(2, 2)
            self.register_buffer("buf", torch.ones(2))
            self.sub = nn.Module()
            self.sub.w = nn.Parameter(torch.full((2,), 3.0))

        def forward(self, x):
            return self.lin(x) + self.buf + self.sub.w

    m = M()
    gm = symtrace.symbolic_trace(m)
    assert hasattr(gm, "lin") and not hasattr(gm, "unused")
    assert gm.lin is m.lin  # shared, as in torch.fx
    assert "buf" in dict(gm.named_buffers())
    assert "sub.w" in dict(gm.named_parameters())
    t = torch.randn(3, 2)
    torch.testing.assert_close(gm(t), m(t))


def test_graph_module_from_dict_root_and_missing_attr():
    g = Graph()
    x = g.placeholder("x")
    w = g.get_attr("a.b.w")
    g.output(g.call_function(operator.mul, (x, w)))
    gm = GraphModule({"a.b.w": torch.tensor([2.0])}, g)
    assert gm(torch.tensor([3.0])).item() == 6.0
    with pytest.raises(AttributeError, match="a.b.w"):
        GraphModule(nn.Module(), g)


def test_class_name_and_print_readable(capsys):
    model = build("transformer")
    gm = symtrace.symbolic_trace(model)
    text = gm.print_readable(print_output=False)
    assert "class TransformerBlock(torch.nn.Module):" in text
    assert "    def forward(self, x" in text
    assert capsys.readouterr().out == ""
    gm.print_readable()
    assert "class TransformerBlock" in capsys.readouterr().out
    g = Graph()
    x = g.placeholder("x")
    g.output(x)
    assert "class Custom(" in GraphModule(nn.Module(), g, class_name="Custom").print_readable(False)
    assert "class" in str(gm)


def test_graph_without_output_returns_none():
    g = Graph()
    x = g.placeholder("x")
    g.call_method("add_", (x, 1))
    gm = GraphModule(nn.Module(), g)
    t = torch.zeros(1)
    assert gm(t) is None
    assert t.item() == 1.0


# --- errors inside generated code ----------------------------------------------------------------
def bad_matmul(x, w):
    y = x.relu()
    z = torch.matmul(y, w)
    return z + 1


@pytest.mark.parametrize("how", [None] + list(ROUND_TRIPS))
def test_error_note_names_node_and_user_line(how):
    gm = symtrace.symbolic_trace(bad_matmul)
    if how is not None:
        gm = ROUND_TRIPS[how](gm)
    with pytest.raises(RuntimeError) as ei:
        gm(torch.ones(2, 3), torch.ones(4, 5))
    notes = getattr(ei.value, "__notes__", [])
    assert len(notes) == 1, notes
    note = notes[0]
    lines, start = inspect.getsourcelines(bad_matmul)
    lineno = start + next(i for i, s in enumerate(lines) if "torch.matmul" in s)
    assert "'matmul'" in note
    assert f"{HERE}:{lineno}" in note
    assert "z = torch.matmul(y, w)" in note
    # the right inputs still work
    out = gm(torch.ones(2, 3), torch.ones(3, 5))
    assert out.shape == (2, 5)


def test_error_note_without_source():
    g = Graph()
    x = g.placeholder("x")
    bad = g.call_method("view", (x, 7), name="bad_view")
    g.output(bad)
    gm = GraphModule(nn.Module(), g)
    with pytest.raises(RuntimeError) as ei:
        gm(torch.ones(3))
    assert any("'bad_view'" in n for n in getattr(ei.value, "__notes__", []))


def test_error_note_added_once_for_nested_graph_modules():
    inner = symtrace.symbolic_trace(bad_matmul)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, x, w):
            return self.inner(x, w) * 2

    outer = symtrace.symbolic_trace(Outer())
    with pytest.raises(RuntimeError) as ei:
        outer(torch.ones(2, 3), torch.ones(4, 5))
    notes = getattr(ei.value, "__notes__", [])
    assert len(notes) == 1 and "matmul" in notes[0]


def test_error_from_user_leaf_has_note():
    @symtrace.leaf_function
    def explode(x):
        raise ValueError("boom")

    def f(x):
        return explode(x + 1)

    gm = symtrace.symbolic_trace(f)
    with pytest.raises(ValueError, match="boom") as ei:
        gm(torch.ones(1))
    notes = getattr(ei.value, "__notes__", [])
    assert notes and "explode" in notes[0]
