"""Lowered casts and integer arithmetic are defined C and equal eager PyTorch bit for bit.

float -> integer conversion of NaN, +-Inf or an out-of-range value is undefined behaviour in C
(and poison in LLVM); the kernels convert through the prelude's range-checked helpers, which give
eager's answers on x86-64 (INT_MIN for int32, INT64_MIN for int64, the low bits of those for
int8/int16/uint8, see prelude.h). Signed overflow is undefined in C while torch wraps: kernels
compute integers modulo 2^64 and wrap narrow results to their dtype. Also: int -> float and
float -> float narrowing (overflow to Inf, NaN kept), the values spreading into reductions and
mixed int/half arithmetic, the Triton backend (interpreter), and a build of the generated C with
UBSan that must stay silent.

Compiling C is the slow part: each program is lowered once per layout and kept (module scope),
and hypothesis only draws the values.
"""
from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import symtrace
from symtrace.lower import compile as lower
from symtrace.lower import toolchain as tc

pytestmark = [
    pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None and shutil.which("gcc") is None,
                       reason="no C compiler"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

REPO = Path(__file__).resolve().parent.parent
X86 = __import__("platform").machine().lower() in ("x86_64", "amd64", "i386", "i686")
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
TARGETS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)
NAN, INF = math.nan, math.inf

# specials, every target's range boundaries and their neighbours, fractions (trunc toward zero)
SPECIAL = [NAN, -NAN, INF, -INF, 0.0, -0.0, 5e-324, -5e-324, 1e-45, -1e-45, 1e-40, 0.4, -0.4, 0.5, -0.5, 0.99,
           -0.99, 1.5, -1.5, 2.9, -2.9, 127.0, 127.9, 128.0, -128.0, -128.9, -129.0, 255.0, 255.9, 256.0, 300.0,
           -300.0, -1.0, 32767.9, 32768.0, -32768.9, -32769.0, 40000.0, -40000.0, 65504.0, 65535.9, 65536.0,
           70000.0, 2147483520.0, 2147483647.0, 2147483647.9, 2147483648.0, -2147483648.0, -2147483648.9,
           -2147483649.0, -2147483904.0, 3e9, -3e9, 4294967295.0, 4294967296.0, 4294967301.0, -4294967301.0,
           1e10, -1e10, 9.2e18, 2.0 ** 63, -(2.0 ** 63), 2.0 ** 63 - 1024, -(2.0 ** 63) - 2048, 1e19, -1e19,
           2.0 ** 64, 1e30, -1e30, 3.4e38, -3.4e38, 1e300, -1e300]


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("SYMTRACE_CACHE_DIR", str(tmp_path_factory.mktemp("symtrace-cache")))
    yield
    mp.undo()


_compiled: dict = {}


def lowered(fn, *inputs, target="cpu"):
    """``fn`` lowered for ``inputs``' layout, once per (function, target, layout)."""
    key = (fn, target) + tuple((tuple(x.shape), x.stride(), x.dtype) for x in inputs)
    lm = _compiled.get(key)
    if lm is None:
        lm = lower(symtrace.symbolic_trace(fn, example_inputs=inputs), inputs, target=target)
        # the comparisons below mean something only if the ops really run as kernels
        assert lm.eager_reason is None and lm._first is not None, lm.eager_reason
        in_torch = [r.node for r in lm._first.reports.values() if r.where == "torch"]
        assert not in_torch, f"{fn.__name__}: {in_torch} ran through torch, not in kernels"
        _compiled[key] = lm
    return lm


def assert_same(got, ref, what=""):
    got = got if isinstance(got, (tuple, list)) else (got,)
    ref = ref if isinstance(ref, (tuple, list)) else (ref,)
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g.dtype == r.dtype and g.shape == r.shape, (what, i, g.dtype, r.dtype, g.shape, r.shape)
        if r.is_floating_point():
            same = (g == r) | (torch.isnan(g) & torch.isnan(r))
        else:
            same = g == r
        if not bool(same.all()):
            bad = (~same).nonzero()[:5].tolist()
            raise AssertionError(f"{what} output {i} ({r.dtype}) differs from eager at {bad}: "
                                 f"got {[g[tuple(j)].item() for j in bad]}, eager {[r[tuple(j)].item() for j in bad]}")


def check(fn, *inputs, target="cpu"):
    lm = lowered(fn, *inputs, target=target)
    with torch.no_grad():
        got = lm(*[x.clone() for x in inputs])
        ref = fn(*[x.clone() for x in inputs])
    assert_same(got, ref, getattr(fn, "__name__", "fn"))
    return lm


def all_casts(a, b, c, d):
    """every float dtype (a: float32, b: float64, c: float16, d: bfloat16) to every integer dtype and bool"""
    return tuple(x.to(t) for x in (a, b, c, d) for t in TARGETS)


def all_casts_expanded(a, b, c, d):
    return all_casts(*(x.expand(3, *x.shape) for x in (a, b, c, d)))


def inputs_from(values, shape=None):
    base = torch.tensor(values, dtype=torch.float64)
    if shape is not None:
        base = base.reshape(shape)
    return tuple(base.to(dt) for dt in FLOATS)


# ------------------------------------------------------------------ measured semantics


@pytest.mark.skipif(not X86, reason="the table was measured on x86-64")
def test_eager_semantics_are_the_documented_table():
    """What the prelude reproduces: if torch changes it, the helpers must follow."""
    x = torch.tensor([NAN, INF, -INF, 3e9, -3e9, 300.0, -300.0, -1.5, 2.9, -0.0, 4294967301.0, 1e19])
    assert x.to(torch.int32).tolist() == [-2 ** 31] * 5 + [300, -300, -1, 2, 0, -2 ** 31, -2 ** 31]
    assert x.to(torch.int64).tolist() == [-2 ** 63] * 3 + [3000000000, -3000000000, 300, -300, -1, 2, 0, 4294967296,
                                                           -2 ** 63]
    assert x.to(torch.int16).tolist() == [0] * 5 + [300, -300, -1, 2, 0, 0, 0]
    assert x.to(torch.int8).tolist() == [0] * 5 + [44, -44, -1, 2, 0, 0, 0]
    assert x.to(torch.uint8).tolist() == [0] * 5 + [44, 212, 255, 2, 0, 0, 0]
    assert x.to(torch.bool).tolist() == [True] * 9 + [False, True, True]
    d = torch.tensor([4294967301.0, -4294967301.0], dtype=torch.float64)   # uint8 goes through int64
    assert d.to(torch.uint8).tolist() == [5, 251] and d.to(torch.int8).tolist() == [0, 0]


# ------------------------------------------------------------------ float -> integer


def test_every_half_and_bfloat16_bit_pattern_and_random_float_bits():
    """All 65536 fp16 and bf16 patterns; float32/float64: the specials, then random bit patterns
    (NaN payloads, subnormals, every exponent)."""
    n = 1 << 16
    g = torch.Generator().manual_seed(0)
    bits16 = torch.arange(n, dtype=torch.int32).to(torch.int16)
    f32 = torch.randint(-2 ** 31, 2 ** 31, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    f64 = torch.randint(-2 ** 63, 2 ** 63 - 1, (n,), generator=g, dtype=torch.int64).view(torch.float64)
    # and values near the int ranges (all exponents up to 2^70), so that not all are out of range
    near = torch.randn(n // 2, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(0, 70, (n // 2,), generator=g))
    f32, f64 = f32.clone(), f64.clone()
    f32[: n // 2], f64[: n // 2] = near.float(), near
    sp = torch.tensor(SPECIAL, dtype=torch.float64)
    f32[-len(sp):], f64[-len(sp):] = sp.float(), sp
    check(all_casts, f32, f64, bits16.view(torch.float16), bits16.view(torch.bfloat16))


values = st.one_of(st.sampled_from(SPECIAL), st.floats(allow_nan=True, allow_infinity=True),
                   st.floats(-1e10, 1e10), st.integers(-2 ** 65, 2 ** 65).map(float))

LAYOUTS = {
    "contiguous": (37, lambda t: t),
    "empty": (0, lambda t: t),
    "empty_2d": (0, lambda t: t.reshape(3, 0)),
    "strided": (2 * 38, lambda t: t.reshape(2, 38).t()[::3]),       # transposed and sliced
}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=st.sampled_from(sorted(LAYOUTS)), data=st.data())
def test_casts_match_eager_on_any_layout(layout, data):
    n, view = LAYOUTS[layout]
    vals = data.draw(st.lists(values, min_size=n, max_size=n))
    ins = tuple(view(x) for x in inputs_from(vals))
    check(all_casts, *ins)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(vals=st.lists(values, min_size=5, max_size=5))
def test_casts_of_broadcast_inputs(vals):
    check(all_casts_expanded, *inputs_from(vals))


def broadcast_max(x, y):
    return tuple(torch.maximum(x.to(t), y.to(t)) for t in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(a=st.lists(values, min_size=5, max_size=5), b=st.lists(values, min_size=7, max_size=7))
def test_casts_in_a_broadcast_binary_op(a, b):
    x = torch.tensor(a, dtype=torch.float64).float().reshape(5, 1)
    y = torch.tensor(b, dtype=torch.float64).reshape(1, 7)
    check(broadcast_max, x, y)


def three_casts(t):
    return t.to(torch.int32), t.double().to(torch.int8), t.to(torch.uint8), t.to(torch.int64)


def test_generated_c_uses_the_defined_conversions():
    x = torch.tensor([NAN, 1e30, 2.5, -7.5])
    lm = check(three_casts, x)
    kernels = lm.source().split("#endif /* SYMTRACE_PRELUDE_H */", 1)[1]
    for helper in ("st_f2i32f(", "st_f2i8(", "st_f2u8f(", "st_f2i64f("):
        assert helper in kernels
    for body in kernels.split("\nvoid ")[1:]:
        floats = set(re.findall(r"const (?:float|double) (t\d+) =", body))
        casts = set(re.findall(r"\((?:u?int\d+_t|int)\)\(?(t\d+)\b", body))
        assert not floats & casts, f"a bare C cast of a float value to an integer type:\n{body}"
        assert not re.search(r"\((?:u?int\d+_t|int)\)\(?b0\[", body), body   # b0: the float32 input


# ------------------------------------------------------------------ the values spread


def spread(x, h):
    i = x.to(torch.int32)
    return (torch.amin(i), torch.amax(i), i.sum(), i.amin(-1), i.amax(-1), (i < 0), torch.where(i == 0, h, -h),
            i + h, i * h, x.to(torch.int16) - h, x.to(torch.uint8) + h, x.to(torch.int64).to(torch.float16),
            x.to(torch.int32).to(torch.float32) + 1, x.to(torch.bool) & (h > 0))


def test_casts_spread_into_reductions_and_mixed_int_half_arithmetic():
    vals = SPECIAL[:72]
    x = torch.tensor(vals, dtype=torch.float64).float().reshape(8, 9)
    h = torch.linspace(-3, 3, 72, dtype=torch.float16).reshape(8, 9)
    check(spread, x, h)
    check(spread, x.double(), h)
    # the reported case
    r = lowered(lambda t: t.to(torch.int32), torch.zeros(4))(torch.tensor([NAN, INF, -INF, 1e30]))
    assert r.tolist() == torch.tensor([NAN, INF, -INF, 1e30]).to(torch.int32).tolist()


# ------------------------------------------------------------------ integer overflow


def int_ops(a, b):
    return (a + b, a - b, a * b, -a, a.abs(), (a + b) > 0, (a * b) < 0, torch.maximum(a + b, b - a),
            (a + b).amax(), (a - b).amin(), (a * b).sum(), (a * 3 + 7) * 5, torch.where(a + b > a, a, b),
            (a + b).to(torch.float32), (a * b).to(torch.float16), (a + 1).to(torch.bfloat16))


def _edge_ints(dtype):
    info = torch.iinfo(dtype)
    vals = [info.max, info.min, info.max - 1, info.min + 1, 0, 1, -1, 2, 3, info.max // 2, info.min // 2, 7, -7,
            100, -100, 12345 % max(info.max, 1)]
    return torch.tensor([v for v in vals if info.min <= v <= info.max], dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64])
def test_integer_overflow_wraps_like_eager(dtype):
    v = _edge_ints(dtype)
    a = v.repeat_interleave(len(v))
    b = v.repeat(len(v))
    check(int_ops, a, b)


def int64_sums(a):
    return a.sum(), a.sum(-1), (a * a).sum(), (a + a).sum(-1)


def test_int64_sums_wrap():
    big = torch.tensor([[2 ** 62, 2 ** 62, 2 ** 62, 5], [-2 ** 63, -2 ** 63, -1, 3]], dtype=torch.int64)
    check(int64_sums, big)
    check(int64_sums, big.repeat(1, 3000))   # blocked full reduction (several blocks and threads)


# ------------------------------------------------------------------ int -> float, float -> float


def narrowing(x64, i64, i32):
    return (x64.to(torch.float32), x64.to(torch.float16), x64.to(torch.bfloat16), x64.float().half(),
            i64.to(torch.float32), i64.to(torch.float16), i64.to(torch.bfloat16), i64.double(),
            i32.to(torch.float16), i32.to(torch.bfloat16), i32.float(), x64 * 1e300, x64.float() * 1e30)


def test_int_to_float_and_float_narrowing():
    x64 = torch.tensor([NAN, INF, -INF, 1e6, -1e6, 65504.0, 65519.99, 65520.0, 1e39, -1e39, 3.5e38, 1 + 2 ** -11 + 2 ** -40,
                        1e-8, -1e-8, 1e-46, 5e-324, -0.0, 1.0, 0.1, 1 + 2 ** -8 + 2 ** -40], dtype=torch.float64)
    n = len(x64)
    i64 = torch.tensor([2 ** 62 + 2 ** 38 + 1, 2 ** 53 + 1, 2 ** 24 + 1, 2 ** 63 - 1, -2 ** 63, 65519, 65520, 2049, 0, -1,
                        -2 ** 31, 2 ** 31, 123456789, -987654321, 16777217, 2 ** 40 + 1, 65504, -65505, 7, 9][:n])
    i32 = torch.tensor([2 ** 31 - 1, -2 ** 31, 16777217, 16777219, 2049, 4097, 65519, 65520, 100000, -100000, 0, 1, -1,
                        2 ** 24, 33554435, 257, 511, 1025, 3, 5][:n], dtype=torch.int32)
    check(narrowing, x64, i64, i32)


def float_constants(x):
    return x * 1e300, x + 1e-50, x.double() * 1e300, (x > 1e39), x * -1e39, x < -1e39


def test_float_constants_out_of_float32_range():
    check(float_constants, torch.tensor([1.0, -2.0, 0.0, NAN, INF, 3e38, 1e-45]))


# ------------------------------------------------------------------ Triton (interpreter)


def test_triton_casts_match_eager():
    pytest.importorskip("triton", reason="triton not installed")
    from symtrace.lower import codegen_triton
    if not codegen_triton.interpreting():
        pytest.skip("compiled for a GPU: eager CUDA semantics, checked by hand (see codegen_triton)")
    # (no subnormals: the interpreter's bfloat16 -> float32 conversion mangles them, a GPU does not)
    vals = [v if not 0 < abs(v) < 1.2e-38 else 0.5 for v in SPECIAL] + [2.5, -2.5, 7.9]
    check(all_casts, *inputs_from(vals), target="cuda")
    x = torch.tensor(vals[:72], dtype=torch.float64).float().reshape(8, 9)
    check(spread, x, torch.linspace(-3, 3, 72, dtype=torch.float16).reshape(8, 9), target="cuda")
    v = _edge_ints(torch.int32)
    check(int_ops_no_bf16, v.repeat_interleave(len(v)), v.repeat(len(v)), target="cuda")


def int_ops_no_bf16(a, b):   # the interpreter rounds float32 -> bfloat16 toward zero (a GPU: to nearest)
    return int_ops(a, b)[:-1]


def test_triton_cuda_semantics_helpers():
    """The GPU prelude's helpers (eager CUDA's saturating casts) give their documented table."""
    pytest.importorskip("triton", reason="triton not installed")
    from symtrace.lower import codegen_triton
    if not codegen_triton.interpreting():
        pytest.skip("needs the interpreter")
    import importlib.util
    src = codegen_triton.prelude(portable=False) + textwrap.dedent('''

        @triton.jit
        def k(x, y, WHICH: tl.constexpr):
            offs = tl.arange(0, 8)
            v = tl.load(x + offs)
            if WHICH == 0:
                r = st_f2i32(v)
            elif WHICH == 1:
                r = st_d2i32(v)
            elif WHICH == 2:
                r = st_f2i64(v)
            elif WHICH == 3:
                r = st_f2i8(v)
            else:
                r = st_f2u8(v)
            tl.store(y + offs, r)
        ''')
    path = Path(os.environ["SYMTRACE_CACHE_DIR"]) / "cuda_helpers_test.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("st_cuda_helpers_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    vals = [NAN, INF, -INF, 3e9, -3e9, 300.0, -1.5, 1e19]
    want = {0: [0, 2 ** 31 - 1, -2 ** 31, 2 ** 31 - 1, -2 ** 31, 300, -1, 2 ** 31 - 1],
            1: [-2 ** 31, 2 ** 31 - 1, -2 ** 31, 2 ** 31 - 1, -2 ** 31, 300, -1, 2 ** 31 - 1],
            2: [-2 ** 63, 2 ** 63 - 1, -2 ** 63, 3000000000, -3000000000, 300, -1, 2 ** 63 - 1],
            3: [0, -1, 0, -1, 0, 44, -1, -1],
            4: [0, 255, 0, 0, 0, 44, 255, 255]}
    for which, dt in [(0, torch.float32), (1, torch.float64), (2, torch.float32), (3, torch.float32), (4, torch.float32)]:
        y = torch.zeros(8, dtype=torch.int64)
        mod.k[(1,)](torch.tensor(vals, dtype=dt), y, WHICH=which)
        assert y.tolist() == want[which], which


# ------------------------------------------------------------------ no undefined behaviour (UBSan)


_UBSAN_CHILD = r"""
import sys, torch
from symtrace.lower import toolchain as tc
SAN = ("-fsanitize=undefined,float-cast-overflow", "-fno-sanitize-recover=all")
base = tc.compiler_flags
tc.compiler_flags = lambda info=None: base(info) + SAN
sys.path.insert(0, "tests")
import test_lower_casts as T
T.check(T.all_casts, *T.inputs_from(T.SPECIAL))
for dt in (torch.int32, torch.int64):
    v = T._edge_ints(dt)
    T.check(T.int_ops, v.repeat_interleave(len(v)), v.repeat(len(v)))
T.check(T.int64_sums, torch.tensor([[2 ** 62, 2 ** 62, 2 ** 62, 5], [-2 ** 63, -2 ** 63, -1, 3]]))
assert tc.stats.compiles >= 4
print("UBSAN-CLEAN", tc.stats.compiles)
"""


def test_generated_c_is_clean_under_ubsan(tmp_path):
    """The kernels of the cast, overflow and sum programs, built with -fsanitize=undefined and
    float-cast-overflow (abort on the first report), run on the special values silently."""
    try:
        tc.load_library("int st_probe_ubsan(int a) { return a + 1; }\n",
                        flags=tc.compiler_flags() + ("-fsanitize=undefined", "-fno-sanitize-recover=all"))
    except tc.ToolchainError as e:
        pytest.skip(f"no UBSan: {e}")
    env = dict(os.environ, SYMTRACE_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", _UBSAN_CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "UBSAN-CLEAN" in out.stdout, (out.stdout[-2000:], out.stderr[-4000:])
    assert "runtime error" not in out.stderr
