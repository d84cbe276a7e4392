"""Global average pooling and reductions over trailing dimensions, checked against eager and fp64
across dtypes, layouts (contiguous, channels-last, sliced), 0-size batches and NaN/Inf."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import symtrace
from symtrace.lower import compile as lower
from kernel_tests import needs_c_compiler

sys.path.insert(0, os.path.dirname(__file__))
from test_lower_cpu import assert_close_to_ref, ref64  # noqa: E402

pytestmark = [needs_c_compiler, pytest.mark.usefixtures("session_kernel_cache")]

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def pool_fn(x):
    return F.adaptive_avg_pool2d(x, 1).flatten(1)


def pool_after_act(x):
    return F.adaptive_avg_pool2d(F.hardswish(x), (1, 1)) * 2


def pool_module(x):
    return nn.AdaptiveAvgPool2d(1)(x)


def mean_hw(x):
    return x.mean((-2, -1))


def sum_keep(x):
    return x.sum((2, 3), keepdim=True)


def amax_hw(x):
    return torch.amax(x, (2, 3))


def squeeze_excite(x):
    s = F.adaptive_avg_pool2d(x, 1)
    return x * torch.sigmoid(s * 3 - 1)


PROGRAMS = [pool_fn, pool_after_act, pool_module, mean_hw, sum_keep, amax_hw, squeeze_excite]


@st.composite
def images(draw):
    n = draw(st.sampled_from([0, 1, 2]))
    c = draw(st.sampled_from([1, 3, 8]))
    h, w = draw(st.sampled_from([(1, 1), (2, 3), (7, 5), (9, 16)]))
    dtype = draw(st.sampled_from(FLOATS))
    layout = draw(st.sampled_from(["contiguous", "channels_last", "sliced"]))
    t = torch.randn(n, c, h, w, dtype=torch.float64) * draw(st.sampled_from([1.0, 30.0]))
    if layout == "channels_last":
        t = t.contiguous(memory_format=torch.channels_last)
    elif layout == "sliced":
        big = torch.randn(n, c, 2 * h, 2 * w + 1, dtype=torch.float64)
        t = big[:, :, ::2, 1::2]
        t.copy_(torch.randn(n, c, h, w, dtype=torch.float64))
    if t.numel() and draw(st.booleans()):
        t[(0,) * 4] = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    return t.to(dtype)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prog=st.sampled_from(PROGRAMS), x=images())
def test_pooling_matches_eager_and_fp64(prog, x):
    gm = symtrace.symbolic_trace(prog, example_inputs=(x,))
    lm = lower(gm, (x,))
    with torch.no_grad():
        got, eager = lm(x.clone()), prog(x.clone())
    assert_close_to_ref(got, eager, ref64(prog, x), x.dtype)


def test_pooling_runs_in_kernels():
    x = torch.randn(2, 8, 7, 5).contiguous(memory_format=torch.channels_last)
    lm = lower(symtrace.symbolic_trace(squeeze_excite, example_inputs=(x,)), (x,))
    report = lm.report()
    assert "adaptive_avg_pool2d" in report and not any(
        "adaptive_avg_pool2d" in ln and " torch " in ln for ln in report.splitlines())
    torch.testing.assert_close(lm(x), squeeze_excite(x))


def test_pooling_to_other_sizes_runs_through_torch():
    def f(x):
        return F.adaptive_avg_pool2d(x, 2)
    x = torch.randn(1, 3, 6, 6)
    lm = lower(symtrace.symbolic_trace(f, example_inputs=(x,)), (x,))
    assert "size other than 1" in lm.report()
    torch.testing.assert_close(lm(x), f(x))
