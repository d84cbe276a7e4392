"""symtrace.passes.shape_prop: tensor metadata from real, meta and fake runs."""
import copy

import pytest
import torch
from torch import nn

import symtrace
from examples.models import build, example_inputs
from symtrace.errors import GuardError, NodeRunError
from symtrace.graph import TensorMeta
from symtrace.passes.shape_prop import ShapeProp, propagate_shapes

MODES = ["real", "meta", "fake"]


@pytest.fixture(scope="module", params=["resnet", "transformer"])
def traced(request):
    model = build(request.param)
    inputs = example_inputs(request.param)
    gm = symtrace.symbolic_trace(model, example_inputs=inputs)
    # the tracer ran every op on the example values: its tensor_meta is the eager truth
    truth = {n.name: n.meta.get("tensor_meta") for n in gm.graph.nodes}
    truth["output"] = TensorMeta.of(model(*inputs))
    return model, inputs, gm, truth


def _clear(gm):
    for n in gm.graph.nodes:
        n.meta.pop("tensor_meta", None)


@pytest.mark.parametrize("mode", MODES)
def test_example_models_get_the_eager_shapes_dtypes_and_strides(traced, mode):
    model, inputs, gm, truth = traced
    state = {k: v.clone() for k, v in model.state_dict().items()}
    _clear(gm)
    propagate_shapes(gm, *inputs, mode=mode)
    for n in gm.graph.nodes:
        if truth[n.name] is None:
            continue
        got = n.meta.get("tensor_meta")
        assert got is not None, f"{mode}: {n.name} has no tensor_meta"
        want = truth[n.name]
        assert (got.shape, got.dtype, got.stride) == (want.shape, want.dtype, want.stride), n.name
        assert got.device == want.device and got.requires_grad == want.requires_grad, n.name
    # the model is untouched: same values, still on the CPU
    after = model.state_dict()
    assert all(torch.equal(after[k], v) and after[k].device.type == "cpu" for k, v in state.items())
    gm.graph.lint()
    torch.testing.assert_close(gm(*inputs), model(*inputs))


def test_tuples_of_tensors_get_a_tuple_of_tensor_meta():
    def f(x):
        a, b = x.chunk(2, dim=1)
        return a * 2, x.shape[0]

    x = torch.randn(3, 4)
    gm = symtrace.symbolic_trace(f, example_inputs=(x,))
    _clear(gm)
    for mode in MODES:
        propagate_shapes(gm, x, mode=mode)
        chunk = gm.graph.find_nodes(op="call_method", target="chunk")[0]
        assert chunk.tensor_meta == tuple(TensorMeta.of(t) for t in x.chunk(2, dim=1))
        assert chunk.tensor_meta[0].stride == (4, 1)
        out = gm.graph.output_node().tensor_meta
        assert out[0].shape == (3, 2) and out[1] is None  # (tensor, int)
        getattr_nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is getattr]
        assert all("tensor_meta" not in n.meta for n in getattr_nodes)  # x.shape is no tensor
    torch.testing.assert_close(gm(x), f(x))


def test_real_mode_leaves_inputs_buffers_and_rng_as_they_were():
    class Stats(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)
            self.register_buffer("count", torch.zeros(()))

        def forward(self, x):
            self.count.add_(1)
            x.mul_(2)
            return self.bn(x) + torch.rand(4)

    torch.manual_seed(0)
    m = Stats().train()
    x = torch.randn(8, 4)
    gm = symtrace.symbolic_trace(m, example_inputs=(x.clone(),))
    x0, state0 = x.clone(), {k: v.clone() for k, v in m.state_dict().items()}
    rng = torch.random.get_rng_state()
    propagate_shapes(gm, x, mode="real")
    assert torch.equal(x, x0)
    assert all(torch.equal(m.state_dict()[k], v) for k, v in state0.items())
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert gm.graph.find_nodes(op="call_module", target="bn")[0].tensor_meta.shape == (8, 4)
    # and the graph still computes what the model computes (both update their state once)
    torch.manual_seed(1)
    got = gm(x.clone())
    torch.manual_seed(1)
    want = m(x.clone())
    torch.testing.assert_close(got, want)


def test_entry_guards_are_checked_on_the_inputs_as_given():
    model, inputs = build("transformer"), example_inputs("transformer")
    gm = symtrace.symbolic_trace(model, example_inputs=inputs)
    with pytest.raises(GuardError):
        propagate_shapes(gm, torch.randn(2, 8), mode="meta")  # wrong rank
    # meta inputs fail the device guard, unless guards are skipped
    meta_x = torch.empty(2, 8, 64, device="meta")
    with pytest.raises(GuardError):
        propagate_shapes(gm, meta_x, mode="meta")
    _clear(gm)
    propagate_shapes(gm, meta_x, mode="meta", check_guards=False)
    assert gm.graph.output_node().tensor_meta.shape == (2, 8, 64)
    # with meta inputs, recorded devices come from the parameters
    assert gm.graph.output_node().tensor_meta.device == torch.device("cpu")


def test_data_guards_are_skipped_without_data_and_data_dependent_ops_name_the_node():
    def f(x):
        if x.sum() > 0:  # a data guard
            x = x + torch.ones(4)  # a factory inside the graph
        return x[x > 0.5].sum() + x.nonzero().shape[0]

    x = torch.ones(4)
    gm = symtrace.symbolic_trace(f, example_inputs=(x,))
    propagate_shapes(gm, x, mode="real")
    assert gm.graph.output_node().tensor_meta.shape == ()
    for mode in ("meta", "fake"):
        with pytest.raises(NodeRunError, match=rf"cannot run node %\w+ = .* on {mode} tensors.*mode='real'"):
            propagate_shapes(gm, x, mode=mode)

    def g(x):
        if x.sum() > 0:
            x = x + torch.ones(4)
        return x * 2

    gm = symtrace.symbolic_trace(g, example_inputs=(x,))
    assert any(n.target is symtrace.graph.guards.check_data_guard for n in gm.graph.nodes)
    for mode in MODES:
        _clear(gm)
        propagate_shapes(gm, x, mode=mode)
        tm = gm.graph.output_node().tensor_meta
        assert (tm.shape, tm.dtype, tm.device.type) == ((4,), torch.float32, "cpu")
    torch.testing.assert_close(gm(x), g(x))


def test_meta_never_touches_the_module_and_fake_keeps_devices():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    x = torch.randn(3, 4)
    gm = symtrace.symbolic_trace(m, example_inputs=(x,))
    before = copy.deepcopy(m.state_dict())
    for mode in ("meta", "fake"):
        propagate_shapes(gm, x, mode=mode)
        assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
        assert m[1].num_batches_tracked.item() == 0
        assert all(p.device.type == "cpu" and type(p) is nn.Parameter for p in m.parameters())
        assert gm.graph.output_node().tensor_meta.device == torch.device("cpu")


def test_shape_prop_returns_the_output_and_rejects_unknown_modes():
    x = torch.randn(2, 3)
    gm = symtrace.symbolic_trace(lambda x: x.t() @ x, example_inputs=(x,))
    out = ShapeProp(gm, "meta").run(x)
    assert out.device.type == "meta" and out.shape == (3, 3)
    with pytest.raises(ValueError, match="unknown shape propagation mode 'abstract'"):
        propagate_shapes(gm, x, mode="abstract")


def test_interpreter_checks_guards_of_a_renamed_placeholder():
    m = nn.Sequential(nn.Linear(4, 4))
    x = torch.randn(3, 4)
    gm = symtrace.symbolic_trace(m, example_inputs=(x,))
    torch.testing.assert_close(symtrace.Interpreter(gm, check_guards=True).run(x), m(x))
