"""fuse_attention: softmax(q @ k^T * s [+ mask]) [-> eval dropout] @ v -> F.scaled_dot_product_attention."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import symtrace
from symtrace.passes import PassContext, fuse_attention, run_passes
from symtrace.passes.fuse_attention import find_attention

SDPA = F.scaled_dot_product_attention
TOL = {torch.float32: 2e-5, torch.float64: 1e-12, torch.bfloat16: 3e-2, torch.float16: 3e-3}


def sdpa_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is SDPA]


def fused(fn, *inputs):
    gm = symtrace.symbolic_trace(fn, example_inputs=inputs)
    n = fuse_attention(gm)
    return gm, n


class Attn(nn.Module):
    """Attention written in one of several spellings."""

    def __init__(self, scale_form="mul", drop="none", softmax="method", transpose="transpose", matmul="op",
                 scale=0.3):
        super().__init__()
        self.scale_form, self.drop, self.softmax, self.transpose, self.matmul = scale_form, drop, softmax, transpose, matmul
        self.scale = scale
        self.sm = nn.Softmax(dim=-1)
        self.dropout = nn.Dropout(0.5).eval() if drop == "module" else nn.Dropout(0.0)

    def mm(self, a, b):
        return a @ b if self.matmul == "op" else torch.matmul(a, b) if self.matmul == "torch" else a.matmul(b)

    def forward(self, q, k, v, mask=None):
        kt = {"transpose": lambda: k.transpose(-2, -1), "swap": lambda: torch.transpose(k, -1, -2),
              "mT": lambda: k.mT}[self.transpose]()
        s = self.scale
        if self.scale_form == "q":
            att = self.mm(q * s, kt)
        elif self.scale_form == "div":
            att = self.mm(q, kt) / (1.0 / s)
        elif self.scale_form == "rmul":
            att = s * self.mm(q, kt)
        elif self.scale_form == "none":
            att = self.mm(q, kt)
        else:
            att = self.mm(q, kt) * s
        if mask is not None:
            att = att + mask
        att = {"method": lambda: att.softmax(dim=-1), "F": lambda: F.softmax(att, dim=-1),
               "torch": lambda: torch.softmax(att, -1), "module": lambda: self.sm(att)}[self.softmax]()
        if self.drop in ("module", "p0"):
            att = self.dropout(att)
        elif self.drop == "functional":
            att = F.dropout(att, 0.3, training=False)
        return self.mm(att, v)


@st.composite
def attention_case(draw):
    batch = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    L, S, E, Ev = (draw(st.integers(1, 9)) for _ in range(4))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
    model = Attn(scale_form=draw(st.sampled_from(["mul", "div", "rmul", "q", "none"])),
                 drop=draw(st.sampled_from(["none", "module", "functional", "p0"])),
                 softmax=draw(st.sampled_from(["method", "F", "torch", "module"])),
                 transpose=draw(st.sampled_from(["transpose", "swap", "mT"])),
                 matmul=draw(st.sampled_from(["op", "torch", "method"])),
                 scale=draw(st.floats(0.05, 2.0)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    q, k, v = (torch.randn(*batch, n, e, generator=g).to(dtype) for n, e in ((L, E), (S, E), (S, Ev)))
    mask = None
    if draw(st.booleans()):
        mshape = draw(st.sampled_from([(L, S), (1, S), (*batch, L, S)]))
        mask = torch.randn(*mshape, generator=g).to(dtype)
    return model, (q, k, v) + ((mask,) if mask is not None else ())


@settings(max_examples=60, deadline=None)
@given(attention_case())
def test_rewrite_matches_eager(case):
    model, inputs = case
    gm, n = fused(model, *inputs)
    assert n == 1 and len(sdpa_nodes(gm)) == 1
    assert not any(n.op == "call_method" and n.target == "softmax" for n in gm.graph.nodes)
    with torch.no_grad():
        got, ref = gm(*inputs), model(*inputs)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    tol = TOL[ref.dtype]
    if ref.dtype is torch.bfloat16:
        # eager rounds the scores and the softmax to bfloat16, SDPA keeps them wider: compare
        # both with the float64 result and accept the fused one when it is as near as eager's (x2)
        with torch.no_grad():
            exact = model.double()(*[t.double() if t.is_floating_point() else t for t in inputs])
        err, eager_err = (got.double() - exact).abs(), (ref.double() - exact).abs()
        assert bool((err <= tol + 2 * eager_err).all()), f"max err {err.max():.3g}, eager {eager_err.max():.3g}"
    else:
        torch.testing.assert_close(got.double(), ref.double(), rtol=tol, atol=tol)


def test_transformer_block_and_meta():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from examples.models import TransformerBlock
    m = TransformerBlock(32, 4).eval()
    x = torch.randn(2, 5, 32)
    mask = torch.triu(torch.full((5, 5), -1e4), 1)
    for inputs in ((x,), (x, mask)):
        gm = symtrace.symbolic_trace(m, example_inputs=inputs)
        final = [n for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__ == "matmul"][-1]
        source = final.meta["source"]
        assert fuse_attention(gm) == 1
        node, = sdpa_nodes(gm)
        assert node.meta["source"] == source and "models.py" in str(source)
        assert node.kwargs["scale"] == m.scale
        assert (node.kwargs.get("attn_mask") is not None) == (len(inputs) == 2)
        with torch.no_grad():
            torch.testing.assert_close(gm(*inputs), m(*inputs), rtol=1e-5, atol=1e-5)
        gm.graph.lint()


def test_runs_in_a_pipeline_and_names_itself():
    def f(q, k, v):
        return (q @ k.transpose(-2, -1) * 0.5).softmax(-1) @ v
    t = torch.randn(2, 3, 4)
    gm = symtrace.symbolic_trace(f, example_inputs=(t, t, t))
    ctx = PassContext(lint=True)
    gm = run_passes(gm, [fuse_attention], ctx)
    assert ctx.history == [("fuse_attention", True)] and len(sdpa_nodes(gm)) == 1


def _not_rewritten(fn, *inputs):
    gm = symtrace.symbolic_trace(fn, example_inputs=inputs)
    before = str(gm.graph)
    assert find_attention(gm) == []
    assert fuse_attention(gm) == 0
    assert str(gm.graph) == before


Q = torch.randn(2, 4, 3)


def test_softmax_over_another_dim_is_not_rewritten():
    _not_rewritten(lambda q, k, v: (q @ k.transpose(-2, -1) * 0.5).softmax(dim=-2) @ v, Q, Q, Q)
    _not_rewritten(lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1), 0) @ v, Q, Q, Q)


def test_used_intermediate_is_not_rewritten():
    def scores_used(q, k, v):
        s = q @ k.transpose(-2, -1) * 0.5
        return s.softmax(-1) @ v, s

    def probs_used(q, k, v):
        p = (q @ k.transpose(-2, -1)).softmax(-1)
        return p @ v, p.sum()
    _not_rewritten(scores_used, Q, Q, Q)
    _not_rewritten(probs_used, Q, Q, Q)


def test_training_dropout_is_never_rewritten():
    drop = nn.Dropout(0.2)  # training mode

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = drop

        def forward(self, q, k, v):
            return self.drop((q @ k.transpose(-2, -1)).softmax(-1)) @ v
    _not_rewritten(M().train(), Q, Q, Q)
    _not_rewritten(lambda q, k, v: F.dropout((q @ k.transpose(-2, -1)).softmax(-1), 0.1) @ v, Q, Q, Q)
    _not_rewritten(lambda q, k, v: F.dropout((q @ k.transpose(-2, -1)).softmax(-1), 0.1, True) @ v, Q, Q, Q)


def test_mismatched_transpose_and_operand_order_are_not_rewritten():
    q4 = torch.randn(2, 3, 3, 3)
    _not_rewritten(lambda q, k, v: (q @ k.transpose(-3, -1)).softmax(-1) @ v, q4, q4, q4)
    _not_rewritten(lambda q, k, v: (q @ k).softmax(-1) @ v, Q, Q.transpose(-2, -1), Q)   # no transpose
    _not_rewritten(lambda q, k, v: v @ (q @ k.transpose(-2, -1)).softmax(-1), Q, Q, Q.transpose(-2, -1))


def test_masks_that_sdpa_reads_differently_are_not_rewritten():
    boolean = torch.rand(4, 4) > 0.5
    bigger = torch.randn(3, 2, 4, 4)
    one_d = torch.randn(4)
    for mask in (boolean, bigger, one_d):
        _not_rewritten(lambda q, k, v, m: (q @ k.transpose(-2, -1) + m).softmax(-1) @ v, Q, Q, Q, mask)
    # and masks=False leaves a valid float mask alone
    mask = torch.randn(4, 4)
    gm = symtrace.symbolic_trace(lambda q, k, v, m: (q @ k.transpose(-2, -1) + m).softmax(-1) @ v,
                                 example_inputs=(Q, Q, Q, mask))
    assert fuse_attention(gm, masks=False) == 0 and fuse_attention(gm) == 1


def test_side_effect_between_is_not_crossed():
    def f(q, k, v):
        s = q @ k.transpose(-2, -1)
        q.mul_(2)          # the fused call would read q after this write
        return s.softmax(-1) @ v
    _not_rewritten(f, Q.clone(), Q, Q)


def test_mismatched_shapes_or_dtypes_are_not_rewritten():
    # batch dims broadcast by matmul but differ between q and k
    _not_rewritten(lambda q, k, v: (q @ k.transpose(-2, -1)).softmax(-1) @ v,
                   torch.randn(2, 4, 3), torch.randn(1, 4, 3), torch.randn(2, 4, 3))
    # a rank-2 k broadcast against rank-3 q
    _not_rewritten(lambda q, k, v: (q @ k.transpose(-2, -1)).softmax(-1) @ v,
                   torch.randn(2, 4, 3), torch.randn(4, 3), torch.randn(2, 4, 3))


def test_without_tensor_meta_structural_match_still_correct():
    def f(q, k, v):
        return (q @ k.transpose(-2, -1) / 2.0).softmax(dim=-1) @ v
    gm = symtrace.symbolic_trace(f)
    assert fuse_attention(gm) == 1
    q, k, v = torch.randn(3, 5, 4), torch.randn(3, 6, 4), torch.randn(3, 6, 2)
    torch.testing.assert_close(gm(q, k, v), f(q, k, v), rtol=1e-5, atol=1e-5)


def test_two_attentions_and_bad_input():
    def f(q, k, v):
        a = (q @ k.transpose(-2, -1) * 0.5).softmax(-1) @ v
        return (a @ k.transpose(-2, -1) * 0.25).softmax(-1) @ v
    gm, n = fused(f, Q, Q, Q)
    assert n == 2 and len(sdpa_nodes(gm)) == 2
    torch.testing.assert_close(gm(Q, Q, Q), f(Q, Q, Q), rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="GraphModule"):
        find_attention(nn.Linear(2, 2))
