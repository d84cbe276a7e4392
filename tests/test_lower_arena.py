"""Arena blocks shared between intermediate buffers whose lifetimes do not overlap."""
from __future__ import annotations


import pytest
import torch

import symtrace
from symtrace.lower import compile as lower
from symtrace.lower.arena import lifetimes
from kernel_tests import needs_c_compiler

pytestmark = [needs_c_compiler, pytest.mark.usefixtures("session_kernel_cache")]


def chain(x):
    # kernels feeding torch calls (cumsum has no rule): each kernel's result is an arena temp
    a = torch.cumsum(x.exp(), 0)
    b = torch.cumsum(a.sin() * 2, 1)
    c = torch.cumsum(b.cos() + a, 0)
    d = torch.cumsum(c.tanh(), 1)
    return d * 3


def views(x):
    # torch.diagonal (no rule) returns a view of an arena temp: the temp lives as long as the view
    a = torch.diagonal(x.exp() + 1)
    b = torch.cumsum(x.sin(), 0)
    c = torch.cumsum(b.cos(), 0)
    return a * 2, c + a.sum()


def _storages(lm):
    g = lm._first.call.__globals__
    return {g[k].untyped_storage().data_ptr() for k in g if k.startswith("_arena_")}, \
        [k for k in g if k.startswith("_arena_")]


@pytest.mark.parametrize("fn", [chain, views])
def test_shared_arena_gives_eager_results(fn):
    x = torch.randn(16, 16)
    lm = lower(symtrace.symbolic_trace(fn, example_inputs=(x,)), (x,))
    for _ in range(2):
        torch.testing.assert_close(lm(x), fn(x))
    blocks, names = _storages(lm)
    if fn is chain:
        assert len(names) >= 4 and len(blocks) < len(names)


def test_lifetimes_follow_views():
    from symtrace.lower.steps import ExternStep, KernelStep
    x = torch.randn(16, 16)
    lm = lower(symtrace.symbolic_trace(views, example_inputs=(x,)), (x,))
    lw = lm._first.lowering
    span = lifetimes(lw)
    i, diag = next((i, s) for i, s in enumerate(lw.steps)
                   if isinstance(s, ExternStep) and s.target is torch.diagonal)
    (temp,) = [a.buffer for a in diag.args if hasattr(a, "buffer") and a.buffer.role == "temp"]
    view = diag.out_buffers[0][1]
    last_read = max(j for j, s in enumerate(lw.steps)
                    if isinstance(s, KernelStep) and any(b is view for b in s.kernel.buffers()))
    assert span[id(temp)][0] < i < last_read <= span[id(temp)][1]


def test_switch_off(monkeypatch):
    monkeypatch.setenv("SYMTRACE_ARENA_SHARING", "0")
    x = torch.randn(16, 16)
    lm = lower(symtrace.symbolic_trace(chain, example_inputs=(x,)), (x,))
    blocks, names = _storages(lm)
    assert len(blocks) == len(names)
    torch.testing.assert_close(lm(x), chain(x))


def test_torch_results_are_freed_after_their_last_use():
    """The wrapper ``del``s a torch call's result after the last line that reads it, so its
    memory returns to the allocator during the call (as eager frees a layer's output)."""
    x = torch.randn(16, 16)
    lm = lower(symtrace.symbolic_trace(chain, example_inputs=(x,)), (x,))
    code = lm.wrapper_code
    lines = code.splitlines()
    dels = [ln.strip() for ln in lines if ln.strip().startswith("del ")]
    assert dels, code
    for d in dels:   # nothing reads a name after its del
        for name in d[4:].split(", "):
            later = lines[lines.index(next(ln for ln in lines if ln.strip() == d)) + 1:]
            assert not any(name in ln.split("  # ")[0].replace(",", " ").split() or f"{name}." in ln or
                           f"({name}" in ln or f" {name})" in ln for ln in later), (name, code)
    torch.testing.assert_close(lm(x), chain(x))


class _Holder:
    pass


class _KeepsAValue(torch.nn.Module):
    """``self.h.last = x * 2 + 1``: a kernel's result stored into Python state (a replayed
    assignment) outlives the call."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.h = _Holder()
        self.h.last = None

    def forward(self, x):
        y = self.lin(x)
        self.h.last = x * 2 + 1
        return y


def test_values_kept_past_the_call_are_not_arena_buffers():
    """A value the caller keeps (stored into state) is not in the arena, which the next call
    would overwrite."""
    model = _KeepsAValue().eval()
    x1, x2 = torch.zeros(2, 4), torch.ones(2, 4)
    with torch.no_grad():
        gm = symtrace.symbolic_trace(model, example_inputs=(x1,))
        lm = lower(gm, (x1,))
        holder = gm if hasattr(gm, "h") else model   # (where the graph replays the store)
        lm(x1)
        kept = holder.h.last
        lm(x2)
    torch.testing.assert_close(kept, x1 * 2 + 1)
    torch.testing.assert_close(holder.h.last, x2 * 2 + 1)
    assert kept.data_ptr() != holder.h.last.data_ptr()
