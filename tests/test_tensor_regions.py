"""Tensor regions (symtrace.passes.tensor_regions) and their lowering under capture
(``lowering_pass`` on graphs that pass Python objects around, as a KV cache): only tensors cross
a region's boundary, the objects stay Python, results and the caller's objects match eager."""
import warnings

import pytest
import torch
from torch import nn

import symtrace
from symtrace.graph.node import TensorMeta
from symtrace.lower import lowering_pass
from symtrace.lower.capture_pass import LazyRegion
from symtrace.passes.tensor_regions import needs_regions, split_tensor_regions


class Cache:
    """A growing key cache kept in an attribute, as transformers' DynamicCache keeps its layers."""

    def __init__(self):
        self.k = None

    def update(self, k):
        self.k = k if self.k is None else torch.cat([self.k, k], 1)
        return self.k


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.randn(16))

    def forward(self, x, cache):
        h = self.proj(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w   # an RMSNorm
        k = cache.update(h)
        att = torch.softmax(h @ k.transpose(1, 2) / 4.0, -1) @ k
        return {"out": torch.relu(att) + 1.0, "length": k.shape[1]}   # a size leaves the tensors too


def _graphs(model, *example):
    graphs = []
    cap = symtrace.capture(model, passes=[lambda gm: graphs.append(gm)])
    cap(*example)
    return graphs[0]


def _primed(seed=1):
    """A cache holding 3 positions: the graph of a decode step reads and replaces its tensor."""
    c = Cache()
    c.update(torch.randn(1, 3, 16, generator=torch.Generator().manual_seed(seed)))
    return c


def _regions(top):
    return [m for name, m in top.named_children() if isinstance(m, LazyRegion)]


def test_only_tensors_cross_a_region_and_the_split_graph_computes_the_same():
    torch.manual_seed(0)
    model = Block().eval()
    gm = _graphs(model, torch.randn(1, 1, 16), _primed())
    assert needs_regions(gm)
    top = split_tensor_regions(gm)
    subs = [m for name, m in top.named_children() if name.startswith("region_")]
    assert subs
    for sub in subs:
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                assert isinstance(n.meta.get("tensor_meta"), TensorMeta), n.name
        out = sub.graph.output_node().args[0]
        for v in (out if isinstance(out, tuple) else (out,)):
            assert isinstance(v.meta.get("tensor_meta"), TensorMeta), v.name
    # the object plumbing (the cache's attribute read and write, the dict) is in the top level,
    # and the returned length is read there from the region's tensor (k.shape[1])
    assert any(n.op == "call_function" and n.target is getattr and n.args[1] == "shape" for n in top.graph.nodes)
    assert any(n.op == "placeholder" and n.name == "cache" and n.users for n in top.graph.nodes)
    c1, c2 = _primed(), _primed()
    with torch.no_grad():
        for t in (1, 2, 1):
            x = torch.randn(1, t, 16)
            want, got = model(x, c1), top(x, c2)
            torch.testing.assert_close(got["out"], want["out"])
            assert got["length"] == want["length"]
    torch.testing.assert_close(c2.k, c1.k)
    assert len(list(gm.graph.nodes)) == len(list(_graphs(model, torch.randn(1, 1, 16), _primed()).graph.nodes))


def test_lowering_pass_lowers_the_regions_and_updates_the_callers_object_as_eager():
    torch.manual_seed(0)
    model = Block().eval()
    cap = symtrace.capture(model, passes=[lowering_pass()])
    c_eager, c_low = Cache(), Cache()
    with torch.no_grad():
        for t in (4, 1, 1, 1, 1, 1):
            x = torch.randn(1, t, 16)
            want, got = model(x, c_eager), cap(x, c_low)
            torch.testing.assert_close(got["out"], want["out"])
            assert got["length"] == want["length"]
            torch.testing.assert_close(c_low.k, c_eager.k)
    assert cap.captures <= 3
    regions = [r for gm in cap.graphs for r in _regions(gm)]
    assert regions and all(r.failure is None and r.lowered is not None for r in regions)
    assert any(len(r.lowered.kernels) > 0 for r in regions)   # (fused: RMSNorm, softmax, relu + 1)
    # the decode graph serves growing cache lengths from at most two compiles (static, then generic)
    assert all(r.lowered.compiles <= 2 and r.lowered.torch_calls == 0 for r in regions)


class Slots(nn.Module):
    """Writes into a preallocated buffer of the caller's object (an in-place write, a barrier in
    the middle), then reads it: the regions before and after it are separate."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, state):
        h = torch.tanh(self.proj(x)) * 2.0
        state.buf[:, state.pos] = h
        state.pos += 1
        return torch.softmax(state.buf.sum(1) * h, -1) + 1.0


class State:
    def __init__(self):
        self.buf = torch.zeros(1, 6, 8)
        self.pos = 0


def test_an_inplace_write_between_tensor_regions_keeps_its_place():
    torch.manual_seed(0)
    model = Slots().eval()
    cap = symtrace.capture(model, passes=[lowering_pass()])
    s_eager, s_low = State(), State()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            for _ in range(4):
                x = torch.randn(1, 8)
                torch.testing.assert_close(cap(x, s_low), model(x, s_eager))
                torch.testing.assert_close(s_low.buf, s_eager.buf)
                assert s_low.pos == s_eager.pos
    regions = [r for gm in cap.graphs for r in _regions(gm)]
    assert len(regions) >= 2   # (the write splits the graph: a region before it, one after)


def test_a_graph_of_tensors_only_is_lowered_whole():
    cap = symtrace.capture(lambda x: torch.relu(x) * 2, passes=[lowering_pass()])
    with torch.no_grad():
        x = torch.randn(4, 8)
        torch.testing.assert_close(cap(x), torch.relu(x) * 2)
    gm = cap.graphs[0]
    assert hasattr(gm, "lowered") and not _regions(gm)


def test_a_region_that_fails_to_lower_runs_as_captured_with_one_warning():
    torch.manual_seed(0)
    model = Block().eval()
    gm = _graphs(model, torch.randn(1, 1, 16), _primed())
    from symtrace.lower.capture_pass import lower_regions

    def refuse(region, inputs):
        raise RuntimeError("no compiler here")

    top = lower_regions(gm, refuse)
    c1, c2 = _primed(), _primed()
    with torch.no_grad():
        with pytest.warns(UserWarning, match="could not be lowered .*no compiler here"):
            got = top(torch.ones(1, 1, 16), c2)
        want = model(torch.ones(1, 1, 16), c1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # once only
            top(torch.ones(1, 1, 16), c2)
    torch.testing.assert_close(got["out"], want["out"])
    assert all(r.failure and "no compiler here" in r.failure for r in _regions(top))


class WithOptional(nn.Module):
    """An optional input left None and a dataclass-like output: no object is read or written,
    but the graph is not tensors only (as a decoder called with use_cache=False)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, mask=None):
        h = torch.softmax(self.proj(x), -1)
        if mask is not None:
            h = h * mask
        return Output(logits=h * 2.0, hidden=h)


class Output:
    def __init__(self, logits, hidden):
        self.logits, self.hidden = logits, hidden


def test_an_unused_none_input_and_an_object_output_are_lowered_by_regions():
    torch.manual_seed(0)
    model = WithOptional().eval()
    cap = symtrace.capture(model, passes=[lowering_pass()])
    x = torch.randn(2, 8)
    with torch.no_grad():
        got, want = cap(x), model(x)
    assert isinstance(got, Output)
    torch.testing.assert_close(got.logits, want.logits)
    torch.testing.assert_close(got.hidden, want.hidden)
    regions = _regions(cap.graphs[0])
    assert regions and all(r.lowered is not None for r in regions)
