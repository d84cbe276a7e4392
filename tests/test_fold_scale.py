"""fold_channel_scale: a constant per-output-channel multiply after a convolution or linear layer
(layer scale) folds into the layer's weights; everything else is left alone; shared state is
never changed."""
from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symtrace
from symtrace.lower import onednn
from symtrace.passes.fold_scale import fold_channel_scale


def _fold(model, *inputs):
    gm = symtrace.symbolic_trace(model, example_inputs=inputs)
    before = copy.deepcopy(model.state_dict())
    k = fold_channel_scale(gm)
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs), model(*inputs), rtol=1e-5, atol=1e-6)
    for name, t in model.state_dict().items():   # the user's model is untouched
        assert torch.equal(t, before[name]), name
    muls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")
            and getattr(n.target, "__name__", n.target) == "mul"]
    return k, muls, gm


class LayerScale(nn.Module):
    def __init__(self, layer, gamma_shape, how="method"):
        super().__init__()
        self.layer, self.how = layer, how
        self.gamma = nn.Parameter(torch.rand(gamma_shape) + 0.5)

    def forward(self, x):
        y = self.layer(x)
        if self.how == "method":   # timm ConvNeXt: x.mul(self.gamma.reshape(1, -1, 1, 1))
            return y.mul(self.gamma.reshape(1, -1, 1, 1)) + x
        if self.how == "left":
            return self.gamma * y + 1
        return y * self.gamma + 1


@pytest.mark.parametrize("bias", [True, False])
def test_conv_layer_scale_read_through_a_reshape_folds(bias):
    torch.manual_seed(0)
    m = LayerScale(nn.Conv2d(6, 6, 3, padding=1, bias=bias), (6,)).eval()
    k, muls, gm = _fold(m, torch.randn(2, 6, 5, 5))
    assert k == 1 and not muls
    assert not any(n.op == "get_attr" and "gamma" in n.target for n in gm.graph.nodes)


@pytest.mark.parametrize("how", ["left", "right"])
def test_linear_and_conv_scales_in_either_operand_order_fold(how):
    torch.manual_seed(0)
    k, muls, _ = _fold(LayerScale(nn.Linear(8, 5), (5,), how).eval(), torch.randn(3, 4, 8))
    assert k == 1 and not muls
    k, muls, _ = _fold(LayerScale(nn.Conv2d(3, 4, 1), (4, 1, 1), how).eval(), torch.randn(1, 3, 4, 4))
    assert k == 1 and not muls


def test_functional_layers_and_number_scales_fold():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.b = nn.Parameter(torch.randn(4, 3, 3, 3)), nn.Parameter(torch.randn(4))
            self.lw = nn.Parameter(torch.randn(5, 4))

        def forward(self, x):
            y = F.conv2d(x, self.w, self.b, padding=1) * 0.5
            return F.linear(y.mean((2, 3)), self.lw) * 3

    torch.manual_seed(0)
    k, muls, _ = _fold(M().eval(), torch.randn(2, 3, 6, 6))
    assert k == 2 and not muls


class Kept(nn.Module):
    """Multiplies that are not a per-output-channel constant scale of a layer read once."""

    def __init__(self):
        super().__init__()
        self.conv, self.lin = nn.Conv2d(4, 4, 1), nn.Linear(4, 4)
        self.spatial = nn.Parameter(torch.rand(1, 1, 5, 5))
        self.bad = nn.Parameter(torch.tensor([1.0, float("inf"), 1.0, 1.0]).reshape(4, 1, 1))
        self.wide = nn.Parameter(torch.rand(4, 1, 1, dtype=torch.float64))
        self.rows = nn.Parameter(torch.rand(3, 1))

    def forward(self, x, z):
        a = self.conv(x)
        twice = a * self.spatial.new_ones(()) + a                   # the layer's result is read twice
        b = self.conv(x) * self.spatial                             # varies over pixels
        c = self.conv(x) * self.bad                                 # not finite
        d = self.conv(x) * self.wide                                # float64: the product is promoted
        e = self.lin(z) * self.rows                                 # scales rows, not output features
        f = self.conv(x) * x                                        # not a constant
        return twice, b, c, d, e, f


def test_what_is_not_a_channel_scale_is_left_alone():
    torch.manual_seed(0)
    k, muls, _ = _fold(Kept().eval(), torch.randn(1, 4, 5, 5), torch.randn(3, 4))
    assert k == 0 and len(muls) == 6


def test_a_layer_called_elsewhere_keeps_computing_the_same():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)
            self.gamma = nn.Parameter(torch.rand(3, 1, 1) + 0.5)

        def forward(self, x):
            return self.conv(x) * self.gamma, self.conv(x + 1)   # the second call is not scaled

    torch.manual_seed(0)
    k, muls, gm = _fold(Shared().eval(), torch.randn(1, 3, 4, 4))
    assert k == 1 and not muls
    assert sum(1 for n in gm.graph.nodes if n.op == "call_module") == 2


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None and shutil.which("gcc") is None,
                    reason="no C compiler")
@pytest.mark.skipif(not onednn.available(), reason="this torch build has no oneDNN ops")
def test_lower_folds_layer_scale_and_accumulates_the_residual_in_place(tmp_path, monkeypatch):
    from symtrace.lower import compile as lower
    monkeypatch.setenv("SYMTRACE_CACHE_DIR", str(tmp_path))

    class Block(nn.Module):   # ConvNeXt's block in NCHW
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Conv2d(8, 16, 1), nn.Conv2d(16, 8, 1)
            self.gamma = nn.Parameter(torch.rand(8) + 0.5)

        def forward(self, x):
            x = self.fc2(F.relu(self.fc1(x))) * 1.0 + x
            for _ in range(2):
                x = self.fc2(F.relu(self.fc1(x))).mul(self.gamma.reshape(1, -1, 1, 1)) + x
            return x

    torch.manual_seed(0)
    m = Block().eval()
    x = torch.randn(1, 8, 6, 6)
    lm = lower(m, (x,))
    notes = "\n".join(lm.pipeline_notes)
    assert "3 constant per-channel scale(s)" in notes and "residual add(s) accumulate" in notes
    with torch.no_grad():
        torch.testing.assert_close(lm(x), m(x), rtol=1e-5, atol=1e-5)
