import copy
import operator
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symtrace
from examples.models import build, example_inputs
from symtrace.errors import GuardError
from symtrace.graph import Graph, GraphModule, SourceLocation
from symtrace.graph.interpreter import Interpreter
from symtrace.transformer import Transformer

MODELS = ("resnet", "transformer")


@pytest.fixture(scope="module")
def traced():
    """(model, inputs, eager output, symbolic gm, gm traced with example inputs) per model."""
    out = {}
    for name in MODELS:
        model, x = build(name), example_inputs(name)
        out[name] = (model, x, model(*x), symtrace.symbolic_trace(model),
                     symtrace.symbolic_trace(model, example_inputs=x))
    return out


# --- Interpreter ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", MODELS)
def test_interpreter_matches_eager_and_graph_module(traced, name):
    _, x, ref, gm, gm_ex = traced[name]
    for g in (gm, gm_ex):
        out = Interpreter(g).run(*x)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(out, g(*x))
    torch.testing.assert_close(Interpreter(gm_ex, check_guards=True).run(*x), ref)


def test_binds_inputs_like_generated_forward():
    g = Graph()
    x, y = g.placeholder("x"), g.placeholder("y", default=2)
    rest, kw = g.placeholder("*args"), g.placeholder("**kwargs")
    g.output((x, y, rest, kw))
    gm = GraphModule(nn.Module(), g)
    for args, kwargs in [((1,), {}), ((1, 3, 4, 5), {"z": 6}), ((), {"x": 1, "y": 7, "w": 0})]:
        assert Interpreter(gm).run(*args, **kwargs) == gm(*args, **kwargs)
    assert Interpreter(gm).run(1, 3, 4) == (1, 3, (4,), {})
    with pytest.raises(TypeError, match="missing a required argument: 'x'"):
        Interpreter(gm).run(y=1)


def test_overriding_call_function_swaps_add_for_mul():
    def f(x, y):
        return torch.add(x, y) + x

    class AddToMul(Interpreter):
        def call_function(self, target, args, kwargs):
            if target in (operator.add, torch.add):
                target = operator.mul
            return super().call_function(target, args, kwargs)

    gm = symtrace.symbolic_trace(f)
    x, y = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(Interpreter(gm).run(x, y), x + y + x)
    torch.testing.assert_close(AddToMul(gm).run(x, y), x * y * x)


def test_initial_env_partial_evaluation():
    def f(x):
        return ((x + 1) * 2).sin()

    gm = symtrace.symbolic_trace(f)
    x_node = next(n for n in gm.graph.nodes if n.op == "placeholder")
    add = next(n for n in gm.graph.nodes if n.target is operator.add)
    t = torch.randn(4)
    # a pre-set node is not run: the result starts from t, not from x + 1
    torch.testing.assert_close(Interpreter(gm).run(torch.zeros(4), initial_env={add: t}), (t * 2).sin())
    # pre-set placeholders need no argument
    torch.testing.assert_close(Interpreter(gm).run(initial_env={x_node: t}), f(t))


def _bad_matmul(x, w):
    return x @ w


def test_error_note_names_node_and_user_line():
    gm = symtrace.symbolic_trace(_bad_matmul)
    line = _bad_matmul.__code__.co_firstlineno + 1
    with pytest.raises(RuntimeError) as info:
        Interpreter(gm).run(torch.randn(2, 3), torch.randn(4, 5))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "%matmul = call_function[operator.matmul]" in notes
    assert f"test_interpreter.py:{line}" in notes and "return x @ w" in notes
    # the original traceback is kept: it ends in the handler that ran the op
    assert traceback.extract_tb(info.value.__traceback__)[-1].name == "call_function"


def test_garbage_collection_frees_values():
    def chain(x):
        for _ in range(20):
            x = x.sin() + 1
        return x

    class Watch(Interpreter):
        sizes: list

        def run_node(self, n):
            self.sizes.append(len(self.env))
            return super().run_node(n)

    gm = symtrace.symbolic_trace(chain)
    x = torch.randn(3)
    collected, kept = Watch(gm), Watch(gm, garbage_collect_values=False)
    collected.sizes, kept.sizes = [], []
    torch.testing.assert_close(collected.run(x), chain(x))
    torch.testing.assert_close(kept.run(x), chain(x))
    assert max(collected.sizes) <= 2
    assert max(kept.sizes) == len(gm.graph) - 1
    assert len(collected.env) == 1 and len(kept.env) == len(gm.graph)


def test_entry_guards_checked_only_on_request():
    def f(x):
        return x * 2

    gm = symtrace.symbolic_trace(f, example_inputs=(torch.ones(3),))
    x64 = torch.ones(3, dtype=torch.float64)
    torch.testing.assert_close(Interpreter(gm).run(x64), x64 * 2)  # not checked by default
    with pytest.raises(GuardError, match="float32"):
        Interpreter(gm, check_guards=True).run(x64)
    with pytest.raises(GuardError):
        gm(x64)


# --- Transformer ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", MODELS)
def test_transformer_identity_round_trip(traced, name):
    _, x, ref, gm, gm_ex = traced[name]
    for g in (gm, gm_ex):
        placeholder = next(iter(g.graph.nodes))
        op = next(n for n in g.graph.nodes if n.op == "call_module")
        placeholder.meta["tag"], op.meta["tag"] = "input", "first-layer"
        new = Transformer(g).transform()
        torch.testing.assert_close(new(*x), ref)
        old_nodes, new_nodes = list(g.graph.nodes), list(new.graph.nodes)
        assert [(n.name, n.op, n.target, n.default) for n in new_nodes] == \
               [(n.name, n.op, n.target, n.default) for n in old_nodes]
        for a, b in zip(old_nodes, new_nodes):
            assert b.meta == a.meta and b.meta is not a.meta
        assert new_nodes[0].meta["tag"] == "input" and new.graph.find_nodes(op="call_module")[0].meta["tag"] == "first-layer"
        assert new.graph.created_by == "Transformer"
        assert new.graph.guards == g.graph.guards and new.graph.guards is not g.graph.guards
        new.graph.lint()


class ReluToSigmoid(Transformer):
    def call_function(self, target, args, kwargs):
        if target in (torch.relu, F.relu):
            return torch.sigmoid(args[0])
        return super().call_function(target, args, kwargs)

    def call_module(self, target, args, kwargs):
        if isinstance(self.fetch_attr(target), nn.ReLU):
            return torch.sigmoid(*args)
        return super().call_module(target, args, kwargs)


def test_transformer_replaces_relu_by_sigmoid(traced):
    model, x, _, gm, _ = traced["resnet"]
    expected = copy.deepcopy(model)
    for mod in expected.modules():
        for child_name, child in mod.named_children():
            if isinstance(child, nn.ReLU):
                setattr(mod, child_name, nn.Sigmoid())
    new = ReluToSigmoid(gm).transform()
    torch.testing.assert_close(new(*x), expected(*x))
    assert not any(isinstance(new.get_submodule(n.target), nn.ReLU) for n in new.graph.find_nodes(op="call_module"))
    sig = new.graph.find_nodes(op="call_function", target=torch.sigmoid)
    assert len(sig) == 13
    old = {n.name: n for n in gm.graph.nodes}
    # nodes made by the override keep the user's source line and module path of what they replace
    assert sig[1].meta["source"] == old["layer1_0_relu1"].meta["source"]
    assert sig[1].meta["module_path"] == old["layer1_0_relu1"].meta["module_path"]
    assert new.graph.created_by == "ReluToSigmoid"

    def f(x):
        return torch.relu(x) + F.relu(x * 2)

    xs = torch.randn(5)
    torch.testing.assert_close(ReluToSigmoid(symtrace.symbolic_trace(f)).transform()(xs),
                               torch.sigmoid(xs) + torch.sigmoid(xs * 2))


def test_transformer_keeps_guards_working(traced):
    _, x, ref, gm, _ = traced["transformer"]
    assert any("root.heads" in str(g.expr) for g in gm.graph.guards)
    new = Transformer(gm).transform()
    torch.testing.assert_close(new(*x), ref)  # guards on root attributes still hold
    with pytest.raises(GuardError, match="mask"):
        new(x[0], mask=torch.zeros(1))


def test_super_call_with_new_target_and_tensor_constants():
    const = torch.tensor([1.0, 2.0, 3.0])
    root = nn.Module()
    root._tensor_constant0 = const  # as the tracer stores tensor constants
    g = Graph()
    x = g.placeholder("x")
    add = g.call_function(operator.add, (x, g.get_attr("_tensor_constant0")))
    add.meta["source"] = loc = SourceLocation("user.py", 1, "f")
    g.output(add)
    gm = GraphModule(root, g)

    class Rewrite(Transformer):
        def call_function(self, target, args, kwargs):
            if target is operator.add:
                out = super().call_function(operator.mul, args, kwargs)
                return out - torch.full((3,), 0.5)  # a new constant, recorded by the tracer
            return super().call_function(target, args, kwargs)

    new = Rewrite(gm).transform()
    t = torch.randn(3)
    torch.testing.assert_close(new(t), t * const - 0.5)
    mul = new.graph.find_nodes(op="call_function", target=operator.mul)[0]
    sub = new.graph.find_nodes(op="call_function", target=operator.sub)[0]
    assert mul.name == "mul" and mul.meta["source"] == sub.meta["source"] == loc
    assert new.graph.find_nodes(op="get_attr", target="_tensor_constant1")  # no clash with the old one
    assert new._tensor_constant0 is const


def test_errors_while_transforming_name_the_node():
    class Broken(Transformer):
        def call_function(self, target, args, kwargs):
            raise ValueError("nope")

    gm = symtrace.symbolic_trace(_bad_matmul)
    with pytest.raises(ValueError) as info:
        Broken(gm).transform()
    assert any("transforming node %matmul" in n for n in info.value.__notes__)


# --- guards, and bugs found in core files -------------------------------------------------
SCALE = 2.0


def _uses_global(x):
    return x * SCALE


_CONST = torch.tensor([1.0, 2.0])


def _uses_tensor_constant(x):
    return x + _CONST


def test_trace_function_with_tensor_constant():
    gm = symtrace.symbolic_trace(_uses_tensor_constant)
    torch.testing.assert_close(gm(torch.ones(2)), torch.ones(2) + _CONST)


def test_global_guards_checked_like_generated_forward(monkeypatch):
    gm = symtrace.symbolic_trace(_uses_global, example_inputs=(torch.ones(2),))
    assert any(g.kind == "global" for g in gm.graph.guards)
    checked = Interpreter(gm, check_guards=True)
    torch.testing.assert_close(checked.run(torch.ones(2)), gm(torch.ones(2)))
    monkeypatch.setattr(f"{__name__}.SCALE", 3.0)
    for call in (gm, checked.run):
        with pytest.raises(GuardError, match="SCALE"):
            call(torch.ones(2))
