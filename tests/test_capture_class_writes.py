"""What a traced program assigns to a class (``type(self).calls += 1``, ``Counter.total = x``,
``type(o).k`` of an input object) is put back when the trace ends and replayed by the graph, as
eager would have done it; before, the write stayed on the class (or on the tracer's shadow class)
and captured calls returned stale values."""
import pytest
import torch
from torch import nn

import symtrace


class Tally:
    k = 1
    count = 0
    last = None

    def __init__(self):
        self.a = 1


def _bump_input_class(x, o):
    type(o).k += 1
    return x * type(o).k


def _reset_tally():
    Tally.k, Tally.count, Tally.last = 1, 0, None


def test_a_write_to_an_input_objects_class_is_replayed():
    _reset_tally()
    cap = symtrace.capture(_bump_input_class)
    x = torch.ones(2)
    for expected in (2.0, 3.0, 4.0):   # eager: each call adds one to the class value
        torch.testing.assert_close(cap(x, Tally()), x * expected)
        assert Tally.k == expected
    _reset_tally()


def _global_class_program(x):
    Tally.count += 1
    if hasattr(Tally, "scratch"):
        del Tally.scratch
    return x * Tally.count


def test_writes_to_a_global_class_are_replayed():
    _reset_tally()
    Tally.scratch = 1
    cap = symtrace.capture(_global_class_program)
    for i in range(1, 4):
        x = torch.full((3,), float(i))
        torch.testing.assert_close(cap(x), x * i)
        assert Tally.count == i and not hasattr(Tally, "scratch")
    _reset_tally()


def _keeps_a_total(x):
    Tally.last = x.sum() if Tally.last is None else Tally.last + x.sum()
    return x + Tally.last


def test_a_value_the_graph_computes_kept_on_a_class_is_replayed_and_read_afresh():
    # a graph reads class attributes as constants: a running total kept there is guarded on
    # the value it had, so each call re-captures and reads the total eager would
    _reset_tally()
    cap = symtrace.capture(_keeps_a_total)
    total = torch.zeros(())
    for i in (1, 2, 3):
        x = torch.full((2,), float(i))
        total = total + x.sum()
        torch.testing.assert_close(cap(x), x + total)
        torch.testing.assert_close(Tally.last, total)
    _reset_tally()


def test_a_computed_value_on_a_class_no_global_names_is_refused_and_the_class_left_alone():
    class Local:
        total = None

    def keep(x, o):
        type(o).total = x.sum()
        return x * 2

    with pytest.raises(symtrace.TraceError, match="Local.total"):
        symtrace.capture(keep)(torch.ones(2), Local())
    assert Local.total is None


class Counting(nn.Module):
    calls = 0
    seen = False

    def forward(self, x):
        type(self).calls += 1
        self.__class__.seen = True
        return x + type(self).calls


def test_writes_to_a_modules_class_reach_the_class_and_not_the_tracers_shadow():
    Counting.calls, Counting.seen = 0, False
    model = Counting()
    cap = symtrace.capture(model)
    x = torch.zeros(2)
    for i in (1, 2, 3):
        torch.testing.assert_close(cap(x), x + i)
        assert Counting.calls == i and Counting.seen is True
    # a trace of another instance starts from the class as it is now (nothing left behind)
    gm = symtrace.symbolic_trace(Counting(), example_inputs=(x,))
    assert Counting.calls == 3            # tracing changed nothing
    torch.testing.assert_close(gm(x), x + 4)
    assert Counting.calls == 4            # the graph replays the write, on the real class
    Counting.calls, Counting.seen = 0, False


class _Flag:
    on = False


class SetsFlag(nn.Module):
    def forward(self, x):
        _Flag.on = True
        return x * 2


def test_a_write_that_keeps_the_guards_holding_is_one_capture():
    _Flag.on = False
    cap = symtrace.capture(SetsFlag())
    x = torch.ones(2)
    for _ in range(3):
        torch.testing.assert_close(cap(x), x * 2)
        assert _Flag.on is True
        _Flag.on = False
    assert cap.captures == 1


class Fails(nn.Module):
    def forward(self, x):
        _Flag.on = "half-way"
        return torch.nonzero_static_that_does_not_exist(x)


def test_a_trace_that_fails_leaves_the_class_as_it_was():
    _Flag.on = False
    with pytest.raises(Exception):
        symtrace.symbolic_trace(Fails(), example_inputs=(torch.ones(2),))
    assert _Flag.on is False


class Registry:
    model = None


class Registers(nn.Module):
    def __init__(self):
        super().__init__()
        self.sub = nn.Linear(2, 2)

    def forward(self, x):
        Registry.model = self          # the module itself, not the tracer's stand-in for it
        return self.sub(x)


def test_a_module_stored_on_a_class_is_refused_and_the_class_left_alone():
    Registry.model = None
    with pytest.raises(symtrace.TraceError, match="Registry.model"):
        symtrace.capture(Registers().eval())(torch.randn(1, 2))
    assert Registry.model is None


class Leaf(nn.Module):
    k = 1

    def forward(self, x):
        return x * self.k


class Parent(nn.Module):
    def __init__(self):
        super().__init__()
        self.leaf = Leaf()

    def forward(self, x):
        type(self.leaf).k += 1        # the child's class, written before the child runs
        return self.leaf(x)


def test_a_parent_writing_its_childs_class_before_the_child_runs_is_replayed():
    Leaf.k = 1
    cap = symtrace.capture(Parent())
    x = torch.ones(1)
    for k in (2, 3, 4):
        torch.testing.assert_close(cap(x), x * k)
        assert Leaf.k == k
    Leaf.k = 1
    torch.testing.assert_close(symtrace.capture(Leaf())(x), x)   # nothing left on the tracer's classes


class _Note:
    def mark(self, m):
        m.__class__.marks += 1          # a write from a helper object's method


_NOTE = _Note()


class Marked(nn.Module):
    marks = 0

    def forward(self, x):
        _NOTE.mark(self)
        return x + 1


def test_a_write_from_code_the_trace_did_not_scan_is_put_back_and_replayed():
    Marked.marks = 0
    model = Marked()
    gm = symtrace.symbolic_trace(model, example_inputs=(torch.ones(2),))
    assert Marked.marks == 0                 # tracing left the class as it was
    cap = symtrace.capture(model)
    for i in (1, 2, 3):
        cap(torch.ones(2))
        assert Marked.marks == i
    Marked.marks = 0
    gm(torch.ones(2))
    assert Marked.marks == 1
    Marked.marks = 0
