"""Size-generic lowering (issue 20): one compiled variant serves every size of a shape class."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import symtrace
from symtrace import lower
from symtrace.graph.symbols import Dim, Sym, sym
from symtrace.lower.decomp_views import view_strides_of
from symtrace.lower.dynamic import NotGeneric, symbolic_record

SIZES = st.one_of(st.sampled_from([2, 3, 5, 7, 13, 31, 97, 257, 1031]), st.integers(2, 300))


def ln_softmax(x, w, b):
    return torch.softmax(F.layer_norm(x, (x.shape[-1],), w, b) * 0.5, dim=-1)


def _ln_args(t, c=64):
    return torch.randn(3, t, c), torch.randn(c), torch.randn(c)


@pytest.fixture(scope="module")
def auto_ln():
    lm = lower.compile(ln_softmax, _ln_args(10), speed_check=False)
    assert lm.compiles == 1 and not lm._generic
    return lm


@settings(max_examples=15, deadline=None)
@given(t=SIZES)
def test_auto_compiles_twice_over_many_sizes(auto_ln, t):
    args = _ln_args(t)
    with torch.no_grad():
        out = auto_ln(*args)
    torch.testing.assert_close(out, ln_softmax(*args))
    assert auto_ln.compiles <= 2
    if t != 10:
        (g,) = auto_ln._generic
        assert g.symbols == ("s0",) and list(g.dims) == [(0, 1)]


@pytest.mark.parametrize("t", [2, 37, 600])
def test_generic_kernels_equal_static_kernels_bitwise(auto_ln, t):
    args = _ln_args(t)
    auto_ln(*_ln_args(11))   # (makes sure the generic variant exists)
    static = lower.compile(ln_softmax, args, speed_check=False, dynamic=False)
    with torch.no_grad():
        a, b = auto_ln(*args), static(*args)
    assert torch.equal(a, b)
    assert "size-generic variant: s0 = x.shape[1] (2..inf)" in auto_ln.report()


def test_sizes_0_and_1_get_static_variants():
    lm = lower.compile(ln_softmax, _ln_args(10), speed_check=False)
    for t in (12, 40):
        lm(*_ln_args(t))
    assert lm.compiles == 2
    for t in (1, 0):
        args = _ln_args(t)
        torch.testing.assert_close(lm(*args), ln_softmax(*args))
    assert lm.compiles == 4 and len(lm._generic) == 1   # 0 and 1 specialise (docs/lowering.md)
    lm(*_ln_args(77))
    assert lm.compiles == 4


def test_dynamic_false_compiles_per_signature():
    lm = lower.compile(ln_softmax, _ln_args(10), speed_check=False, dynamic=False)
    for t in (11, 12, 13):
        args = _ln_args(t)
        torch.testing.assert_close(lm(*args), ln_softmax(*args))
    assert lm.compiles == 4 and not lm._generic


def test_dynamic_true_is_generic_from_the_start():
    lm = lower.compile(ln_softmax, _ln_args(10), speed_check=False, dynamic=True)
    assert lm.compiles == 1 and lm._generic and lm._first is lm._generic[0]
    for b, t, c in [(3, 10, 64), (5, 7, 64), (2, 3, 96)]:
        args = (torch.randn(b, t, c), torch.randn(c), torch.randn(c))
        torch.testing.assert_close(lm(*args), ln_softmax(*args))
    assert lm.compiles == 1
    assert "size-generic variant (the first variant)" in lm.report()


def test_declared_dynamic_shapes_and_their_ranges():
    seq = Dim("seq", min=4, max=64)
    lm = lower.compile(ln_softmax, _ln_args(10), speed_check=False, dynamic_shapes={"x": {1: seq}})
    assert lm.compiles == 1 and lm._generic[0].dims == {(0, 1): Sym("seq", 4, 64)}
    for t in (4, 33, 64):
        args = _ln_args(t)
        torch.testing.assert_close(lm(*args), ln_softmax(*args))
    assert lm.compiles == 1
    args = _ln_args(65)   # outside the declared range: the guard refuses, a static variant serves it
    torch.testing.assert_close(lm(*args), ln_softmax(*args))
    assert lm.compiles == 2
    with pytest.raises(ValueError, match="outside"):
        lower.compile(ln_softmax, _ln_args(3), speed_check=False, dynamic_shapes={"x": {1: seq}})


def scaled(x):
    return x * (x.shape[-1] * 0.125)


def test_a_float_from_a_size_is_not_generic_and_says_why():
    gm = symtrace.symbolic_trace(scaled, example_inputs=(torch.randn(4, 8),))
    lm = lower.compile(gm, (torch.randn(4, 8),), speed_check=False)
    for c in (9, 10):
        x = torch.randn(4, c)
        torch.testing.assert_close(lm(x), scaled(x))
    assert not lm._generic and lm.compiles == 3
    assert "no size-generic variant" in lm.report() and "computed from a symbolic size" in lm.report()


def add_bias_rows(x, y, b):
    return torch.relu(x * y + b)   # x: (T, C) symbolic T; y: (T, 1); b: (C,)


def test_broadcasting_between_symbolic_and_static_dims():
    c = 24

    def args(t):
        return torch.randn(t, c), torch.randn(t, 1), torch.randn(c)
    lm = lower.compile(add_bias_rows, args(5), speed_check=False)
    for t in (6, 2, 41, 333):
        a = args(t)
        torch.testing.assert_close(lm(*a), add_bias_rows(*a))
    assert lm.compiles == 2 and lm._generic[0].symbols == ("s0",)


def gelu_t(x):
    return F.gelu(x.t()) + 1.0


def test_non_contiguous_inputs():
    lm = lower.compile(gelu_t, (torch.randn(16, 9).t(),), speed_check=False)
    for t in (10, 3, 130):
        x = torch.randn(16, t).t()   # transposed: strides (1, t)
        torch.testing.assert_close(lm(x), gelu_t(x))
    assert lm.compiles == 2
    x = torch.randn(5, 16)           # contiguous: another layout class, its own variant
    torch.testing.assert_close(lm(x), gelu_t(x))


def sums(x):
    return x.sum(-1), torch.amax(x, dim=-1), (x * 2).sum()


def test_reductions_over_a_symbolic_row():
    lm = lower.compile(sums, (torch.randn(3, 10),), speed_check=False)
    for t in (11, 4099, 2):
        x = torch.randn(3, t)
        for a, b in zip(lm(x), sums(x)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert lm.compiles == 2


def branchy(x):
    if x.shape[1] > 8:
        return x * 2
    return x - 1


def test_shape_guards_still_hold_for_generic_variants():
    gm = symtrace.symbolic_trace(branchy, example_inputs=(torch.randn(2, 16),))
    lm = lower.compile(gm, (torch.randn(2, 16),), speed_check=False)
    x = torch.randn(2, 20)
    torch.testing.assert_close(lm(x), x * 2)
    assert lm._generic
    with pytest.raises(symtrace.GuardError):
        lm(torch.randn(2, 4))   # the traced branch does not hold: refused, as for static variants


def test_transformer_block_through_the_inference_pipeline():
    from examples.models import TransformerBlock
    torch.manual_seed(0)
    m = TransformerBlock(64, 4).eval()
    with torch.no_grad():
        lm = lower.compile(m, (torch.randn(2, 8, 64),), speed_check=False)
        for t in (9, 2, 31, 64):
            x = torch.randn(2, t, 64)
            torch.testing.assert_close(lm(x), m(x), rtol=1e-4, atol=1e-4)
    assert lm.compiles == 2 and lm._generic


def test_generic_variants_count_once_against_max_variants():
    lm = lower.compile(ln_softmax, _ln_args(10), speed_check=False, max_variants=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no "through torch" warning
        for t in range(11, 40):
            lm(*_ln_args(t))
    assert lm.compiles == 2


# ------------------------------------------------------------------ building blocks

@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data())
def test_view_strides_match_torch(shape, data):
    perm = data.draw(st.permutations(range(len(shape))))
    base = torch.empty(shape).permute(perm)
    numel = base.numel()
    # a new shape: the old one with adjacent dims merged or split at random
    new = list(base.shape)
    if len(new) > 1 and data.draw(st.booleans()):
        k = data.draw(st.integers(0, len(new) - 2))
        new[k:k + 2] = [new[k] * new[k + 1]]
    try:
        expect = tuple(base.view(new).stride())
    except RuntimeError:
        expect = None
    assert view_strides_of(tuple(base.shape), tuple(base.stride()), tuple(new)) == expect and numel >= 0


def test_symbolic_view_strides():
    s = sym("s0")
    assert view_strides_of((2, s, 768), (768 * s, 768, 1), (2, s, 3, 4, 64)) == (768 * s, 768, 256, 64, 1)
    assert view_strides_of((2, 4, s, 64), (256 * s, 64, 256, 1), (2, s, 256)) is None   # (a transposed view)


def test_symbolic_record_fits_polynomials_and_refuses_others():
    def f(x):
        return torch.matmul(x, x.transpose(0, 1)).reshape(-1)   # s0*s0 elements
    gm = symtrace.symbolic_trace(f, example_inputs=(torch.randn(6, 4),))
    seen = symbolic_record(gm, (torch.randn(6, 4),), {(0, 0): Sym("s0")}, cache=False)
    out = [m for n, m in seen.items() if n.name == "reshape"][0]
    s = sym("s0")
    assert out.shape == (s * s,) and out.stride == (1,)

    def g(x):
        return x[::2] * 2
    gm = symtrace.symbolic_trace(g, example_inputs=(torch.randn(6, 4),))
    seen = symbolic_record(gm, (torch.randn(6, 4),), {(0, 0): Sym("s0")}, cache=False)
    out = [m for n, m in seen.items() if n.name == "mul"][0]
    assert out.shape[0] == (s + 1) // 2          # not a polynomial: the IR's symbolic run's expression
    for n in (2, 3, 7, 10):
        assert out.shape[0].evaluate({"s0": n}) == torch.randn(n, 4)[::2].shape[0]

    def h(x):   # a size that is a polynomial nowhere, and the IR's run fails (data-dependent)
        return x[: int(x.sum() > 0) + x.shape[0] // 3] * 2
    gm = symtrace.symbolic_trace(h, example_inputs=(torch.randn(6, 4),))
    with pytest.raises(NotGeneric):
        symbolic_record(gm, (torch.randn(6, 4),), {(0, 0): Sym("s0")}, cache=False)


def relu2(x):
    return torch.relu(x * 2)


def test_threads_are_chosen_per_call_for_generic_kernels():
    lm = lower.compile(relu2, (torch.randn(3, 10),), speed_check=False)
    for t in (11, 2, 50000):   # 150000 elements: over the OpenMP threshold
        x = torch.randn(3, t)
        torch.testing.assert_close(lm(x), relu2(x))
    src = lm._generic[0].c_source
    assert "void k0_par(" in src and "void k0_ser(" in src
    assert "if (((int64_t)3*s0) > 32768) k0_par(p0, p1, s0, nt);" in src
    assert lm.compiles == 2


def square_mix(x, y):
    return torch.sigmoid(x) * y + x.mean(-1, keepdim=True)


def test_duck_sized_dims_that_later_differ_get_one_wider_variant():
    lm = lower.compile(square_mix, (torch.randn(8, 8), torch.randn(8, 8)), speed_check=False)
    for shape in [(12, 12), (5, 30), (7, 9), (40, 3), (6, 6)]:
        x, y = torch.randn(*shape), torch.randn(*shape)
        torch.testing.assert_close(lm(x, y), square_mix(x, y))
    assert lm.compiles == 3   # static, generic with one symbol (s0 x s0), generic with two
    assert [g.symbols for g in lm._generic] == [("s0",), ("s0", "s1")]


def mixed(x, y, b):
    return torch.softmax(x * y + b, -1) + x.mean(-1, keepdim=True)


def _mixed_args(t, transposed):
    x = torch.randn(48, t).t() if transposed else torch.randn(t, 48)   # (t, 48), maybe strided
    return x, torch.randn(t, 1), torch.randn(48)


@pytest.fixture(scope="module")
def auto_mixed():
    return {tr: lower.compile(mixed, _mixed_args(9, tr), speed_check=False) for tr in (False, True)}


@settings(max_examples=8, deadline=None)
@given(t=st.one_of(st.sampled_from([0, 1, 2, 3, 5, 31, 1031]), st.integers(2, 200)), transposed=st.booleans())
def test_generic_equals_eager_and_static_kernels(auto_mixed, t, transposed):
    lm = auto_mixed[transposed]
    args = _mixed_args(t, transposed)
    with torch.no_grad():
        got = lm(*args)
        torch.testing.assert_close(got, mixed(*args))
        if t >= 2 and t != 9:   # served by the size-generic variant
            static = lower.compile(mixed, args, speed_check=False, dynamic=False)
            if transposed:   # a row read with a stride known only per call: the compiler may vectorise
                # its reduction otherwise than with a literal stride (another summation order)
                torch.testing.assert_close(got, static(*args), rtol=1e-6, atol=1e-7)
            else:            # the same bits as the static kernels
                assert torch.equal(got, static(*args))
    assert lm.compiles <= 4   # static, generic, and a static variant each for sizes 0 and 1


def test_declared_min_1_serves_size_1_and_min_0_gets_a_static_variant_for_0():
    seq = Dim("seq", min=1, max=512)
    lm = lower.compile(ln_softmax, _ln_args(10), speed_check=False, dynamic_shapes={"x": {1: seq}})
    for t in (1, 2, 300):
        args = _ln_args(t)
        torch.testing.assert_close(lm(*args), ln_softmax(*args))
    assert lm.compiles == 1
    lm0 = lower.compile(ln_softmax, _ln_args(10), speed_check=False, dynamic_shapes={"x": {1: Dim("n", min=0)}})
    for t in (0, 1, 2, 300, 0):
        args = _ln_args(t)
        torch.testing.assert_close(lm0(*args), ln_softmax(*args))
    assert lm0.compiles == 2 and lm0.torch_calls == 0   # generic from 1 up, static for 0
    with pytest.raises(ValueError, match="pass example inputs with a size of at least 1"):
        lower.compile(ln_softmax, _ln_args(0), speed_check=False, dynamic_shapes={"x": {1: Dim("n", min=0)}})


def test_capture_with_a_lowering_pass_serves_growing_lengths_with_at_most_two_compiles():
    # the captured graph is general over the length; its lowered module compiles static kernels,
    # then one size-generic variant, and every later length reuses them (no call through torch).
    # (The graph reads `block` from this function's closure and guards it: guard-only nodes do
    # not keep it from being size-generic.)
    import torch.nn.functional as F

    import symtrace
    from symtrace.lower import lowering_pass

    def block(x, w, b):
        return torch.softmax(F.layer_norm(x, (x.shape[-1],), w, b) * 0.125, dim=-1).sum(-1)

    cap = symtrace.capture(lambda x, w, b: block(x.transpose(1, 2), w, b), passes=[lowering_pass()])
    w, b = torch.randn(16), torch.randn(16)
    with torch.no_grad():
        for t in (5, 9, 13, 30, 7, 64, 2):
            x = torch.randn(2, 16, t)
            torch.testing.assert_close(cap(x, w, b), block(x.transpose(1, 2), w, b))
    assert cap.captures == 1
    lowered = cap.graphs[0].lowered
    assert lowered.compiles <= 2 and lowered.torch_calls == 0


@pytest.mark.parametrize("name", ["torch", "x", "nt", "def", "_k0", "buf0", "int"])
def test_dim_names_never_reach_generated_code(name):
    # a declared Dim's name used to become a variable of the wrapper and a C parameter: `torch`
    # shadowed the module, `def` was a syntax error, `x` overwrote the input
    def f(x):
        return torch.softmax(x * 2, -1) + 1

    lm = lower.compile(f, (torch.randn(3, 5, 8),), dynamic_shapes={"x": {1: Dim(name)}}, speed_check=False)
    y = torch.randn(3, 9, 8)
    with torch.no_grad():
        torch.testing.assert_close(lm(y), f(y))
    assert lm.compiles == 1 and name in lm.report()   # the report still says the user's name


class _StridedNet(torch.nn.Module):
    """stride-2 convolutions (sizes (s - 1)//2 + 1), batch norm, a global mean and a softmax over
    the spatial dims: not polynomials of the input sizes."""

    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.c2 = torch.nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.fc = torch.nn.Linear(16, 5)

    def forward(self, x):
        y = torch.relu(self.bn(self.c1(x)))
        y = torch.nn.functional.gelu(self.c2(y)) * 2 + 1
        return self.fc(y.mean((2, 3))), torch.softmax(y.flatten(2), -1)


@pytest.fixture(scope="module", params=[True, False], ids=["pipeline", "plain"])
def strided(request):
    torch.manual_seed(0)
    model = _StridedNet().eval()
    with torch.no_grad():
        lm = lower.compile(model, (torch.randn(1, 3, 32, 32),), inference=request.param, speed_check=False)
    return model, lm


@settings(max_examples=12, deadline=None)
@given(h=st.one_of(st.sampled_from([2, 3, 5, 7, 31, 97]), st.integers(2, 120)),
       w=st.one_of(st.sampled_from([2, 3, 5, 7, 31, 97]), st.integers(2, 120)))
def test_strided_convolutions_get_size_generic_variants(strided, h, w):
    model, lm = strided
    x = torch.randn(1, 3, h, w)
    with torch.no_grad():
        for got, want in zip(lm(x), model(x)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert lm.torch_calls == 0
    assert lm.compiles <= 3   # static, generic over H = W, generic over H and W
    if lm._generic:
        assert not lm._generic_failed


class _Pooled(torch.nn.Module):
    """three stride-2 convolutions, then global pooling and flatten: whether the pooled map has
    more than one element ((s + 7)//8 squared > 1) is not decided for every size from 2 up."""

    def __init__(self):
        super().__init__()
        self.convs = torch.nn.Sequential(*[torch.nn.Conv2d(c, 8, 3, stride=2, padding=1) for c in (3, 8, 8)])
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        y = torch.nn.functional.adaptive_avg_pool2d(torch.relu(self.convs(x)), 1)
        return self.fc(torch.flatten(y, 1))


def test_undecided_size_comparisons_narrow_the_generic_range():
    torch.manual_seed(0)
    model = _Pooled().eval()
    with torch.no_grad():
        lm = lower.compile(model, (torch.randn(1, 3, 48, 48),), speed_check=False)
        for hw in [(64, 64), (40, 56), (90, 33), (5, 5), (100, 100), (17, 200)]:
            x = torch.randn(1, 3, *hw)
            torch.testing.assert_close(lm(x), model(x), rtol=1e-4, atol=1e-5)
    assert lm.torch_calls == 0 and not lm._generic_failed
    assert len(lm._generic) == 2
    lo = {s.lo for g in lm._generic for s in g.dims.values()}
    assert len(lo) == 1 and 9 <= lo.pop() <= 40   # decided from 9 up; all sizes seen before were in range
    assert lm.compiles == 4                          # static 48, generic, wider generic, static 5x5


def test_grad_mode_switches_and_all_any_keep_a_graph_size_generic():
    # `with torch.no_grad()` records grad-mode reads and switches, and a mask check records
    # `.all()` under a data guard: neither shapes a tensor, so one generic variant serves
    # every size (they had kept such graphs, transformers' masking among them, per size)
    def f(x):
        with torch.no_grad():
            y = x * 2
        if (x > -100).all():
            return y.sum(-1)
        return y

    x = torch.randn(3, 8)
    lm = symtrace.lower.compile(symtrace.symbolic_trace(f, example_inputs=(x,)), (x,), speed_check=False)
    for n in (12, 16, 20):
        x = torch.randn(3, n)
        torch.testing.assert_close(lm(x), f(x))
        assert torch.is_grad_enabled()
    assert lm.compiles == 2, lm.dynamic_notes()
