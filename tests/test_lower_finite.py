"""Finite-value analysis (passes/finite_values.py) and what the inference pipeline builds on it:
activations fused only where their input is finite whenever the graph's inputs are, a per-call
input check, and residual adds that accumulate in place."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

import symtrace
from symtrace.lower import InferenceOptions, compile as lower
from symtrace.lower import onednn
from symtrace.lower.onednn import PackedConv
from symtrace.passes.finite_values import FiniteValues
from kernel_tests import needs_c_compiler

pytestmark = pytest.mark.usefixtures("session_kernel_cache")
needs_cc = needs_c_compiler
needs_onednn = pytest.mark.skipif(not onednn.available(), reason="this torch build has no oneDNN ops")


def _answers(fn, *inputs, module=None):
    model = module if module is not None else fn
    gm = symtrace.symbolic_trace(model, example_inputs=inputs)
    fv = FiniteValues(gm)
    return {n.name: fv.holds(n) for n in gm.graph.nodes if n.op != "output"}, fv, gm


# --------------------------------------------------------------------------- the analysis

def test_finite_preserving_ops_hold_and_others_do_not():
    conv = nn.Conv2d(3, 4, 3, padding=1)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.pool = conv, nn.BatchNorm2d(4).eval(), nn.AdaptiveAvgPool2d(1)

        def forward(self, x):
            a = F.relu(self.bn(self.conv(x)))
            b = a * 2.0 + a.permute(0, 1, 3, 2) / 4       # views, mul/add, division by a constant
            c = torch.softmax(b.flatten(2), -1)
            d = b / a                                      # 0/0
            e = torch.sqrt(b - 1)                          # sqrt of a negative
            f = torch.exp(b)                               # overflows at 89
            g = self.pool(b) + c.sum()
            h = torch.unflatten(g, 1, (2, 2))
            return h, d, e, f

    ans, fv, _ = _answers(None, torch.randn(1, 3, 5, 5), module=M().eval())
    for name in ("x", "conv", "bn", "relu", "mul", "permute", "truediv", "add", "softmax", "pool", "add_1",
                 "unflatten"):
        assert ans[name], name
    for name in ("truediv_1", "sqrt", "exp"):
        assert not ans[name], name
    assert [n.name for n in fv.inputs_relied_on] == ["x"]


def test_unbind_roll_cumsum_and_fresh_constants_hold():
    # CoaT's q, k, v = qkv.unbind(0); Swin's shifted windows (roll); cumulative sums
    def fn(x):
        q, k = x.unbind(0)
        r = torch.roll(q, 1, 1) + k.roll(-1, 2)
        z = torch.zeros(2, 3) + torch.ones(2, 3)   # (no inputs)
        return torch.cumsum(r, 1) + r.cumsum(2) + torch.unbind(x, 1)[0].sum() + z.sum()

    ans, _, _ = _answers(fn, torch.randn(2, 3, 4, 5))
    for name in ("unbind", "roll", "roll_1", "zeros", "ones", "cumsum", "cumsum_1", "unbind_1"):
        assert ans[name], name


def test_non_finite_constants_and_fills_do_not_hold():
    w_bad = torch.randn(4, 4)
    w_bad[1, 2] = float("inf")

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.good, self.bad = nn.Linear(4, 4), nn.Linear(4, 4)
            with torch.no_grad():
                self.bad.weight.copy_(w_bad)

        def forward(self, x, mask):
            return (self.good(x), self.bad(x), x.masked_fill(mask, -float("inf")), x.masked_fill(mask, -1e9),
                    x + float("nan"), torch.full_like(x, 1.0))

    x = torch.randn(2, 4)
    ans, _, _ = _answers(None, x, x > 0, module=M())
    assert ans["good"] and ans["masked_fill_1"] and ans["mask"]        # a bool input is always finite
    assert not ans["bad"] and not ans["masked_fill"] and not ans["add"]
    assert not ans["full_like"]                                         # an unknown function


def test_attention_with_a_boolean_mask_and_empty_means_do_not_hold():
    def f(q, m, e):
        return (F.scaled_dot_product_attention(q, q, q), F.scaled_dot_product_attention(q, q, q, attn_mask=m),
                F.scaled_dot_product_attention(q, q, q, attn_mask=m.float()), q.mean(-1), e.mean(-1))

    q = torch.randn(1, 2, 4, 8)
    ans, _, _ = _answers(f, q, torch.ones(4, 4, dtype=torch.bool), torch.randn(3, 0))
    assert ans["scaled_dot_product_attention"] and ans["scaled_dot_product_attention_2"] and ans["mean"]
    assert not ans["scaled_dot_product_attention_1"]   # a row masked entirely is NaN
    assert not ans["mean_1"]                            # a mean over nothing is NaN


def test_norms_written_out_hold_and_roots_of_what_may_be_negative_or_zero_do_not():
    # timm's RmsNorm2d / LayerNorm2d and transformers' RMSNorm, written with var/mean and rsqrt
    def f(x, y):
        rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        ln = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(torch.var(x, dim=-1, keepdim=True, unbiased=False) + 1e-5)
        v2 = x * (x.var(-1, keepdim=True) + 1e-6).rsqrt()
        sq = torch.sqrt((x * x).sum(-1)) + x.abs().sqrt().sum() + torch.relu(x).amax().sqrt()
        no_eps = torch.rsqrt(x.pow(2).mean(-1))          # rsqrt(0) is inf
        minus = torch.rsqrt(x.pow(2).mean(-1) - 1e-6)     # may be negative
        odd = torch.sqrt(x.pow(3).mean(-1))               # may be negative
        one = torch.var(y, dim=-1)                        # one element, correction 1: NaN
        one_biased = torch.var(y, dim=-1, correction=0)
        return rms, ln, v2, sq, no_eps, minus, odd, one, one_biased

    ans, _, _ = _answers(f, torch.randn(2, 8), torch.randn(2, 1))
    for name in ("rsqrt", "mul", "rsqrt_1", "mul_1", "var_1", "rsqrt_2", "mul_2", "sqrt", "sqrt_1", "sqrt_2",
                 "var_3"):
        assert ans[name], name
    for name in ("rsqrt_3", "rsqrt_4", "sqrt_3", "var_2"):
        assert not ans[name], name


def test_an_input_without_tensor_metadata_is_not_assumed_finite():
    gm = symtrace.symbolic_trace(lambda x, s: x * s, example_inputs=(torch.randn(3), torch.tensor(2.0)))
    for n in gm.graph.find_nodes(op="placeholder"):
        if n.name == "s":
            del n.meta["tensor_meta"]   # (what an input of unknown type looks like)
    fv = FiniteValues(gm)
    mul = next(n for n in gm.graph.nodes if n.name == "mul")
    assert not fv.holds(mul) and not fv.inputs_relied_on   # (a "no" relies on no input)
    assert fv.holds(next(n for n in gm.graph.nodes if n.name == "x")) and [n.name for n in fv.inputs_relied_on] == ["x"]


def test_deep_graphs_do_not_recurse():
    def f(x):
        for _ in range(3000):
            x = x + 1.0
        return torch.relu(x)

    gm = symtrace.symbolic_trace(f, example_inputs=(torch.randn(3),))
    out = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    assert FiniteValues(gm).holds(out)


# --------------------------------------------------------------------------- the pipeline

class Net(nn.Module):
    """conv-relu chains, a residual block with a downsample convolution, an unsafe branch."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.c3 = nn.Conv2d(8, 16, 1)
        self.down = nn.Conv2d(8, 16, 1)
        self.c4 = nn.Conv2d(16, 16, 1)
        self.c5 = nn.Conv2d(16, 16, 1)

    def forward(self, x):
        a = F.relu(self.c1(x))
        b = F.relu(self.c2(a))
        c = F.relu(self.c3(b) + self.down(a))         # residual: other is a fresh packed conv result
        d = F.relu(self.c4(c) + c)                     # other = c, read before by c4 only
        u = F.relu(self.c5(torch.log(d)))              # log: may be NaN from finite inputs
        return d, u


def _assert_matches_eager(lm, model, x):
    with torch.no_grad():
        for got, want in zip(lm(x), model(x)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, equal_nan=True)


def _packed(lm):
    return {n.name: n.target for n in lm.gm.graph.nodes if n.op == "call_function" and isinstance(n.target, PackedConv)}


@needs_cc
@needs_onednn
def test_guarded_fusion_decisions_and_per_call_check():
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(2, 3, 8, 8)
    lm = lower(model, (x,))
    posts = sorted(t.post for t in _packed(lm).values())
    assert posts.count("relu") == 4 and posts.count("none") == 2   # c5's relu stays separate (after log)
    assert lm._finite_inputs == (0,)
    assert "NaN or Inf runs through torch" in lm.report()
    _assert_matches_eager(lm, model, x)
    assert lm.torch_calls == 0


class _NormedMlp(nn.Module):
    """ConvNeXt's block in NCHW (timm's conv_mlp): a norm written with var and rsqrt between
    convolutions, then 1x1 convolution -> erf-GELU."""

    def __init__(self):
        super().__init__()
        self.dw, self.fc1, self.fc2 = nn.Conv2d(8, 8, 7, padding=3, groups=8), nn.Conv2d(8, 32, 1), nn.Conv2d(32, 8, 1)
        self.weight = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        y = self.dw(x).permute(0, 2, 3, 1)
        y = y * torch.rsqrt(torch.var(y, dim=-1, keepdim=True) + 1e-6) * self.weight
        return x + self.fc2(F.gelu(self.fc1(y.permute(0, 3, 1, 2))))


@needs_cc
@needs_onednn
def test_gelu_fuses_after_a_norm_written_with_var_and_rsqrt():
    torch.manual_seed(0)
    model = _NormedMlp().eval()
    x = torch.randn(1, 8, 9, 9).to(memory_format=torch.channels_last)
    lm = lower(model, (x,))
    assert sorted(t.post for t in _packed(lm).values()).count("gelu") == 1
    with torch.no_grad():
        torch.testing.assert_close(lm(x), model(x), rtol=1e-4, atol=1e-5)
        bad = x.clone()
        bad[0, 1, 2, 3] = float("inf")   # oneDNN's gelu differs on inf: this call runs through torch
        torch.testing.assert_close(lm(bad), model(bad), rtol=1e-4, atol=1e-5, equal_nan=True)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """Net and its lowered module, built once for the hypothesis test."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SYMTRACE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "symtrace-cache"))
        torch.manual_seed(0)
        model = Net().eval()
        return model, lower(model, (torch.randn(2, 3, 8, 8),))


@needs_cc
@needs_onednn
@settings(max_examples=25, deadline=None)
@given(cells=st.lists(st.tuples(st.integers(0, 2 * 3 * 8 * 8 - 1),
                                st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30, -1e30])),
                      max_size=4))
def test_guarded_module_equals_eager_on_non_finite_inputs(guarded, cells):
    model, lm = guarded
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    flat = x.view(-1)
    for i, v in cells:
        flat[i] = v
    _assert_matches_eager(lm, model, x)


@needs_cc
@needs_onednn
def test_non_finite_weights_keep_activations_separate():
    torch.manual_seed(0)
    model = Net().eval()
    with torch.no_grad():
        model.c2.bias[0] = float("inf")
    x = torch.randn(2, 3, 8, 8)
    lm = lower(model, (x,))
    # only c1's relu is fused: c2 has an Inf bias, and c3, c4, c5 read what it computed
    assert sorted(t.post for t in _packed(lm).values()).count("relu") == 1
    _assert_matches_eager(lm, model, x)


@needs_cc
@needs_onednn
def test_residual_adds_accumulate_in_place_only_into_dead_fresh_results():
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(2, 3, 8, 8)
    lm = lower(model, (x,))
    inplace = [name for name, t in _packed(lm).items() if t.inplace]
    assert len(inplace) == 1                          # c3(b) + down(a); not c4(c) + c, which reads c
    assert "accumulate" in lm.report()

    class ReadAfter(nn.Module):
        """the residual's other operand is also returned, or read by a kernel after the add"""

        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)

        def forward(self, x):
            o = self.a(x)
            y = F.relu(self.b(x) + o)
            z = F.relu(self.c(x) + o * 1.0)           # (o * 1.0: not a packed conv result)
            return y, z, o

    m2 = ReadAfter().eval()
    x2 = torch.randn(1, 4, 6, 6)
    lm2 = lower(m2, (x2,))
    assert not any(t.inplace for t in _packed(lm2).values())
    _assert_matches_eager(lm2, m2, x2)
    for _ in range(4):                                   # repeated calls: no state left in buffers
        _assert_matches_eager(lm, model, x)


def test_size_arithmetic_keeps_values_finite():
    """channel shuffle: view(b, g, c // g, h, w) -> transpose -> view; sizes computed in Python."""
    def f(x):
        b, c, h, w = x.size()
        y = x.view(b, 2, c // 2, h, w).transpose(1, 2).contiguous()
        return torch.relu(y.view(b, -1, h, w))

    ans, _, _ = _answers(f, torch.randn(1, 4, 3, 3))
    assert ans["relu"] and ans["floordiv"]


def test_an_unknown_nan_exact_is_a_clear_error():
    with pytest.raises(ValueError, match="nan_exact must be True, False or 'guarded'"):
        InferenceOptions(nan_exact="sometimes")


@needs_cc
@needs_onednn
def test_inputs_are_checked_per_call_only_where_a_fused_activation_relies_on_them():
    # packed layers without a NaN-sensitive activation rely on nothing: the per-call finiteness
    # check used to cover every input that reached any packed layer (a decode step's whole KV
    # cache, summed on every call)
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, y):
            return torch.sigmoid(self.a(x)) + F.relu(self.b(y))   # only y's layer fuses relu

    torch.manual_seed(0)
    model = TwoInputs().eval()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    lm = lower(model, (x, y))
    assert lm._finite_inputs == (1,)
    with torch.no_grad():
        x[0, 0] = float("nan")
        torch.testing.assert_close(lm(x, y), model(x, y), equal_nan=True)
        assert lm.torch_calls == 0   # NaN in x: no fused activation depends on it


@needs_onednn
def test_a_layer_left_unfused_adds_no_per_call_check():
    # exp(x) may overflow to inf: relu stays out of the layer, and nothing relies on x being finite
    class ExpThenLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.lin = nn.Conv2d(4, 4, 1), nn.Linear(4, 4)

        def forward(self, x):
            return F.relu(self.conv(x.exp())), F.relu(self.lin(x.mean((2, 3)).exp()))

    torch.manual_seed(0)
    model = ExpThenLayer().eval()
    x = torch.randn(1, 4, 3, 3)
    lm = lower(model, (x,))
    assert lm._finite_inputs == ()
    assert all(t.post == "none" for t in [n.target for n in lm.gm.graph.nodes]
               if isinstance(t, (PackedConv, onednn.PackedLinear)))
    with torch.no_grad():
        for got, want in zip(lm(x), model(x)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
