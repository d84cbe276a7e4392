"""symtrace as a torch.compile backend: Dynamo's graphs (one per graph break) come through
from_fx, the user's passes run on them, numerics match eager. Each compile costs seconds on a
CPU, so there are few compiles here."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symtrace.interop.dynamo as dynamo_backend
from symtrace.interop.dynamo import backend, example_values
from symtrace.passes import PassContext

_dynamo = pytest.importorskip("torch._dynamo")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    _dynamo.reset()
    yield
    _dynamo.reset()


class Breaky(nn.Module):
    """Three graphs: a print() breaks the first, a Python branch on .item() the second."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = torch.relu(self.fc(x))  # line: fc
        print("graph break")
        if h.sum().item() > 1.0:
            h = h * 2
        return torch.relu(h - 1)


def _reference(model, x, act):
    h = act(model.fc(x))
    if h.sum().item() > 1.0:
        h = h * 2
    return act(h - 1)


def _inputs(n, scale, seed):
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(seed)) * scale


def _line(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# line: {marker}"))


def test_graph_breaks_numerics_dynamic_sizes_and_meta(capsys, monkeypatch):
    torch.manual_seed(0)
    model = Breaky()
    eager = copy.deepcopy(model)
    lowered = []

    def fake_lower(gm, example_inputs, target):  # stands in for symtrace.lower.compile
        lowered.append((target, example_inputs))
        return gm.forward

    monkeypatch.setattr(dynamo_backend, "_lower_compile", lambda target: fake_lower)
    be = backend(target="some-target")
    compiled = torch.compile(model, backend=be)
    for i, x in enumerate([_inputs(3, 2.0, 0), _inputs(3, 0.01, 1), _inputs(5, 2.0, 2)]):
        x.requires_grad_(True)
        xe = x.detach().clone().requires_grad_(True)
        out, ref = compiled(x), eager(xe)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        out.sum().backward()
        ref.sum().backward()
        torch.testing.assert_close(x.grad, xe.grad, rtol=0, atol=0)
    assert capsys.readouterr().out.count("graph break") == 6  # 3 compiled + 3 eager calls: print ran
    # both branches and the recompile for a new batch size (dynamic, SymInt inputs) went through
    assert len(be.graphs) >= 4
    first = be.graphs[0]
    first.graph.lint()
    lin = next(n for n in first.graph.nodes if n.op == "call_function" and n.target is F.linear)
    assert lin.meta["source"].filename == os.path.abspath(__file__) and lin.meta["source"].lineno == _line("fc")
    assert lin.meta["module_path"] == "fc"
    assert lin.tensor_meta.shape == (3, 4) and lin.tensor_meta.device == torch.device("cpu")
    dynamic = [g for g in be.graphs if any(n.meta.get("example_value").__class__ is torch.SymInt
                                          for n in g.graph.nodes if n.op == "placeholder")]
    assert dynamic, "expected a graph compiled for dynamic sizes"
    # the lowering step got concrete examples: this call's sizes, real tensors
    assert len(lowered) == len(be.graphs) and {t for t, _ in lowered} == {"some-target"}
    assert len(be.lowered) == len(be.graphs)  # what the lowering returned, kept in compile order
    last = lowered[-1][1]
    assert 5 in last and all(type(v) is int or type(v) in (torch.Tensor, nn.Parameter) for v in last)


def test_example_values_make_fakes_concrete():
    from torch._subclasses.fake_tensor import FakeTensorMode
    real = torch.randn(2, 3)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.randn(4, 3).t())
    out = example_values([fake, real, 7])
    assert type(out[0]) is torch.Tensor and out[0].shape == (3, 4) and out[0].stride() == (1, 3)
    assert out[1] is real and out[2] == 7


def test_passes_are_applied():
    torch.manual_seed(0)
    model = Breaky()
    seen = []

    def count_graphs(gm):
        seen.append(len(gm.graph))
        return False  # nothing changed

    def relu_to_gelu(gm):
        hits = gm.graph.find_nodes(op="call_function", target=torch.relu)
        for n in hits:
            n.target = F.gelu
        return len(hits)

    ctx = PassContext(lint=True)
    be = backend(passes=[count_graphs, relu_to_gelu], context=ctx)
    compiled = torch.compile(model, backend=be)
    x = _inputs(3, 2.0, 0)
    out = compiled(x)
    with torch.no_grad():
        torch.testing.assert_close(out, _reference(model, x, F.gelu))
        assert not torch.allclose(out, _reference(model, x, torch.relu))
    assert len(seen) == len(be.graphs) >= 3
    assert ("relu_to_gelu", True) in ctx.history and ("count_graphs", False) in ctx.history
    assert all(not g.graph.find_nodes(op="call_function", target=torch.relu) for g in be.graphs)


def test_lower_target_works_or_explains():
    try:
        be = backend(target="cpu")
    except ImportError as e:
        assert "symtrace.lower.compile" in str(e) and "target=None" in str(e)
        return
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = _inputs(2, 1.0, 0)
    torch.testing.assert_close(torch.compile(model, backend=be)(x), model(x))
    assert len(be.graphs) == 1 and len(be.lowered) == 1
    assert "kernel" in be.lowered[0].report()  # the ReLU went into a kernel


def test_bad_passes_are_refused():
    with pytest.raises(TypeError, match="pass 2 of 2 is a str"):
        backend(passes=[lambda gm: None, "cse"])
