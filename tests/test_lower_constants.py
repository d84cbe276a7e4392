"""Tensors made from sizes and constants are computed once, at compile time
(``symtrace.lower.constant_tensors``), and only where no caller or later write can see or change
the one copy every call shares."""
from __future__ import annotations

import pytest
import torch

import symtrace
from symtrace.lower import compile as lower
from symtrace.lower import constant_tensors as CT
from kernel_tests import needs_c_compiler

pytestmark = [needs_c_compiler, pytest.mark.usefixtures("session_kernel_cache")]


def fourier_position(x):
    """A sine/cosine positional encoding built from the feature map's size (EdgeNeXt's form)."""
    b, c, h, w = x.shape
    mask = torch.zeros(b, h, w)
    y_embed = (~mask.bool()).cumsum(1, dtype=torch.float32)
    x_embed = (~mask.bool()).cumsum(2, dtype=torch.float32)
    dim_t = torch.arange(c // 2, dtype=torch.int64)
    dim_t = 10000.0 ** (2 * torch.div(dim_t, 2, rounding_mode="floor") / (c // 2))
    pos_x = x_embed[:, :, :, None] / dim_t
    pos_y = y_embed[:, :, :, None] / dim_t
    pos_x = torch.stack((pos_x[:, :, :, 0::2].sin(), pos_x[:, :, :, 1::2].cos()), dim=4).flatten(3)
    pos_y = torch.stack((pos_y[:, :, :, 0::2].sin(), pos_y[:, :, :, 1::2].cos()), dim=4).flatten(3)
    pos = torch.cat((pos_y, pos_x), dim=3).permute(0, 3, 1, 2)
    return x + pos


def _folded(lm) -> list:
    return [line for line in lm.report().splitlines() if "computed once, at compile time" in line]


def _run(fn, *inputs):
    gm = symtrace.symbolic_trace(fn, example_inputs=inputs)
    lm = lower(gm, inputs)
    with torch.no_grad():
        return lm, lm(*[t.clone() for t in inputs]), fn(*[t.clone() for t in inputs])


def test_positional_encoding_from_sizes_is_computed_once():
    x = torch.randn(2, 8, 5, 6)
    lm, got, want = _run(fourier_position, x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    folded = _folded(lm)
    assert any("cumsum" in line for line in folded) and any("cat" in line for line in folded)
    code = lm.wrapper_code
    assert "cumsum" not in code and "torch.zeros" not in code and "torch.stack" not in code
    for _ in range(2):   # the same answer on later calls, for new data
        x2 = torch.randn(2, 8, 5, 6)
        torch.testing.assert_close(lm(x2), fourier_position(x2), rtol=0, atol=0)


def test_each_size_gets_its_own_constants():
    lm, _, _ = _run(fourier_position, torch.randn(1, 4, 3, 3))
    for shape in [(1, 4, 7, 2), (3, 8, 2, 5), (1, 4, 3, 3)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(lm(x), fourier_position(x), rtol=0, atol=0)


def test_a_returned_constant_is_not_shared_between_calls():
    def f(x):
        ids = torch.arange(x.shape[1]) * 2
        return x + ids, ids

    x = torch.randn(3, 4)
    lm, (y, ids), (wy, wids) = _run(f, x)
    assert torch.equal(ids, wids) and torch.equal(y, wy)
    ids.add_(100)   # the caller owns what it got back
    assert torch.equal(lm(x)[1], wids)
    folded = _folded(lm)   # (arange's own result is private: the product is a new tensor)
    assert any("arange" in line for line in folded) and not any("mul" in line for line in folded)


def test_a_view_of_a_returned_constant_is_not_folded():
    def f(x):
        base = torch.ones(4, 4) * 3
        return x * base, base[0]

    x = torch.randn(4, 4)
    lm, (_, row), _ = _run(f, x)
    row.zero_()
    assert torch.equal(lm(x)[1], torch.full((4,), 3.0))


@pytest.mark.parametrize("write", ["setitem", "add_", "copy_"])
def test_a_constant_written_with_data_is_computed_per_call(write):
    def f(x):
        buf = torch.zeros(x.shape[0], 4)
        if write == "setitem":
            buf[:, 0] = x.sum(1)
        elif write == "add_":
            buf.add_(x[:, :4])
        else:
            buf[1:].copy_(x[1:, :4])
        return buf.cumsum(1) + 1

    x = torch.randn(3, 5)
    lm, got, want = _run(f, x)
    torch.testing.assert_close(got, want)
    for _ in range(2):
        x2 = torch.randn(3, 5)
        torch.testing.assert_close(lm(x2), f(x2))
    assert not any("zeros" in line for line in _folded(lm))


_KEPT: list = []


@symtrace.leaf_function
def _keep(t):
    """User code that keeps what it is given."""
    _KEPT.append(t)
    return t


def test_a_constant_handed_to_user_code_is_not_folded():
    def f(x):
        return x + _keep(torch.ones(x.shape[1]) * 2)

    x = torch.randn(2, 3)
    lm, got, want = _run(f, x)
    torch.testing.assert_close(got, want)
    assert not any("mul" in line for line in _folded(lm))
    _KEPT[-1].add_(1)   # (the user's code changes what it kept: the next call is not affected)
    torch.testing.assert_close(lm(x), want)


def test_random_and_uninitialized_tensors_are_never_folded():
    def f(x):
        return x + torch.rand(x.shape) * 0 + torch.empty(x.shape).zero_()

    x = torch.randn(2, 3)
    lm, got, want = _run(f, x)
    torch.testing.assert_close(got, want)
    assert not any("rand" in line or "empty" in line for line in _folded(lm))


def test_large_constants_stay_per_call(monkeypatch):
    monkeypatch.setattr(CT, "MAX_BYTES", 64)   # (the 4 int64 frequencies fit; the 2x8x5x6 encoding does not)
    x = torch.randn(2, 8, 5, 6)
    lm, got, want = _run(fourier_position, x)
    torch.testing.assert_close(got, want)   # (our sin/cos kernels, within an ulp or two)
    folded = _folded(lm)
    assert any("arange" in line for line in folded) and not any("cat" in line for line in folded)


def test_a_fold_the_alias_model_misses_is_undone(monkeypatch):
    # (as if the effect model did not know that an op returns its input: the lowering sees the
    # folded tensor among what it returns, and lowers again with nothing folded)
    monkeypatch.setattr(CT.ConstantTensors, "_private", lambda self, node: True)

    def f(x):
        ids = torch.arange(x.shape[1]) * 1.0
        return x + ids, ids

    x = torch.randn(2, 4)
    lm, (_, ids), _ = _run(f, x)
    ids.add_(100)
    torch.testing.assert_close(lm(x)[1], torch.arange(4.0))
    assert not _folded(lm)


def test_ops_returning_their_input_keep_the_fold_away_from_the_caller():
    def f(x):
        ids = torch.arange(x.shape[1]) * 1.0
        return x + ids, ids.to_dense(), ids.conj_physical()

    x = torch.randn(2, 4)
    lm, (_, a, b), _ = _run(f, x)
    a.add_(100)
    b.add_(100)
    torch.testing.assert_close(lm(x)[1], torch.arange(4.0))


def test_values_the_kernels_cannot_read_are_computed_per_call():
    def f(x):
        n = x.shape[-1] // 2
        rot = torch.view_as_real(torch.polar(torch.ones(n), torch.arange(n) * 0.5)).flatten()   # (complex64)
        return x * rot

    x = torch.randn(3, 8)
    lm, got, want = _run(f, x)
    torch.testing.assert_close(got, want)


def test_only_the_folded_tensors_a_call_reads_are_kept():
    x = torch.randn(2, 8, 5, 6)
    lm, _, _ = _run(fourier_position, x)
    holder = lm._first.lowering.constants.holder
    assert len(vars(holder)) == 1 and lm.wrapper_code.count(".c") == 1


def test_sparse_values_are_computed_per_call():
    def f(x):
        s = torch.eye(x.shape[1]).to_sparse()
        return torch.sparse.mm(s, x.t()).t() + 1

    x = torch.randn(3, 5)
    lm, got, want = _run(f, x)
    torch.testing.assert_close(got, want)
