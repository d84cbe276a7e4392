"""The "c" int8 backend (symtrace.lower.int8_cpu): exact against the portable backend (same
integers, same floats), for the VNNI kernels and the plain-C ones, on odd shapes, batch 0/1/odd,
zero points, int8/uint8 activations and outputs, ReLU; dynamic Linear; registration and use by
lower/quantize_dynamic; clear errors."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

import symtrace
from symtrace.lower import int8_cpu
from symtrace.lower.int8_cpu import CInt8Backend, pack_weight
from symtrace.lower.int8_portable import PortableBackend
from symtrace.passes import quant as Q
from symtrace.passes.quant import backend as B
from symtrace.passes.quant import kernels as K
from symtrace.passes.quant import registry as R

C = int8_cpu.BACKEND
pytestmark = pytest.mark.skipif(not C.available(), reason=f"the C int8 backend is not usable here: {C.reason}")
PORTABLE = PortableBackend()
GENERIC = CInt8Backend("c-generic-test", generic=True)
IMPLS = [C, GENERIC]
if C.available():  # built (and self-checked) before any test patches the fallback
    assert GENERIC.available(), GENERIC.reason


class _NoPortable:
    def __getattr__(self, name):
        raise AssertionError(f"the C backend fell back to the portable backend ({name})")


@pytest.fixture
def c_only(monkeypatch):
    """The C kernels must answer themselves (no silent fallback to the portable backend)."""
    monkeypatch.setattr(int8_cpu, "_PORTABLE", _NoPortable())


def _ints(gen, shape, lo, hi, dtype):
    return torch.randint(lo, hi + 1, shape, generator=gen, dtype=torch.int64).to(dtype)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.sampled_from([0, 1, 2, 3, 5, 7, 13]), k=st.integers(1, 150), n=st.integers(1, 140),
       x_signed=st.booleans(), out_kind=st.sampled_from(["uint8", "int8", "float"]), relu=st.booleans(),
       x_zp=st.integers(-128, 255), out_zp=st.integers(-128, 255), bias=st.booleans(), seed=st.integers(0, 2**16),
       impl=st.sampled_from([0, 1]), lead3=st.booleans())
def test_static_linear_is_exact_against_portable(m, k, n, x_signed, out_kind, relu, x_zp, out_zp, bias, seed, impl,
                                                lead3, c_only):
    gen = torch.Generator().manual_seed(seed)
    b = IMPLS[impl]
    x = _ints(gen, (m, k), -128, 127, torch.int8) if x_signed else _ints(gen, (m, k), 0, 255, torch.uint8)
    if lead3:  # (A, B, K) inputs: leading dimensions are kept
        x = x.reshape(1, m, k)
    w = _ints(gen, (n, k), -128, 127, torch.int8)
    ws = torch.rand(n, generator=gen) * 0.02 + 1e-4
    bv = torch.randn(n, generator=gen) * 3 if bias else None
    x_zp = max(-128, min(127, x_zp)) if x_signed else max(0, x_zp)
    qmin, qmax = (-128, 127) if out_kind == "int8" else (0, 255)
    out_zp = max(qmin, min(qmax, out_zp))
    args = (x, w, ws, bv, 0.01 + seed % 7 * 0.013, x_zp, 0.05 + seed % 5 * 0.031, out_zp, qmin, qmax,
            "relu" if relu else "none", out_kind == "float")
    want = PORTABLE.linear(*args)
    got = b.linear(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.sampled_from([0, 1, 2, 3, 6, 9]), k=st.integers(1, 130), n=st.integers(1, 100), relu=st.booleans(),
       bias=st.booleans(), shift=st.floats(-3, 3), spread=st.floats(1e-3, 50), seed=st.integers(0, 2**16),
       impl=st.sampled_from([0, 1]))
def test_dynamic_linear_is_exact_against_portable(m, k, n, relu, bias, shift, spread, seed, impl, c_only):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * spread + shift
    w = _ints(gen, (n, k), -128, 127, torch.int8)
    ws = torch.rand(n, generator=gen) * 0.02 + 1e-4
    bv = torch.randn(n, generator=gen) if bias else None
    post = "relu" if relu else "none"
    want = PORTABLE.dynamic_linear(x, w, ws, bv, post)
    got = IMPLS[impl].dynamic_linear(x, w, ws, bv, post)
    assert got.dtype is torch.float32 and got.shape == (m, n)
    assert torch.equal(got, want)


@pytest.mark.parametrize("impl", IMPLS, ids=lambda b: b.name)
def test_dynamic_quantization_matches_portable_on_many_values(impl, c_only):
    gen = torch.Generator().manual_seed(3)
    for x in (torch.randn(40001, generator=gen) * 7 - 1, torch.rand(3, 333, generator=gen) + 0.5,  # all > 0
              -torch.rand(1000, generator=gen), torch.zeros(17), torch.tensor([2.5, -2.5, 0.0, 1e-9])):
        q, s, z = impl.quantize_dynamic_input(x)
        wq, ws, wz = B._dynamic_quantize(x)
        assert (s, z) == (ws, wz)
        assert torch.equal(q, wq)


def test_constant_and_tiny_inputs(c_only):
    w = torch.randint(-128, 128, (5, 8), dtype=torch.int64).to(torch.int8)
    ws = torch.full((5,), 0.01)
    for x in (torch.zeros(2, 8), torch.full((2, 8), 1e-12), torch.full((1, 8), -4.0)):
        for b in IMPLS:
            assert torch.equal(b.dynamic_linear(x, w, ws, None, "none"), PORTABLE.dynamic_linear(x, w, ws, None, "none"))


def test_nonfinite_input_is_a_clear_error():
    w = torch.ones(3, 4, dtype=torch.int8)
    for bad in (float("nan"), float("inf")):
        x = torch.ones(2, 4)
        x[1, 2] = bad
        with pytest.raises(ValueError, match="inf/nan"):
            C.dynamic_linear(x, w, torch.ones(3), None, "none")


def test_shape_mismatch_is_a_clear_error():
    w = torch.ones(3, 4, dtype=torch.int8)
    with pytest.raises(ValueError, match="5 features but the weight"):
        C.linear(torch.ones(2, 5, dtype=torch.uint8), w, torch.ones(3), None, 0.1, 0, 0.1, 0, 0, 255, "none")
    with pytest.raises(ValueError, match="5 features"):
        C.dynamic_linear(torch.ones(2, 5), w, torch.ones(3), None, "none")


def test_uncovered_inputs_use_the_portable_backend():
    gen = torch.Generator().manual_seed(0)
    w = _ints(gen, (6, 10), -128, 127, torch.int8)
    x64 = torch.randn(3, 10, dtype=torch.float64)  # not float32: the portable path
    assert torch.equal(C.dynamic_linear(x64, w, torch.ones(6), None, "none"),
                       PORTABLE.dynamic_linear(x64, w, torch.ones(6), None, "none"))
    xt = _ints(gen, (10, 3), 0, 255, torch.uint8).t()  # non-contiguous input
    args = (w, torch.rand(6, generator=gen), None, 0.1, 3, 0.2, 7, 0, 255, "relu")
    assert torch.equal(C.linear(xt, *args), PORTABLE.linear(xt, *args))


def test_weight_update_repacks():
    gen = torch.Generator().manual_seed(1)
    w = _ints(gen, (9, 12), -128, 127, torch.int8)
    ws, x = torch.rand(9, generator=gen) * 0.01, _ints(gen, (2, 12), 0, 255, torch.uint8)
    args = (ws, None, 0.1, 3, 0.2, 7, 0, 255, "none")
    before = C.linear(x, w, *args)
    w.mul_(-1)
    after = C.linear(x, w, *args)
    assert not torch.equal(before, after)
    assert torch.equal(after, PORTABLE.linear(x, w, *args))


def test_pack_weight_layout():
    w = torch.arange(-60, 60, dtype=torch.int64).reshape(10, 12).to(torch.int8)
    packed, rowsum = pack_weight(w)
    assert packed.shape == (1, 3, 64, 4) and rowsum.shape == (64,)
    assert packed[0, 1, 2, 3].item() == w[2, 7].item() and packed[0, 2, 9, 0].item() == w[9, 8].item()
    assert packed[0, :, 10:].abs().sum() == 0 and torch.equal(rowsum[:10], w.to(torch.int32).sum(1))
    with pytest.raises(TypeError, match="2-D int8"):
        pack_weight(torch.ones(3, 4))


def test_registered_as_default_and_used_by_lowering():
    assert "c" in Q.available_backends() and Q.default_backend() == "c"
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(20, 33), nn.ReLU(), nn.Linear(33, 7)).eval()
    x = torch.randn(5, 4, 5)
    gm = symtrace.symbolic_trace(mlp, example_inputs=(x,))
    p = Q.prepare(gm)
    Q.calibrate(p, torch.randn(64, 4, 5))
    ref = Q.to_reference(p)
    low_c, low_p = Q.lower(ref, "auto"), Q.lower(ref, "portable")
    assert low_c.meta["quant_backend"] == "c"
    for xb in (x, x[:1], x[:0]):
        assert torch.equal(low_c(xb), low_p(xb))
    dyn_c, dyn_p = Q.quantize_dynamic(gm, "c"), Q.quantize_dynamic(gm, "portable")
    assert torch.equal(dyn_c(x), dyn_p(x)) and torch.equal(dyn_c(x[:0]), dyn_p(x[:0]))


def test_convolutions_go_to_another_backend():
    gen = torch.Generator().manual_seed(2)
    x = _ints(gen, (1, 4, 6, 6), 0, 255, torch.uint8)
    w = _ints(gen, (5, 4, 3, 3), -127, 127, torch.int8)
    ws = torch.rand(5, generator=gen) * 1e-2
    args = (x, w, ws, None, (1, 1), (1, 1), (1, 1), 1, 0.05, 3, 0.1, 5, 0, 255, "relu")
    other = K.get_backend("onednn" if K.backend_available("onednn") else "portable")
    assert torch.equal(C.conv2d(*args), other.conv2d(*args))


def test_unregistered_backend_name_is_explained():
    assert not K.backend_available("no-such-backend")
    with pytest.raises(ValueError, match="register_backend"):
        K.int8_linear(torch.ones(1, 2, dtype=torch.uint8), torch.ones(1, 2, dtype=torch.int8), torch.ones(1), None,
                      x_scale=1.0, x_zp=0, out_scale=1.0, out_zp=0, backend="no-such-backend")


def test_missing_compiler_makes_it_unavailable(monkeypatch):
    from symtrace.lower import toolchain

    def no_compiler(*a, **k):
        raise toolchain.CompilerUnavailable("no C compiler (test)")
    monkeypatch.setattr(toolchain, "load_library", no_compiler)
    b = CInt8Backend("c-no-compiler-test")
    assert not b.available() and "no C compiler" in b.reason
    w = torch.ones(3, 4, dtype=torch.int8)
    x = torch.ones(2, 4, dtype=torch.uint8)
    args = (x, w, torch.ones(3), None, 0.1, 0, 0.1, 0, 0, 255, "none")
    assert torch.equal(b.linear(*args), PORTABLE.linear(*args))  # still answers, through the portable backend


@pytest.mark.parametrize("threads", [1, 2])
def test_parallel_kernels_are_exact(threads, c_only):
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(threads)
        x = _ints(gen, (33, 301), 0, 255, torch.uint8)
        w = _ints(gen, (130, 301), -128, 127, torch.int8)
        ws, bias = torch.rand(130, generator=gen) * 1e-3, torch.randn(130, generator=gen)
        args = (x, w, ws, bias, 0.02, 77, 0.3, 4, 0, 255, "relu")
        assert torch.equal(C.linear(*args), PORTABLE.linear(*args))
        xf = torch.randn(33, 301, generator=gen)
        assert torch.equal(C.dynamic_linear(xf, w, ws, bias, "none"), PORTABLE.dynamic_linear(xf, w, ws, bias, "none"))
    finally:
        torch.set_num_threads(saved)


def test_saved_model_loads_where_the_c_backend_is_not_registered(tmp_path, monkeypatch):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(12, 9), nn.ReLU(), nn.Linear(9, 3)).eval()
    x = torch.randn(4, 12)
    dyn = Q.quantize_dynamic(symtrace.symbolic_trace(mlp, example_inputs=(x,)), "c")
    path = tmp_path / "dyn.pt"
    Q.save_quantized(dyn, path)
    want = dyn(x)
    monkeypatch.setattr(R, "_BACKENDS", {k: v for k, v in R._BACKENDS.items() if k != "c"})
    with pytest.warns(UserWarning, match="not usable here"):
        back = Q.load_quantized(path)
    assert back.meta["quant_backend"] != "c" and torch.allclose(back(x), want, atol=0.02)  # onednn: not bit-exact
    with pytest.raises(ValueError, match="unknown int8 backend 'c'"):
        dyn(x)  # still pointing at the unregistered backend: the error says how to get it


# --- graph edges folded into the kernel: float input quantized in the call, output dequantized ---
def _edges_by_composition(x, w, ws, bv, x_scale, x_zp, x_range, out_scale, out_zp, qmin, qmax, post, deq):
    """What a lowered graph computed before the edges were folded: quantize -> portable linear -> dequantize."""
    if x_range is not None:
        lo, hi = x_range
        x = Q.quantize_per_tensor(x, x_scale, x_zp, lo, hi, torch.int8 if lo < 0 else torch.uint8)
    y = PORTABLE.linear(x, w, ws, bv, x_scale, x_zp, out_scale, out_zp, qmin, qmax, post)
    return Q.dequantize_per_tensor(y, out_scale, out_zp) if deq else y


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.sampled_from([0, 1, 2, 3, 5, 7, 13]), k=st.integers(1, 150), n=st.integers(1, 140),
       x_kind=st.sampled_from(["uint8", "int8", "int8-narrow", "uint8-reduced", "quantized"]),
       out_kind=st.sampled_from(["uint8", "int8"]), deq=st.booleans(), relu=st.booleans(),
       x_zp=st.integers(-128, 255), out_zp=st.integers(-128, 255), spread=st.floats(0.01, 30), bias=st.booleans(),
       seed=st.integers(0, 2**16), impl=st.sampled_from([0, 1]), lead3=st.booleans())
def test_fused_edges_are_exact_against_the_composition(m, k, n, x_kind, out_kind, deq, relu, x_zp, out_zp, spread,
                                                       bias, seed, impl, lead3, c_only):
    gen = torch.Generator().manual_seed(seed)
    x_range = {"uint8": (0, 255), "int8": (-128, 127), "int8-narrow": (-127, 127), "uint8-reduced": (0, 127),
               "quantized": None}[x_kind]
    if x_range is None:  # an already quantized input: only the output edge is folded
        x = _ints(gen, (m, k), 0, 255, torch.uint8)
        x_zp = max(0, min(255, x_zp))
    else:  # float input, with values far outside the range (clamping) and on rounding ties (x.5 steps)
        x_zp = max(x_range[0], min(x_range[1], x_zp))
        x = torch.randn(m, k, generator=gen) * spread
        x[:, ::3] = torch.round(x[:, ::3] * 2) / 2 * (0.01 + seed % 7 * 0.013)
    if not deq and x_range is None:
        deq = True
    if lead3:
        x = x.reshape(1, m, k)
    w = _ints(gen, (n, k), -128, 127, torch.int8)
    ws = torch.rand(n, generator=gen) * 0.02 + 1e-4
    bv = torch.randn(n, generator=gen) * 3 if bias else None
    qmin, qmax = (-128, 127) if out_kind == "int8" else (0, 255)
    out_zp = max(qmin, min(qmax, out_zp))
    args = (x, w, ws, bv, 0.01 + seed % 7 * 0.013, x_zp, x_range, 0.05 + seed % 5 * 0.031, out_zp, qmin, qmax,
            "relu" if relu else "none", deq)
    want = _edges_by_composition(*args)
    got = IMPLS[impl].linear_edges(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)
    # the graph-facing function takes the same path, and the base class composes the same way
    kw = dict(x_scale=args[4], x_zp=x_zp, out_scale=args[7], out_zp=out_zp, qmin=qmin, qmax=qmax, post=args[11],
              x_range=x_range, dequantize_out=deq)
    for name in ("c", "portable"):
        assert torch.equal(K.int8_linear(x, w, ws, bv, backend=name, **kw), want)


def test_fused_edges_fall_back_where_the_kernel_does_not_apply():
    gen = torch.Generator().manual_seed(4)
    w = _ints(gen, (6, 10), -128, 127, torch.int8)
    ws = torch.rand(6, generator=gen) * 0.01
    for x in (torch.randn(3, 10, dtype=torch.float64) * 5, torch.randn(10, 3, generator=gen).t()):  # float64, strided
        args = (x, w, ws, None, 0.03, 7, (0, 255), 0.2, 9, 0, 255, "relu", True)
        assert torch.equal(C.linear_edges(*args), _edges_by_composition(*args))


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(20, 33), nn.Linear(33, 17), nn.Linear(17, 7)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(torch.flatten(x, 1))))))


@pytest.mark.parametrize("backend", ["c", "portable"])
def test_lowered_mlp_is_one_call_per_layer_and_exact(backend):
    torch.manual_seed(0)
    x = torch.randn(5, 4, 5)
    gm = symtrace.symbolic_trace(_MLP().eval(), example_inputs=(x,))
    p = Q.prepare(gm)
    Q.calibrate(p, torch.randn(64, 4, 5))
    ref = Q.to_reference(p)
    low, unfused = Q.lower(ref, backend), Q.lower(ref, backend, fuse_edges=False)
    h = Q.op_histogram(low)
    assert h == {"torch.flatten": 1, "q+int8_linear+relu": 1, "int8_linear+relu": 1, "int8_linear+dq": 1}
    assert Q.op_histogram(unfused).get("quantize_per_tensor") == 1
    stats = low.meta["quant_lowering"]
    assert stats["input quantize fused"] == 1 and stats["output dequantize fused"] == 1
    last = low.graph.output_node().args[0]
    assert last.meta["tensor_meta"].dtype is torch.float32 and last.meta["tensor_meta"].qparams is not None
    for xb in (x * 3, x[:1], x[:0]):
        want = ref(xb)
        assert torch.equal(low(xb), want) and torch.equal(unfused(xb), want)


def test_shared_input_quantize_is_not_folded():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 3)

        def forward(self, x):
            return self.a(x), self.b(x)

    torch.manual_seed(1)
    x = torch.randn(6, 8)
    p = Q.prepare(symtrace.symbolic_trace(TwoHeads().eval(), example_inputs=(x,)))
    Q.calibrate(p, x)
    ref = Q.to_reference(p)
    low = Q.lower(ref, "c")
    h = Q.op_histogram(low)
    assert h.get("quantize_per_tensor") == 1 and h.get("int8_linear+dq") == 2  # one quantize feeds both
    for a, b in zip(low(x), ref(x)):
        assert torch.equal(a, b)


def test_c_backend_found_by_name_in_a_fresh_process():
    """No registration by import side effect: ``backend="c"`` works without importing
    ``symtrace.lower`` first, and importing ``symtrace.lower`` alone loads no int8 module."""
    import os
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = ("import sys, torch\n"
              "import symtrace.lower\n"
              "assert 'symtrace.lower.int8_cpu' not in sys.modules\n"
              "from symtrace.passes.quant import kernels as K\n"
              "b = K.get_backend('c')\n"
              "assert b is sys.modules['symtrace.lower.int8_cpu'].BACKEND\n"
              "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


@pytest.mark.parametrize("backend", ["c", "portable", "onednn"])
def test_int8_backends_run_models_made_in_inference_mode(backend):
    # the backends' weight caches read tensors' version counters, which inference tensors lack
    from symtrace.passes import quant as Q
    from symtrace.passes.quant.registry import backend_available
    if not backend_available(backend):
        pytest.skip(f"backend {backend!r} is not available here")
    with torch.inference_mode():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
        x = torch.randn(2, 16)
        gm = symtrace.symbolic_trace(m, example_inputs=(x,))
        q = Q.quantize_dynamic(gm, backend=backend)
        torch.testing.assert_close(q(x), m(x), rtol=0.05, atol=0.05)
