"""Quantization-aware training: fake quantization (STE), observers in train/eval/frozen,
batch norm kept trainable and folded at conversion, and conversion giving post-training
quantization's int8 graph."""
import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

import symtrace
from symtrace.passes import quant as Q
from symtrace.passes.quant.qparams import (choose_qparams, dequantize_per_channel, dequantize_per_tensor,
                                           quantize_per_channel, quantize_per_tensor)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small models: one thread is faster, and on a shared 2-core machine OpenMP's second
    thread mostly waits (training steps went from ~20 ms to ~1 s)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class Net(nn.Module):
    """conv-bn-relu, depthwise conv-bn-relu, pointwise conv-bn + residual add + relu, a conv
    without batch norm, pooling, linear-bn1d-relu, linear."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.dw, self.b2 = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8)
        self.pw, self.b3 = nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8)
        self.c4 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.fc1, self.b4 = nn.Linear(8, 16), nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        x = F.relu(self.b1(self.c1(x)))
        y = F.relu(self.b2(self.dw(x)))
        x = F.relu(x + self.b3(self.pw(y)))
        x = F.relu(self.c4(x))
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.fc2(F.relu(self.b4(self.fc1(x))))


def _model(seed=0):
    torch.manual_seed(seed)
    m = Net()
    with torch.no_grad():  # non-trivial running statistics and affine parameters
        for b in (m.b1, m.b2, m.b3, m.b4):
            b.running_mean.uniform_(-0.3, 0.3)
            b.running_var.uniform_(0.5, 2.0)
            b.weight.uniform_(0.5, 1.5)
            b.bias.uniform_(-0.2, 0.2)
    return m


X = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def qat_of(m, config=None):
    return Q.prepare_qat(symtrace.symbolic_trace(m.train(), example_inputs=(X,)), config or Q.QuantConfig())


def train_steps(qat, steps=4, seed=2):
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(qat.parameters(), lr=0.05)
    for _ in range(steps):
        x = torch.randn(16, 3, 8, 8, generator=g)
        loss = F.cross_entropy(qat(x), torch.randint(4, (16,), generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return qat


def signature(gm):
    return [(n.op, getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes]


# --- fake quantization ------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(lo=st.floats(-4, -0.01), hi=st.floats(0.01, 4), seed=st.integers(0, 1000))
def test_fake_quantize_is_dequantize_of_quantize_with_straight_through_gradient(lo, hi, seed):
    qp = choose_qparams(lo, hi, torch.uint8)
    x = (torch.randn(257, generator=torch.Generator().manual_seed(seed)) * 3).requires_grad_()
    y = Q.fake_quantize(x, qp)
    want = dequantize_per_tensor(quantize_per_tensor(x.detach(), qp.scale, qp.zero_point, qp.qmin, qp.qmax,
                                                     qp.dtype), qp.scale, qp.zero_point)
    assert torch.allclose(y.detach(), want, rtol=0, atol=1e-6 * max(1.0, abs(lo), abs(hi)))
    y.backward(torch.ones_like(y))
    q = (x.detach() * (1.0 / qp.scale)).round() + qp.zero_point
    inside = (q >= qp.qmin) & (q <= qp.qmax)
    assert torch.equal(x.grad, inside.float())  # 1 where representable, 0 where clipped
    assert inside.sum() < x.numel()  # |x| reaches ~10 > 4: some values are always clipped


def test_fake_quantize_per_channel_and_low_bits():
    w = torch.randn(6, 4, 3, 3, requires_grad=True)
    obs = Q.PerChannelSymmetricObserver(bits=4)
    obs(w.detach())
    qp = obs.qparams()
    assert (qp.qmin, qp.qmax) == (-7, 7)
    y = Q.fake_quantize(w, qp)
    want = dequantize_per_channel(quantize_per_channel(w.detach(), qp.scale, qp.zero_point, 0, qp.qmin, qp.qmax,
                                                       torch.int8), qp.scale, qp.zero_point, 0)
    assert torch.allclose(y.detach(), want, atol=1e-6)
    assert max(len(torch.unique(y[c].detach())) for c in range(6)) <= 15
    y.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))  # symmetric max|w| range: nothing is clipped
    with pytest.raises(ValueError, match="bits must be an int from 2 to 8"):
        Q.PerTensorSymmetricObserver(bits=9)


# --- the prepared model -----------------------------------------------------------------
def test_prepare_qat_wraps_layers_keeps_bn_and_leaves_the_model_alone():
    m = _model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    qat = qat_of(m)
    layers = {n: mod for n, mod in qat.named_modules() if isinstance(mod, Q.QATLayer)}
    assert sorted(layers) == ["c1_bn_folded", "c4", "dw_bn_folded", "fc1_bn_folded", "fc2", "pw_bn_folded"]
    assert all(layers[n].bn is not None for n in layers if n.endswith("_bn_folded"))
    assert not any(isinstance(mod, nn.BatchNorm2d) for n, mod in qat.named_modules() if "." not in n)
    fqs = [mod for mod in qat.modules() if isinstance(mod, Q.FakeQuantize)]
    assert fqs and all(isinstance(f.observer, Q.MovingAverageMinMaxObserver) for f in fqs)  # EMA by default
    assert qat.training and isinstance(qat, symtrace.GraphModule)
    train_steps(qat)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())


def test_without_rounding_the_qat_model_computes_the_float_model_in_train_and_eval():
    m = _model()
    qat = qat_of(m)
    for mod in qat.modules():
        if isinstance(mod, Q.FakeQuantize):
            mod.fake_quant = False
        if isinstance(mod, Q.QATLayer):
            mod.weight_observer = None
    ref = _model()
    x = torch.randn(8, 3, 8, 8)
    assert torch.allclose(qat(x), ref.train()(x), atol=1e-5)  # batch statistics, running stats updated
    assert torch.allclose(qat.get_submodule("c1_bn_folded").bn.running_mean, ref.b1.running_mean, atol=1e-6)
    assert torch.allclose(qat.eval()(x), ref.eval()(x), atol=1e-5)  # folded with running statistics


def test_gradients_reach_every_parameter_and_an_optimizer_trains_it():
    qat = qat_of(_model())
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(32, 3, 8, 8, generator=g), torch.randint(4, (32,), generator=g)
    F.cross_entropy(qat(x), y).backward()
    named = dict(qat.named_parameters())
    assert any(k.endswith("bn.weight") for k in named) and any(k.endswith("bn.bias") for k in named)
    for k, p in named.items():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, k
    opt = torch.optim.Adam(qat.parameters(), lr=0.01)
    losses = []
    for _ in range(25):
        loss = F.cross_entropy(qat(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_observers_update_by_ema_in_training_only_and_freeze():
    qat = qat_of(_model())
    fq = qat.get_submodule("quant_observers.x")
    obs = fq.observer
    x1, x2 = torch.randn(4, 3, 8, 8), 3 * torch.randn(4, 3, 8, 8)
    qat(x1)
    assert obs.min_val.item() == x1.min().item() and obs.max_val.item() == x1.max().item()
    qat(x2)
    c = obs.averaging_constant
    assert obs.max_val.item() == pytest.approx(x1.max().item() + c * (x2.max().item() - x1.max().item()), rel=1e-6)
    state = (obs.min_val.clone(), obs.max_val.clone(), obs.count.clone())
    qat.eval()(5 * x2)
    assert torch.equal(obs.max_val, state[1]) and torch.equal(obs.count, state[2])  # eval: no update
    assert Q.freeze_observers(qat) == len([m for m in qat.modules() if isinstance(m, Q.FakeQuantize)])
    qat.train()(5 * x2)
    assert torch.equal(obs.max_val, state[1]) and torch.equal(obs.count, state[2])  # frozen
    out = qat(x1)
    assert torch.allclose(out, qat(x1))  # deterministic once frozen (BN aside, same batch)
    Q.freeze_observers(qat, frozen=False)
    qat(5 * x2)
    assert obs.max_val.item() > state[1].item()


def test_bn_statistics_update_in_training_and_freeze():
    qat = qat_of(_model())
    layer = qat.get_submodule("c1_bn_folded")
    mean0 = layer.bn.running_mean.clone()
    qat(torch.randn(8, 3, 8, 8))
    mean1 = layer.bn.running_mean.clone()
    assert not torch.equal(mean0, mean1)
    assert Q.freeze_bn_stats(qat) == 4
    x = torch.randn(8, 3, 8, 8)
    out = qat(x)
    assert torch.equal(layer.bn.running_mean, mean1)
    # frozen batch norm in training = the folded layer with running stats, as in eval mode
    Q.freeze_observers(qat)
    assert torch.allclose(out, qat.eval()(x), atol=1e-6)
    out.sum().backward()
    assert layer.bn.weight.grad is not None and layer.bn.weight.grad.abs().sum() > 0


# --- conversion ---------------------------------------------------------------------------
CONFIGS = {
    "per-channel": lambda: Q.QuantConfig(),
    "per-tensor": lambda: Q.QuantConfig(weight=Q.PerTensorSymmetricObserver),
    "4-bit": lambda: Q.QuantConfig(weight=functools.partial(Q.PerChannelSymmetricObserver, bits=4)),
    "fc2 in float": lambda: Q.QuantConfig().keep_float("fc2"),
    # by the user's name, though batch-norm folding renames the layer c1 -> c1_bn_folded
    "c1 in float": lambda: Q.QuantConfig().keep_float("c1"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_convert_gives_the_post_training_graph_and_the_fake_quant_results(name):
    m = _model()
    qat = train_steps(qat_of(m, CONFIGS[name]()))
    q = Q.convert(qat, backend="portable")
    prepared = Q.prepare(symtrace.symbolic_trace(_model().eval(), example_inputs=(X,)), CONFIGS[name]())
    Q.calibrate(prepared, [X])
    ptq = Q.convert(prepared, backend="portable")
    assert signature(q) == signature(ptq)
    if name == "c1 in float":
        assert qat.get_submodule("c1_bn_folded").weight_observer is None
        assert not hasattr(q, "c1_bn_folded_weight_int8") and hasattr(q, "dw_bn_folded_weight_int8")
    assert Q.op_histogram(q) == Q.op_histogram(ptq)
    assert not any(isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d, Q.QATLayer, Q.FakeQuantize))
                   for mod in q.modules())
    # outputs: the int8 model against the fake-quantized one, within a few output steps
    qat.eval()
    x = torch.randn(64, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want, got = qat(x), q(x)
    out_scale = qat.get_submodule("quant_observers.fc2").qparams().scale if name != "fc2 in float" else None
    err = (want - got).abs()
    if out_scale is not None:
        assert err.max() <= 4 * out_scale and err.mean() <= 0.5 * out_scale, (err.max(), out_scale)
    else:
        assert err.max() <= 0.05 * want.abs().max()
    assert (want.argmax(1) == got.argmax(1)).float().mean() >= 0.95


def test_convert_folds_bn_with_running_stats_into_the_int8_weights():
    qat = train_steps(qat_of(_model(), Q.QuantConfig(weight=functools.partial(Q.PerChannelSymmetricObserver,
                                                                              bits=4))))
    layer = qat.get_submodule("dw_bn_folded")
    bn, conv = layer.bn, layer.layer
    s = (bn.weight.detach().double() / torch.sqrt(bn.running_var.double() + bn.eps))
    w = (conv.weight.detach().double() * s.reshape(-1, 1, 1, 1)).float()
    b = (-bn.running_mean.double() * s + bn.bias.detach().double()).float()
    obs = Q.PerChannelSymmetricObserver(bits=4)
    obs(w)
    qp = obs.qparams()
    want = quantize_per_channel(w, qp.scale, qp.zero_point, 0, qp.qmin, qp.qmax, torch.int8)
    q = Q.convert(qat, backend="portable")
    assert torch.equal(q.dw_bn_folded_weight_int8, want)
    assert q.dw_bn_folded_weight_int8.abs().max() <= 7
    assert torch.allclose(q.dw_bn_folded_bias, b, atol=1e-6)
    ref = Q.to_reference(qat)  # the q/dq oracle, same folding
    assert torch.equal(ref.dw_bn_folded_weight_int8, want)
    assert qat.training and qat.get_submodule("dw_bn_folded") is layer  # converting leaves the QAT model as it was


def test_converted_model_saves_and_loads_in_the_safe_format(tmp_path):
    q = Q.convert(train_steps(qat_of(_model())), backend="portable")
    path = tmp_path / "qat.symtrace"
    symtrace.save(q, path)
    back = symtrace.load(path)
    x = torch.randn(5, 3, 8, 8)
    assert torch.equal(back(x), q(x))
    Q.save_quantized(q, tmp_path / "qat2.symtrace")
    assert torch.equal(Q.load_quantized(tmp_path / "qat2.symtrace", backend="portable")(x), q(x))


# --- errors -----------------------------------------------------------------------------------
def test_clear_errors():
    eval_gm = symtrace.symbolic_trace(_model().eval(), example_inputs=(X,))
    with pytest.raises(ValueError, match="training mode.*model.train\\(\\)"):
        Q.prepare_qat(eval_gm)
    with pytest.raises(TypeError, match="symtrace GraphModule"):
        Q.prepare_qat(_model())
    with pytest.raises(ValueError, match="no observers or fake quantization"):
        Q.convert(eval_gm)
    with pytest.raises(ValueError, match="no observers or fake quantization"):
        Q.convert(_model())
    qat = qat_of(_model())
    with pytest.raises(ValueError, match="already prepared"):
        Q.prepare_qat(qat)
    with pytest.raises(RuntimeError, match="has seen no data"):
        Q.convert(qat)  # never run in training mode: no ranges yet
    qat.eval()(X)
    with pytest.raises(RuntimeError, match="has seen no data"):
        Q.convert(qat)  # eval mode does not observe
    with pytest.raises(ValueError, match="observes ranges in training mode only"):
        Q.calibrate(qat, [X])
    Q.calibrate(qat.train(), [X])  # training mode: ranges (and BN statistics) from the data
    assert Q.convert(qat.eval(), backend="portable")(X).shape == (4, 4)


# --- the example, in a few steps ---------------------------------------------------------------
def test_example_qat_finetune_smoke():
    from examples.quantization.qat_mobilenet import TinyMobileNet, qat_finetune
    torch.manual_seed(0)
    x = torch.rand(64, 1, 16, 16) * 2 - 1
    y = torch.randint(10, (64,))
    qat = Q.prepare_qat(symtrace.symbolic_trace(TinyMobileNet().train(), example_inputs=(x[:8],)),
                        Q.QuantConfig(weight=functools.partial(Q.PerChannelSymmetricObserver, bits=4)))
    qat_finetune(qat, x, y, steps=4, batch=16)
    assert not qat.training
    q = Q.convert(qat, backend="portable")
    assert Q.op_histogram(q)["int8_conv2d+relu"] == 9
    with torch.no_grad():
        assert (q(x).argmax(1) == qat(x).argmax(1)).float().mean() >= 0.9


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_qat_trains_on_a_gpu_and_converts_on_the_cpu():
    # QAT on CUDA (traced on CUDA inputs: a graph's inputs are guarded by device): fake
    # quantization, BN and the optimizer run on the GPU; convert gives the graph the CPU-trained
    # model gives
    m = _model().cuda()
    qat = Q.prepare_qat(symtrace.symbolic_trace(m.train(), example_inputs=(X.cuda(),)), Q.QuantConfig())
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(32, 3, 8, 8, generator=g).cuda(), torch.randint(4, (32,), generator=g).cuda()
    opt = torch.optim.Adam(qat.parameters(), lr=0.01)
    losses = []
    for _ in range(15):
        loss = F.cross_entropy(qat(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(p.device.type == "cuda" for p in qat.parameters())
    assert signature(Q.convert(qat.eval())) == signature(Q.convert(train_steps(qat_of(_model())).eval()))
