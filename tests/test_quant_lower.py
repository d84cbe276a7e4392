"""Quantization lowering: int8 kernels (both backends) against the reference and against
integer arithmetic, the int8 flow through pooling/flatten/cat, dynamic Linear, save/load."""
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symtrace
from symtrace.passes.quant import (backend_available, calibrate, compare_numerics, lower, op_histogram, prepare,
                                   quantize_dynamic, sensitivity, sqnr, to_reference, weight_sqnr)
from symtrace.lower import int8_onednn, int8_portable
from symtrace.passes.quant import kernels as K
from symtrace.passes.quant import registry as R
from symtrace.passes.quant.numerics import model_size, observer_table
from symtrace.passes.quant.qparams import quantize_per_tensor as Q_quantize
from symtrace.passes.quant.save import load_quantized, save_quantized

BACKENDS = ["portable"] + (["onednn"] if backend_available("onednn") else [])


def trace(m, *xs):
    return symtrace.symbolic_trace(m.eval(), example_inputs=xs)


def steps(a, b):
    """Largest difference between two integer tensors, in quantization steps."""
    return (a.to(torch.int32) - b.to(torch.int32)).abs().max().item()


# --- kernels against exact integer arithmetic --------------------------------------------
def _int_conv(x, zx, w, stride, padding, dilation, groups):
    """sum((x - zx) * w) exactly (float64 holds these sums exactly), zero padding = zx."""
    xs = x.to(torch.float64) - zx
    return F.conv2d(xs, w.to(torch.float64), None, stride, padding, dilation, groups)


@pytest.mark.parametrize("k,s,p,d,g", [(3, 1, 1, 1, 1), (3, 2, 1, 1, 1), (1, 1, 0, 1, 1), (3, 1, 2, 2, 1),
                                       (3, 1, 1, 1, 2), (3, 1, 1, 1, 4), (5, 3, 2, 1, 1)])
def test_portable_conv_is_exact_integer_arithmetic(k, s, p, d, g):
    gen = torch.Generator().manual_seed(k * 100 + s * 10 + g)
    x = torch.randint(0, 256, (2, 8, 9, 7), generator=gen).to(torch.uint8)
    w = torch.randint(-127, 128, (12, 8 // g, k, k), generator=gen).to(torch.int8)
    ws = torch.rand(12, generator=gen) * 1e-3 + 1e-4
    bias = torch.randn(12, generator=gen)
    zx, sx = 37, 0.02
    acc = _int_conv(x, zx, w, (s, s), (p, p), (d, d), g)
    want = torch.round((acc * (ws.double() * sx).reshape(1, -1, 1, 1) + bias.double().reshape(1, -1, 1, 1)) / 0.05) + 3
    want = want.clamp(0, 255)
    got = int8_portable.PortableBackend().conv2d(x, w, ws, bias, (s, s), (p, p), (d, d), g, sx, zx, 0.05, 3, 0, 255, "none")
    assert got.dtype is torch.uint8 and got.shape == want.shape
    assert steps(got, want) <= 1 and (got.double() != want).double().mean() < 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_agree_on_conv_with_residual_and_linear(backend):
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (3, 16, 6, 6), generator=gen).to(torch.uint8)
    w = torch.randint(-127, 128, (16, 16, 3, 3), generator=gen).to(torch.int8)
    ws = torch.rand(16, generator=gen) * 1e-3 + 1e-4
    r = torch.randint(0, 256, (3, 16, 6, 6), generator=gen).to(torch.uint8)
    args = dict(stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=1, x_scale=0.03, x_zp=100, out_scale=0.1,
                out_zp=10, post="relu", accum_scale=0.05, accum_zp=128)
    r_before = r.clone()
    want = K.int8_conv2d(x, w, ws, None, accum=r, backend="portable", **args)
    got = K.int8_conv2d(x, w, ws, None, accum=r, backend=backend, **args)
    assert torch.equal(r, r_before)  # accum_inplace=False: the caller's tensor is untouched
    assert steps(got, want) <= 1
    xl = torch.randint(0, 256, (5, 32), generator=gen).to(torch.uint8)
    wl = torch.randint(-127, 128, (7, 32), generator=gen).to(torch.int8)
    wls = torch.rand(7, generator=gen) * 1e-2
    la = dict(x_scale=0.1, x_zp=120, out_scale=0.5, out_zp=128)
    assert steps(K.int8_linear(xl, wl, wls, None, backend=backend, **la),
                 K.int8_linear(xl, wl, wls, None, backend="portable", **la)) <= 1


def test_int8_max_pool_matches_float_pool():
    gen = torch.Generator().manual_seed(0)
    for k, s, p, d in itertools.product([2, 3], [1, 2], [0, 1], [1, 2]):
        x = torch.randint(0, 256, (2, 5, 11, 9), generator=gen).to(torch.uint8)
        want = F.max_pool2d(x.float(), k, s, p, d)
        got = K.int8_max_pool2d(x.contiguous(memory_format=torch.channels_last), k, s, p, d)
        assert torch.equal(got.float(), want)


def test_portable_without_int_mm(monkeypatch):
    """torch builds without ``torch._int_mm``: an exact float64 matmul is used instead."""
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(-128, 128, (9, 70), generator=gen).to(torch.int8)
    b = torch.randint(-128, 128, (11, 70), generator=gen).to(torch.int8)
    want = a.long() @ b.long().t()
    monkeypatch.delattr(torch, "_int_mm", raising=False)
    got = int8_portable._int_matmul(a, b)
    assert got.dtype is torch.int32 and torch.equal(got.long(), want)


def test_onednn_missing_falls_back(monkeypatch):
    be = int8_onednn.OneDNNBackend()
    monkeypatch.setattr(int8_onednn, "_onednn_ops_present", lambda: False)
    assert not be.available()
    monkeypatch.setattr(R, "_BACKENDS", {"portable": K.get_backend("portable"), "onednn": be})  # no "c" either
    assert K.default_backend() == "portable"
    with pytest.raises(RuntimeError, match="not usable"):
        from symtrace.passes.quant.lower import resolve_backend
        resolve_backend("onednn")


# --- whole-graph lowering -----------------------------------------------------------------
class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2a = nn.Conv2d(8, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.c3 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        x = F.max_pool2d(x, 2)
        y = self.c2(F.relu(self.c2a(x)))
        y += x
        y = F.relu(y)
        y = F.relu(self.c3(y))
        y = F.adaptive_avg_pool2d(y, 1)
        return self.fc(y.reshape(y.size(0), -1))


@pytest.fixture(scope="module")
def cnn_ref():
    torch.manual_seed(0)
    m = CNN().eval()
    with torch.no_grad():
        m.bn.running_var.uniform_(0.5, 2.0)
    x = torch.randn(64, 1, 16, 16)
    p = prepare(trace(m, x[:4]))
    calibrate(p, x)
    return m, p, to_reference(p), torch.randn(16, 1, 16, 16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lowered_cnn_matches_reference(cnn_ref, backend):
    m, p, ref, x = cnn_ref
    low = lower(ref, backend)
    unfused = lower(ref, backend, fuse_edges=False)
    h, hu = op_histogram(low), op_histogram(unfused)
    # int8 end to end: one quantize in, one dequantize out (folded into the final Linear), nothing float in between
    assert hu.get("quantize_per_tensor") == 1 and hu.get("dequantize_per_tensor") == 1 and hu.get("int8_linear") == 1
    assert h.get("quantize_per_tensor") == 1 and "dequantize_per_tensor" not in h and h.get("int8_linear+dq") == 1
    assert h.get("int8_conv2d+relu") == 3 and h.get("int8_conv2d+add+relu") == 1
    assert h.get("int8_max_pool2d") == 1 and h.get("int8_adaptive_avg_pool2d") == 1 and h.get("torch.flatten") == 1
    assert set(h) <= {"quantize_per_tensor", "int8_conv2d+relu", "int8_conv2d+add+relu",
                      "int8_linear+dq", "int8_max_pool2d", "int8_adaptive_avg_pool2d", "torch.flatten"}
    assert low.meta["quant_lowering"]["output dequantize fused"] == 1
    with torch.no_grad():
        r, q = ref(x), low(x)
        assert torch.equal(q, unfused(x))
    scale = next(n for n in low.graph.nodes if n.target is K.int8_linear).kwargs["out_scale"]
    assert (r - q).abs().max().item() <= scale * 1.001  # within one output step
    assert torch.equal(r.argmax(1), q.argmax(1))
    if backend == "portable":  # integer GEMM + float64 requantization: the oracle, exactly
        assert torch.equal(r, q)
    assert sqnr(m(x), q) > 20
    # quantized parameters are buffers (plain int8 / float32), activations' in tensor_meta
    conv = next(n for n in low.graph.nodes if n.target is K.int8_conv2d)
    assert getattr(low, conv.args[1].target).dtype is torch.int8
    assert conv.meta["tensor_meta"].qparams["scale"] == conv.kwargs["out_scale"]


def test_residual_accumulator_inplace_only_when_safe(cnn_ref):
    _, _, ref, x = cnn_ref
    low = lower(ref, "portable")
    conv = next(n for n in low.graph.nodes if n.target is K.int8_conv2d and n.kwargs.get("accum") is not None)
    assert conv.kwargs["accum_inplace"] is True  # max-pool output read by nothing afterwards

    class SelfResidual(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            y = F.relu(self.c(x))
            return F.relu(self.c(y) + y) * 1.0 + y  # y read again after the fused add

    m = SelfResidual().eval()
    xs = torch.randn(8, 4, 6, 6)
    p = prepare(trace(m, xs))
    calibrate(p, xs)
    for backend in BACKENDS:
        low2 = lower(to_reference(p), backend)
        conv = next(n for n in low2.graph.nodes if n.target is K.int8_conv2d and n.kwargs.get("accum") is not None)
        assert conv.kwargs["accum_inplace"] is False
        torch.testing.assert_close(low2(xs), to_reference(p)(xs), atol=0.2, rtol=0)


class Mixed(nn.Module):
    """cat, standalone add, sigmoid, reshape in the int8 domain."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv2d(3, 4, 1)
        self.fc = nn.Linear(8 * 4 * 4, 6)

    def forward(self, x):
        a, b = F.relu(self.a(x)), self.b(x)
        c = torch.cat([a, b], 1)
        s = torch.sigmoid(b) + a
        return self.fc(c.reshape(c.shape[0], -1)), s


@pytest.mark.parametrize("backend", BACKENDS)
def test_cat_add_sigmoid_stay_int8(backend):
    torch.manual_seed(0)
    m = Mixed().eval()
    x = torch.randn(32, 3, 4, 4)
    p = prepare(trace(m, x))
    calibrate(p, x)
    ref = to_reference(p)
    low = lower(ref, backend)
    h = op_histogram(low)
    assert h.get("int8_cat") == 1 and h.get("int8_add") == 1 and h.get("int8_lut") == 1
    assert h.get("quantize_per_tensor") == 1  # only the input
    r, q = ref(x), low(x)
    for a, b in zip(r, q):
        assert (a - b).abs().max() < 0.05
        if backend == "portable":
            assert torch.equal(a, b)
    stats = low.meta["quant_lowering"]
    assert stats["int8_lut(sigmoid)"] == 1


def test_float32_reference_is_close_to_float64_reference(cnn_ref):
    m, p, ref, x = cnn_ref
    ref32 = to_reference(p, precision=torch.float32)
    assert ref32.meta["quant_precision"] is torch.float32
    step = next(n for n in ref.graph.nodes if n.target is Q_quantize and n.meta.get("quant_of") == "fc").args[1]
    assert (ref32(x) - ref(x)).abs().max().item() <= step * 1.001
    with pytest.raises(ValueError, match="precision"):
        to_reference(p, precision=torch.float16)


# --- dynamic Linear ------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(64, 128), nn.Linear(128, 64), nn.Linear(64, 10)

    def forward(self, x):
        return self.l3(torch.relu(self.l2(F.relu(self.l1(torch.flatten(x, 1))))))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dynamic_linear(backend):
    torch.manual_seed(0)
    m = MLP().eval()
    x = torch.randn(16, 1, 8, 8)
    dq = quantize_dynamic(trace(m, x), backend, keep_float=["l3"])
    h = op_histogram(dq)
    assert h.get("int8_dynamic_linear+relu") == 2 and h.get("Linear") == 1
    assert sqnr(m(x), dq(x)) > 30
    assert dq.l1_weight_int8.dtype is torch.int8


# --- numerics tools, save/load ---------------------------------------------------------------
def test_numerics_tables(cnn_ref):
    m, p, ref, x = cnn_ref
    low = lower(ref, "portable")
    rows = compare_numerics(p, low, x)
    assert rows[-1]["node"] == "output" and rows[0]["node"] == "x"
    assert all(r["sqnr_db"] > 15 and r["cosine"] > 0.95 for r in rows)
    ws = weight_sqnr(p, low)
    assert len(ws) == 5 and min(ws.values()) > 35
    assert weight_sqnr(p, ref) == pytest.approx(ws)
    sens = sensitivity(p, x)
    assert sens[0]["layer"] is None and len(sens) == 6
    assert max(r["sqnr_db"] for r in sens[1:]) >= sens[0]["sqnr_db"] - 1.0
    tab = observer_table(p)
    assert sum(r["kind"] == "weight" for r in tab) == 5 and all(r["dtype"] in ("uint8", "int8") for r in tab)
    assert model_size(low) < model_size(m) / 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_load_roundtrip(cnn_ref, tmp_path, backend):
    _, _, ref, x = cnn_ref
    low = lower(ref, backend)
    path = tmp_path / "q.symtrace"
    save_quantized(low, path)  # symtrace.save: the safe format, no pickle
    back = load_quantized(path)
    assert torch.equal(back(x), low(x))
    assert torch.equal(symtrace.load(path)(x), low(x))
    assert back.meta["quant_backend"] == backend
    assert any(b.dtype is torch.int8 for b in back.buffers())
    sd = low.state_dict()
    assert any(v.dtype is torch.int8 for v in sd.values())  # int8 weights are in the state dict
    portable = load_quantized(path, backend="portable")
    assert (portable(x) - low(x)).abs().max() <= 0.2
    bad = tmp_path / "bad.pt"
    torch.save({"x": 1}, bad)  # e.g. a file of the earlier, pickle-based save_quantized
    with pytest.raises(symtrace.SerializationError, match="does not unpickle"):
        load_quantized(bad)


def test_portable_linear_with_one_input_feature_is_exact():
    """torch._int_mm mishandles a K == 1 weight view on CPU; the portable backend must not."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(0, 256, (4, 1), generator=gen).to(torch.uint8)
    w = torch.randint(-128, 128, (6, 1), generator=gen).to(torch.int8)
    got = int8_portable.PortableBackend().linear(x, w, torch.ones(6), None, 1.0, 3, 1.0, 0, -128, 127, "none", out_float=True)
    want = (x.double() - 3) @ w.double().t()
    assert torch.equal(got.double(), want)


def test_dynamic_linear_batch_zero_and_nonfinite_input():
    w = torch.ones(3, 4, dtype=torch.int8)
    out = int8_portable.PortableBackend().dynamic_linear(torch.ones(0, 4), w, torch.ones(3), torch.ones(3), "none")
    assert out.shape == (0, 3)
    with pytest.raises(ValueError, match="inf/nan"):
        int8_portable.PortableBackend().dynamic_linear(torch.tensor([[1.0, float("inf"), 0.0, 0.0]]), w, torch.ones(3), None,
                                           "none")


def test_default_backend_follows_priority(monkeypatch):
    class Fake(K.Int8Backend):
        name = "fake-test"
    monkeypatch.setattr(R, "_BACKENDS", dict(R._BACKENDS))
    monkeypatch.setattr(R, "_PRIORITY", dict(R._PRIORITY))
    before = K.default_backend()
    K.register_backend(Fake(), priority=-1)
    assert K.default_backend() == before
    K.register_backend(Fake(), priority=1000)
    assert K.default_backend() == "fake-test"
    with pytest.raises(TypeError, match="Int8Backend"):
        K.register_backend(object())


def test_auto_warns_once_where_no_int8_backend_is_fast(monkeypatch):
    # an AVX2 AMD EPYC: symtrace's C kernels compile as plain C (no AVX512-VNNI) and torch's
    # oneDNN int8 fails the exactness check (int16 saturation); the int8 digits CNN ran 13-28x
    # slower than float32 there, silently. "auto" now says so, once.
    import warnings
    import importlib
    QL = importlib.import_module("symtrace.passes.quant.lower")

    class Fake:
        def __init__(self, isa):
            self.isa = lambda: isa
    for isa, onednn, warned in (("generic", False, True), ("avx512_vnni", False, False), ("generic", True, False)):
        monkeypatch.setattr(QL, "_SLOW_WARNED", False)
        monkeypatch.setattr(QL, "get_backend", lambda name, isa=isa: Fake(isa))
        monkeypatch.setattr(QL, "backend_available", lambda name, onednn=onednn: onednn)
        monkeypatch.setattr(QL, "default_backend", lambda: "c")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert QL.resolve_backend("auto") == "c" and QL.resolve_backend("auto") == "c"
        slow = [w for w in caught if "no fast exact int8 kernels" in str(w.message)]
        assert len(slow) == (1 if warned else 0), (isa, onednn)
