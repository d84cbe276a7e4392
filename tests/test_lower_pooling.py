"""Windowed max and average pooling lowered to kernels (masked loads where a window reaches past
an edge): against eager across ranks, window parameters (padding, stride, dilation,
ceil_mode, count_include_pad, divisor_override), dtypes, layouts (channels-last, transposed)
and NaN/Inf; fusion with what follows; what stays in torch and why."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from torch import nn

import symtrace
from symtrace.lower import compile as lower
from symtrace.lower.decomp_pooling import pooled_size
from kernel_tests import needs_c_compiler

pytestmark = [needs_c_compiler, pytest.mark.usefixtures("session_kernel_cache")]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
_MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def _rows(lm, target):
    rows = [line for line in lm.report().splitlines() if f" {target} " in line or line.split()[:1] == [target]]
    assert rows, lm.report()
    return rows


def _run(fn, inputs):
    try:
        fn(*inputs)
    except (NotImplementedError, RuntimeError):   # eager has no result to compare with (avg_pool3d in
        reject()                                     # float16, a 3-d window larger than the input)
    gm = symtrace.symbolic_trace(fn, example_inputs=inputs)
    lm = lower(gm, inputs, speed_check=False)
    with torch.no_grad():
        got = lm(*[x.clone() for x in inputs])
        want = fn(*[x.clone() for x in inputs])
    return lm, got, want


def _same(got, want, exact: bool):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got.isnan(), want.isnan())
    fin = ~want.isnan()
    if exact:   # (max pooling: -0.0 and +0.0 compare equal here, as torch's order decides between them)
        assert torch.equal(got[fin], want[fin])
    else:
        tol = {torch.float32: 1e-6, torch.float64: 1e-12, torch.float16: 1e-3, torch.bfloat16: 8e-3}[got.dtype]
        torch.testing.assert_close(got[fin].double(), want[fin].double(), rtol=tol, atol=tol)


@st.composite
def _windows(draw):
    rank = draw(st.sampled_from([1, 2, 2, 3]))
    k = tuple(draw(st.integers(1, 4)) for _ in range(rank))
    s = tuple(draw(st.integers(1, 3)) for _ in range(rank))
    p = tuple(draw(st.integers(0, kk // 2)) for kk in k)
    d = tuple(draw(st.integers(1, 2)) for _ in range(rank))
    ceil = draw(st.booleans())
    sizes = []
    for j in range(rank):
        lo = max(1, d[j] * (k[j] - 1) + 1 - 2 * p[j])
        sizes.append(draw(st.integers(lo, lo + (9 if rank < 3 else 4))))
    return rank, k, s, p, d, ceil, tuple(sizes)


def _input(draw, lead, sizes, dtype):
    shape = lead + sizes
    x = torch.randn(shape, dtype=torch.float64).mul(4).to(dtype)
    layout = draw(st.sampled_from(["contiguous", "channels_last", "transposed"]))
    if layout == "channels_last" and len(shape) in (4, 5):
        x = x.contiguous(memory_format=torch.channels_last if len(shape) == 4 else torch.channels_last_3d)
    elif layout == "transposed" and len(shape) >= 3:
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    if x.numel() and draw(st.booleans()):   # NaN and +-Inf somewhere
        idx = [draw(st.integers(0, n - 1)) for n in shape]
        x[tuple(idx)] = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    return x


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=_windows(), dtype=st.sampled_from(DTYPES), data=st.data())
def test_max_pool_matches_eager(w, dtype, data):
    rank, k, s, p, d, ceil, sizes = w
    x = _input(data.draw, (2, 3), sizes, dtype)

    def fn(x):
        return _MAX[rank](x, k, s, p, d, ceil_mode=ceil)

    lm, got, want = _run(fn, (x,))
    _same(got, want, exact=True)
    assert "kernel" in _rows(lm, f"max_pool{rank}d")[0]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=_windows(), dtype=st.sampled_from(DTYPES), include=st.booleans(),
       override=st.sampled_from([None, None, 3]), data=st.data())
def test_avg_pool_matches_eager(w, dtype, include, override, data):
    rank, k, s, p, _, ceil, sizes = w
    sizes = tuple(max(n, kk - 2 * pp) for n, kk, pp in zip(sizes, k, p))   # (no dilation in avg pooling)
    x = _input(data.draw, (2, 3), sizes, dtype)
    extra = {"divisor_override": override} if rank > 1 else {}

    def fn(x):
        return _AVG[rank](x, k, s, p, ceil, include, **extra)

    lm, got, want = _run(fn, (x,))
    _same(got, want, exact=False)
    assert "kernel" in _rows(lm, f"avg_pool{rank}d")[0]


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_modules_fuse_with_what_follows(channels_last):
    # resnet's stem pool and PoolFormer's token mixer (pool(x) - x): one kernel each, no torch call
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.MaxPool2d(3, 2, 1)
            self.mix = nn.AvgPool2d(3, 1, 1, count_include_pad=False)

        def forward(self, x):
            y = self.stem(x.relu())
            return self.mix(y) - y

    torch.manual_seed(0)
    x = torch.randn(2, 8, 15, 12)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    lm, got, want = _run(Net().eval(), (x,))
    _same(got, want, exact=False)
    assert got.stride() == want.stride()
    assert "torch" not in "".join(_rows(lm, "stem") + _rows(lm, "mix"))
    assert len(lm.kernels) == 3   # relu stored (read by 9 windows), the stem pool, the mixer with its sub


@pytest.mark.parametrize("after", ["sum", "layer_norm", "softmax"])
def test_pools_feed_row_reductions(after):
    # a pooled value read by a row kernel (a reduction over its last dim): its masked taps and
    # bound tests are part of the row's expressions
    def fn(x):
        y = F.max_pool2d(x, 3, 2, 1, ceil_mode=True) + F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False)
        if after == "sum":
            return y.sum(-1)
        if after == "layer_norm":
            return F.layer_norm(y, y.shape[-1:])
        return y.softmax(-1)

    torch.manual_seed(1)
    x = torch.randn(2, 3, 9, 10)
    lm, got, want = _run(fn, (x,))
    _same(got, want, exact=False)
    assert [k.kind for k in lm.kernels] == ["row"]


def test_edges_read_no_memory_outside_the_input():
    # a window past the edge must not read the neighbouring row or image: a slice of a larger
    # buffer whose surroundings hold huge values
    big = torch.full((1, 4, 12, 12), 1e30)
    big[:, :, 2:10, 2:10] = torch.randn(1, 4, 8, 8)

    def fn(b):
        x = b[:, :, 2:10, 2:10]
        return F.max_pool2d(x, 3, 2, 1, ceil_mode=True), F.avg_pool2d(x, 3, 2, 1, ceil_mode=True)

    lm, got, want = _run(fn, (big,))
    for g, w in zip(got, want):
        _same(g, w, exact=False)
        assert g.abs().max() < 1e3


def test_masked_loads_vectorise_as_selects():
    x = torch.randn(1, 16, 9, 9).contiguous(memory_format=torch.channels_last)
    lm, _, _ = _run(lambda x: F.max_pool2d(x, 3, 2, 1), (x,))
    src = lm.source()
    assert "st_pickf(" in src and "st__pick_index(" in src
    assert "? b0[" not in src   # (no read under a condition: gcc does not vectorise those)


def test_what_stays_in_torch():
    x = torch.randn(1, 2, 6, 6)
    lm, got, want = _run(lambda x: F.max_pool2d(x, 2, return_indices=True)[0], (x,))
    assert torch.equal(got, want)
    assert "torch" in _rows(lm, "max_pool2d_with_indices")[0]
    lm, got, want = _run(nn.Sequential(nn.MaxPool2d(2, return_indices=True)).eval(), (x,))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert "returns indices" in lm.report()
    xi = torch.randint(-5, 5, (1, 2, 6, 6))
    lm, got, want = _run(lambda x: F.max_pool2d(x, 2) + 1, (xi,))
    assert torch.equal(got, want)
    assert "floating-point" in " ".join(_rows(lm, "max_pool2d"))
    x0 = torch.randn(0, 2, 6, 6)
    lm, got, want = _run(lambda x: F.avg_pool2d(x, 2), (x0,))
    assert got.shape == want.shape == (0, 2, 3, 3)
    assert "empty" in lm.report()


@pytest.mark.parametrize("n,k,s,p,d,ceil", [(112, 3, 2, 1, 1, False), (55, 3, 2, 0, 1, True), (7, 2, 2, 0, 1, True),
                                            (10, 3, 3, 1, 2, True), (5, 4, 1, 2, 1, True), (6, 2, 4, 1, 1, True)])
def test_pooled_size_is_torchs(n, k, s, p, d, ceil):
    assert pooled_size(n, k, s, p, d, ceil) == F.max_pool1d(torch.zeros(1, 1, n), k, s, p, d, ceil_mode=ceil).shape[-1]
