"""Quantization core: parameters, observers, canonicalization, annotation, observers'
insertion and calibration, and the q/dq reference conversion."""
import operator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

import symtrace
from symtrace.passes.quant import (HistogramObserver, MinMaxObserver, MovingAverageMinMaxObserver, PercentileObserver,
                                   PerChannelSymmetricObserver, PerTensorSymmetricObserver, QuantConfig, annotate,
                                   calibrate, canonicalize, choose_qparams, dequantize_per_tensor, prepare,
                                   quantize_per_tensor, sqnr, to_reference)
from symtrace.passes.quant.canonicalize import counts
from symtrace.passes.quant.prepare import observers_of
from symtrace.passes.quant.qparams import dequantize_per_channel, quantize_per_channel, qrange


def trace(m, *xs):
    return symtrace.symbolic_trace(m.eval(), example_inputs=xs)


# --- parameters and primitives ----------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(lo=st.floats(-50, 0), hi=st.floats(0, 50), reduce=st.booleans())
def test_choose_qparams_covers_range_and_keeps_zero_exact(lo, hi, reduce):
    qp = choose_qparams(lo, hi, torch.uint8, reduce_range=reduce)
    assert (qp.qmin, qp.qmax) == ((0, 127) if reduce else (0, 255))
    x = torch.linspace(lo, hi, 101)
    q = quantize_per_tensor(x, qp.scale, qp.zero_point, qp.qmin, qp.qmax, qp.dtype)
    assert q.dtype is torch.uint8
    err = (dequantize_per_tensor(q, qp.scale, qp.zero_point) - x).abs().max().item()
    assert err <= qp.scale * 0.5 + 1e-5 * max(1.0, abs(lo), abs(hi)) + 1e-6
    zero = quantize_per_tensor(torch.zeros(1), qp.scale, qp.zero_point, qp.qmin, qp.qmax, qp.dtype)
    assert dequantize_per_tensor(zero, qp.scale, qp.zero_point).item() == 0.0


def test_symmetric_and_per_channel_qparams():
    qp = choose_qparams(-2.0, 1.0, torch.int8, symmetric=True, narrow=True)
    assert qp.zero_point == 0 and (qp.qmin, qp.qmax) == (-127, 127)
    assert abs(qp.scale - 2.0 / 127) < 1e-7
    w = torch.randn(6, 3, 3, 3)
    obs = PerChannelSymmetricObserver()
    obs(w)
    qp = obs.qparams()
    assert qp.per_channel and qp.scale.shape == (6,)
    q = quantize_per_channel(w, qp.scale, qp.zero_point, 0, qp.qmin, qp.qmax, torch.int8)
    assert q.dtype is torch.int8 and q.abs().max() <= 127
    assert sqnr(w, dequantize_per_channel(q, qp.scale, qp.zero_point, 0)) > 38


def test_bad_dtype_and_nonfinite_range_are_clear_errors():
    with pytest.raises(TypeError, match="uint8 or torch.int8"):
        qrange(torch.int16)
    with pytest.raises(ValueError, match="inf/nan"):
        choose_qparams(float("-inf"), 1.0)


# --- observers --------------------------------------------------------------------------
def test_minmax_and_moving_average_observers():
    mm, ma = MinMaxObserver(), MovingAverageMinMaxObserver(averaging_constant=0.5)
    for x in (torch.tensor([0.0, 1.0]), torch.tensor([-3.0, 5.0]), torch.tensor([0.0, 1.0])):
        assert mm(x) is x and ma(x) is x
    assert (mm.min_val.item(), mm.max_val.item()) == (-3.0, 5.0)
    # 0 -> (0 + (-3)) / 2 -> (-1.5 + 0) / 2
    assert ma.min_val.item() == pytest.approx(-0.75) and ma.max_val.item() == pytest.approx(2.0)
    with pytest.raises(RuntimeError, match="no data"):
        MinMaxObserver().qparams()


def test_histogram_observer_minimises_l2_error():
    g = torch.Generator().manual_seed(0)
    # a million values in [0, 1] and one at 3: clipping the outlier costs less than the
    # rounding noise of a 3x wider step on every value
    x = torch.cat([torch.rand(1_000_000, generator=g), torch.tensor([3.0])])
    h, mm = HistogramObserver(), MinMaxObserver()
    for part in x.split(250_000):
        h(part)
        mm(part)
    lo, hi = h.range()
    assert lo.item() == 0.0 and 0.9 < hi.item() < 1.5

    def err(qp):
        q = quantize_per_tensor(x, qp.scale, qp.zero_point, qp.qmin, qp.qmax, qp.dtype)
        return (dequantize_per_tensor(q, qp.scale, qp.zero_point) - x).pow(2).sum()
    assert err(h.qparams()) < err(mm.qparams())
    # a single outlier among few values is worth keeping (L2): the range stays wide
    h2 = HistogramObserver()
    h2(torch.cat([torch.rand(1000, generator=g), torch.tensor([3.0])]))
    assert h2.range()[1].item() > 2.5


def test_percentile_observer():
    x = torch.cat([torch.linspace(0, 1, 10000), torch.tensor([100.0])])
    p = PercentileObserver(lower=0.0, upper=99.9)
    p(x)
    lo, hi = p.range()
    assert lo.item() == pytest.approx(0.0) and 0.99 < hi.item() < 1.01


# --- canonicalization -------------------------------------------------------------------
class Spellings(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.flat = nn.Flatten()
        self.drop = nn.Dropout(0.5)
        self.sig = nn.Sigmoid()

    def forward(self, x):
        y = self.relu(self.conv(x))
        z = self.conv(x)
        z += y                      # in place on a fresh value: safe
        z = z.relu_()
        a = F.relu(self.conv(x), inplace=True)
        b = torch.add(z, a)
        c = self.pool(b)
        d = self.gap(c)
        e = d.view(d.size(0), -1) + self.flat(d)
        return self.sig(self.drop(e)) + d.flatten(1).tanh()


def test_canonicalize_rewrites_spellings_and_keeps_results():
    m = Spellings().eval()
    x = torch.randn(2, 3, 8, 8)
    gm = trace(m, x)
    n = canonicalize(gm)
    assert n >= 10
    k = counts(gm)
    assert k["relu"] == 3 and k["add"] == 4 and k["flatten"] == 3 and k["max_pool2d"] == 1
    assert k["adaptive_avg_pool2d"] == 1 and k["sigmoid"] == 1 and k["tanh"] == 1
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert operator.iadd not in targets and F.relu not in targets
    assert not any(n.op == "call_method" for n in gm.graph.nodes)  # size/view/flatten/relu_ gone
    assert not any(n.op == "call_module" and n.target in ("drop", "relu", "pool") for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x), m(x))


class UnsafeInplace(nn.Module):
    def forward(self, x, w):
        y = x * 2
        v = y.view(-1)              # an alias of y
        y.relu_()                   # writes y, visible through v: must stay in place
        x.add_(1)                   # writes a graph input: must stay in place
        return v * 1 + x


def test_canonicalize_leaves_unsafe_inplace_ops():
    m = UnsafeInplace()
    gm = trace(m, torch.randn(4), torch.randn(4))
    canonicalize(gm)
    names = [n.target for n in gm.graph.nodes if n.op == "call_method"]
    assert "relu_" in names and "add_" in names
    a, b = torch.randn(4), torch.randn(4)
    torch.testing.assert_close(gm(a.clone(), b), m(a.clone(), b))


class LaterReader(nn.Module):
    def forward(self, x):
        y = x + 1
        y.relu_()
        return y * 3               # reads y after the in-place write


def test_inplace_rewrite_redirects_later_readers():
    gm = trace(LaterReader(), torch.randn(8))
    canonicalize(gm)
    assert not any(n.op == "call_method" for n in gm.graph.nodes)
    x = torch.randn(8)
    torch.testing.assert_close(gm(x), LaterReader()(x))


# --- annotation, observers, calibration, reference ---------------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.b1 = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.b2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        x = F.relu(self.b1(self.c1(x)))
        y = self.b2(self.c2(x))
        y = F.relu(y + x)
        y = F.max_pool2d(y, 2)
        y = torch.flatten(F.adaptive_avg_pool2d(y, 1), 1)
        return torch.cat([self.fc(y), torch.sigmoid(self.head(y))], 1)


def _net():
    torch.manual_seed(0)
    m = Net()
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-0.2, 0.2)
            mod.running_var.uniform_(0.5, 1.5)
    return m.eval()


def test_annotate_finds_patterns_and_int8_flow():
    gm = trace(_net(), torch.randn(2, 3, 8, 8))
    canonicalize(gm)
    from symtrace.passes.fold_bn import fold_batch_norm
    fold_batch_norm(gm)
    plan = annotate(gm, QuantConfig())
    assert sorted(m.kinds for m in plan.fused.values()) == sorted(
        [("conv2d", "relu"), ("conv2d", "add", "relu"), ("linear",), ("linear",)])
    assert set(plan.int8_ops.values()) == {"max_pool2d", "adaptive_avg_pool2d", "flatten", "sigmoid", "cat"}
    x = gm.graph.placeholders()[0]
    assert x in plan.observe  # the float input is observed once (one quantize)
    plan2 = annotate(gm, QuantConfig().keep_float("fc", nn.Conv2d))
    assert [m.kinds for m in plan2.fused.values()] == [("linear",)]


def test_prepare_calibrate_reference():
    m = _net()
    x = torch.randn(4, 3, 8, 8)
    p = prepare(trace(m, x))
    assert not m.training and len(observers_of(p)) == 6
    with pytest.raises(RuntimeError, match="has seen no data"):
        to_reference(p)
    torch.testing.assert_close(p(x), m(x), atol=1e-5, rtol=1e-5)  # prepared = folded float model
    n = calibrate(p, torch.randn(64, 3, 8, 8), batch_size=16, progress=False)
    assert n == 64
    ref = to_reference(p)
    # weights are int8 buffers; activations quantized to uint8 with explicit parameters
    bufs = dict(ref.named_buffers())
    assert any(v.dtype is torch.int8 for v in bufs.values())
    assert not any(isinstance(mod, (nn.Conv2d, nn.Linear)) for mod in ref.modules())
    qnodes = [n for n in ref.graph.nodes if n.target is quantize_per_tensor]
    assert all(n.meta["tensor_meta"].dtype is torch.uint8 and n.meta["tensor_meta"].qparams["scale"] > 0
               for n in qnodes)
    assert sqnr(m(x), ref(x)) > 25
    assert ref.graph.created_by == "to_reference"


def test_calibrate_progress_bar_and_interpreter(capsys):
    p = prepare(trace(_net(), torch.randn(2, 3, 8, 8)))
    calibrate(p, [torch.randn(2, 3, 8, 8) for _ in range(3)], progress=True, interpreter=True)
    err = capsys.readouterr().err
    assert "calibrating [" in err and "3/3 batches, 6 samples" in err


def test_prepare_refuses_training_mode_and_non_graph_modules():
    m = _net().train()
    gm = symtrace.symbolic_trace(m, example_inputs=(torch.randn(2, 3, 8, 8),))
    with pytest.raises(ValueError, match="eval mode"):
        prepare(gm)
    with pytest.raises(TypeError, match="symtrace GraphModule"):
        prepare(_net())


def test_reference_skip_keeps_a_layer_float():
    m = _net()
    x = torch.randn(8, 3, 8, 8)
    p = prepare(trace(m, x))
    calibrate(p, x)
    ref = to_reference(p, skip=["c1"])
    assert any(isinstance(mod, nn.Conv2d) for mod in ref.modules())
    with pytest.raises(KeyError, match="no node named"):
        to_reference(p, skip=["nope"])


def test_override_observer_and_per_tensor_weights():
    m = _net()
    x = torch.randn(8, 3, 8, 8)
    cfg = QuantConfig(activation=MovingAverageMinMaxObserver).override(nn.Linear, weight=PerTensorSymmetricObserver)
    p = prepare(trace(m, x), cfg)
    assert all(isinstance(o, MovingAverageMinMaxObserver) for o in observers_of(p).values())
    calibrate(p, x)
    ref = to_reference(p)
    s = ref.fc_weight_scale
    assert torch.all(s == s[0])  # one scale for the whole Linear weight
    assert not torch.all(ref.c1_bn_folded_weight_scale == ref.c1_bn_folded_weight_scale[0]) \
        if hasattr(ref, "c1_bn_folded_weight_scale") else True
