"""How a lowered module takes its inputs: keyword arguments by the forward's parameter names,
keyword example inputs, example inputs rebuilt from what tracing recorded, inputs that hold
tensors in containers; and values whose sizes come from the data (``.item()``, ``nonzero``,
boolean masks), which a variant chosen by its inputs' sizes must not fix."""
from __future__ import annotations

import dataclasses
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


class TakesVariadics(nn.Module):
    """Reads its ``*args`` and ``**kwargs`` (a Hugging Face forward passes ``**kwargs`` on)."""

    def forward(self, x, *args, scale=2.0, **kwargs):
        y = torch.relu(x) * scale
        for a in args:
            y = y * a
        if "bias" in kwargs:
            y = y + kwargs["bias"]
        return y


@pytest.mark.parametrize("args, kwargs", [
    ((torch.randn(4, 8), 3.0), {}),
    ((torch.randn(4, 8),), {"bias": torch.randn(8), "scale": 0.5}),
    ((torch.randn(4, 8), torch.randn(8)), {}),
], ids=["a-number-in-args", "a-tensor-in-kwargs", "a-tensor-in-args"])
def test_a_forward_taking_args_and_kwargs_lowers_and_binds_calls_as_python_does(args, kwargs):
    # (refused before: "graphs with *args/**kwargs inputs cannot be lowered")
    m = TakesVariadics()
    lm = lower(m, dict(kwargs, x=args[0]) if kwargs else args, speed_check=False)
    assert lm.kernels and lm.torch_calls == 0
    x = torch.randn(4, 8)
    other = tuple(torch.randn_like(a) if isinstance(a, torch.Tensor) else a for a in args[1:])
    kw = {k: torch.randn_like(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    torch.testing.assert_close(lm(x, *other, **kw), m(x, *other, **kw))


class TakesKeywordOnly(nn.Module):
    def forward(self, x, *args, bias=None, **kwargs):
        return x * 2 if bias is None else x * 2 + bias


def test_a_keyword_only_input_after_unused_args_is_not_bound_positionally():
    # (second review: *args traced empty was dropped and `bias` then took a positional argument)
    m, x, b = TakesKeywordOnly(), torch.randn(2, 3), torch.randn(3)
    gm = symtrace.symbolic_trace(m, example_inputs={"x": x, "bias": b})
    lm = lower(gm, {"x": x, "bias": b}, speed_check=False)
    torch.testing.assert_close(lm(x, bias=b * 2), m(x, bias=b * 2))
    with pytest.raises(symtrace.GuardError, match=r"len\(args\) == 0"):
        lm(x, torch.full((3,), 100.0))
    # example inputs already in placeholder order (a tuple for *args, a dict for **kwargs)
    lm = lower(gm, (x, (), b, {}), speed_check=False)
    torch.testing.assert_close(lm(x, bias=b), m(x, bias=b))


def test_a_call_with_other_variadic_arguments_answers_as_the_graph_does():
    m, x, bias = TakesVariadics(), torch.randn(4, 8), torch.randn(8)
    gm = symtrace.symbolic_trace(m, example_inputs={"x": x, "bias": bias})
    lm = lower(gm, {"x": x, "bias": bias}, speed_check=False)
    assert lm.kernels and lm.torch_calls == 0
    torch.testing.assert_close(lm(x, bias=bias * 2), m(x, bias=bias * 2))
    for args, kwargs in [((x,), {}), ((x, 2.0), {"bias": bias}), ((x,), {"bias": bias, "other": 1})]:
        with pytest.raises(symtrace.GuardError) as lowered:
            lm(*args, **kwargs)
        with pytest.raises(symtrace.GuardError) as graph:
            gm(*args, **kwargs)
        assert str(lowered.value) == str(graph.value)


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


def _pairs(kind, a, b):
    if kind == "dict":
        return {"a": a, "b": b}
    if kind == "nested":
        return [(a, 2.0), {"b": b}]
    return kind([a, b])


def _use_pair(x, held):
    if isinstance(held, dict):
        a, b = held["a"], held["b"]
    elif isinstance(held[0], tuple):
        a, b = held[0][0] * held[0][1], held[1]["b"]
    else:
        a, b = held
    return torch.tanh(x * a + b) + torch.stack([a, b]).sum(0)


@pytest.mark.parametrize("kind", [list, tuple, "dict", "nested"])
def test_containers_of_tensors_are_flattened_into_kernel_arguments(kind):
    x = torch.randn(4)
    lm = lower(_use_pair, (x, _pairs(kind, torch.randn(4), torch.randn(4))), speed_check=False)
    assert lm.kernels
    assert [n.op for n in lm.gm.graph.nodes].count("placeholder") == 3   # (x and the two tensors)
    held2 = _pairs(kind, torch.randn(4), torch.randn(4))   # other tensors, same structure
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(lm(x, held2), _use_pair(x, held2))
        torch.testing.assert_close(lm(x, held=held2), _use_pair(x, held2))
    assert lm.torch_calls == 0


def test_another_structure_runs_the_original_graph_and_its_guards():
    from symtrace.errors import GuardError

    def f(x, held):
        return x * held[0] + held[1] * held[2]
    x = torch.randn(3)
    gm = symtrace.symbolic_trace(f, example_inputs=(x, [torch.randn(3), torch.randn(3), 2]))
    lm = lower(gm, (x, [torch.randn(3), torch.randn(3), 2]), speed_check=False)
    same = [torch.randn(3), torch.randn(3), 2]
    torch.testing.assert_close(lm(x, same), f(x, same))
    assert lm.torch_calls == 0
    for other in ([torch.randn(3), torch.randn(3), 3],             # another value at a plain leaf
                  [torch.randn(3), torch.randn(3)],                # another length
                  (torch.randn(3), torch.randn(3), 2)):            # another container type
        with pytest.raises(GuardError):
            gm(x, other)
        with pytest.raises(GuardError):
            lm(x, other)
    assert lm.torch_calls == 3


def test_a_guard_on_a_held_tensors_shape_is_checked_on_the_leaf():
    def f(x, held):
        y = held[0] * 2 if held[0].shape[0] > 2 else held[0] - 1
        return y + x
    x = torch.randn(4)
    lm = lower(f, (x, [torch.randn(4)]), speed_check=False)
    from symtrace.errors import GuardError
    with pytest.raises(GuardError):
        lm(torch.randn(2), [torch.randn(2)])   # (the branch was decided on held[0]'s size)
    h = [torch.randn(4)]
    torch.testing.assert_close(lm(x, h), f(x, h))


def test_a_conv_model_taking_a_list_of_images_runs_its_kernels():
    class TwoViews(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)

        def forward(self, images):
            return [torch.relu(self.bn(self.conv(im))).mean((2, 3)) for im in images]

    torch.manual_seed(0)
    m = TwoViews().eval()
    ims = [torch.randn(1, 3, 16, 16), torch.randn(1, 3, 8, 8)]
    with torch.no_grad():
        lm = lower(m, (ims,), speed_check=False)
        ims2 = [torch.randn(1, 3, 16, 16), torch.randn(1, 3, 8, 8)]
        for got, want in zip(lm(ims2), m(ims2)):
            torch.testing.assert_close(got, want)
    assert lm.kernels and lm.torch_calls == 0


class _Holder:
    def __init__(self, a):
        self.a = a


@dataclasses.dataclass(slots=True)
class _SlotHolder:
    a: torch.Tensor


@pytest.mark.parametrize("holder", [_Holder, _SlotHolder], ids=["attributes", "slots"])
def test_an_object_holding_tensors_runs_through_torch_with_the_reason(holder):
    def f(x, h):
        return x + h.a

    x = torch.randn(4)
    lm = lower(f, (x, holder(torch.randn(4))), speed_check=False)
    h2 = holder(torch.randn(4))
    torch.testing.assert_close(lm(x, h2), f(x, h2))
    assert f"holds tensors in a {holder.__name__}" in lm.report()


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


# --- found in review: more ways data sizes a value -----------------------------------------

def _slice_by_tensor(x, k):
    return x[:k.sum()] * 2 + 1


def _slice_by_max(x, k):
    return torch.sigmoid(x[:max(k, 1)]) * 2


def _sized_by_nonzero_count(x, m):
    n = torch.nonzero(m).size(0)
    return torch.sigmoid(x[:n]) * 2


def _one_hot(k):
    return (torch.nn.functional.one_hot(k).float() * 2).sum(-1)


def _ceil(x, k):
    import math
    return x[:math.ceil(k)] * 2 + 1


@pytest.mark.parametrize("fn,example,other", [
    (_slice_by_tensor, (torch.randn(64), torch.tensor([30, 9])), (torch.randn(64), torch.tensor([1, 0]))),
    (_slice_by_max, (torch.randn(8), torch.tensor(2)), (torch.randn(8), torch.tensor(5))),
    (_sized_by_nonzero_count, (torch.randn(8), torch.arange(8) < 3), (torch.randn(8), torch.arange(8) < 6)),
    (_one_hot, (torch.tensor([1, 3]),), (torch.tensor([0, 1]),)),
    (_ceil, (torch.randn(8), torch.tensor(1.5)), (torch.randn(8), torch.tensor(4.2))),
], ids=["slice_by_0d_tensor", "slice_by_max", "size_of_nonzero", "one_hot", "math_ceil"])
def test_more_values_sized_by_data(fn, example, other):
    lm = lower(fn, example, speed_check=False)
    want = fn(*other)
    got = lm(*other)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)


def test_a_data_guard_on_a_data_sized_count_is_checked_per_call():
    from symtrace.errors import GuardError

    def f(x, m):
        if torch.nonzero(m).size(0) > 4:
            return x * 2
        return x * 3
    x = torch.randn(8)
    gm = symtrace.symbolic_trace(f, example_inputs=(x, torch.arange(8) < 6))
    lm = lower(gm, (x, torch.arange(8) < 6), speed_check=False)
    with pytest.raises(GuardError):
        gm(x, torch.arange(8) < 2)
    with pytest.raises(GuardError):
        lm(x, torch.arange(8) < 2)


def test_a_value_guard_on_a_tensor_input_is_checked_per_call():
    import operator
    from symtrace.errors import GuardError

    def f(x, k):
        return x[:operator.index(k)] * 2 + 1   # (the tracer specialises k: a guard k == 2)
    x = torch.randn(8)
    lm = lower(f, (x, torch.tensor(2)), speed_check=False)
    torch.testing.assert_close(lm(x, torch.tensor(2)), f(x, torch.tensor(2)))
    with pytest.raises(GuardError):
        lm(x, torch.tensor(5))


def test_a_user_function_whose_result_is_sized_by_data_is_a_loud_error_not_a_wrong_size():
    @symtrace.leaf_function
    def keep_positive(x):
        return x[x > 0]

    def f(x):
        return torch.exp(keep_positive(x)) * 2
    make = (lambda n: torch.cat([torch.rand(n) + 0.1, -torch.rand(8 - n) - 0.1]))
    lm = lower(f, (make(5),), speed_check=False)
    five = make(5)
    torch.testing.assert_close(lm(five), f(five))
    with pytest.raises(RuntimeError, match=r"returned sizes \(2,\) where \(5,\) were recorded"):
        lm(make(2))


def _mean_of_masked(x):
    s = x[x > 0].mean()                              # shape () whatever the data
    return torch.softmax(torch.tanh(x / s) * 2 + 1, -1)


def _leaky_by_item(x, t):
    y = torch.nn.functional.leaky_relu(x, t.item())  # a number read from data: an operand
    return torch.softmax(torch.tanh(y) * 2 + 1, -1)


def _index_add_of_selected(x, m):
    top = torch.nonzero(m).squeeze(1)
    out = torch.zeros_like(x).index_add(0, top, x[top] * 2)   # the sizes of its first argument
    return torch.softmax(torch.tanh(out) * 2 + 1, -1)


@pytest.mark.parametrize("fn,example,other", [
    (_mean_of_masked, (torch.randn(16, 16),), (torch.randn(16, 16),)),
    (_leaky_by_item, (torch.randn(16, 16), torch.tensor(0.1)), (torch.randn(16, 16), torch.tensor(0.3))),
    (_index_add_of_selected, (torch.randn(16, 16), torch.arange(16) < 4), (torch.randn(16, 16), torch.arange(16) < 9)),
], ids=["full_reduction", "scalar_operand", "index_add"])
def test_fixed_sizes_after_a_data_sized_value_run_kernels_again(fn, example, other):
    lm = lower(fn, example, speed_check=False)
    torch.testing.assert_close(lm(*other), fn(*other))
    lines = {line.split()[0]: line for line in lm.report().splitlines() if line.strip()}
    assert all(" kernel " in lines[name] for name in ("tanh", "softmax")), lm.report()


def test_dynamic_shapes_name_inputs_by_the_forwards_parameter_names():
    from symtrace.graph.symbols import Dim
    m, x = TakesInput(), torch.randn(4, 8)
    for key in ("input", "input_1"):   # (the parameter's name, or the graph's)
        lm = lower(m, {"input": x}, speed_check=False, dynamic_shapes={key: {0: Dim("b")}})
        y = torch.randn(7, 8)
        torch.testing.assert_close(lm(input=y), m(y))
        assert lm.compiles == 1


def test_a_foreign_example_meta_entry_is_not_read_as_a_recipe():
    from symtrace.trace.inputs import EXAMPLE_META_KEY
    gm = symtrace.symbolic_trace(lambda x, n: x * n, example_inputs=(torch.randn(3), 2))
    ph = [p for p in gm.graph.nodes if p.op == "placeholder"][1]
    assert ph.meta[EXAMPLE_META_KEY] == ("value", 2)
    ph.meta[EXAMPLE_META_KEY] = ("tensor", "not a TensorMeta")
    with pytest.raises(ValueError, match="input 'n' has no recorded tensor metadata"):
        lower(gm, speed_check=False)


# --- found in review: flattening ----------------------------------------------------------

def test_a_dict_in_another_key_order_runs_the_original_graph():
    from symtrace.errors import GuardError

    def f(d):
        return torch.cat(list(d.values())) * 2
    lm = lower(f, ({"a": torch.zeros(2), "b": torch.ones(3)},), speed_check=False)
    assert lm.torch_calls == 0 and lm.kernels
    with pytest.raises(GuardError):
        lm({"b": torch.ones(3), "a": torch.zeros(2)})


def test_one_list_reached_twice_is_not_flattened():
    from symtrace.errors import GuardError

    def f(xs, ys):
        return xs[0] + ys[1] * 10

    def g(xs):
        return xs[0][0] * 2 + xs[1][0]
    a = [torch.randn(4), torch.randn(4)]
    lm = lower(f, (a, a), speed_check=False)
    with pytest.raises(GuardError):   # (the graph read one stand-in for both: `ys is xs`)
        lm([torch.zeros(4), torch.zeros(4)], [torch.ones(4), torch.ones(4)])
    torch.testing.assert_close(lm(a, a), f(a, a))
    inner = [torch.randn(4)]
    lm = lower(g, ([inner, inner],), speed_check=False)
    with pytest.raises(GuardError):
        lm([[torch.ones(4)], [torch.zeros(4)]])


def test_example_inputs_the_graph_was_not_traced_for_are_refused():
    from symtrace.errors import GuardError

    def f(xs, k):
        return sum(xs) * k
    gm = symtrace.symbolic_trace(f, example_inputs=([torch.ones(4), torch.ones(4)], 2.0))
    with pytest.raises(GuardError, match="len"):
        lower(gm, ([torch.ones(4)] * 3, 2.0), speed_check=False)
    with pytest.raises(GuardError):
        lower(gm, ([torch.ones(4)] * 2, 3.0), speed_check=False)


def test_leaf_names_never_collide_with_other_inputs():
    def f(batch, batch_mask):
        return batch["x"] * batch_mask + batch["mask"] + batch["layer1.0"]
    ex = ({"x": torch.randn(3), "mask": torch.randn(3), "layer1.0": torch.randn(3)}, torch.randn(3))
    lm = lower(f, ex, speed_check=False)
    other = ({"x": torch.randn(3), "mask": torch.randn(3), "layer1.0": torch.randn(3)}, torch.randn(3))
    torch.testing.assert_close(lm(*other), f(*other))
    assert lm.torch_calls == 0
    targets = [str(n.target) for n in lm.gm.graph.nodes if n.op == "placeholder"]
    assert len(set(targets)) == len(targets) and all(t.isidentifier() for t in targets)


def test_masked_fill_broadcasting_to_a_data_sized_mask_is_data_sized():
    def f(x, m):
        sel = x[m]
        out = torch.zeros(1, 4).masked_fill(sel > 0, 1.0)   # (out of place: the mask's sizes)
        return torch.tanh(out) * 2
    x = torch.randn(8, 4)
    lm = lower(f, (x, torch.arange(8) < 3), speed_check=False)
    m = torch.arange(8) < 5
    torch.testing.assert_close(lm(x, m), f(x, m))


def test_dynamic_shapes_with_a_container_input():
    from symtrace.graph.symbols import Dim

    def f(xs, y):
        return xs[0].sum() * 2 + y
    ex = ([torch.randn(4), torch.randn(4)], torch.randn(4))
    lm = lower(f, ex, speed_check=False, dynamic_shapes=(None, {0: Dim("n")}))
    assert lm.compiles == 1
    with pytest.raises(ValueError, match="holds tensors in a container"):
        lower(f, ex, speed_check=False, dynamic_shapes={"xs": [{0: Dim("n")}, None]})
    lm = lower(f, ex, speed_check=False, dynamic_shapes={"y": {0: Dim("n")}})
    for n in (4, 9):
        other = ([torch.randn(4), torch.randn(4)], torch.randn(n))
        torch.testing.assert_close(lm(*other), f(*other))
    assert lm.compiles == 1


def _numel_reshape(x):
    n = torch.numel(x)                         # metadata, not data
    return torch.tanh(x).reshape(n) * 2 + 1


def _full_with_tensor_fill(x, t):
    y = torch.tanh(x) * 2
    return torch.softmax(y + torch.full((4,), t), -1) * 3   # t fills, it does not size


@pytest.mark.parametrize("fn,example", [(_numel_reshape, (torch.randn(4, 4),)),
                                        (_full_with_tensor_fill, (torch.randn(4), torch.tensor(3)))],
                         ids=["numel", "full_fill_value"])
def test_metadata_reads_and_fill_values_are_not_data_sized(fn, example):
    lm = lower(fn, example, speed_check=False)
    assert "depends on the data" not in lm.report(), lm.report()
    torch.testing.assert_close(lm(*example), fn(*example))


# --- found in the third review ------------------------------------------------------------

def _peak(x):   # a 0-d int tensor whose value (1, 2 or 4) depends on the data
    return 2 ** (x.argmax() % 3)


def _peaked(n):
    x = torch.rand(8, 4)
    x.view(-1)[{1: 0, 2: 1, 4: 2}[n]] = 5.0
    return x


@pytest.mark.parametrize("fn", [
    lambda x: x.reshape(_peak(x), -1) + 1,
    lambda x: x.view(_peak(x), -1) * 2,
    lambda x: x.unflatten(0, (_peak(x), -1)) - 1,
    lambda x: torch.split(x, _peak(x))[0] * 3,
    lambda x: x.chunk(_peak(x))[0] + 2,
    lambda x: torch.tensor_split(x, _peak(x))[0] * 2,
], ids=["reshape", "view", "unflatten", "split", "chunk", "tensor_split"])
def test_views_sized_by_a_tensors_value_follow_it(fn):
    lm = lower(fn, (_peaked(2),), speed_check=False)
    for n in (1, 2, 4):
        x = _peaked(n)
        want, got = fn(x), lm(x)
        assert got.shape == want.shape, n
        torch.testing.assert_close(got, want)


def test_a_long_chain_after_a_data_sized_value_keeps_its_alias_lists_short():
    from symtrace.lower.lowering import Lowering

    def f(x):
        m = x[x > 0]
        for _ in range(24):
            m = m + m * 0.5
        return m
    x = torch.randn(32)
    gm = symtrace.symbolic_trace(f, example_inputs=(x,))
    lw = Lowering(gm, (x,)).run()
    assert max(len(v) for v in lw._runtime_bufs.values()) <= 2   # (they doubled per step before)
    lm = lower(gm, (x,), speed_check=False)
    x2 = torch.randn(32)
    torch.testing.assert_close(lm(x2), f(x2))


def test_a_user_functions_variable_size_result_that_is_only_returned_is_kept():
    @symtrace.leaf_function
    def positives(x):
        return x[x > 0]

    def f(x):
        return positives(x * 2)
    lm = lower(f, (torch.randn(16),), speed_check=False)
    for _ in range(3):
        x = torch.randn(16)
        torch.testing.assert_close(lm(x), f(x))


def test_packed_sequences_are_data_sized():
    def f(x, lengths):
        data, batch_sizes = torch._VF._pack_padded_sequence(x, lengths, True)
        return data * 2 + 1
    x = torch.randn(4, 10, 8)   # (batch first: 4 sequences of up to 10 steps)
    lm = lower(f, (x, torch.tensor([10, 7, 5, 3])), speed_check=False)
    lengths = torch.tensor([9, 7, 5, 3])
    torch.testing.assert_close(lm(x, lengths), f(x, lengths))


def test_rebuilt_example_inputs_that_fail_the_guards_are_a_clear_error():
    import operator

    def f(x, k):
        return x.repeat(operator.index(k), 1)
    gm = symtrace.symbolic_trace(f, example_inputs=(torch.randn(2, 3), torch.tensor(2)))
    with pytest.raises(ValueError, match="do not pass the graph's guards"):
        lower(gm, speed_check=False)
    lm = lower(gm, (torch.randn(2, 3), torch.tensor(2)), speed_check=False)
    x = torch.randn(2, 3)
    torch.testing.assert_close(lm(x, torch.tensor(2)), f(x, torch.tensor(2)))


def test_a_forward_taking_kwargs_traced_without_them_lowers():
    class KwModel(nn.Module):
        def forward(self, input_ids, attention_mask=None, **kwargs):
            return torch.softmax(input_ids.float() * 2, -1) * attention_mask

    m, ids, mask = KwModel(), torch.randint(0, 9, (2, 5)), torch.ones(2, 5)
    lm = lower(m, {"input_ids": ids, "attention_mask": mask}, speed_check=False)
    torch.testing.assert_close(lm(input_ids=ids, attention_mask=mask), m(ids, mask))
    assert lm.kernels and lm.torch_calls == 0
    with pytest.raises(symtrace.GuardError, match=r"list\(kwargs\) == \[\]"):   # (as the traced graph)
        lm(input_ids=ids, attention_mask=mask, output_attentions=True)


def test_guards_on_metadata_methods_are_not_checked_per_call():
    def f(x):
        if x.is_contiguous() and x.is_floating_point():
            return x * 2
        return x.contiguous() * 3
    lm = lower(f, (torch.randn(4, 4),), speed_check=False)
    assert lm._global_guards == []
    x = torch.randn(4, 4)
    torch.testing.assert_close(lm(x), f(x))
