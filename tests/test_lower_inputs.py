"""How a lowered module takes its inputs: keyword arguments by the forward's parameter names,
keyword example inputs, example inputs rebuilt from what tracing recorded, inputs that hold
tensors in containers; and values whose sizes come from the data (``.item()``, ``nonzero``,
boolean masks), which a variant chosen by its inputs' sizes must not fix."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import symtrace
from symtrace.lower import compile as lower
from kernel_tests import needs_c_compiler

pytestmark = [needs_c_compiler, pytest.mark.usefixtures("session_kernel_cache")]


class TakesInput(nn.Module):
    """``input`` shadows a builtin: the graph names its placeholder ``input_1``."""

    def forward(self, input, scale=None):
        y = torch.relu(input) * 3
        return y if scale is None else y * scale


def test_keyword_arguments_bind_by_the_forwards_parameter_names():
    x = torch.randn(4, 8)
    gm = symtrace.symbolic_trace(TakesInput(), example_inputs={"input": x})
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"][0] != "input"
    lm = lower(gm, {"input": x}, speed_check=False)
    y = torch.randn(4, 8)
    torch.testing.assert_close(lm(input=y), TakesInput()(y))
    torch.testing.assert_close(lm(y), TakesInput()(y))
    assert lm.torch_calls == 0
    with pytest.raises(TypeError, match="multiple values for argument 'input'"):
        lm(y, input=y)
    with pytest.raises(TypeError, match="unexpected arguments"):
        lm(input=y, other=y)


def test_keyword_example_inputs_trace_and_lower_a_module():
    m, x = TakesInput(), torch.randn(3, 5)
    lm = lower(m, {"input": x}, speed_check=False)
    torch.testing.assert_close(lm(input=x), m(x))
    with pytest.raises(ValueError, match="no argument named 'other'"):
        lower(symtrace.symbolic_trace(m, example_inputs={"input": x}), {"input": x, "other": x}, speed_check=False)


def test_example_inputs_are_rebuilt_from_what_tracing_recorded():
    def f(x, n: int = 3, mask=None, pair=None):
        y = x * n
        if mask is not None:
            y = y + mask
        return y + pair[0] * pair[1]

    x, pair = torch.randn(2, 3), (torch.randn(2, 3), torch.randn(3))
    gm = symtrace.symbolic_trace(f, example_inputs={"x": x, "n": 4, "pair": pair})
    lm = lower(gm, speed_check=False)   # (no example inputs: n=4, mask=None, a pair of tensors)
    torch.testing.assert_close(lm(x, 4, None, pair), f(x, 4, None, pair))
    torch.testing.assert_close(lm(x, n=4, pair=pair), f(x, 4, None, pair))


def test_an_input_traced_at_its_default_takes_the_default_when_rebuilt():
    class Masked(nn.Module):
        def forward(self, x, attn_mask=None):
            return torch.softmax(x if attn_mask is None else x + attn_mask, -1)

    x = torch.randn(2, 6)
    gm = symtrace.symbolic_trace(Masked(), example_inputs={"x": x})
    lm = lower(gm, speed_check=False)
    torch.testing.assert_close(lm(x), Masked()(x))
    assert lm.torch_calls == 0


def test_an_input_with_nothing_recorded_and_no_default_is_a_clear_error():
    gm = symtrace.symbolic_trace(lambda x: x + 1)   # (no example inputs: no metadata)
    with pytest.raises(ValueError, match="input 'x' has no recorded tensor metadata"):
        lower(gm, speed_check=False)


@pytest.mark.parametrize("kind", [list, tuple, dict])
def test_inputs_holding_tensors_run_through_torch_with_the_reason(kind):
    def f(x, held):
        a, b = (held["a"], held["b"]) if isinstance(held, dict) else held
        return x * a + b

    x, a, b = torch.randn(4), torch.randn(4), torch.randn(4)
    held = {"a": a, "b": b} if kind is dict else kind([a, b])
    lm = lower(f, (x, held), speed_check=False)
    a2, b2 = torch.randn(4), torch.randn(4)   # other tensors: never the example's, baked in
    held2 = {"a": a2, "b": b2} if kind is dict else kind([a2, b2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(lm(x, held2), f(x, held2))
        torch.testing.assert_close(lm(x, held), f(x, held))
    assert lm.torch_calls == 2
    assert "holds tensors in a" in lm.report() and repr("held") in lm.report()


def _sizes_from_item(x, k):
    n = k.sum().item()
    return torch.sigmoid(x[:n]) * 2 + 1


def _nonzero(x, m):
    idx = torch.nonzero(m).squeeze(1)
    return (x[idx] * 3).relu() + 1


def _bool_mask(x):
    y = x[x > 0]
    return torch.exp(y) * 2


def _where_one_argument(x):
    (i,) = torch.where(x > 0.5)
    return i.float() * 2 + 1


def _unique(x):
    return torch.unique((x * 3).round()).sigmoid() + 1


@pytest.mark.parametrize("fn,make", [
    (_sizes_from_item, lambda n: (torch.randn(8), torch.tensor([1, n]))),
    (_nonzero, lambda n: (torch.randn(8), torch.arange(8) < n)),
    (_bool_mask, lambda n: (torch.cat([torch.rand(n) + 0.1, -torch.rand(8 - n) - 0.1]),)),
    (_where_one_argument, lambda n: (torch.cat([torch.full((n,), 0.9), torch.zeros(8 - n)]),)),
    (_unique, lambda n: (torch.arange(8.0) % max(n, 1),)),
], ids=["item", "nonzero", "bool_mask", "where", "unique"])
def test_sizes_that_come_from_the_data_are_not_fixed_by_the_variant(fn, make):
    example = make(2)
    lm = lower(fn, example, speed_check=False)
    for n in (2, 5, 0, 7):   # same input sizes, other data: other result sizes
        inputs = make(n)
        want = fn(*inputs)
        got = lm(*inputs)
        assert got.shape == want.shape, n
        torch.testing.assert_close(got, want)
    assert "size depends on the data" in lm.report()
    assert lm.compiles == 1   # (one variant serves them all: the data-sized part runs in torch)


def test_kernels_before_a_data_sized_value_still_run():
    def f(x, k):
        y = torch.tanh(x) * 2 + 1      # a kernel: not sized by data
        return y[: k.sum().item()] + 1
    x, k = torch.randn(16), torch.tensor([3, 4])
    lm = lower(f, (x, k), speed_check=False)
    assert lm.kernels, lm.report()
    k2 = torch.tensor([10, 1])
    torch.testing.assert_close(lm(x, k2), f(x, k2))


def test_a_slice_bound_computed_when_the_graph_runs_is_a_torch_call():
    def f(x, k):
        return x[:, : k.sum().item()] * 2 + 1
    x, k = torch.randn(3, 10), torch.tensor([2, 2])
    lm = lower(f, (x, k), speed_check=False)
    k2 = torch.tensor([5, 3])
    torch.testing.assert_close(lm(x, k2), f(x, k2))


def test_a_number_read_from_data_as_an_operand_keeps_the_kernels_after_it():
    def f(x):
        s = x.abs().max().item()
        y = x / s               # (the number changes values, not sizes)
        return torch.tanh(y) * 2 + 1
    x = torch.randn(64)
    lm = lower(f, (x,), speed_check=False)
    x2 = torch.randn(64) * 10
    torch.testing.assert_close(lm(x2), f(x2))
    lines = {line.split()[0]: line for line in lm.report().splitlines() if line.strip()}
    assert all(" kernel " in lines[name] for name in ("tanh", "mul", "add")), lm.report()
