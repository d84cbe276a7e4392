"""The inference pipeline's rewrite of ``nn.MultiheadAttention`` calls into linear layers and
SDPA (:mod:`symtrace.lower.mha_inference`): same results as the module, every layout and
projection form; calls it cannot rewrite keep the module; weights and modes still checked."""
from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import symtrace
from symtrace.lower import InferenceOptions, compile as lower
from symtrace.lower.mha_inference import expand_multihead_attention
from symtrace.lower.pipeline import private_copy
from kernel_tests import needs_c_compiler

pytestmark = [needs_c_compiler, pytest.mark.usefixtures("session_kernel_cache")]


class Encoder(nn.Module):
    """A pre-norm attention block (torchvision's ViT encoder layer, reduced)."""

    def __init__(self, e=32, heads=4, batch_first=True, kdim=None, bias=True, **call):
        super().__init__()
        self.ln = nn.LayerNorm(e)
        self.attn = nn.MultiheadAttention(e, heads, batch_first=batch_first, kdim=kdim, vdim=kdim, bias=bias)
        self.call = call

    def forward(self, x, memory=None):
        h = self.ln(x)
        kv = h if memory is None else memory
        out, _ = self.attn(h, kv, kv, **self.call)
        return x + out


def _inputs(batch_first, n, lq, lk, e, kdim=None, cross=False, g=None):
    def make(l, d):
        return torch.randn((n, l, d) if batch_first else (l, n, d), generator=g)
    x = make(lq, e)
    return (x,) if not cross else (x, make(lk, kdim or e))


def _expanded(model, args):
    gm = symtrace.symbolic_trace(model, example_inputs=args)
    copy = private_copy(gm)
    return gm, copy, expand_multihead_attention(copy)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("form", ["self", "cross", "cross-kdim", "no-bias"])
def test_rewritten_attention_matches_the_module(batch_first, form):
    torch.manual_seed(0)
    cross = form.startswith("cross")
    kdim = 24 if form == "cross-kdim" else None
    model = Encoder(batch_first=batch_first, kdim=kdim, bias=form != "no-bias", need_weights=False).eval()
    args = _inputs(batch_first, 2, 9, 5, 32, kdim, cross)
    gm, copy, done = _expanded(model, args)
    assert done == ["attn"]
    assert not copy.graph.find_nodes(op="call_module", target="attn")
    with torch.no_grad():
        want = model(*args)
        torch.testing.assert_close(copy(*args), want, rtol=1e-5, atol=1e-5)
        lm = lower(model, args, speed_check=False)
        torch.testing.assert_close(lm(*args), want, rtol=1e-5, atol=1e-5)
    report = lm.report()
    assert "nn.MultiheadAttention call(s) as linear layers and SDPA: attn" in report
    views = [line.split()[-1] for line in report.splitlines() if line.startswith("unflatten")]
    assert views == ["view"] * {"self": 1, "no-bias": 1, "cross": 2, "cross-kdim": 3}[form]   # projections
    assert "torch.nn.functional.linear " not in report   # (every projection packed: constant weights)
    assert gm.graph.find_nodes(op="call_module", target="attn")   # (the caller's graph is unchanged)


@settings(max_examples=25, deadline=None)
@given(batch_first=st.booleans(), n=st.integers(1, 3), lq=st.integers(1, 12), lk=st.integers(1, 12),
       heads=st.sampled_from([1, 2, 4]), cross=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_rewrite_over_sizes(batch_first, n, lq, lk, heads, cross, seed):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = Encoder(e=16, heads=heads, batch_first=batch_first, need_weights=False).eval()
    args = _inputs(batch_first, n, lq, lk, 16, cross=cross, g=g)
    _, copy, done = _expanded(model, args)
    assert done == ["attn"]
    with torch.no_grad():
        torch.testing.assert_close(copy(*args), model(*args), rtol=1e-5, atol=1e-5)


def test_unused_weights_and_nan_inputs_behave_like_the_module():
    torch.manual_seed(0)
    model = Encoder().eval()   # need_weights=True, the weights unpacked into `_` and unused
    x = torch.randn(2, 6, 32)
    _, copy, done = _expanded(model, (x,))
    assert done == ["attn"]
    x[0, 1, 3] = float("nan")
    with torch.no_grad():
        got, want = copy(x), model(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.isnan(got[0]).all() and not torch.isnan(got[1]).any()


class UsesWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        out, weights = self.attn(x, x, x)
        return out, weights


class Masked(nn.Module):
    def __init__(self, **call):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.call = call

    def forward(self, x, mask):
        return self.attn(x, x, x, need_weights=False, **{self.call["name"]: mask})[0]


@pytest.mark.parametrize("case", ["weights used", "attn_mask", "key_padding_mask", "bias_k", "add_zero_attn",
                                  "training", "hook", "subclass"])
def test_calls_it_cannot_rewrite_keep_the_module(case):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    if case == "weights used":
        model, args = UsesWeights(), (x,)
    elif case == "attn_mask":
        model, args = Masked(name="attn_mask"), (x, torch.zeros(5, 5, dtype=torch.bool))
    elif case == "key_padding_mask":
        model, args = Masked(name="key_padding_mask"), (x, torch.zeros(2, 5, dtype=torch.bool))
    else:
        model, args = Encoder(e=16, heads=2, need_weights=False), (x,)
        if case == "bias_k":
            model.attn = nn.MultiheadAttention(16, 2, batch_first=True, add_bias_kv=True)
        elif case == "add_zero_attn":
            model.attn = nn.MultiheadAttention(16, 2, batch_first=True, add_zero_attn=True)
        elif case == "hook":
            model.attn.register_forward_hook(lambda m, i, o: (o[0] * 2, o[1]))
        elif case == "subclass":
            model.attn = type("MyAttention", (nn.MultiheadAttention,), {})(16, 2, batch_first=True)
    model.eval()
    if case == "training":
        model.attn.train()
    gm, copy, done = _expanded(model, args)
    assert done == []
    if case not in ("hook", "subclass"):   # (these the tracer records op by op)
        assert copy.graph.find_nodes(op="call_module", target="attn")
    with torch.no_grad():
        got, want = copy(*args), model(*args)
    torch.testing.assert_close(got, want)


def test_switched_off():
    torch.manual_seed(0)
    model = Encoder(need_weights=False).eval()
    x = torch.randn(2, 6, 32)
    lm = lower(model, (x,), speed_check=False, inference=InferenceOptions(expand_attention_modules=False))
    assert "nn.MultiheadAttention" not in lm.report().split("node ")[0]
    with torch.no_grad():
        torch.testing.assert_close(lm(x), model(x))


@pytest.mark.parametrize("change", ["in_place", "train"])
def test_changed_weights_or_mode_run_through_torch(change):
    torch.manual_seed(0)
    model = Encoder(need_weights=False).eval()
    x = torch.randn(2, 6, 32)
    lm = lower(model, (x,), speed_check=False)
    with torch.no_grad():
        lm(x)
        if change == "in_place":
            model.attn.in_proj_weight.mul_(2)
        else:
            model.attn.train()
            model.attn.dropout = 0.0   # (training mode, the same values: only the mode changed)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got = lm(x)
        want = model(x)
    assert any("changed since lowering" in str(i.message) for i in w)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("case", ["weight norm", "buffers", "inference tensors", "heads changed"])
def test_unusual_weights_and_attributes(case):
    """A parametrized out-projection keeps the module call; weights held as buffers or made
    under inference mode, and num_heads changed after construction, are rewritten correctly."""
    torch.manual_seed(0)
    if case == "inference tensors":
        with torch.inference_mode():
            model = Encoder(e=16, heads=2, need_weights=False).eval()
    else:
        model = Encoder(e=16, heads=2, need_weights=False).eval()
    attn = model.attn
    if case == "weight norm":
        torch.nn.utils.parametrizations.weight_norm(attn.out_proj)
    elif case == "buffers":
        for name in ("in_proj_weight", "in_proj_bias"):
            t = getattr(attn, name).detach()
            del attn._parameters[name]
            attn.register_buffer(name, t)
    elif case == "heads changed":
        attn.num_heads = 4   # (eager divides embed_dim by num_heads on every call)
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    with torch.no_grad():   # (inference tensors cannot take part in a graph autograd records)
        _, copy, done = _expanded(model, (x, memory))
        assert done == ([] if case == "weight norm" else ["attn"])
        want = model(x, memory)
        torch.testing.assert_close(copy(x, memory), want, rtol=1e-5, atol=1e-5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # (no step of the pipeline failed)
            lm = lower(model, (x, memory), speed_check=False)
        torch.testing.assert_close(lm(x, memory), want, rtol=1e-5, atol=1e-5)
    assert bool(lm.pipeline_notes) == (case != "weight norm")
