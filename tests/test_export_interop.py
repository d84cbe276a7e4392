"""torch.export interop: from_export (ExportedProgram -> symtrace) and to_export (symtrace -> ExportedProgram)."""
import collections
import copy
import warnings

import pytest
import torch
from torch import nn
from torch.export import Dim

import symtrace
from symtrace import FxConversionError, GuardError, from_export, to_export


class Nested(nn.Module):
    """Parameters, buffers (BN running stats), a tensor constant, nested inputs/outputs, a kwarg."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("scale", torch.full((4,), 1.5))
        self.register_buffer("shift", torch.arange(4.0), persistent=False)
        self.c = torch.tensor([2.0, 3.0, 4.0, 5.0])  # a constant: neither parameter nor buffer

    def forward(self, d, pair, bias=None):
        x = d["a"][0] + d["b"] * pair[1]
        h = self.bn(self.fc(x)) * self.scale + self.c + self.shift
        return {"out": h + bias, "more": (h.sum(), [x, pair[0]])}


def _nested_inputs(batch=3):
    g = torch.Generator().manual_seed(batch)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return ({"a": (r(batch, 4),), "b": r(batch, 4)}, (r(2), r(batch, 4))), {"bias": r(4)}


def _export(model, args, kwargs=None, **kw):
    return torch.export.export(model, args, kwargs, **kw)


@pytest.fixture(scope="module")
def nested_train():
    torch.manual_seed(0)
    model = Nested().train()
    args, kwargs = _nested_inputs()
    ep = _export(copy.deepcopy(model), args, kwargs)
    return model, ep


def test_nested_inputs_outputs_kwargs_and_lifted_state(nested_train):
    model, ep = nested_train
    gm = from_export(ep)
    gm.graph.lint()
    assert isinstance(gm, symtrace.GraphModule)
    # lifted state comes back under its original qualified names, reached by get_attr
    targets = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert {"fc.weight", "fc.bias", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var",
            "bn.num_batches_tracked", "scale", "shift", "c"} <= targets
    assert dict(gm.named_parameters()).keys() == dict(model.named_parameters()).keys()
    assert set(gm.state_dict()) == set(model.state_dict())  # `shift` non-persistent, `c` a constant
    assert set(dict(gm.named_buffers())) == set(dict(model.named_buffers()))
    assert torch.equal(gm.c, model.c)
    # called like the model (same nesting, keyword argument), returns the same nesting
    eager = copy.deepcopy(model)
    for step in range(2):  # train mode: BatchNorm's running stats are updated by each call
        args, kwargs = _nested_inputs()
        ref, out = eager(*args, **kwargs), gm(*args, **kwargs)
        assert type(out) is dict and type(out["more"]) is tuple and type(out["more"][1]) is list
        torch.testing.assert_close(out, ref)
        for name, buf in eager.named_buffers():
            torch.testing.assert_close(gm.get_buffer(name), buf, msg=f"buffer {name} after call {step}")
    assert int(gm.bn.num_batches_tracked) == 2 + int(model.bn.num_batches_tracked)


def test_functional_program_writes_mutations_back(nested_train):
    """run_decompositions() makes BN's updates and an input's in-place update graph outputs:
    they come back as copy_ nodes into the buffer and the caller's tensor."""
    class AddInPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x):
            x.add_(1)
            return self.bn(x) * 2

    torch.manual_seed(1)
    model = AddInPlace().train()
    x = torch.randn(5, 4)
    ep = _export(copy.deepcopy(model), (x.clone(),)).run_decompositions()
    kinds = {s.kind.name for s in ep.graph_signature.output_specs}
    assert {"BUFFER_MUTATION", "USER_INPUT_MUTATION"} <= kinds
    gm = from_export(ep)
    assert [n.target for n in gm.graph.nodes if n.op == "call_method"].count("copy_") == 4
    xa, xb = x.clone(), x.clone()
    torch.testing.assert_close(gm(xa), model(xb))
    torch.testing.assert_close(xa, xb)  # the caller's tensor was updated in place
    for name, buf in model.named_buffers():
        torch.testing.assert_close(gm.get_buffer(name), buf)


def test_guards_refuse_inputs_the_program_was_not_exported_for(nested_train):
    class Scale(nn.Module):
        def forward(self, x, n: int, mode: str):
            return x * n if mode == "mul" else x + n

    ep = _export(Scale(), (torch.ones(2, 3), 3, "mul"))
    gm = from_export(ep)
    torch.testing.assert_close(gm(torch.ones(2, 3), 3, "mul"), torch.full((2, 3), 3.0))
    with pytest.raises(GuardError, match="n == 3"):
        gm(torch.ones(2, 3), 4, "mul")  # the program baked n=3 in: never a silent wrong answer
    with pytest.raises(GuardError, match="mode == 'mul'"):
        gm(torch.ones(2, 3), 3, "add")
    with pytest.raises(GuardError, match=r"x.shape\[0\] == 2"):
        gm(torch.ones(5, 3), 3, "mul")  # static sizes are guarded too
    with pytest.raises(GuardError, match="dtype"):
        gm(torch.ones(2, 3, dtype=torch.float64), 3, "mul")
    _, ep_nested = nested_train
    gm = from_export(ep_nested)
    args, kwargs = _nested_inputs()
    bad = ({"a": args[0]["a"], "b": args[0]["b"], "extra": 1}, args[1])
    with pytest.raises(GuardError, match=r"list\(d\) == \[.a., .b.\]"):
        gm(*bad, **kwargs)


def test_dynamic_dims_stay_general_and_are_range_checked():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x, y):
            return self.fc(x).view(x.shape[0], 3) + y

    model = TwoInputs()
    batch = Dim("batch", min=2, max=16)
    ep = _export(model, (torch.randn(3, 4), torch.randn(3, 3)), dynamic_shapes={"x": {0: batch}, "y": {0: batch}})
    gm = from_export(ep)
    for b in (2, 7, 16):
        x, y = torch.randn(b, 4), torch.randn(b, 3)
        torch.testing.assert_close(gm(x, y), model(x, y))
    ph = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    sym = ph["x"].meta["symbolic_shape"]
    assert isinstance(sym[0], str) and sym[1] == 4 and ph["y"].meta["symbolic_shape"][0] == sym[0]
    assert gm.meta["range_constraints"][sym[0]] == (2, 16)
    assert ph["x"].meta["tensor_meta"].shape == (3, 4)  # sizes at the example
    with pytest.raises(GuardError, match=r"x.shape\[0\] >= 2"):
        gm(torch.randn(1, 4), torch.randn(1, 3))
    with pytest.raises(GuardError, match=r"x.shape\[0\] <= 16"):
        gm(torch.randn(17, 4), torch.randn(17, 3))
    with pytest.raises(GuardError, match=r"y.shape\[0\] == x.shape\[0\]"):
        gm(torch.randn(4, 4), torch.randn(5, 3))


def test_derived_dims_are_checked():
    class Cat(nn.Module):
        def forward(self, x, y):
            return torch.cat([x, x], 0) + y

    d = Dim("d", min=1, max=32)
    ep = _export(Cat(), (torch.randn(3, 2), torch.randn(6, 2)), dynamic_shapes={"x": {0: d}, "y": {0: 2 * d}})
    gm = from_export(ep)
    x, y = torch.randn(5, 2), torch.randn(10, 2)
    torch.testing.assert_close(gm(x, y), torch.cat([x, x]) + y)
    with pytest.raises(GuardError, match=r"y.shape\[0\] =="):
        gm(torch.randn(5, 2), torch.randn(9, 2))


def test_save_load_round_trip(nested_train, tmp_path):
    """aten OpOverloads are admitted by the file format's allow-list: the converted graph is
    saved and loaded without registering anything, functional or not."""
    model, ep = nested_train
    for i, program in enumerate((ep, ep.run_decompositions())):
        gm = from_export(program)
        path = tmp_path / f"g{i}.symtrace"
        with warnings.catch_warnings():  # decomposition provenance in meta is left out, with a warning
            warnings.simplefilter("ignore", UserWarning)
            symtrace.save(gm, path)
        loaded = symtrace.load(path)
        assert any(isinstance(n.target, torch._ops.OpOverload) for n in loaded.graph.nodes)
        args, kwargs = _nested_inputs()
        a, b = copy.deepcopy(gm), loaded
        torch.testing.assert_close(b(*args, **kwargs), a(*args, **kwargs))
        for name, buf in a.named_buffers():
            torch.testing.assert_close(b.get_buffer(name), buf)
        assert len(loaded.graph.guards) == len(gm.graph.guards)


def test_namedtuple_inputs_and_outputs():
    Out = collections.namedtuple("Out", ["lo", "hi"])

    class NT(nn.Module):
        def forward(self, p):
            return Out(p.lo - 1, [p.hi + 1, None])

    x = torch.randn(2)
    gm = from_export(_export(NT(), (Out(x, x * 3),)))
    out = gm(Out(x, x * 2))
    assert type(out) is Out and out.hi[1] is None
    torch.testing.assert_close(out.lo, x - 1)
    torch.testing.assert_close(out.hi[0], x * 2 + 1)
    with pytest.raises(GuardError, match="is a"):
        gm((x, x))  # a plain tuple is not the namedtuple the program was exported for


class Pair:
    """A user class registered with torch.utils._pytree."""

    def __init__(self, a, b, tag):
        self.a, self.b, self.tag = a, b, tag


_pt = torch.utils._pytree
_pt.register_pytree_node(
    Pair, lambda p: ([p.a, p.b], p.tag), lambda kids, tag: Pair(kids[0], kids[1], tag),
    flatten_with_keys_fn=lambda p: ([(_pt.GetAttrKey("a"), p.a), (_pt.GetAttrKey("b"), p.b)], p.tag))


def test_registered_pytree_classes_in_and_out():
    class Swap(nn.Module):
        def forward(self, p, od):
            return Pair(p.b * 2, p.a + od["k"], p.tag), collections.OrderedDict(s=od["k"].sum())

    x, y = torch.randn(3), torch.randn(3)
    od = collections.OrderedDict(k=torch.ones(3))
    gm = from_export(_export(Swap(), (Pair(x, y, "t"), od)))
    gm.graph.lint()
    out, od_out = gm(Pair(y, x, "t"), od)
    assert type(out) is Pair and out.tag == "t" and type(od_out) is collections.OrderedDict
    torch.testing.assert_close((out.a, out.b, od_out["s"]), (x * 2, y + 1, torch.tensor(3.0)))
    with pytest.raises(GuardError, match="_st_pytree_context"):
        gm(Pair(x, y, "other"), od)  # the context (here the tag) was exported as a constant


def test_clear_errors_for_what_is_not_a_program():
    ep = _export(nn.Linear(2, 2), (torch.randn(1, 2),))
    with pytest.raises(TypeError, match="pass the ExportedProgram itself"):
        from_export(ep.module())
    with pytest.raises(FxConversionError, match=r"custom code generator.*symtrace.from_export\(ep\)"):
        symtrace.from_fx(ep.module())  # and from_fx says why it cannot take ep.module()


# --- to_export -------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.bn = nn.BatchNorm1d(5)

    def forward(self, x):
        return torch.relu(self.bn(self.fc(x))).view(x.shape[0], -1)


def test_to_export_with_dynamic_batch_and_back():
    model = Block().eval()
    gm = symtrace.symbolic_trace(model, example_inputs=(torch.randn(3, 4),))
    ep = to_export(gm, (torch.randn(3, 4),), dynamic_shapes={"x": {0: Dim("batch")}})
    assert isinstance(ep, torch.export.ExportedProgram)
    (sym,) = ep.range_constraints  # the batch stayed symbolic
    for b in (1, 7):
        x = torch.randn(b, 4)
        torch.testing.assert_close(ep.module()(x), model(x))
    back = from_export(ep)
    x = torch.randn(9, 4)
    torch.testing.assert_close(back(x), model(x))


def test_to_export_with_kwargs_and_defaults():
    class Opt(nn.Module):
        def forward(self, x, scale=None, *, shift=1.0):
            return x * 2 + shift if scale is None else x * scale + shift

    x = torch.randn(2, 3)
    gm = symtrace.symbolic_trace(Opt(), example_inputs={"x": x, "shift": 0.5})
    ep = to_export(gm, (x,), {"shift": 0.5})  # scale keeps its default (None), which the graph guards
    torch.testing.assert_close(ep.module()(x, None, 0.5), x * 2 + 0.5)  # inputs in order, defaults filled
    with pytest.raises(GuardError, match="scale is None"):
        to_export(gm, (x, 2.0), {"shift": 0.5})
    with pytest.raises(TypeError, match="not the keyword argument 'bias'"):
        to_export(gm, (x,), {"bias": 0.5})


def test_to_export_keeps_symtrace_guards():
    class Branch(nn.Module):
        def forward(self, x):
            return x * 2 if x.shape[0] > 2 else x + 1

    x = torch.randn(3, 4)
    gm = symtrace.symbolic_trace(Branch(), example_inputs=(x,))
    with pytest.raises(Exception, match="Constraints violated") as info:
        to_export(gm, (x,), dynamic_shapes={"x": {0: Dim("batch")}})  # batch 1 would take the other branch
    assert "x.shape[0] > 2" in "".join(getattr(info.value, "__notes__", []))
    ep = to_export(gm, (x,), dynamic_shapes={"x": {0: Dim("batch", min=3)}})
    x5 = torch.randn(5, 4)
    torch.testing.assert_close(ep.module()(x5), x5 * 2)
    with pytest.raises(GuardError):
        to_export(gm, (torch.randn(2, 4),))  # example inputs the graph was not traced for


def test_to_export_data_guards():
    class Data(nn.Module):
        def forward(self, x):
            n, c = x.relu().shape  # a data guard on a size: exported as the program is
            return x * c * 2 if x.sum() > 0 else x  # a data guard on a value: refused

    x = torch.ones(3, 4)
    gm = symtrace.symbolic_trace(Data(), example_inputs=(x,))
    with pytest.raises(FxConversionError, match=r"data guard from .*if x.sum\(\) > 0"):
        to_export(gm, (x,))

    class Sizes(nn.Module):
        def forward(self, x):
            n, c = x.relu().shape
            return x * c

    gm = symtrace.symbolic_trace(Sizes(), example_inputs=(x,))
    assert any(n.target is symtrace.graph.guards.check_data_guard for n in gm.graph.nodes)
    ep = to_export(gm, (x,), dynamic_shapes={"x": {0: Dim("n")}})
    x5 = torch.randn(5, 4)
    torch.testing.assert_close(ep.module()(x5), x5 * 4)


def test_public_names():
    assert {"from_export", "to_export"} <= set(symtrace.__all__)
    assert symtrace.interop.onnx.export.__module__ == "symtrace.interop.onnx"


def test_higher_order_ops_run_but_are_not_saved(tmp_path):
    class Cond(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            with torch.no_grad():
                y = self.fc(x) * 2
            return torch.cond(x.sum() > 0, lambda a: a.sin(), lambda a: a.cos(), (y,))

    model = Cond()
    gm = from_export(_export(model, (torch.randn(2, 3),)))
    for sign in (1.0, -1.0):
        x = torch.full((2, 3), sign)
        torch.testing.assert_close(gm(x), model(x))
    with pytest.raises(symtrace.SerializationError):
        symtrace.save(gm, tmp_path / "cond.symtrace")
