"""Row kernels: per-element values shared between a row kernel's loops are computed once
(ir.RowCache, schedule.plan_row_cache) and the results stay exactly those of recomputing;
constant folding keeps IEEE signed zeros."""
from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import symtrace
from symtrace.lower import compile as lower
from symtrace.lower import schedule, toolchain
from symtrace.lower.codegen_c import kernel_source, translation_unit
from symtrace.lower.ir import ExprBuilder, Var
from kernel_tests import needs_c_compiler

pytestmark = [needs_c_compiler, pytest.mark.usefixtures("session_kernel_cache")]


def lowered(fn, *inputs):
    return lower(symtrace.symbolic_trace(fn, example_inputs=inputs), inputs)


def kernels(lm):
    return lm._first.lowering.kernels


_TOLERANCES = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def assert_like_float64(got, want, ref, dtype):
    """``got`` has NaN where the float64 reference ``ref`` has, its infinities, and elsewhere
    is within the dtype's tolerance of ``ref`` or no further from it than twice eager's ``want``."""
    g64, r = got.double(), ref
    assert torch.equal(torch.isnan(g64), torch.isnan(r))
    both = ~torch.isnan(r)
    tol = _TOLERANCES[dtype]
    err = (g64 - r).abs()[both]
    eager_err = (want.double() - r).abs()[both]
    fin = torch.isfinite(r[both])
    assert torch.equal(g64[both][~fin], r[both][~fin])
    assert bool(((err <= tol + tol * r[both].abs()) | (err <= 2 * eager_err))[fin].all())


def check(fn, *inputs, rtol=1e-5, atol=1e-6):
    """Lowered result close to float64 (or no worse than 2x eager's error); returns the module."""
    lm = lowered(fn, *inputs)
    with torch.no_grad():
        got = lm(*inputs)
        eager = fn(*inputs)
        ref = fn(*[x.double() for x in inputs])
    assert got.dtype == eager.dtype and got.shape == eager.shape
    err = (got.double() - ref).abs()
    ok = (err <= atol + rtol * ref.abs()) | (err <= 2 * (eager.double() - ref).abs())
    assert bool(ok.all()), f"max err {err.max().item():.3g}"
    return lm


def softmax(x):
    return torch.softmax(x, -1)


def log_softmax(x):
    return F.log_softmax(x, -1)


def ln_softmax(x, w, b):
    return torch.softmax(F.layer_norm(x, (x.shape[-1],), w, b) * 3.0, -1)


def x3():
    g = torch.Generator().manual_seed(0)
    return torch.randn(37, 300, generator=g) * 4


# ---------------------------------------------------------------------------- planning


def test_softmax_exp_is_computed_once_per_element():
    lm = check(softmax, x3())
    (k,) = kernels(lm)
    assert k.kind == "row" and len(k.row_cache) == 1
    rc = k.row_cache[0]
    assert rc.phase is k.phases[1] and rc.value.op == "exp"          # the sum phase computes it
    assert [loop for loop, _ in rc.uses] == [None]                      # the store loop reads it
    src = kernel_source(k)
    assert src.count("st_expf(") == 1, src
    assert f"float {rc.name}[300];" in src


def test_cheap_shared_values_are_recomputed():
    # log_softmax shares only x - max; layer_norm only x - mean: not worth a scratch array
    assert kernels(check(log_softmax, x3()))[0].row_cache == []
    x = x3()
    lm = check(lambda x: F.layer_norm(x, (300,)), x)
    assert all(k.row_cache == [] for k in kernels(lm))


def test_layernorm_softmax_chain_caches_and_stays_right():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(9, 257, generator=g), torch.randn(257, generator=g), torch.randn(257, generator=g)
    lm = check(ln_softmax, x, w, b)
    ks = [k for k in kernels(lm) if k.kind == "row"]
    assert any(k.row_cache for k in ks)
    src = "\n".join(kernel_source(k) for k in ks)
    assert src.count("st_expf(") == 1, src


def test_different_row_lengths_or_indices_are_not_shared():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 16, generator=g)

    def transposed(x):  # same length, but the store reads x[i, o] where the phase reads x[o, r]
        return torch.exp(x.t()) / torch.exp(x).sum(-1, keepdim=True)

    def shorter(x):     # the store walks 8 columns, the phase 16
        return torch.exp(x[:, :8]) / torch.exp(x).sum(-1, keepdim=True)

    for fn in (transposed, shorter):
        lm = check(fn, x)
        assert all(k.row_cache == [] for k in kernels(lm)), fn.__name__


def test_long_rows_recompute_instead_of_exceeding_the_scratch_limit():
    n = schedule.ROW_CACHE_BYTES // 4 + 1
    x = torch.randn(2, n, generator=torch.Generator().manual_seed(3))
    lm = check(softmax, x)
    assert kernels(lm)[0].row_cache == []
    lm = check(softmax, x[:, : n - 1].contiguous())
    assert len(kernels(lm)[0].row_cache) == 1


def test_odd_shapes():
    cases = [torch.randn(300), torch.randn(5, 7, 64).transpose(0, 1), torch.randn(4, 1), torch.randn(0, 5),
             torch.randn(3, 0)]
    for x in cases:
        lm = lowered(softmax, x)
        assert [len(k.row_cache) for k in kernels(lm)] == [int(x.shape[-1] > 0)]
        torch.testing.assert_close(lm(x), torch.softmax(x, -1), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_other_dtypes(dtype):
    x = x3().to(dtype)
    lm = lowered(softmax, x)
    (k,) = kernels(lm)
    assert len(k.row_cache) == 1
    assert ("double sc0" in kernel_source(k)) == (dtype == torch.float64)
    got, ref = lm(x), torch.softmax(x.double(), -1)
    tol = {torch.float64: 1e-12, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert (got.double() - ref).abs().max().item() <= tol


def test_special_values_in_cached_rows():
    x = torch.tensor([[0.0, -0.0, 1.0, 2.0], [float("-inf"), 0.0, 1.0, float("-inf")],
                      [float("nan"), 1.0, 2.0, 3.0], [float("inf"), 1.0, 2.0, 3.0], [-1e30, 1e30, 0.0, 5.0]])
    lm = lowered(softmax, x)
    assert len(kernels(lm)[0].row_cache) == 1
    got, eager = lm(x), torch.softmax(x, -1)
    assert torch.equal(torch.isnan(got), torch.isnan(eager))
    fin = ~torch.isnan(eager)
    torch.testing.assert_close(got[fin], eager[fin], rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------- bit-identical to recomputing


def _run_kernels(ks, bufs_of, nt):
    lib = toolchain.load_library(translation_unit(ks, toolchain.prelude_source()))
    for k in ks:
        getattr(lib, k.name)(*[ctypes.c_void_p(bufs_of[id(b)].data_ptr()) for b in k.buffers()], ctypes.c_int(nt))


@pytest.mark.parametrize("fn", [softmax, ln_softmax], ids=["softmax", "layernorm_softmax"])
def test_cache_is_bit_identical_to_recomputing_and_thread_independent(fn):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(300, 203, generator=g) * 3   # 300 rows x 203: parallel, odd tail
    inputs = (x, torch.randn(203, generator=g), torch.randn(203, generator=g))[: 1 if fn is softmax else 3]
    lm = lowered(fn, *inputs)
    lw = lm._first.lowering
    assert any(k.row_cache for k in lw.kernels)
    results = []
    for cached, nt in ((True, 1), (True, 2), (False, 2)):
        ks = [k if cached else dataclasses.replace(k, row_cache=[]) for k in lw.kernels]
        bufs = {}
        names = [n for n, _ in lw.inputs]
        for b in lw.buffers:
            if b.role == "input":
                bufs[id(b)] = inputs[names.index(b.name)]
            else:
                bufs[id(b)] = torch.empty_strided(b.shape, b.strides, dtype=b.dtype)
        _run_kernels(ks, bufs, nt)
        out = [bufs[id(s.buffer)] for s in ks[-1].stores][0]
        results.append(out.clone())
    assert torch.equal(results[0], results[1]), "1 vs 2 threads differ"
    assert torch.equal(results[0].view(torch.int32), results[2].view(torch.int32)), "cached differs from recomputed"
    torch.testing.assert_close(results[0], lm(*inputs), rtol=0, atol=0)


# ---------------------------------------------------------------------------- folding


def test_adding_zero_keeps_ieee_signed_zeros():
    x = torch.tensor([-0.0, 0.0, -1.5, float("nan")])
    for fn in (lambda x: x + 0.0, lambda x: x - 0.0, lambda x: x + (-0.0), lambda x: x - (-0.0), lambda x: x * 1.0):
        got, eager = lowered(fn, x)(x), fn(x)
        assert torch.equal(torch.signbit(got[:3]), torch.signbit(eager[:3])) and torch.isnan(got[3])
    eb, v = ExprBuilder(), Var("i", 4)
    from symtrace.lower.ir import Affine, Buffer
    ld = eb.load(Buffer("b", torch.float32, (4,), (1,), "input"), Affine.of(v))
    assert eb.binary("add", ld, eb.const(-0.0, "f32")) is ld and eb.binary("sub", ld, eb.const(0.0, "f32")) is ld
    assert eb.binary("add", ld, eb.const(0.0, "f32")) is not ld and eb.binary("sub", ld, eb.const(-0.0, "f32")) is not ld


# ------------------------------------------------------------ fp16 values leaving their dtype


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_values_are_rounded_where_they_leave_their_dtype(dtype):
    x = torch.tensor([-19.6, 56.94, 11.2, 1e4, -3.0, 0.5, 7.77], dtype=dtype)
    y = torch.linspace(-1, 1, 7)

    def promoted(x, y):   # exp(56.94) overflows in fp16: eager has Inf there
        return torch.where(x > y, x.exp(), y) + y * x.exp()

    def compared(x):      # x * 1.001 rounds back to x for many fp16/bf16 values
        return (x * 1.001) == x

    for fn, args in ((promoted, (x, y)), (compared, (x,))):
        got, eager = lowered(fn, *args)(*args), fn(*args)
        assert got.dtype == eager.dtype
        if got.dtype == torch.bool:
            assert torch.equal(got, eager)
        else:
            assert torch.equal(torch.isinf(got), torch.isinf(eager))
            torch.testing.assert_close(got, eager, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_op_cost_weighs_transcendentals_and_pow_and_can_count_a_subset():
    from symtrace.lower.ir import Affine, Buffer, op_cost

    eb, v = ExprBuilder(), Var("i", 4)
    x = eb.load(Buffer("x", torch.float32, (4,), (1,), "input"), Affine.of(v))
    y = eb.load(Buffer("y", torch.float32, (4,), (1,), "input"), Affine.of(v))
    prod = eb.binary("mul", x, y)
    e = eb.binary("add", eb.unary("exp", prod), eb.binary("pow", x, eb.const(3.0, "f32")))
    assert op_cost(prod) == 1 and op_cost(eb.unary("neg", x)) == 1
    assert op_cost(e) == 1 + 4 + 4 + 1  # mul, exp, pow, add; loads and constants are free
    assert op_cost(e, only={prod.id, e.id}) == 2


def test_a_norm_over_channels_last_is_stored_in_memory_order():
    # timm's LayerNorm2d/RmsNorm2d in NCHW models: permute to NHWC, reduce over channels, scale,
    # permute back. The variance is a kernel of its own; the scaling kernel must then loop in the
    # channels-last buffer's memory order (channels innermost), not in NCHW's logical order
    # (one 128-byte stride per element: 2x slower on ConvNeXt's 56x56 stages).
    def norm(x, w):
        y = x.permute(0, 2, 3, 1)
        y = y * torch.rsqrt(torch.var(y, dim=-1, keepdim=True) + 1e-6) * w
        return y.permute(0, 3, 1, 2) + 1

    x = torch.randn(1, 32, 9, 9).to(memory_format=torch.channels_last)
    w = torch.rand(32) + 0.5
    lm = lowered(norm, x, w)
    with torch.no_grad():
        got, want = lm(x, w), norm(x, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.stride() == want.stride()
    scaling = [k for k in lm.kernels if "rsqrt" in k.nodes and k.kind == "pointwise"]
    assert scaling
    for k in scaling:
        inner = k.kernel.inner
        assert all(s.index.coeff(inner) == 1 for s in k.kernel.stores), k.source


# --------------------------------------------------------------------------- column form

from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_COLUMN_REDUCTIONS = {
    "mean_hw": lambda x: x.mean((2, 3), keepdim=True),   # an SE block's squeeze on channels-last
    "sum_hw": lambda x: x.sum((2, 3)),
    "amax_hw": lambda x: x.amax((2, 3), keepdim=True),
    "amin_hw": lambda x: torch.amin(x, (2, 3)),
    "mean_then": lambda x: torch.sigmoid(x.mean((2, 3), keepdim=True)) * 3,
}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(sorted(_COLUMN_REDUCTIONS)), c=st.sampled_from([8, 16, 24, 40, 48, 13]),
       hw=st.sampled_from([(1, 1), (3, 5), (7, 7), (12, 9)]), n=st.sampled_from([1, 2]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
       special=st.booleans())
def test_reductions_over_strided_rows_are_reduced_as_columns(which, c, hw, n, dtype, special):
    # channels-last: a row (one channel's H*W values) is strided and neighbouring rows are
    # neighbours in memory; the C kernel reduces blocks of rows together, vectorised across them
    fn = _COLUMN_REDUCTIONS[which]
    g = torch.Generator().manual_seed(c * 100 + hw[0] * 10 + n)
    x = torch.randn(n, c, *hw, generator=g)
    if special:
        x[0, 0, 0, 0] = float("nan")
        x[-1, -1, -1, -1] = float("inf")
        x[0, c // 2, hw[0] - 1, 0] = float("-inf")
    x = x.to(dtype).contiguous(memory_format=torch.channels_last)
    lm = lowered(fn, x)
    with torch.no_grad():
        got, want = lm(x), fn(x)
        ref = fn(x.double())
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_like_float64(got, want, ref, dtype)
    if hw != (1, 1) and c >= 8:
        src = lm.source()
        assert "c_lo" in src, "the column form was not used"
        assert ("enum { c_n" in src) == (c % 8 == 0)


def test_a_transposed_matrix_sums_its_columns_in_column_form():
    x = torch.randn(64, 48)
    for fn in (lambda a: a.t().sum(-1), lambda a: a.t().var(-1), lambda a: torch.softmax(a, 0), lambda a: a.amax(0)):
        lm = check(fn, x)   # (var: two phases, the second reads the first)
        assert "c_lo" in lm.source()
    lm = check(lambda a: a.sum(-1), x)   # a contiguous row keeps the row form
    assert "c_lo" not in lm.source()


def _group_norm(groups):
    def fn(x, w, b):
        return F.group_norm(x, groups, w, b, 1e-5) * 2 - 1
    return fn


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.sampled_from([(2, 8, 5, 7), (1, 12, 3, 3), (3, 6, 11), (2, 4), (0, 8, 2, 2), (1, 16, 1, 1)]),
       groups=st.sampled_from([1, 2, 4]), layout=st.sampled_from(["contiguous", "channels_last", "transposed"]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
       special=st.booleans(), affine=st.booleans())
def test_group_norm_runs_in_kernels_and_matches_eager(shape, groups, layout, dtype, special, affine):
    # (poolformer's GroupNorm1 ran through torch: no rule); statistics in float32, x read in its layout
    assume(shape[1] % groups == 0)
    g = torch.Generator().manual_seed(sum(shape) * 10 + groups)
    x = torch.randn(*shape, generator=g) * 3 + 1
    if special and x.numel():
        x.view(-1)[0] = float("nan")
        x.view(-1)[-1] = float("inf")
    x = x.to(dtype)
    if layout == "channels_last" and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "transposed" and x.dim() >= 3:
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    c = shape[1]
    w, b = (torch.randn(c, generator=g).to(dtype), torch.randn(c, generator=g).to(dtype)) if affine else (None, None)
    fn = _group_norm(groups)
    lm = lowered(fn, x, w, b)
    with torch.no_grad():
        got, want = lm(x, w, b), fn(x, w, b)
        ref = fn(x.double(), *(None if t is None else t.double() for t in (w, b)))
    assert _runs_in_kernels(lm, "group_norm")
    assert got.dtype == want.dtype and got.shape == want.shape
    g64 = got.double()
    assert torch.equal(torch.isnan(g64), torch.isnan(want.double()))
    fin = torch.isfinite(ref)
    tol = {torch.float32: 1e-4, torch.float64: 1e-10, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    err, eager_err = (g64 - ref).abs()[fin], (want.double() - ref).abs()[fin]
    assert bool(((err <= tol + tol * ref[fin].abs()) | (err <= 2 * eager_err)).all())


def _runs_in_kernels(lm, name) -> bool:
    rows = [line for line in lm.report().split("\n") if line.startswith(name + " ")]
    return bool(rows) and all("kernel" in line.split("  ")[-1] or " kernel" in line for line in rows)


def test_a_group_norm_module_runs_in_kernels():
    m = torch.nn.Sequential(torch.nn.GroupNorm(2, 6)).eval()
    with torch.no_grad():
        m[0].weight.normal_()
        m[0].bias.normal_()
    x = torch.randn(2, 6, 4, 5).contiguous(memory_format=torch.channels_last)
    gm = symtrace.symbolic_trace(m, example_inputs=(x,), leaf_modules=(torch.nn.GroupNorm,))
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_module", "output"]
    lm = lower(gm, (x,))
    with torch.no_grad():
        torch.testing.assert_close(lm(x), m(x), rtol=1e-5, atol=1e-5)
    assert _runs_in_kernels(lm, "v_0"), lm.report()


# ------------------------------------------------------------ other dimensions than the last

_OTHER_DIMS = {
    "softmax_2": lambda x: x.softmax(dim=2),                       # CoaT's factorised attention: k.softmax(dim=2)
    "log_softmax_1": lambda x: F.log_softmax(x, 1) * 2,
    "sum_1_keep": lambda x: x.sum(1, keepdim=True) - x,
    "mean_0_2": lambda x: x.mean((0, 2)),
    "amax_1_3": lambda x: torch.amax(x, (1, 3), keepdim=True),
    "var_1": lambda x: x.var(1, keepdim=True),
    "std_2": lambda x: torch.std(x, 2, correction=0),
    "softmax_then_matmul": lambda x: x.softmax(2).transpose(-1, -2) @ x,
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(sorted(_OTHER_DIMS)), shape=st.sampled_from([(2, 3, 37, 8), (1, 8, 5, 3), (2, 1, 1, 16),
                                                                          (3, 4, 7, 1)]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
       special=st.booleans(), transposed=st.booleans())
def test_reductions_and_softmax_over_other_dimensions_than_the_last(which, shape, dtype, special, transposed):
    fn = _OTHER_DIMS[which]
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 3
    if special:
        x[0, 0, 0, 0] = float("nan")
        x[-1, -1, -1, -1] = float("inf")
        x[0, -1, 0, -1] = float("-inf")
    x = x.to(dtype)
    if transposed:   # (a non-contiguous input)
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    lm = lowered(fn, x)
    reasons = [r for r in lm.report().splitlines() if "other than the last" in r or "only trailing" in r]
    assert not reasons, reasons
    with torch.no_grad():
        got, want = lm(x), fn(x)
        ref = fn(x.double())
    assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
    assert_like_float64(got, want, ref, dtype)


@pytest.mark.parametrize("fn", [lambda x: x.sum(0), lambda x: x.mean(-1), lambda x: x.amax(0),
                                lambda x: x.sum(0, keepdim=True), lambda x: x.any(0),
                                lambda x: torch.softmax(x, 0)])
def test_reductions_of_a_0d_tensor_over_its_dim(fn):
    x = torch.tensor(3.5)
    lm = lowered(fn, x)
    torch.testing.assert_close(lm(x), fn(x))


def test_var_of_a_0d_tensor_runs_through_torch():
    x = torch.tensor(3.5)
    lm = lowered(lambda t: t.var(0, correction=0), x)
    torch.testing.assert_close(lm(x), x.var(0, correction=0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_normalize_runs_in_kernels_like_eager(dtype):
    # EdgeNeXt's / XCiT's cross-covariance attention: F.normalize(q, dim=-1); a zero row is 0 / eps
    # (and 0 / 0 = NaN in half, where eager's eps rounds to 0)
    def fn(x):
        return F.normalize(x, dim=-1) + F.normalize(x * 2, p=2.0, dim=1, eps=1e-6), F.normalize(x.transpose(1, 2), dim=2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 7, 9, generator=g)
    x[0, 1] = 0
    x[1, 2, 3, 4] = float("nan")
    x[1, 3, 1, 1] = float("inf")
    x = x.to(dtype)
    lm = lowered(fn, x)
    assert all("kernel" in r for r in lm.report().splitlines() if r.startswith("normalize"))
    with torch.no_grad():
        got, want, ref = lm(x), fn(x), fn(x.double())
    for g_, w, r in zip(got, want, ref):
        assert g_.dtype == w.dtype and g_.stride() == w.stride()
        assert torch.equal(torch.isnan(g_), torch.isnan(w))
        fin = torch.isfinite(r) & torch.isfinite(w)
        err, eager_err = (g_.double() - r).abs()[fin], (w.double() - r).abs()[fin]
        tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
        assert bool(((err <= tol + tol * r[fin].abs()) | (err <= 2 * eager_err)).all())


def test_normalize_other_than_the_2_norm_runs_through_torch():
    x = torch.randn(3, 4)
    lm = lowered(lambda t: F.normalize(t, p=1.0, dim=0), x)
    assert "normalize other than the 2-norm" in lm.report()
    torch.testing.assert_close(lm(x), F.normalize(x, p=1.0, dim=0))


def ln_transposed(x, w, b):
    """A layer norm whose result leaves transposed (MLP-Mixer's token mixing; EdgeNeXt's and
    ConvNeXt's norm before a permute back to NCHW)."""
    return F.layer_norm(x, (x.shape[-1],), w, b).transpose(1, 2)


def ln_permuted_back(x, w, b):
    return F.layer_norm(x.permute(0, 2, 3, 1), (x.shape[1],), w, b).permute(0, 3, 1, 2)


@pytest.mark.parametrize("fn,shape", [(ln_transposed, (2, 37, 48)), (ln_permuted_back, (2, 24, 5, 7))])
def test_a_norm_read_back_in_its_own_order_is_one_row_kernel(fn, shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g) * 3 + 1
    c = shape[-1] if fn is ln_transposed else shape[1]
    w, b = torch.randn(c, generator=g), torch.randn(c, generator=g)
    lm = check(fn, x, w, b)
    ks = kernels(lm)
    # one kernel, a row kernel, when the result is stored in the layer norm's own order
    got = lm(x, w, b)
    want = fn(x, w, b)
    assert got.stride() == want.stride()
    assert len(ks) == 1 and ks[0].kind == "row", [(k.kind, k.nodes) for k in ks]
