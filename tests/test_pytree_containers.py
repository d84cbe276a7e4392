"""Containers registered with torch.utils._pytree as inputs and outputs (graph/pytree_bridge.py):
their children are traced, their class, context and size are guarded, and outputs are rebuilt
by the registered unflatten function."""
import pytest
import torch
import torch.utils._pytree as pytree

import symtrace
from symtrace.errors import GuardError, TraceError


class Bag:
    """A keyed container with __slots__ (not a plain object): only pytree says what it holds."""
    __slots__ = ("items",)

    def __init__(self, items):
        self.items = dict(items)


class Opaque:
    __slots__ = ("t",)

    def __init__(self, t):
        self.t = t


pytree.register_pytree_node(Bag, lambda b: (list(b.items.values()), tuple(b.items)),
                            lambda xs, keys: Bag(zip(keys, xs)))


def scale(b, s):
    return Bag({k: v * s for k, v in b.items.items()})


def _bag(**kw):
    return Bag(kw)


def test_registered_container_in_and_out():
    x = _bag(a=torch.ones(2), b=torch.arange(3.0))
    gm = symtrace.symbolic_trace(scale, example_inputs=(x, 3.0))
    y = gm(_bag(a=torch.full((2,), 2.0), b=torch.zeros(3)), 3.0)
    assert type(y) is Bag and list(y.items) == ["a", "b"]
    assert torch.equal(y.items["a"], torch.full((2,), 6.0)) and torch.equal(y.items["b"], torch.zeros(3))


def test_context_and_children_are_guarded():
    gm = symtrace.symbolic_trace(scale, example_inputs=(_bag(a=torch.ones(2)), 2.0))
    with pytest.raises(GuardError, match="pytree container input's context"):
        gm(_bag(z=torch.ones(2)), 2.0)
    with pytest.raises(GuardError, match="dtype"):
        gm(_bag(a=torch.ones(2, dtype=torch.float64)), 2.0)


def test_capture_recaptures_when_the_structure_changes():
    cap = symtrace.capture(scale)
    for kw in ({"a": torch.ones(2)}, {"a": torch.ones(2), "b": torch.ones(1)}, {"a": torch.zeros(4)}):
        y = cap(Bag(kw), 5.0)
        assert list(y.items) == list(kw) and all(torch.equal(y.items[k], v * 5) for k, v in kw.items())
    assert cap.captures == 2   # the second bag has other keys; the third only other sizes


def test_nested_registered_containers_and_lists():
    def f(b):
        inner = b.items["inner"]
        return [inner.items["x"] + b.items["y"][0], Bag({"s": b.items["y"][1].sum()})]

    x = _bag(inner=_bag(x=torch.ones(3)), y=[torch.arange(3.0), torch.ones(2, 2)])
    gm = symtrace.symbolic_trace(f, example_inputs=(x,))
    got, want = gm(x), f(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1].items["s"], want[1].items["s"])


def test_unregistered_containers_of_tensors_are_still_refused():
    with pytest.raises(TraceError, match="Opaque holding tensors"):
        symtrace.symbolic_trace(lambda o: o.t + 1, example_inputs=(Opaque(torch.ones(1)),))
