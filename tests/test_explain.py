"""``symtrace.explain``: without inputs the trace is symbolic; with inputs it is specialised."""
import pytest
import torch
from torch import nn

import symtrace


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return torch.relu(self.fc(x)) * x.shape[0]


class Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # BRANCH
            return x * 2
        return x - 1


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if marker in line and "_line_of" not in line)


def test_no_inputs_traces_symbolically():
    report = symtrace.explain(Net())
    assert report.ok and report.symbolic and report.error is None
    gm = report.graph_module
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["x"]
    assert all("tensor_meta" not in n.meta for n in gm.graph.nodes)  # nothing was run on real data
    assert not any(g.kind in ("shape", "dtype", "ndim") for g in report.guards)
    text = str(report)
    assert text.startswith("Traced symbolically (no example inputs) into ") and "explain(model, x)" in text


def test_no_inputs_graph_computes_the_model():
    model = Net()
    gm = symtrace.explain(model).graph_module
    for batch in (1, 7):  # symbolic: not specialised on the batch size
        x = torch.randn(batch, 4)
        torch.testing.assert_close(gm(x), model(x))


def test_no_inputs_data_dependent_branch_is_the_error():
    report = symtrace.explain(Branchy())
    assert not report.ok and report.symbolic and isinstance(report.error, symtrace.TraceError)
    text = str(report)
    assert text.startswith("Tracing FAILED") and f"test_explain.py:{_line_of('# BRANCH')}" in text
    assert "if x.sum() > 0" in text


def test_with_inputs_specialises_and_guards_the_branch():
    report = symtrace.explain(Branchy(), torch.ones(2, 3))
    assert report.ok and not report.symbolic
    assert len(report.data_guards) == 1 and f"test_explain.py:{_line_of('# BRANCH')}" in report.data_guards[0].where()
    kinds = {g.kind for g in report.guards}
    assert {"dtype", "ndim"} <= kinds
    assert str(report).startswith("Traced into ")


def test_keyword_inputs_and_functions():
    report = symtrace.explain(Net(), x=torch.randn(2, 4))
    assert report.ok and not report.symbolic and any(g.kind == "dtype" for g in report.guards)

    def fn(a, b):
        return torch.tanh(a) + b

    report = symtrace.explain(fn)
    assert report.ok and report.symbolic
    assert [n.name for n in report.graph_module.graph.nodes if n.op == "placeholder"] == ["a", "b"]
    with pytest.raises(TypeError, match="either positional or keyword"):
        symtrace.explain(fn, torch.ones(1), b=torch.ones(1))
