"""Regressions found on real models (torchvision/timm zoo, transformers) — each reduced to
plain torch."""
import functools
import types

import pytest
import torch
from torch import nn

import symtrace


def test_dtype_read_of_an_intermediate_replays():
    def f(x):
        y = x * 2
        return torch.zeros(3, dtype=y.dtype) + y.sum()

    x = torch.randn(3)
    gm = symtrace.symbolic_trace(f, example_inputs=(x,))
    x2 = torch.randn(3)
    torch.testing.assert_close(gm(x2), f(x2))


def test_keyword_example_inputs_are_passed_as_keywords():
    def defaults(fn):  # like transformers' decorators filling **kwargs
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            if kwargs.get("use_cache") is None:
                kwargs["use_cache"] = True
            return fn(self, *args, **kwargs)
        return wrapper

    class M(nn.Module):
        @defaults
        def forward(self, x, mask=None, use_cache=None):
            return x * 2 if use_cache else x + 1

    kw = {"x": torch.ones(2), "use_cache": False}
    gm = symtrace.symbolic_trace(M(), example_inputs=kw)
    torch.testing.assert_close(gm(**kw), M()(**kw))
    with pytest.raises(symtrace.GuardError):
        gm(torch.ones(2), use_cache=True)


class _Cache:
    def __init__(self):
        self.keys = []


class _Box:
    def __init__(self, t):
        self.t = t


def test_a_plain_object_built_around_traced_values_is_rebuilt_in_the_output():
    class M(nn.Module):
        def forward(self, x):
            c = _Cache()
            c.keys.append(x * 2)
            return x + 1, c

    gm = symtrace.symbolic_trace(M(), example_inputs=(torch.ones(2),))
    out, cache = gm(torch.full((2,), 3.0))
    assert type(cache) is _Cache and torch.equal(cache.keys[0], torch.full((2,), 6.0))
    assert torch.equal(out, torch.full((2,), 4.0))


def test_a_plain_object_input_holding_tensors_is_traced_through_and_written_back():
    class M(nn.Module):
        def forward(self, x, box):
            box.seen = box.t * 2  # assigned on the caller's object when the graph runs
            return x + box.t, box

    gm = symtrace.symbolic_trace(M(), example_inputs=(torch.ones(2), _Box(torch.ones(2))))
    box = _Box(torch.full((2,), 5.0))
    out, same = gm(torch.ones(2), box)
    assert same is box and torch.equal(box.seen, torch.full((2,), 10.0)) and torch.equal(out, torch.full((2,), 6.0))
    with pytest.raises(symtrace.GuardError):  # the object's class is guarded
        gm(torch.ones(2), _Cache())


def test_autograd_function_is_one_node_and_keeps_its_backward():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 3  # deliberately not the true derivative: proves this backward runs

    class M(nn.Module):
        def forward(self, x):
            return Double.apply(x) + 1

    gm = symtrace.symbolic_trace(M(), example_inputs=(torch.ones(3),))
    x = torch.ones(3, requires_grad=True)
    gm(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 3.0))
    assert torch.autograd.Function.apply.__func__.__name__ == "apply"  # restored after tracing


def test_config_object_reads_are_guarded_and_iterable():
    class Config:
        def __init__(self):
            self.flag = False
            self.sizes = (1, 2)

        def __iter__(self):
            return iter(self.sizes)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = Config()

        def forward(self, x):
            total = sum(self.config)
            return x + total if self.config.flag else x - total

    m, x = M(), torch.ones(2)
    captured = symtrace.capture(m)
    torch.testing.assert_close(captured(x), m(x))
    m.config.flag = True
    torch.testing.assert_close(captured(x), m(x))
    gm = symtrace.symbolic_trace(M(), example_inputs=(x,))
    gm.config.flag = True
    with pytest.raises(symtrace.GuardError, match="config.flag"):
        gm(x)


def test_attribute_written_and_read_in_the_same_forward():
    class Corr(nn.Module):
        def build(self, a, b):
            self.pyramid = [a @ b.t()]

        def index(self, i):
            return self.pyramid[0] * i

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.corr = Corr()

        def forward(self, a, b):
            self.corr.build(a, b)
            return self.corr.index(2.0)

    net, a, b = Net(), torch.randn(2, 3), torch.randn(2, 3)
    gm = symtrace.symbolic_trace(net, example_inputs=(a, b))
    assert not hasattr(net.corr, "pyramid")  # tracing did not change the model
    a2, b2 = torch.randn(2, 3), torch.randn(2, 3)
    torch.testing.assert_close(gm(a2, b2), Net()(a2, b2))


def test_shape_tuple_comparison_replays_on_its_own_inputs():
    def f(a, b):
        h, w = a.shape[-2:]
        if (h, w) != b.shape[-2:]:
            raise ValueError("shapes differ")
        return a + b

    a, b = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    gm = symtrace.symbolic_trace(f, example_inputs=(a, b))
    torch.testing.assert_close(gm(a, b), f(a, b))


def test_no_grad_block_restores_the_callers_grad_mode():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            with torch.no_grad():
                c = x.mean()
            return self.lin(x) - c

    m, x = M(), torch.randn(2, 3)
    gm = symtrace.symbolic_trace(m, example_inputs=(x,))  # traced with grad enabled
    with torch.no_grad():
        out = gm(x)
        assert not torch.is_grad_enabled()
    assert not out.requires_grad
    assert gm(x).requires_grad and torch.is_grad_enabled()


def test_factories_with_traced_sizes_stay_general():
    def f(x):
        n, m = x.shape
        return x + torch.ones(n, m) + torch.zeros((n, m))

    gm = symtrace.symbolic_trace(f, example_inputs=(torch.randn(2, 3),))
    x2 = torch.randn(5, 4)
    torch.testing.assert_close(gm(x2), f(x2))


def test_plain_namespace_view_does_not_change_the_object():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = types.SimpleNamespace(scale=2.0)

        def forward(self, x):
            self.config.tmp = 1.0  # written to the trace's view only
            return x * self.config.scale + self.config.tmp

    m = M()
    gm = symtrace.symbolic_trace(m, example_inputs=(torch.ones(2),))
    assert not hasattr(m.config, "tmp")
    torch.testing.assert_close(gm(torch.ones(2)), torch.full((2,), 3.0))


def test_ordered_dict_output_is_rebuilt_at_run_time():
    import collections

    class M(nn.Module):
        def forward(self, x):
            return collections.OrderedDict(out=x * 2, aux=x + 1)

    gm = symtrace.symbolic_trace(M(), example_inputs=(torch.ones(2),))
    out = gm(torch.full((2,), 3.0))
    assert type(out) is collections.OrderedDict and list(out) == ["out", "aux"]
    torch.testing.assert_close(out["out"], torch.full((2,), 6.0))


def _legacy_constructor(x):
    return torch.Tensor(x) + 1  # the line the note must name


def test_a_proxy_reaching_c_code_gets_a_note_naming_the_users_line():
    x = torch.randn(3)
    for example in (None, (x,)):
        with pytest.raises(Exception) as info:
            symtrace.symbolic_trace(_legacy_constructor, example_inputs=example)
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "_legacy_constructor" in notes and "torch.Tensor(x) + 1" in notes, notes
        assert "leaf_function" in notes and "torch.as_tensor" in notes

    # the fixes it suggests trace and compute what eager computes
    @symtrace.leaf_function
    def legacy(x):
        return torch.Tensor(x)

    for fn in (lambda x: torch.as_tensor(x) + 1, lambda x: legacy(x) + 1):
        for example in (None, (x,)):
            assert torch.equal(symtrace.symbolic_trace(fn, example_inputs=example)(x), x + 1)
