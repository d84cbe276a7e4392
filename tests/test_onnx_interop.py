"""symtrace.interop.onnx.export: symtrace graph -> ONNX file, checked with onnxruntime."""
import importlib.util

import pytest
import torch
from torch import nn
from torch.export import Dim

import symtrace
from symtrace.interop import onnx as sonnx

_MISSING = sonnx.missing_packages() + [p for p in ("onnxruntime",) if importlib.util.find_spec(p) is None]
needs_onnx = pytest.mark.skipif(bool(_MISSING), reason=f"ONNX export tests need {', '.join(_MISSING)} "
                                "(pip install onnx onnxscript onnxruntime, or the dev extra)")


def _run(path, inputs):
    import onnxruntime as ort
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    assert len(names) == len(inputs)
    return [torch.from_numpy(o) for o in sess.run(None, {n: t.numpy() for n, t in zip(names, inputs)})]


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(nn.functional.gelu(self.bn(self.fc1(x))))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        h = nn.functional.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(h, 1), 1))


class TwoWay(nn.Module):
    def forward(self, x, y):
        s = x @ y.transpose(0, 1)
        return {"scores": torch.softmax(s, -1), "rest": (s.amax(-1), x * 2)}


def _eval(model):
    torch.manual_seed(0)
    model = model.eval()
    for m in model.modules():  # non-trivial running stats
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    return model


@needs_onnx
def test_mlp_dynamic_batch(tmp_path):
    model = _eval(MLP())
    gm = symtrace.symbolic_trace(model, example_inputs=(torch.randn(4, 8),))
    path = sonnx.export(gm, (torch.randn(4, 8),), tmp_path / "mlp.onnx", dynamic_shapes={"x": {0: Dim("batch")}})
    import onnx
    dims = onnx.load(path).graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param and dims[1].dim_value == 8  # the batch stayed symbolic
    for b in (1, 4, 11):
        x = torch.randn(b, 8)
        (out,) = _run(path, [x])
        torch.testing.assert_close(out, model(x).detach(), rtol=1e-5, atol=1e-5)


@needs_onnx
def test_convnet(tmp_path):
    model = _eval(ConvNet())
    x = torch.randn(2, 3, 16, 16)
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    (out,) = _run(sonnx.export(gm, (x,), tmp_path / "conv.onnx"), [x])
    torch.testing.assert_close(out, model(x).detach(), rtol=1e-5, atol=1e-5)


@needs_onnx
def test_nested_outputs_and_a_graph_from_export(tmp_path):
    """An ExportedProgram converted to symtrace (and edited) goes on to ONNX; outputs come out
    flattened in order."""
    x, y = torch.randn(3, 5), torch.randn(4, 5)
    gm = symtrace.from_export(torch.export.export(TwoWay(), (x, y)))
    for n in gm.graph.nodes:  # an edit: x * 2 -> x * 3
        if n.op == "call_function" and n.target is torch.ops.aten.mul.Tensor:
            n.args = (n.args[0], 3)
    outs = _run(sonnx.export(gm, (x, y), tmp_path / "two.onnx"), [x, y])
    ref = TwoWay()(x, y)
    for got, want in zip(outs, (ref["scores"], ref["rest"][0], x * 3)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_missing_packages_are_named(monkeypatch, tmp_path):
    monkeypatch.setattr(sonnx, "_NEEDED", ("onnx", "symtrace_no_such_package"))
    gm = symtrace.symbolic_trace(MLP().eval(), example_inputs=(torch.randn(2, 8),))
    with pytest.raises(ImportError, match="pip install .*symtrace_no_such_package"):
        sonnx.export(gm, (torch.randn(2, 8),), tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()
