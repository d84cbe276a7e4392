"""``torch.cat`` lowered as one kernel per input storing into its slice of the result: exact
against eager across dtypes, ranks, dims, layouts (channels-last, transposed and sliced inputs),
0-size parts and NaN/Inf; what it removes from a RoPE decode step; what still runs in torch."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

import symtrace
from symtrace.lower import compile as lower
from kernel_tests import needs_c_compiler

pytestmark = [needs_c_compiler, pytest.mark.usefixtures("session_kernel_cache")]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]


def _where(lm, node_target="torch.cat"):
    """The 'runs in' column of the report rows for ``node_target``."""
    rows = [line for line in lm.report().splitlines() if f" {node_target} " in line]
    assert rows, lm.report()
    return rows


def _run(fn, inputs):
    gm = symtrace.symbolic_trace(fn, example_inputs=inputs)
    lm = lower(gm, inputs)
    with torch.no_grad():
        got = lm(*[x.clone() for x in inputs])
        want = fn(*[x.clone() for x in inputs])
    return lm, got, want


def _assert_same(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.stride() == want.stride()
    if got.is_floating_point():
        assert torch.equal(got.isnan(), want.isnan())
        fin = ~want.isnan()
        assert torch.equal(got[fin], want[fin])
    else:
        assert torch.equal(got, want)


def _cat3(a, b, c, dim):
    # each part computed on the fly (negation, an affine map, a raw input), stored into its slice
    return torch.cat([-a, b * 2 + 1, c], dim=dim) * 3


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rank=st.integers(1, 4), data=st.data(), dtype=st.sampled_from(DTYPES), special=st.booleans(),
       transposed=st.booleans(), seed=st.integers(0, 2**16))
def test_cat_matches_eager_exactly(rank, data, dtype, special, transposed, seed):
    gen = torch.Generator().manual_seed(seed)
    dim = data.draw(st.integers(-rank, rank - 1))
    base = [data.draw(st.integers(1, 4)) for _ in range(rank)]
    sizes = [data.draw(st.integers(0, 3)) for _ in range(3)]
    if sum(sizes) == 0:
        sizes[0] = 1
    inputs = []
    for s in sizes:
        shape = list(base)
        shape[dim] = s
        x = torch.randn(*shape, generator=gen) * 4
        if special and x.numel():
            flat = x.view(-1)
            flat[0] = float("nan")
            flat[-1] = float("inf") if flat.numel() > 1 else flat[-1]
        x = x.round().to(dtype) if dtype is torch.int64 else x.to(dtype)
        if transposed and rank >= 2:   # a non-contiguous view of the same values
            x = x.transpose(0, -1).contiguous().transpose(0, -1)
        inputs.append(x)
    lm, got, want = _run(lambda a, b, c: _cat3(a, b, c, dim), inputs)
    _assert_same(got, want)
    assert all("kernel" in row for row in _where(lm))


def test_rotate_half_is_stored_by_kernels_not_torch():
    # RoPE's rotate_half (Llama, Mistral, Qwen...): cat((-x2, x1)) of two halves of a projection
    def rope(q, cos, sin):
        q1, q2 = q[..., :32], q[..., 32:]
        return q * cos + torch.cat((-q2, q1), dim=-1) * sin

    qkv = torch.randn(1, 1, 3 * 4 * 64)
    q = qkv[..., :256].view(1, 1, 4, 64).transpose(1, 2)   # a strided view, as after a fused projection
    cos, sin = torch.randn(1, 1, 1, 64), torch.randn(1, 1, 1, 64)
    lm, got, want = _run(rope, (q, cos, sin))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not any(s for s in _where(lm) if "torch" in s.split("torch.cat")[1])
    assert sum(1 for k in lm.kernels if "cat" in k.nodes) == 2   # one kernel per half


class _Branches(nn.Module):
    """An inception-style block: convolution branches joined along channels."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(8, 4, 1)
        self.b = nn.Conv2d(8, 6, 3, padding=1)
        self.pool = nn.MaxPool2d(3, 1, 1)

    def forward(self, x):
        return torch.relu(torch.cat([torch.relu(self.a(x)), self.b(x).sigmoid(), self.pool(x)], 1)) + 1


@pytest.mark.parametrize("channels_last", [False, True])
def test_convolution_branches_keep_eager_layout(channels_last):
    torch.manual_seed(0)
    x = torch.randn(2, 8, 7, 7)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    m = _Branches().eval()
    lm, got, want = _run(m, (x,))
    assert got.stride() == want.stride()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_grown_cache_is_one_buffer_written_in_two_parts():
    # a KV cache grown by one step: the old keys are copied, the new key is computed into place
    def grow(past, new):
        return torch.cat([past, new.sin()], dim=-2)

    past, new = torch.randn(1, 4, 9, 16), torch.randn(1, 4, 1, 16)
    lm, got, want = _run(grow, (past, new))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    before = got.clone()
    past.add_(1.0)   # a fresh output, not a view of the input
    assert torch.equal(got, before)


@pytest.mark.parametrize("case", ["in memory", "dtypes", "out", "empty"])
def test_what_cat_leaves_to_torch_says_why(case):
    if case == "in memory":   # nothing computed on the way: torch's copy is as fast
        fn, inputs, why = (lambda a, b: torch.cat([a, b], 1) + 1), (torch.randn(2, 3), torch.randn(2, 4)), "in memory"
    elif case == "dtypes":   # type promotion
        fn, inputs, why = (lambda a, b: torch.cat([a, b]) + 1), (torch.randn(3), torch.arange(2)), "dtypes"
    elif case == "out":
        def fn(a, b):
            out = torch.empty(5)
            torch.cat([a, b], out=out)
            return out + 1
        inputs, why = (torch.randn(3), torch.randn(2)), "in-place"   # (out= writes a visible tensor)
    else:
        fn, inputs, why = (lambda a, b: torch.cat([a, b], 1) + 1), (torch.randn(0, 2), torch.randn(0, 3)), "empty"
    lm, got, want = _run(fn, inputs)
    torch.testing.assert_close(got, want)
    rows = _where(lm)
    assert all("torch" in row.split("torch.cat", 1)[1] and why in row for row in rows), rows


def test_parts_of_a_channels_last_join_are_stored_in_memory_order():
    # HGNet's aggregation: cat along channels of channels-last values. Each part's slice of the
    # result is strided (not dense); its kernel must still loop channels innermost
    def join(a, b, s):
        return torch.cat([a * s + 1, torch.relu(b), a], 1) * 2

    a = torch.randn(1, 16, 7, 7).to(memory_format=torch.channels_last)
    b = torch.randn(1, 8, 7, 7).to(memory_format=torch.channels_last)
    lm, got, want = _run(join, (a, b, torch.tensor(0.5)))
    torch.testing.assert_close(got, want)
    assert got.stride() == want.stride()
    parts = [k for k in lm.kernels if "cat" in k.nodes]
    assert len(parts) == 3
    for k in parts:
        assert all(s.index.coeff(k.kernel.inner) == 1 for s in k.kernel.stores), k.source


# --------------------------------------------------------------------------- constant padding


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pad=st.lists(st.integers(-2, 3), min_size=2, max_size=6).filter(lambda p: len(p) % 2 == 0),
       value=st.sampled_from([None, 0.0, -1.5, float("inf"), float("nan"), 3]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.int64]),
       lazy=st.booleans(), strided=st.booleans())
def test_constant_padding_reads_its_input_through_a_masked_load(pad, value, dtype, lazy, strided):
    if dtype is torch.int64 and value is not None and not float(value).is_integer():
        value = 2
    x = (torch.randn(2, 5, 6, 7) * 4).to(dtype)
    if strided:
        x = x[:, :, ::2]

    def fn(t):
        y = F.pad(t * 2 if lazy else t, pad, value=value)
        return y + 1

    try:
        want = fn(x)
    except RuntimeError:   # (pads that crop more than there is)
        assume(False)
    gm = symtrace.symbolic_trace(fn, example_inputs=(x,))
    lm = lower(gm, (x,))
    if want.numel():
        assert [r for r in lm.report().splitlines() if r.startswith("pad ")][0].split()[3] == "kernel"
    got = lm(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, equal_nan=True)


def test_other_padding_modes_run_through_torch():
    x = torch.randn(1, 2, 5, 5)

    def fn(t):
        return F.pad(t, (1, 1, 2, 0), mode="reflect") * 2
    lm = lower(symtrace.symbolic_trace(fn, example_inputs=(x,)), (x,))
    assert "'reflect' padding" in lm.report()
    torch.testing.assert_close(lm(x), fn(x))
