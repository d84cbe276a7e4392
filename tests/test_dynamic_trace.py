"""symbolic_trace(dynamic_shapes=...): symbolic metadata, graphs general over sizes, size guards,
specialisation refused (issue 20)."""
import copy
import pickle
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import symtrace
from symtrace import Dim
from symtrace.errors import GuardError, SpecializedDimError, TraceError
from symtrace.graph.symbols import evaluate, is_symbolic
from symtrace.trace.dynamic import size_guards


def reshaping(x, y):
    b, s = x.shape[0], x.shape[1]
    h = (x @ y).relu()
    return h.view(b, s * 2, -1).sum(-1)


def _trace(fn, *inputs, spec):
    return symtrace.symbolic_trace(fn, example_inputs=inputs, dynamic_shapes=spec)


Y = torch.randn(8, 4)
GM = _trace(reshaping, torch.randn(3, 6, 8), Y, spec={"x": {1: Dim("seq")}})


def _metas(gm):
    return {n.name: str(n.meta["tensor_meta"]) for n in gm.graph.nodes if n.meta.get("tensor_meta") is not None}


def test_metadata_is_symbolic_and_tabular_shows_it():
    metas = _metas(GM)
    assert metas["x"] == "float32[3, seq, 8]"
    assert metas["y"] == "float32[8, 4]"
    assert metas["matmul"] == "float32[3, seq, 4]"
    assert metas["view"] == "float32[3, seq*2, 2]"
    assert metas["sum_1"] == "float32[3, seq*2]"
    x = next(iter(GM.graph.nodes))
    assert x.meta["tensor_meta"].stride == (x.meta["tensor_meta"].shape[1] * 8, 8, 1)
    table = symtrace.graph.tabular.format_tabular(GM)
    rows = {line.split()[1]: line for line in table.splitlines()[3:]}
    assert "float32[3, seq*2, 2]" in rows["view"]
    assert rows["mul"].split()[-2] == "seq*2"   # a size node shows the size it computes


def test_tabular_golden():
    def f(x):
        n = x.shape[1]
        return x.reshape(-1, n // 2, 2).sum(0)
    gm = _trace(f, torch.randn(3, 8), spec={"x": {1: Dim("n")}})
    from symtrace.graph.tabular import _rows
    cells = [[r[0], r[1], r[5]] for r in _rows(gm.graph.nodes)]
    assert cells == [["placeholder", "x", "float32[3, n]"],
                     ["call_function", "getattr_1", "[3, n]"],
                     ["call_function", "getitem", "n"],
                     ["call_function", "floordiv", "n//2"],
                     ["call_method", "reshape", "float32[3, n//2, 2]"],
                     ["call_method", "sum_1", "float32[n//2, 2]"],
                     ["output", "output", "float32[n//2, 2]"]]
    table = symtrace.graph.tabular.format_tabular(gm)
    assert all(c[2] in table for c in cells)
    # what torch assumed for view(-1) (n even), written over the symbol
    assert "n*3 == (n//2)*6" in gm.meta["shape_assumptions"]
    torch.testing.assert_close(gm(torch.ones(3, 10)), f(torch.ones(3, 10)))


@settings(max_examples=15, deadline=None)
@given(st.one_of(st.integers(2, 40), st.sampled_from([2, 3, 5, 7, 31, 97, 257, 1021])))
def test_graph_computes_sizes_for_every_size(s):
    x = torch.randn(3, s, 8)
    torch.testing.assert_close(GM(x, Y), reshaping(x, Y))


@pytest.mark.parametrize("s", [0, 1])
def test_zero_and_one_are_outside_the_default_range(s):
    with pytest.raises(GuardError, match=r"x.shape\[1\] >= 2"):
        GM(torch.randn(3, s, 8), Y)


def test_declared_min_zero_keeps_zero_and_one_symbolic():
    def mm(x, y):
        return (x @ y).softmax(-1) * x.shape[1]
    gm = _trace(mm, torch.randn(3, 6, 8), Y, spec={"x": {1: Dim("seq", min=0)}})
    assert _metas(gm)["mul"] == "float32[3, seq, 4]"
    for s in (0, 1, 5):
        x = torch.randn(3, s, 8)
        torch.testing.assert_close(gm(x, Y), mm(x, Y))


def test_example_outside_range_is_refused():
    with pytest.raises(ValueError, match="outside Dim"):
        _trace(reshaping, torch.randn(3, 1, 8), Y, spec={"x": {1: Dim("seq")}})


def test_declared_max_is_guarded():
    gm = _trace(reshaping, torch.randn(3, 6, 8), Y, spec={"x": {1: Dim("seq", max=16)}})
    gm(torch.randn(3, 16, 8), Y)
    with pytest.raises(GuardError, match=r"x.shape\[1\] <= 16"):
        gm(torch.randn(3, 17, 8), Y)
    assert size_guards(gm) == ["seq >= 2", "seq <= 16"]


def branchy(x):
    if x.shape[1] % 8 == 0:
        return x * 2
    return x + 1


BRANCHY = _trace(branchy, torch.randn(2, 16), spec=({1: Dim("n")},))


@settings(max_examples=12, deadline=None)
@given(st.integers(2, 100))
def test_branch_on_size_is_a_guard_over_the_symbol(s):
    gm = BRANCHY
    assert size_guards(gm) == ["n >= 2", "n % 8 == 0"]
    x = torch.randn(2, s)
    if s % 8 == 0:
        torch.testing.assert_close(gm(x), branchy(x))
    else:
        with pytest.raises(GuardError, match="over the size symbols: n % 8 == 0"):
            gm(x)


def test_shared_dim_declares_equal_sizes():
    def add(a, b):
        return a + b
    d = Dim("n")
    gm = _trace(add, torch.randn(5, 3), torch.randn(5, 3), spec={"a": {0: d}, "b": {0: d}})
    assert _metas(gm)["add"] == "float32[n, 3]"
    torch.testing.assert_close(gm(torch.ones(7, 3), torch.ones(7, 3)), torch.full((7, 3), 2.0))
    with pytest.raises(GuardError, match=r"a.shape\[0\] == b.shape\[0\]|b.shape\[0\] == a.shape\[0\]"):
        gm(torch.ones(7, 3), torch.ones(6, 3))


def test_int_of_a_dynamic_size_is_refused_naming_the_line():
    def f(x):
        n = int(x.shape[0])
        return x.reshape(n, -1)
    with pytest.raises(SpecializedDimError, match=r"dynamic dimension b \(x.shape\[0\]\).*test_dynamic_trace.py") as e:
        _trace(f, torch.randn(4, 3), spec={"x": {0: Dim("b")}})
    assert e.value.pinned == {("x", 0)}


def test_range_over_a_dynamic_size_is_refused():
    def f(x):
        return sum(x[i] for i in range(x.shape[0]))
    with pytest.raises(SpecializedDimError):
        _trace(f, torch.randn(4, 3), spec={"x": {0: Dim("b")}})
    # the static dimension may be read freely
    gm = _trace(f, torch.randn(4, 3), spec={"x": {1: Dim("c")}})
    x = torch.randn(4, 9)
    torch.testing.assert_close(gm(x), f(x))


def test_equality_branch_on_a_size_pins_it():
    def f(x):
        return x * 2 if x.shape[0] == 4 else x
    with pytest.raises(SpecializedDimError):
        _trace(f, torch.randn(4, 3), spec={"x": {0: Dim("b")}})


class Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3, stride=2)

    def forward(self, x):
        return self.conv(x).flatten(1)


def test_module_floor_division_sizes():
    m = Conv()
    gm = _trace(m, torch.randn(2, 3, 11), spec={"x": {0: Dim("b"), 2: Dim("L", min=3)}})
    metas = _metas(gm)
    assert metas["conv"] == "float32[b, 4, (L + 1)//2 - 1]"
    assert metas["flatten"] == "float32[b, ((L + 1)//2)*4 - 4]"
    for b, L in [(2, 3), (5, 4), (3, 17), (4, 100)]:
        x = torch.randn(b, 3, L)
        out = gm(x)
        torch.testing.assert_close(out, m(x))
        flat = next(n for n in gm.graph.nodes if n.name == "flatten").meta["tensor_meta"]
        assert evaluate(flat.shape, {"b": b, "L": L}) == tuple(out.shape)


def test_pickle_and_copy_keep_symbolic_metadata():
    for gm in (pickle.loads(pickle.dumps(GM)), copy.deepcopy(GM)):
        assert _metas(gm) == _metas(GM)
        view = next(n for n in gm.graph.nodes if n.name == "view")
        assert hash(view.meta["tensor_meta"].shape[1]) == hash(next(
            n for n in GM.graph.nodes if n.name == "view").meta["tensor_meta"].shape[1])
        x = torch.randn(3, 9, 8)
        torch.testing.assert_close(gm(x, Y), reshaping(x, Y))


def test_static_trace_has_no_symbols():
    gm = symtrace.symbolic_trace(reshaping, example_inputs=(torch.randn(3, 6, 8), Y))
    assert not any(is_symbolic(n.meta["tensor_meta"].shape) for n in gm.graph.nodes
                   if n.meta.get("tensor_meta") is not None)
    assert not any("size" in n.meta for n in gm.graph.nodes)
    assert "dynamic_inputs" not in gm.meta


def test_data_dependent_node_loses_metadata_with_a_note():
    def f(x):
        idx = torch.nonzero(x > 0)
        return idx.float().sum() + x.sum()
    gm = _trace(f, torch.randn(5, 3), spec={"x": {0: Dim("b")}})
    assert "nonzero" not in _metas(gm) and "float_1" not in _metas(gm)
    assert any(kind == "symbolic shape" and "nonzero" in text for kind, text, _ in gm.meta["trace_notes"])
    x = torch.randn(9, 3)
    torch.testing.assert_close(gm(x), f(x))


def test_spec_errors():
    with pytest.raises(TraceError, match="needs example_inputs"):
        symtrace.symbolic_trace(reshaping, dynamic_shapes={"x": {1: Dim("s")}})
    with pytest.raises(ValueError, match="not an input"):
        _trace(reshaping, torch.randn(3, 6, 8), Y, spec={"z": {1: Dim("s")}})
    with pytest.raises(TraceError, match="not dense"):
        _trace(reshaping, torch.randn(3, 12, 8)[:, ::2], Y, spec={"x": {1: Dim("s")}})


def test_permuted_input_keeps_its_layout():
    x = torch.randn(3, 8, 6).transpose(1, 2)
    gm = _trace(reshaping, x, Y, spec={"x": {1: Dim("seq")}})
    meta = next(iter(gm.graph.nodes)).meta["tensor_meta"]
    assert [str(s) for s in meta.stride] == ["seq*8", "1", "seq"]


# --- capture: declared and automatic dynamic dimensions --------------------------------------
from symtrace.graph.guard_expr import Attr, Const, Input, Item  # noqa: E402
from symtrace.graph.guards import Guard  # noqa: E402


def specialise_static_sizes(gm):
    """A pass standing in for a lowering that compiles for the sizes its metadata shows: the
    graph then accepts only those static sizes (symbolic ones stay free)."""
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.meta.get("tensor_meta") is not None:
            for i, d in enumerate(n.meta["tensor_meta"].shape):
                if isinstance(d, int):
                    gm.graph.guards.append(Guard("shape", Item(Attr(Input(n.name), "shape"), Const(i)), d, "eq"))
    gm.recompile()


class Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        b, t = x.shape[0], x.shape[1]
        return self.fc(x).view(b * t, -1).softmax(-1)


def test_growing_sequence_captures_at_most_twice():
    m = Seq()
    cap = symtrace.capture(m, passes=[specialise_static_sizes], automatic_dynamic=True)
    for t in range(3, 12):
        x = torch.randn(2, t, 8)
        torch.testing.assert_close(cap(x), m(x))
    assert cap.captures == 2
    assert cap.dynamic_dims == {"x": {1: "s0"}}
    meta = next(iter(cap.graphs[0].graph.nodes)).meta["tensor_meta"]
    assert str(meta) == "float32[2, s0, 8]"
    # a new batch size makes that dimension symbolic too: one more capture, then none
    for b in (3, 4, 5):
        x = torch.randn(b, 7, 8)
        torch.testing.assert_close(cap(x), m(x))
    assert cap.captures == 3 and cap.dynamic_dims == {"x": {1: "s0", 0: "s1"}}


def test_without_automatic_dynamic_every_size_captures():
    m = Seq()
    cap = symtrace.capture(m, passes=[specialise_static_sizes], automatic_dynamic=False)
    for t in range(3, 7):
        cap(torch.randn(2, t, 8))
    assert cap.captures == 4 and cap.dynamic_dims == {}


def test_size_one_stays_static_and_other_changes_are_not_sizes():
    m = Seq()
    cap = symtrace.capture(m, passes=[specialise_static_sizes], automatic_dynamic=True)
    cap(torch.randn(2, 1, 8))
    cap(torch.randn(2, 5, 8))    # 1 -> 5: a specialisation of 1, not a size that grows
    assert cap.captures == 2 and cap.dynamic_dims == {}
    cap(torch.randn(2, 6, 8))
    assert cap.captures == 3 and cap.dynamic_dims == {"x": {1: "s0"}}
    cap(torch.randn(2, 9, 8))
    assert cap.captures == 3


def test_automatic_dimension_the_program_pins_stays_static():
    def f(x):
        return sum(x[:, i] for i in range(x.shape[1]))
    cap = symtrace.capture(f, automatic_dynamic=True)
    for t in (3, 4, 5):
        x = torch.randn(2, t)
        torch.testing.assert_close(cap(x), f(x))
    assert cap.captures == 3 and cap.dynamic_dims == {}


class _RingState:
    """A cache-like object: per-layer tensors and a Python int count of what was seen (as
    transformers' sliding-window cache layers keep ``cumulative_length``)."""

    def __init__(self, layers=2, window=6):
        self.layers = [_RingLayer(window) for _ in range(layers)]


class _RingLayer:
    def __init__(self, window):
        self.keys = torch.zeros(1, 0, 4)
        self.seen = 0
        self.window = window


def _ring_step(x, state):
    outs = []
    for layer in state.layers:
        layer.seen += x.shape[1]
        keys = torch.cat([layer.keys, x], 1)
        layer.keys = keys[:, -layer.window:]
        offset = max(layer.seen - layer.window, 0)     # traced, not a branch on the count
        full = layer.seen >= layer.window               # a branch: one more capture when it flips
        scale = 2.0 if full else 1.0
        outs.append(keys.sum(1) * scale + offset)
    return torch.stack(outs)


def test_int_inputs_that_change_are_traced_not_specialised():
    # each call's count differs: after one failing value guard, the ints at that place (every
    # layer's, list positions generalised) are traced values; decisions on them become guards
    # over them, and max() on them a graph node: one capture per side of the branch, not per call
    cap = symtrace.capture(_ring_step)
    eager, traced = _RingState(), _RingState()
    for t in [3] + [1] * 8:
        x = torch.randn(1, t, 4)
        torch.testing.assert_close(cap(x, traced), _ring_step(x, eager))
        assert [layer.seen for layer in traced.layers] == [layer.seen for layer in eager.layers]
        assert all(torch.equal(a.keys, b.keys) for a, b in zip(traced.layers, eager.layers))
    # the first call (count 0, specialised); traced from the second on (full False); full True
    assert cap.captures == 3, cap.captures
    assert cap.dynamic_values == {"state.layers[*].seen"}
    gm = cap.graphs[0]
    assert any(n.op == "call_function" and n.target is max for n in gm.graph.nodes)


def test_max_and_min_of_traced_sizes_are_graph_nodes():
    def f(x):
        return x[:, max(x.shape[1] - 4, 0):].sum(1) * min(x.shape[1], 5)
    gm = symtrace.symbolic_trace(f, example_inputs=(torch.randn(2, 6),), dynamic_shapes={"x": {1: Dim("s")}})
    for t in (2, 3, 6, 9):   # on both sides of 4 and 5: no guard fails, the graph computes both
        x = torch.randn(2, t)
        torch.testing.assert_close(gm(x), f(x))
    assert sum(n.target in (max, min) for n in gm.graph.nodes if n.op == "call_function") == 2
    assert max(3, 4) == 4 and min([2, 1]) == 1   # (untouched outside tracing)


def test_capture_with_declared_dims():
    m = Seq()
    cap = symtrace.capture(m, passes=[specialise_static_sizes], dynamic_shapes={"x": {0: Dim("b"), 1: Dim("t")}})
    for b, t in [(2, 3), (4, 9), (7, 2)]:
        x = torch.randn(b, t, 8)
        torch.testing.assert_close(cap(x), m(x))
    assert cap.captures == 1
    assert str(next(iter(cap.graphs[0].graph.nodes)).meta["tensor_meta"]) == "float32[b, t, 8]"


def test_capture_refuses_a_declared_dim_the_program_pins():
    def f(x):
        return sum(x[:, i] for i in range(x.shape[1]))
    cap = symtrace.capture(f, dynamic_shapes={"x": {1: Dim("t")}})
    with pytest.raises(SpecializedDimError, match=r"x.shape\[1\] declared dynamic"):
        cap(torch.randn(2, 3))


# --- propagate_shapes(mode="symbolic") -----------------------------------------------------
from symtrace.passes import propagate_shapes  # noqa: E402


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.fc(x).view(b * t, 16)
        return self.bn(h).reshape(b, t, 4, 4).transpose(1, 2)


def test_propagate_shapes_symbolic_on_a_static_graph():
    m = Block().train()
    x = torch.randn(2, 5, 8)
    gm = symtrace.symbolic_trace(m, example_inputs=(x,))
    before = m.bn.running_mean.clone()
    propagate_shapes(gm, x, dynamic_shapes={"x": {0: Dim("b"), 1: Dim("t")}})
    metas = _metas(gm)
    assert metas["x"] == "float32[b, t, 8]"
    assert metas["view"] == "float32[b*t, 16]"
    assert metas["transpose"] == "float32[b, 4, t, 4]"
    tm = next(n for n in gm.graph.nodes if n.name == "transpose").meta["tensor_meta"]
    assert [str(s) for s in tm.stride] == ["t*16", "4", "16", "1"]
    assert torch.equal(m.bn.running_mean, before)   # the fake run changed no state
    # real propagation afterwards replaces the symbols (and the size annotations)
    propagate_shapes(gm, x)
    assert _metas(gm)["view"] == "float32[10, 16]"
    assert not any("size" in n.meta for n in gm.graph.nodes)


def test_propagate_shapes_symbolic_reuses_traced_symbols():
    gm = copy.deepcopy(GM)
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            n.meta.pop("tensor_meta", None)
    propagate_shapes(gm, torch.randn(3, 4, 8), Y, mode="symbolic")
    assert _metas(gm) == _metas(GM)


def test_propagate_shapes_symbolic_needs_symbols():
    gm = symtrace.symbolic_trace(reshaping, example_inputs=(torch.randn(3, 6, 8), Y))
    with pytest.raises(ValueError, match="no input of the graph has symbolic sizes"):
        propagate_shapes(gm, torch.randn(3, 6, 8), Y, mode="symbolic")


# --- to_fx carries the dims; torch.export accepts them -------------------------------------
from symtrace.interop.fx import export_dynamic_shapes  # noqa: E402


def test_to_fx_carries_dims_and_torch_export_accepts_them():
    m = Seq()
    d = Dim("t", max=64)
    gm = symtrace.symbolic_trace(m, example_inputs=(torch.randn(2, 5, 8),), dynamic_shapes={"x": {1: d}})
    fx_gm = symtrace.to_fx(gm)
    x_node = next(iter(fx_gm.graph.nodes))
    assert x_node.meta["symtrace_dynamic_dims"] == {1: d}
    assert str(x_node.meta["symtrace_tensor_meta"]) == "float32[2, t, 8]"
    assert "tensor_meta" not in x_node.meta   # FX's TensorMetadata holds ints only
    spec = export_dynamic_shapes(fx_gm)
    assert list(spec) == ["x"] and spec["x"][1].__name__ == "t"
    ep = torch.export.export(fx_gm, (torch.randn(2, 5, 8),), dynamic_shapes=spec)
    for t in (3, 17, 64):
        x = torch.randn(2, t, 8)
        torch.testing.assert_close(ep.module()(x), m(x))
    # the same Dims, written by hand as torch.export takes them
    torch.export.export(fx_gm, (torch.randn(2, 5, 8),),
                        dynamic_shapes={"x": {1: torch.export.Dim("t", min=2, max=64)}})
    back = symtrace.from_fx(fx_gm)
    assert _metas(back) == _metas(gm)
    assert not any("symtrace_dynamic_dims" in n.meta for n in back.graph.nodes)


def test_to_fx_of_a_static_graph_has_no_dims():
    fx_gm = symtrace.to_fx(symtrace.symbolic_trace(Seq(), example_inputs=(torch.randn(2, 5, 8),)))
    assert export_dynamic_shapes(fx_gm) is None
    assert "tensor_meta" in next(iter(fx_gm.graph.nodes)).meta


def test_metadata_run_writes_no_real_tensor():
    class Acc(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("total", torch.zeros(3))

        def forward(self, x, y):
            y.add_(1)
            self.total.add_(x.sum(0))
            return x + y

    m, x, y = Acc(), torch.ones(4, 3), torch.zeros(3)
    gm = _trace(m, x, y, spec={"x": {0: Dim("b")}})
    assert torch.equal(y, torch.zeros(3)) and torch.equal(m.total, torch.zeros(3))
    assert _metas(gm)["output"] == "float32[b, 3]"


def test_parameter_whose_placeholder_is_renamed():
    seq = nn.Sequential(nn.Conv1d(3, 4, 3, stride=2), nn.Flatten())   # forward(self, input)
    gm = _trace(seq, torch.randn(2, 3, 11), spec={"input": {2: Dim("L", min=3)}})
    first = next(iter(gm.graph.nodes))
    assert first.name != "input" and str(first.meta["tensor_meta"]) == "float32[2, 3, L]"
    x = torch.randn(2, 3, 20)
    torch.testing.assert_close(gm(x), seq(x))
    with pytest.raises(GuardError):
        gm(torch.randn(2, 3, 2))


def test_example_of_size_one_is_hinted_as_two():
    def f(x, y):
        return (x + y).sum(1) * 2
    gm = _trace(f, torch.randn(1, 3), torch.randn(1, 3), spec={"x": {0: Dim("b", min=1)}})
    assert _metas(gm)["output"] == "float32[b]"   # not pinned to the example's 1
    for b in (1, 4):
        x, y = torch.randn(b, 3), torch.randn(1, 3)
        torch.testing.assert_close(gm(x, y), f(x, y))


def test_symbol_torch_pins_is_reported():
    from symtrace.graph.symbolic_shapes import SymbolicShapes
    from symtrace.graph.symbols import Sym
    shapes = SymbolicShapes()
    b = shapes.symint(Sym("b", 2, 10), 5)
    assert shapes.specialised() == {}
    torch._check(b == 5)   # as a kernel that needs one size would
    assert shapes.specialised() == {"b": 5}


def test_to_export_uses_the_traced_dims():
    gm = _trace(reshaping, torch.randn(3, 6, 8), Y, spec={"x": {0: Dim("b"), 1: Dim("seq", max=512)}})
    ep = symtrace.to_export(gm, (torch.randn(3, 6, 8), Y))
    for b, s in [(2, 2), (5, 9), (4, 512)]:
        x = torch.randn(b, s, 8)
        torch.testing.assert_close(ep.module()(x, Y), reshaping(x, Y))
    with pytest.raises(Exception):   # the declared range travels: 513 is outside it
        ep.module()(torch.randn(2, 513, 8), Y)


def test_example_inputs_by_keyword():
    gm = symtrace.symbolic_trace(reshaping, example_inputs={"x": torch.randn(3, 6, 8), "y": Y},
                                 dynamic_shapes={"x": {1: Dim("seq")}})
    assert _metas(gm)["sum_1"] == "float32[3, seq*2]"
    x = torch.randn(3, 4, 8)
    torch.testing.assert_close(gm(x=x, y=Y), reshaping(x, Y))


_W = torch.randn(4, 8)
_PRODUCTS = {   # name: (function, example inputs, dynamic dims, node name, expected metadata)
    "matmul": (lambda x: torch.matmul(x, _W.t()), (torch.randn(3, 6, 8),), ({1: Dim("s")},),
               "matmul", "float32[3, s, 4]"),
    "at_3d_2d": (lambda x: x @ _W.t(), (torch.randn(3, 6, 8),), ({1: Dim("s")},), "matmul", "float32[3, s, 4]"),
    "at_3d_3d": (lambda x, y: x @ y, (torch.randn(3, 6, 8), torch.randn(3, 8, 5)), ({0: Dim("b"), 1: Dim("s")},
                 {0: Dim("b")}), "matmul", "float32[b, s, 5]"),
    "at_2d_3d": (lambda x: _W @ x, (torch.randn(3, 8, 6),), ({2: Dim("s")},), "matmul", "float32[3, 4, s]"),
    "bmm": (lambda x, y: torch.bmm(x, y), (torch.randn(3, 6, 8), torch.randn(3, 8, 5)), ({1: Dim("s")}, None), "bmm",
            "float32[3, s, 5]"),
    "linear": (lambda x: nn.functional.linear(x, _W), (torch.randn(3, 6, 8),), ({0: Dim("b"), 1: Dim("s")},),
               "linear", "float32[b, s, 4]"),
    "linear_bias": (nn.Linear(8, 4), (torch.randn(3, 6, 8),), ({1: Dim("s")},), "linear", "float32[3, s, 4]"),
}


@pytest.mark.parametrize("name", sorted(_PRODUCTS))
def test_matrix_products_keep_symbolic_metadata(name):
    # torch 2.11's C++ matmul called numel() on its symbolic inputs and the fake run dropped
    # the metadata from there on, with a note (issue 20)
    fn, inputs, spec, node, expected = _PRODUCTS[name]
    gm = symtrace.symbolic_trace(fn, example_inputs=inputs, dynamic_shapes=spec)
    assert _metas(gm)[node] == expected
    assert _metas(gm)["output"] == expected
    assert not [t for kind, t, _ in gm.meta["trace_notes"] if kind == "symbolic shape"]
    assert gm.meta["shape_assumptions"] == []
    bigger = tuple(torch.randn(*[9 if i in (d or {}) else n for i, n in enumerate(t.shape)])
                   for t, d in zip(inputs, spec))
    torch.testing.assert_close(gm(*bigger), fn(*bigger))


def test_fake_run_takes_torchs_symbolic_matmul(monkeypatch):
    # composite ops run as under Dynamo, through torch's Python decompositions written for
    # symbolic sizes; matmul's C++ kernel read concrete sizes on torch 2.11
    decomps = pytest.importorskip("torch._decomp.decompositions")
    if not hasattr(decomps, "should_fold"):
        pytest.skip("this torch has no Python matmul decomposition")
    seen = []
    original = decomps.should_fold
    monkeypatch.setattr(decomps, "should_fold", lambda *a, **k: seen.append(a[0].shape) or original(*a, **k))
    gm = symtrace.symbolic_trace(lambda x: x @ _W.t(), example_inputs=(torch.randn(3, 6, 8),),
                                 dynamic_shapes=({1: Dim("s")},))
    assert _metas(gm)["matmul"] == "float32[3, s, 4]"
    assert seen and all(isinstance(shape[1], torch.SymInt) for shape in seen)


class _InPlaceAndState(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = x * 2
        y += 1                      # operator.iadd: a registered side effect that is a tensor op
        with torch.no_grad():       # grad-mode switches: run, so requires_grad stays right
            z = self.lin(y)
        cells = [z]
        cells[0] = cells[0] + 1     # setitem on the program's own list
        return cells[0].relu() * random.random()


def test_symbolic_metadata_runs_tensor_ops_with_side_effects_and_skips_python_writes():
    # the fake-tensor pass must not run replayed writes into the caller's objects, but it must
    # run in-place tensor operators, grad-mode switches and random draws: every node keeps
    # symbolic metadata (an over-broad skip left everything after `y += 1` without any)
    gm = symtrace.symbolic_trace(_InPlaceAndState(), example_inputs=(torch.randn(4, 8),),
                                 dynamic_shapes={"x": {0: Dim("b")}})
    metas = {n.name: n.meta.get("tensor_meta") for n in gm.graph.nodes if n.op != "placeholder"}
    out = [n for n in gm.graph.nodes if n.op == "output"][0]
    assert str(out.meta["tensor_meta"].shape[0]) == "b", metas
    lin = [n for n in gm.graph.nodes if n.op == "call_module"][0]
    assert lin.meta["tensor_meta"].requires_grad is False   # computed under no_grad
    assert torch.is_grad_enabled()
