"""Guards are structured records: expression trees whose names are checked when built, written
out as the same readable Python, stored in files as trees and rebuilt without parsing."""
import pickle

import pytest
import torch
from hypothesis import given, settings, strategies as st

import symtrace
from symtrace.graph.code_text import UnsafeNameError
from symtrace.graph.guard_expr import (Attr, BinOp, Call, Const, Global, Input, Item, Method, Root, TorchState,
                                       from_record, root_path)
from symtrace.serialize import SerializationError
from symtrace.serialize.legacy_guards import guard_expr_from_text


def test_render_reads_like_python():
    x = Input("x")
    assert str(BinOp(">", Item(Attr(x, "shape"), Const(0)), Const(1))) == "(x.shape[0] > 1)"
    assert str(Attr(root_path("layer1.0"), "training")) == "getattr(root.layer1, '0').training"
    assert str(Global("pkg.mod", "FLAG")) == "sys.modules['pkg.mod'].FLAG"
    assert str(Global("__main__", "FLAG")) == "sys.modules['__main__'].FLAG"
    assert str(TorchState("is_grad_enabled")) == "torch.is_grad_enabled()"
    assert str(Method(x, "size", (Const(-1),))) == "x.size(-1)"
    assert str(Call("len", (x,))) == "len(x)"
    assert str(Const(float("nan"))) == "float('nan')"
    assert str(Const(torch.float16)) == "torch.float16"
    assert str(Item(x, Const(slice(None, 2, None)))) == "x[slice(None, 2, None)]"


@pytest.mark.parametrize("build", [
    lambda: Input("x; import os"),
    lambda: Input("lambda"),
    lambda: Attr(Input("x"), "__class__"),
    lambda: Attr(Input("x"), "__globals__"),
    lambda: Call("sorted", (Input("x"),)),
    lambda: Call("getattr", (Input("x"), Const("a"))),
    lambda: Call("eval", (Const("1"),)),
    lambda: Method(Input("x"), "format", ()),
    lambda: Method(Input("x"), "untyped_storage", ()),
    lambda: TorchState("load"),
    lambda: Global("os", "system; x"),
    lambda: Global("os;x", "y"),
    lambda: Global("os", "__dict__"),
    lambda: BinOp("if", Input("x"), Input("y")),
    lambda: Const(object()),
    lambda: Const([1, 2]),
    lambda: Const(print),
])
def test_constructors_refuse(build):
    with pytest.raises((UnsafeNameError, TypeError)):
        build()


def test_record_round_trip_and_equality():
    e = BinOp("==", Method(Item(Attr(Input("x"), "shape"), Const(1)), "bit_length", ()), Const(3))
    rec = e.to_record(lambda v: v)
    back = from_record(rec, lambda v: v, {"x"})
    assert back == e and hash(back) == hash(e) and str(back) == str(e)
    assert pickle.loads(pickle.dumps(e)) == e
    with pytest.raises(ValueError, match="not an input"):
        from_record(rec, lambda v: v, {"y"})


@pytest.mark.parametrize("rec", [
    ["call", "sorted", [["input", "x"]]],
    ["attr", ["input", "x"], "__globals__"],
    ["method", ["input", "x"], "format", []],
    ["global", "os", "system"] + ["extra"],
    ["eval", "1"],
    ["const", {"$ref": "print"}],
    "x.shape",
    ["input"],
])
def test_from_record_refuses(rec):
    with pytest.raises((ValueError, TypeError)):
        from_record(rec, lambda v: v, {"x"})


def test_structure_knows_what_it_reads():
    e = BinOp("and" if False else "&", Attr(root_path("a.b"), "training"), Attr(Input("x"), "ndim"))
    assert e.reads_root() and e.inputs() == ["x"]
    assert e.root_chains() == [["a", "b", "training"]]


def test_legacy_text_converts_only_read_only_forms():
    t = guard_expr_from_text("bool(x.shape[0] > 1)", ["x"], "test")
    assert str(t) == "bool((x.shape[0] > 1))"
    assert str(guard_expr_from_text("getattr(root.layer1, '0').training", ["x"], "t")) == \
        "getattr(root.layer1, '0').training"
    assert str(guard_expr_from_text("sys.modules['m'].FLAG", [], "t")) == "sys.modules['m'].FLAG"
    for evil in ["sorted([1, 2], key=sys.modules['os'].system)", "sys.modules['os'].system('id')",
                 "x.__class__", "getattr(x, '__globals__')", "(lambda: 1)()", "[c for c in x]",
                 "x.shape[0] if x else y", "__import__('os')", "root.fc.weight.untyped_storage()"]:
        with pytest.raises(SerializationError):
            guard_expr_from_text(evil, ["x"], "t")


def test_traced_guards_are_trees_with_the_same_text():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = 2

        def forward(self, x, n: int):
            if x.shape[0] > 1 and torch.is_grad_enabled():
                x = x * self.scale
            return x + n

    gm = symtrace.symbolic_trace(Net(), example_inputs=(torch.randn(3, 4), 5))
    texts = {str(g.expr) for g in gm.graph.guards}
    assert {"x.dtype", "(x.shape[0] > 1)", "torch.is_grad_enabled()", "root.scale", "n"} <= texts
    assert all(not isinstance(g.expr, str) for g in gm.graph.guards)
    with pytest.raises(symtrace.GuardError, match=r"x.shape\[0\] > 1"):
        gm(torch.randn(1, 4), 5)


@settings(max_examples=60, deadline=None)
@given(st.recursive(
    st.one_of(st.integers(-5, 5).map(Const), st.sampled_from(["x", "y"]).map(Input), st.just(Root())),
    lambda inner: st.one_of(
        st.tuples(inner, st.sampled_from(["shape", "a b", "0", "_m", "training"])).map(lambda t: Attr(*t)),
        st.tuples(inner, inner).map(lambda t: Item(*t)),
        st.tuples(st.sampled_from(sorted(["+", "-", "==", "<", "is", "%"])), inner, inner).map(lambda t: BinOp(*t)),
        st.tuples(inner, st.sampled_from(["size", "dim"]), st.lists(inner, max_size=2)).map(
            lambda t: Method(t[0], t[1], tuple(t[2]))),
        st.lists(inner, max_size=2).map(lambda a: Call("len", tuple(a)))),
    max_leaves=12))
def test_rendered_trees_parse_to_one_expression_that_reads_only_checked_names(e):
    import ast
    tree = ast.parse(str(e), mode="eval")  # always one valid expression
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert names <= {"x", "y", "root", "len", "getattr"}
    assert not any(isinstance(n, ast.Attribute) and n.attr.startswith("__") for n in ast.walk(tree))
    assert from_record(e.to_record(lambda v: v), lambda v: v, {"x", "y"}) == e


def test_version_1_files_with_text_guards_still_load(tmp_path):
    """Files written before guards were trees: their text converts to the same trees."""
    import json
    import zipfile
    from symtrace.serialize import load, save

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            if x.shape[0] > 1:
                x = x * 2
            return self.lin(x)

    gm = symtrace.symbolic_trace(Net(), example_inputs=(torch.randn(3, 4),))
    path = tmp_path / "m.symtrace"
    save(gm, path)
    with zipfile.ZipFile(path) as zf:
        doc = json.loads(zf.read("symtrace.json"))
        blobs = {i.filename: zf.read(i) for i in zf.infolist() if i.filename != "symtrace.json"}
    doc["version"] = 1
    for g, rec in zip(gm.graph.guards, doc["modules"][doc["root"]]["graph"]["guards"]):
        rec["expr"] = str(g.expr)
    old = tmp_path / "old.symtrace"
    with zipfile.ZipFile(old, "w") as zf:
        zf.writestr("symtrace.json", json.dumps(doc))
        for k, v in blobs.items():
            zf.writestr(k, v)
    back = load(old)
    assert [g.expr for g in back.graph.guards] == [g.expr for g in gm.graph.guards]
    x = torch.randn(3, 4)
    assert torch.equal(back(x), gm(x))
    with pytest.raises(symtrace.GuardError):
        back(torch.randn(1, 4))


def test_tuple_and_slice_constants_round_trip():
    for v in [(1, 2), (), (None, "a", (3,)), slice(1, None, -1), torch.int8, float("inf")]:
        e = Item(Input("x"), Const(v))
        assert from_record(e.to_record(lambda v: v), lambda v: v, {"x"}) == e


def test_what_a_tree_reads_includes_call_and_method_arguments():
    e = BinOp("==", Call("len", (Input("x"),)), Method(Attr(Root(), "n"), "bit_length", (Input("y"),)))
    assert e.inputs() == ["x", "y"] and e.reads_root()
    assert Call("hasattr", (Root(), Const("w"))).reads_root()
    with pytest.raises(UnsafeNameError):
        Call("hasattr", (Root(), Const("__dict__")))
    with pytest.raises(UnsafeNameError):
        Call("hasattr", (Root(), Input("x")))


class _Counting:
    """Attributes and items that count their reads."""

    def __init__(self, reads, **children):
        object.__setattr__(self, "_reads", reads)
        object.__setattr__(self, "_children", children)

    def __getattr__(self, name):
        self._reads[name] = self._reads.get(name, 0) + 1
        return self._children[name]

    def __getitem__(self, i):
        self._reads[f"[{i}]"] = self._reads.get(f"[{i}]", 0) + 1
        return self._children[f"[{i}]"]


def test_shared_rendering_reads_each_common_subexpression_once_and_answers_the_same():
    from symtrace.graph.guard_expr import render_sharing
    layers = root_path("model.layers")
    exprs = [BinOp("is", Attr(Item(layers, Const(0)), "weight"), Input("w0")),
             BinOp("==", Attr(Item(layers, Const(0)), "training"), Const(False)),
             BinOp("==", Attr(Item(layers, Const(1)), "training"), Const(False)),
             BinOp(">", Item(Attr(Input("x"), "shape"), Const(0)), Const(1))]
    texts = render_sharing(exprs, "_s")
    assert texts[0].startswith("(") and ":=" in texts[0] and "_s" in texts[1]
    src = "def test(root, w0, x):\n    return " + " and ".join(texts) + "\n"
    plain = "def test(root, w0, x):\n    return " + " and ".join(e.render() for e in exprs) + "\n"

    def run(code, training0=False, x_rows=3):
        reads = {}
        w0 = torch.zeros(1)
        l0 = _Counting(reads, weight=w0, training=training0)
        l1 = _Counting(reads, training=False)
        root = _Counting(reads, model=_Counting(reads, layers=_Counting(reads, **{"[0]": l0, "[1]": l1})))
        ns = {}
        exec(code, ns)
        return ns["test"](root, w0, torch.zeros(x_rows, 2)), reads

    ok, reads = run(src)
    assert ok is True and run(plain)[0] is True
    assert reads["model"] == 1 and reads["layers"] == 1 and reads["[0]"] == 1   # (plain: 3, 3, 2)
    assert run(plain)[1]["model"] == 3
    for kw in (dict(training0=True), dict(x_rows=1)):   # a failing guard still fails
        assert run(src, **kw)[0] is False and run(plain, **kw)[0] is False


def test_generated_forward_checks_shared_reads_and_still_refuses_a_changed_module():
    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Inner(), Inner()])

        def forward(self, x):
            for b in self.blocks:
                x = b.lin(x)
            return x

    model = Outer().eval()
    cap = symtrace.capture(model)
    x = torch.randn(2, 4)
    torch.testing.assert_close(cap(x), model(x))
    assert ":=" in cap.graphs[0].code   # the live-model guards read model.blocks once
    model.blocks[1].lin = torch.nn.Linear(4, 4)   # a guarded identity changes: re-captured
    torch.testing.assert_close(cap(x), model(x))
    assert cap.captures == 2


def test_shared_rendering_tells_equal_trees_with_different_constants_apart():
    # Const(1) == Const(True) as trees (1 == True): sharing by tree equality would read `a is 1`
    # as `a is True`'s name; sharing goes by text
    import warnings
    from symtrace.graph.guard_expr import render_sharing
    exprs = [BinOp("is", Input("a"), Const(True)), BinOp("is", Input("a"), Const(1))]
    texts = render_sharing(exprs, "_s")
    assert ":=" not in " ".join(texts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        assert [eval(t, {}, {"a": 1}) for t in texts] == [False, True]


# --- module members read from their tables ----------------------------------------------------
class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("shift", torch.ones(4))
        self.gain = 2.0

    def forward(self, x):
        if self.lin.training:
            x = x * 3
        return self.lin(x) * self.gain + self.shift


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_guards_read_submodules_parameters_and_buffers_from_the_module_tables():
    # nn.Module answers `m.lin` from a Python __getattr__ (after a failed lookup): ~20x slower
    # than m._modules['lin'], and a model's guards read hundreds of these on every call
    model = _Net().eval()
    cap = symtrace.capture(model)
    x = torch.randn(2, 4)
    torch.testing.assert_close(cap(x), model(x))
    gm = cap.graphs[0]
    texts = [g.expr.render() for g in gm.graph.guards]
    assert "root._modules['blocks']._modules['0']._modules['lin'].training" in texts
    assert "root._modules['blocks']._modules['1']._buffers['shift']" in texts
    assert "root._modules['blocks']._modules['0'].gain" in texts   # (a plain attribute stays one)
    assert not any("root.blocks" in t for t in texts)
    # what a user reads names the attributes
    described = [g.describe() for g in gm.graph.guards]
    assert "getattr(root.blocks, '0').lin.training is False" in described
    assert all("._modules[" not in d and "._buffers[" not in d for d in described)
    model.blocks[0].lin.train()                       # a guarded mode changes: re-captured
    torch.testing.assert_close(cap(x), model(x))
    model.blocks[1].shift = torch.full((4,), 5.0)     # a buffer rebound
    torch.testing.assert_close(cap(x), model(x))
    del model.blocks[1].lin                           # a submodule removed: eager's error
    with pytest.raises(AttributeError):
        model(x)
    with pytest.raises(AttributeError):
        cap(x)
    assert cap.captures == 3


def test_a_member_shadowed_by_the_class_or_another_getattr_is_read_as_the_attribute():
    from symtrace.trace.modules import _state_path

    class Shadowing(torch.nn.Module):
        lin = None   # what `self.lin` finds first: the class attribute, not the submodule

        def __init__(self):
            super().__init__()
            self._modules["lin"] = torch.nn.Linear(4, 4)

    class Forwarding(torch.nn.Module):   # a wrapper that answers missing names itself
        def __init__(self):
            super().__init__()
            self.inner = _Block()

        def __getattr__(self, name):
            if name == "inner":
                return super().__getattr__(name)
            return getattr(self.inner, name)

        def forward(self, x):
            return self.inner(x)

    assert _state_path(Shadowing(), "lin").render() == "root.lin"
    own = _Block()
    own.__dict__["shift"] = 1.0   # (bypassing Module.__setattr__: the instance attribute wins)
    assert _state_path(own, "shift").render() == "root.shift"
    assert _state_path(own, "lin.weight").render() == "root._modules['lin']._parameters['weight']"
    model = Forwarding().eval()
    cap = symtrace.capture(model)
    x = torch.randn(2, 4)
    torch.testing.assert_close(cap(x), model(x))
    texts = [g.expr.render() for g in cap.graphs[0].graph.guards]
    assert "root.inner.lin.training" in texts   # (below a plain read, attribute reads)
    assert not any(t.startswith("root._modules") for t in texts)


def test_module_members_round_trip_through_files_and_the_attribute_form():
    from symtrace.graph.guard_expr import Member as module_member, as_attributes
    e = Attr(module_member(module_member(Root(), "_modules", "blocks"), "_modules", "0"), "training")
    assert e.render() == "root._modules['blocks']._modules['0'].training"
    assert e.shown() == "getattr(root.blocks, '0').training"
    assert e.root_chain() == ["blocks", "0", "training"]
    assert as_attributes(e) == Attr(Attr(Attr(Root(), "blocks"), "0"), "training")
    assert from_record(e.to_record(lambda v: v), lambda v: v) == e
    with pytest.raises(UnsafeNameError):
        module_member(Root(), "__dict__", "x")
    with pytest.raises(UnsafeNameError):
        module_member(Root(), "_modules", "__class__")
    # one tree level per member: a model nested 40 modules deep saves and loads
    deep = Root()
    for _ in range(40):
        deep = module_member(deep, "_modules", "inner")
    assert from_record(Attr(deep, "training").to_record(lambda v: v), lambda v: v) == Attr(deep, "training")
    model = _Net().eval()
    x = torch.randn(2, 4)
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    assert any("_modules" in g.expr.render() for g in gm.graph.guards)
    path = __import__("tempfile").mktemp(suffix=".symtrace")
    symtrace.save(gm, path)
    back = symtrace.load(path)
    torch.testing.assert_close(back(x), model(x))
    back.get_submodule("blocks.0.lin").train()
    with pytest.raises(symtrace.GuardError, match=r"getattr\(root.blocks, '0'\).lin.training"):
        back(x)


class _ChecksRows(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        if self.lin.weight.shape[0] == 4:
            x = x * 2
        return self.lin(x)


def test_a_member_moved_to_another_table_after_tracing_is_checked_as_the_attribute():
    # a pass that turns a parameter into a buffer (constant folding does) leaves the graph's
    # guards reading the parameter table: the check falls back to the attribute, as the
    # program read it, instead of refusing a graph whose assumptions hold
    model = _ChecksRows().eval()
    x = torch.randn(2, 4)
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    assert "(root._modules['lin']._parameters['weight'].shape[0] == 4)" in [str(g.expr) for g in gm.graph.guards]
    w = gm.lin._parameters.pop("weight")
    gm.lin.register_buffer("weight", w.detach().clone())
    torch.testing.assert_close(gm(x), model(x))
    gm.lin.weight = torch.randn(5, 4)   # the assumption itself breaks: the guard names it
    with pytest.raises(symtrace.GuardError, match=r"root.lin.weight.shape\[0\] == 4"):
        gm(x)


def test_a_plain_objects_own_table_named_like_a_modules_is_read_as_the_program_reads_it():
    # an object (not a module) holding a dict called `_buffers`: its items are what the
    # program reads, guarded as such, and not taken for a module's members
    class Holder:
        def __init__(self):
            self._buffers = {"t": torch.ones(3), "k": 2}
            self.k = 2

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.st = Holder()

        def forward(self, x):
            return x * self.st._buffers["t"] * self.st._buffers["k"]

    model = M()
    cap = symtrace.capture(model)
    x = torch.ones(3)
    torch.testing.assert_close(cap(x), model(x))
    model.st._buffers["k"] = 5
    torch.testing.assert_close(cap(x), model(x))
    assert cap.captures == 2


def test_against_a_live_model_a_moved_member_re_captures_instead_of_running_slowly():
    model = _ChecksRows().eval()
    cap = symtrace.capture(model)
    x = torch.randn(2, 4)
    torch.testing.assert_close(cap(x), model(x))
    w = model.lin._parameters.pop("weight")
    model.lin.register_buffer("weight", w.detach())
    torch.testing.assert_close(cap(x), model(x))
    assert cap.captures == 2
    assert "_buffers['weight']" in str([str(g.expr) for g in cap.graphs[0].graph.guards])
