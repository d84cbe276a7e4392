"""lower.compile's inference pipeline: batch-norm folding, constant folding, oneDNN convolutions and
linears with packed weights and post-ops, channels-last inside; soundness when weights change."""
from __future__ import annotations

import os
import operator
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symtrace
from symtrace.lower import InferenceOptions, compile as lower
from symtrace.lower import onednn
from symtrace.lower.onednn import PackedConv, PackedLinear
from model_helpers import randomize_bn
from kernel_tests import needs_c_compiler

pytestmark = [needs_c_compiler, pytest.mark.usefixtures("session_kernel_cache")]

needs_onednn = pytest.mark.skipif(not onednn.available(), reason="this torch build has no oneDNN ops")


class Block(nn.Module):
    """conv-bn-act, a depthwise conv, squeeze-excite, a residual add + relu, functional conv."""

    def __init__(self, c=8, act=nn.ReLU):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.act = act()
        self.dw = nn.Conv2d(c, c, 3, stride=1, padding=2, dilation=2, groups=c)
        self.se1 = nn.Conv2d(c, 4, 1)
        self.se2 = nn.Conv2d(4, c, 1)
        self.conv2 = nn.Conv2d(c, c, 1)
        self.bn2 = nn.BatchNorm2d(c)
        self.w3 = nn.Parameter(torch.randn(c, c, 3, 3) * 0.2)

    def forward(self, x):
        y = self.act(self.bn1(self.conv1(x)))
        y = F.hardswish(self.dw(y))
        s = F.adaptive_avg_pool2d(y, 1)
        s = F.hardsigmoid(self.se2(F.relu(self.se1(s))))
        y = y * s
        y = self.bn2(self.conv2(y))
        y = F.relu(y + x)
        return F.silu(F.conv2d(y, self.w3, None, 1, 1))


class Head(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.block = Block(c)
        self.fc1 = nn.Linear(c, 16)
        self.fc2 = nn.Linear(16, 5)

    def forward(self, x):
        y = self.block(x).mean((2, 3))
        return self.fc2(F.gelu(self.fc1(y), approximate="tanh"))


def _compile(model, x, **kw):
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    return gm, lower(gm, (x,), **kw)


def _targets(lm):
    return [n.target for n in lm.gm.graph.nodes if n.op == "call_function"]


@needs_onednn
@pytest.mark.parametrize("act", [nn.ReLU, nn.SiLU, nn.Hardswish, nn.GELU])
def test_conv_block_matches_eager(act):
    torch.manual_seed(0)
    model = randomize_bn(Block(8, act)).eval()
    x = torch.randn(2, 8, 10, 10)
    gm, lm = _compile(model, x)
    with torch.no_grad():
        want = model(x)
        got = lm(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert got.stride() == want.stride()            # 4-D output in eager's layout
    packed = [t for t in _targets(lm) if isinstance(t, PackedConv)]
    assert len(packed) == 6
    assert any(t.add for t in packed)               # the residual add is a post-op
    assert any(t.post == "silu" for t in packed)
    assert not any(n.op == "call_module" and isinstance(lm.gm.get_submodule(n.target), nn.BatchNorm2d)
                   for n in lm.gm.graph.nodes)
    report = lm.report()
    assert "batch norm(s) folded" in report and "oneDNN" in report and "channels-last" in report


class _ResidualThen(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.act = act

    def forward(self, x):
        return self.act(self.conv(x) + x * 0.5)   # (not x itself: conv(x) + x merges into the conv)


@needs_onednn
@pytest.mark.parametrize("act", [F.relu, F.gelu, F.silu, F.hardswish, torch.sigmoid])
def test_an_activation_after_a_residual_add_fuses_only_where_onednn_can(act):
    # oneDNN runs only ReLU after a fused add (timm's tiny_vit and nf_regnet have add -> GELU/SiLU,
    # which failed the whole pipeline): the add fuses, the activation then runs by itself
    torch.manual_seed(0)
    model = _ResidualThen(act).eval()
    x = torch.randn(1, 8, 9, 9)
    _, lm = _compile(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # (no "the pipeline's graph failed" fallback)
        with torch.no_grad():
            got = lm(x)
    torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-5)
    packed = [t for t in _targets(lm) if isinstance(t, PackedConv)]
    assert len(packed) == 1 and packed[0].add
    assert packed[0].post == ("relu" if act is F.relu else "none")


class _LeakyLayers(nn.Module):
    """timm's CSPDarknet / DLA pattern: conv-bn-LeakyReLU, and functional leaky ReLUs."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn1, self.act1 = nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.LeakyReLU()
        self.c2 = nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(8, 6)

    def forward(self, x):
        y = self.act1(self.bn1(self.c1(x)))
        y = F.leaky_relu(self.c2(y), 0.2, True)
        return F.leaky_relu(self.fc(y.mean((2, 3))), negative_slope=-0.5)


@needs_onednn
def test_leaky_relu_fuses_into_the_layer_with_its_own_slope():
    torch.manual_seed(0)
    model = randomize_bn(_LeakyLayers()).eval()
    x = torch.randn(2, 4, 7, 7)
    x[0, 0, 1, 1] = float("nan")
    x[0, 1, 2, 2] = float("inf")
    x[1, 2, 3, 3] = -float("inf")
    _, lm = _compile(model, x)
    layers = [t for t in _targets(lm) if isinstance(t, (PackedConv, PackedLinear))]
    assert [(t.post, t.scalars) for t in layers] == [("leaky_relu", [0.01]), ("leaky_relu", [0.2]),
                                                     ("leaky_relu", [-0.5])]
    assert lm._finite_inputs == ()
    with torch.no_grad():
        calls = lm.torch_calls
        got, want = lm(x), model(x)
        assert lm.torch_calls == calls   # (oneDNN's leaky ReLU keeps NaN and Inf as eager does)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, equal_nan=True)
        y = torch.randn(2, 4, 7, 7)
        torch.testing.assert_close(lm(y), model(y), rtol=1e-4, atol=1e-5)


class _Exp(nn.Module):
    def forward(self, x):
        return x.exp()


class _RepBlock(nn.Module):
    """RepVGG's block: 3x3 conv + BN, 1x1 conv + BN and a BN of the input, summed, then ReLU."""

    def __init__(self, c=8):
        super().__init__()
        self.kxk = nn.Sequential(nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c))
        self.one = nn.Sequential(nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c))
        self.identity = nn.BatchNorm2d(c)

    def forward(self, x):
        y = self.one(x) + self.kxk(x)
        y += self.identity(x)
        return F.relu(y)


@needs_onednn
def test_summed_branches_merge_into_one_packed_convolution_for_finite_inputs():
    torch.manual_seed(0)
    model = randomize_bn(_RepBlock()).eval()
    x = torch.randn(1, 8, 6, 6)
    _, lm = _compile(model, x)
    packed = [t for t in _targets(lm) if isinstance(t, PackedConv)]
    assert len(packed) == 1 and packed[0].post == "relu" and packed[0].weight_shape == (8, 8, 3, 3)
    assert "branches merged" in lm.report()
    bad = x.clone()
    bad[0, 0, 2, 2] = float("inf")   # eager's w1 * inf + w2 * inf may be NaN where the merged layer's is not
    with torch.no_grad():
        torch.testing.assert_close(lm(x), model(x), rtol=1e-4, atol=1e-5)
        calls = lm.torch_calls
        torch.testing.assert_close(lm(bad), model(bad), rtol=1e-4, atol=1e-5, equal_nan=True)
        assert lm.torch_calls == calls + 1   # (run through torch)
    _, exact = _compile(model, x, inference=InferenceOptions(nan_exact=True))
    assert len([t for t in _targets(exact) if isinstance(t, PackedConv)]) == 2
    # an input the analysis cannot show finite: not merged, and calls are not checked for it
    ahead = nn.Sequential(_Exp(), model).eval()
    _, lm2 = _compile(ahead, x)
    assert len([t for t in _targets(lm2) if isinstance(t, PackedConv)]) == 2 and lm2._finite_inputs == ()
    _, off = _compile(model, x, inference=InferenceOptions(merge_conv_branches=False))
    assert len([t for t in _targets(off) if isinstance(t, PackedConv)]) == 2


@needs_onednn
def test_leaky_relu_with_slope_zero_fuses_only_for_finite_inputs():
    # oneDNN's leaky relu with slope 0 is max(x, 0); eager's x * 0 makes -inf and NaN a NaN
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.LeakyReLU(0.0)).eval()
    x = torch.randn(1, 4, 6, 6)
    _, lm = _compile(model, x)
    assert [t.post for t in _targets(lm) if isinstance(t, PackedConv)] == ["leaky_relu_zero"]
    assert lm._finite_inputs == (0,)
    bad = x.clone()
    bad[0, :, 2, 2] = float("nan")
    with torch.no_grad():
        torch.testing.assert_close(lm(bad), model(bad), equal_nan=True)
        torch.testing.assert_close(lm(x), model(x), rtol=1e-4, atol=1e-5)


class _ReadAfterWrite(nn.Module):
    """A layer's input written in place before the layer's residual add: the packed call sits at
    the add, so it must not take the layer along (it would read the written input)."""

    def __init__(self):
        super().__init__()
        self.c0, self.c1 = nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        h = self.c0(x)
        a = self.c1(h)
        h.relu_()
        return a + h


@needs_onednn
def test_a_layer_whose_input_is_written_later_is_packed_where_it_stands():
    torch.manual_seed(0)
    model = _ReadAfterWrite().eval()
    x = torch.randn(1, 8, 6, 6)
    _, lm = _compile(model, x)
    with torch.no_grad():
        torch.testing.assert_close(lm(x), model(x), rtol=1e-4, atol=1e-5)


class _CrossStage(nn.Module):
    """timm's CSPNet stage end: ``cat([xs, conv(xb).contiguous()])`` into a convolution; the
    second output reads a ``contiguous()`` copy through a view, which needs it."""

    def __init__(self):
        super().__init__()
        self.exp, self.b, self.out = nn.Conv2d(4, 8, 1), nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(8, 8, 1)

    def forward(self, x):
        xs, xb = self.exp(x).split(4, dim=1)
        xb = self.b(xb).contiguous()
        y = self.out(torch.cat([xs, xb], dim=1))
        return y, self.b(xs).contiguous().view(x.shape[0], -1)


@needs_onednn
def test_contiguous_copies_that_only_feed_convolutions_are_dropped():
    torch.manual_seed(0)
    model = _CrossStage().eval()
    x = torch.randn(2, 4, 6, 6)
    _, lm = _compile(model, x)
    assert "1 contiguous() copies before convolutions dropped" in lm.report()
    with torch.no_grad():
        for got, want in zip(lm(x), model(x)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            assert got.stride() == want.stride()


@needs_onednn
def test_packed_layers_declare_their_writes_and_are_not_kept_alive_by_the_effect_model():
    import gc
    import weakref
    from symtrace.graph.effects import aliased_inputs, written_inputs
    from symtrace.graph.graph import Graph
    conv = PackedConv(torch.randn(4, 4, 3, 3), None, (1, 1), (1, 1), (1, 1), 1, (1, 4, 5, 5), add=True)
    g = Graph()
    x, other = g.placeholder("x"), g.placeholder("other")
    node = g.call_function(conv, (x, other))
    assert written_inputs(node) == [] and aliased_inputs(node) == []   # a fresh result
    conv.accumulate_in_place()                                          # (what the pipeline may decide later)
    assert written_inputs(node) == [other] and other in aliased_inputs(node)
    model = _ResidualThen(F.relu).eval()
    _, lm = _compile(model, torch.randn(1, 8, 9, 9))
    ref = weakref.ref(next(t for t in _targets(lm) if isinstance(t, PackedConv)))
    del lm
    gc.collect()
    assert ref() is None


class _WindowAttention(nn.Module):
    """TinyViT's attention: a learned (heads, N, N) bias as SDPA's 3-D float mask."""

    def __init__(self, positional):
        super().__init__()
        self.qkv, self.bias, self.positional = nn.Linear(16, 48), nn.Parameter(torch.randn(4, 9, 9)), positional

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 4).permute(2, 0, 3, 1, 4).unbind(0)
        if self.positional:
            o = F.scaled_dot_product_attention(q, k, v, self.bias)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias, scale=0.3)
        return o.transpose(1, 2).reshape(b, n, 16)


@pytest.mark.parametrize("positional", [False, True])
def test_a_3d_attention_mask_is_given_to_sdpa_as_4d(positional):
    torch.manual_seed(0)
    model = _WindowAttention(positional).eval()
    x = torch.randn(6, 9, 16)
    _, lm = _compile(model, x)
    assert "1 attention call(s) with a 3-D mask given it as 4-D" in lm.report()
    sdpa = [n for n in lm.gm.graph.nodes if n.target is F.scaled_dot_product_attention]
    mask = sdpa[0].args[3] if positional else sdpa[0].kwargs["attn_mask"]
    assert len(mask.meta["tensor_meta"].shape) == 4
    with torch.no_grad():
        torch.testing.assert_close(lm(x), model(x), rtol=1e-4, atol=1e-5)


class _WrittenAfterCopy(nn.Module):
    """A contiguous() copy is a snapshot: a later write to its source must not reach the
    convolution that reads the copy. And a residual operand written after the add must not
    reach the packed call that replaces the add and the activation after it."""

    def __init__(self, which):
        super().__init__()
        self.which = which
        self.a, self.b, self.c = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        if self.which == "copy":
            h = self.a(x).permute(0, 1, 3, 2)
            c = h.contiguous()
            h.mul_(-3.0)
            return self.b(c), h.sum()
        h = self.a(x)
        y = self.c(x) + h
        h.mul_(-3.0)
        return F.relu(y), h


@needs_onednn
@pytest.mark.parametrize("which", ["copy", "residual"])
def test_values_written_later_are_read_where_eager_reads_them(which):
    torch.manual_seed(0)
    model = _WrittenAfterCopy(which).eval()
    x = torch.randn(1, 4, 6, 6)
    _, lm = _compile(model, x)
    with torch.no_grad():
        for got, want in zip(lm(x), model(x)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


class _ContiguousAlias(nn.Module):
    """``y.contiguous()`` of a contiguous ``y`` is ``y`` itself in eager: a later in-place write
    to ``y`` reaches what the copy's readers see. Channels-last inside the pipeline would make
    it a real copy, so the pipeline is not used for such a graph."""

    def __init__(self, conv_reads_it):
        super().__init__()
        self.conv_reads_it = conv_reads_it
        self.c, self.c2 = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = self.c(x)
        yc = y.contiguous()
        y[:, :2].mul_(3)
        return (self.c2(yc) + y) if self.conv_reads_it else yc * 2


class _ReshapeCopyThenWrite(nn.Module):
    """``z.permute(0, 2, 3, 1).reshape(-1, c)`` copies in eager (z is NCHW there): a later write
    to ``z`` does not reach it. Channels-last inside the pipeline would make it a view."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(4, 8, 1)

    def forward(self, x):
        z = torch.relu(self.c(x))
        r = z.permute(0, 2, 3, 1).reshape(-1, 8)
        z.mul_(2)
        return r + 0, z * 1


@needs_onednn
def test_a_reshape_copy_of_a_value_written_later_stays_a_copy():
    # (found in review)
    torch.manual_seed(0)
    model = _ReshapeCopyThenWrite().eval()
    x = torch.randn(1, 4, 5, 5)
    _, lm = _compile(model, x)
    assert not lm.pipeline_notes
    with torch.no_grad():
        for g, w in zip(lm(x), model(x)):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("conv_reads_it", [True, False])
def test_a_contiguous_alias_written_later_keeps_eagers_memory_sharing(conv_reads_it):
    torch.manual_seed(0)
    model = _ContiguousAlias(conv_reads_it).eval()
    x = torch.randn(1, 4, 5, 5)
    _, lm = _compile(model, x)
    assert not lm.pipeline_notes   # (the graph is lowered as written)
    with torch.no_grad():
        torch.testing.assert_close(lm(x), model(x), rtol=1e-4, atol=1e-5)


class _CachedBias(nn.Module):
    """timm's LeViT / EfficientFormer / EfficientViT pattern: in eval mode a tensor derived from
    a parameter is cached in a plain dict attribute, keyed by device, on first use."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)
        self.bias_table = nn.Parameter(torch.randn(4, 3))
        self.cache = {}

    def biases(self, device):
        key = str(device)
        if key not in self.cache:
            self.cache[key] = self.bias_table[:, :1].reshape(1, 4, 1, 1) * 2
        return self.cache[key]

    def forward(self, x):
        return torch.relu(self.conv(x) + self.biases(x.device))


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "cache-filled"])
def test_tensors_cached_in_python_state_lower(warm):
    # with the cache filled before tracing, the graph reads the dict at run time (read_state); the
    # lowering's metadata recorder ran every such read as a no-op side effect and crashed
    torch.manual_seed(0)
    model = _CachedBias().eval()
    x = torch.randn(2, 4, 5, 5)
    with torch.no_grad():
        if warm:
            model(x)
        gm, lm = _compile(model, x)
        torch.testing.assert_close(lm(x), model(x))
        if warm:   # (cold, the first call fills the graph's copy of the cache, so the guard on it
            torch.testing.assert_close(lm(x), model(x))   # then fails: capture() re-captures there)
            for size in (7, 9):   # other sizes: a size-generic variant (symbolic shapes meet the read)
                x2 = torch.randn(2, 4, size, size)
                torch.testing.assert_close(lm(x2), model(x2))
    if warm:
        from symtrace.graph.replay import read_state
        assert any(n.target is read_state for n in gm.graph.nodes)


class _IndexedBiasCache(nn.Module):
    """timm's TinyViT attention: in eval mode ``table[:, idxs]`` (advanced indexing: a copy) is
    cached in a dict attribute on first use, after a convolution and batch norm."""

    def __init__(self, advanced: bool):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.table = nn.Parameter(torch.randn(4, 6))
        self.register_buffer("idxs", torch.tensor([5, 0, 3, 3]), persistent=False)
        self.advanced = advanced
        self.cache = {}

    def biases(self, device):
        key = str(device)
        if key not in self.cache:
            self.cache[key] = self.table[:, self.idxs] if self.advanced else self.table[:, :4]
        return self.cache[key]

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x))) + self.biases(x.device).sum()


@pytest.mark.parametrize("advanced", [True, False], ids=["advanced-index copy", "slice view"])
def test_state_written_with_a_copy_of_a_parameter_keeps_the_pipeline(advanced):
    # the cache write stores a copy of the table (advanced indexing), which writes no parameter:
    # the pipeline still folds and packs. A basic slice is a view of the table: refused, with why
    torch.manual_seed(0)
    model = _IndexedBiasCache(advanced).eval()
    model.bn.running_mean.uniform_(-1, 1)
    x = torch.randn(2, 4, 6, 6)
    with torch.no_grad():
        want = model(x)
        model.cache.clear()
        gm, lm = _compile(model, x)
        torch.testing.assert_close(lm(x), want)
    folded = "batch norm(s) folded" in lm.report()
    assert folded == advanced, lm.report()


class _Branches(nn.Module):
    """fastvit's reparameterisable stem: convolution branches summed, an activation, and the
    result read by two convolutions."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1)
        self.c, self.d = nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Conv2d(8, 8, 1)

    def forward(self, x):
        y = F.gelu(self.a(x) + self.b(x) * 0.5)
        return self.c(y) + self.d(y) * y


@needs_onednn
def test_values_between_convolutions_are_stored_channels_last(monkeypatch):
    # a kernel's value read by convolutions is stored in eager's layout (channels-last here).
    # In timm's fastvit_t8 some such values were stored contiguous (38 per call, each converted
    # by oneDNN: 0.73x -> 0.96x Inductor-freezing once fixed); this program of the same form
    # checks the property, but I did not reduce fastvit's case to one that fails without the fix
    torch.manual_seed(0)
    model = _Branches().eval()
    x = torch.randn(1, 8, 12, 12)
    _, lm = _compile(model, x)
    layouts = []
    real = PackedConv.__call__

    def watch(self, inp, other=None):
        layouts.append(inp.is_contiguous(memory_format=torch.channels_last))
        return real(self, inp, other)

    monkeypatch.setattr(PackedConv, "__call__", watch)
    with torch.no_grad():
        got = lm(x)
    torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-5)
    assert len(layouts) >= 3 and all(layouts), layouts


@needs_onednn
def test_linear_post_ops_and_new_batch_size():
    torch.manual_seed(0)
    model = Head().eval()
    x = torch.randn(3, 8, 6, 6)
    _, lm = _compile(model, x)
    lin = [t for t in _targets(lm) if isinstance(t, PackedLinear)]
    assert [t.post for t in lin] == ["gelu_tanh", "none"]
    with torch.no_grad():
        torch.testing.assert_close(lm(x), model(x), rtol=1e-4, atol=1e-5)
        x5 = torch.randn(5, 8, 7, 7)                 # another signature: a second variant
        torch.testing.assert_close(lm(x5), model(x5), rtol=1e-4, atol=1e-5)
        xcl = x.contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(lm(xcl), model(xcl), rtol=1e-4, atol=1e-5)


@needs_onednn
def test_nan_and_inf_propagate_like_eager():
    """oneDNN's relu/hardsigmoid/erf-gelu post-ops differ from eager on NaN/Inf: fused only for
    finite inputs by default (a NaN/Inf call runs through torch), never with nan_exact=True."""
    torch.manual_seed(0)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2, self.c3 = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            a = F.relu(self.c1(x))
            b = F.hardsigmoid(self.c2(x))
            c = F.gelu(self.c3(torch.where(torch.isinf(x), 0.0, x)))  # (eager's gelu(+inf) is NaN here)
            return a + b + c, F.relu(self.l(x.mean((2, 3))))

    model = M().eval()
    x = torch.randn(1, 4, 5, 5)
    x[0, 0, 0, 0] = float("nan")
    x[0, 1, 2, 2] = float("inf")
    x[0, 2, 3, 3] = -float("inf")
    _, exact = _compile(model, x, inference=InferenceOptions(nan_exact=True))
    assert all(t.post == "none" for t in _targets(exact) if isinstance(t, (PackedConv, PackedLinear)))
    _, guarded = _compile(model, x)
    assert {t.post for t in _targets(guarded) if isinstance(t, PackedConv)} == {"relu", "hardsigmoid", "gelu"}
    assert guarded._finite_inputs == (0,)
    with torch.no_grad():
        for lm in (exact, guarded):
            calls = lm.torch_calls
            for got, want in zip(lm(x), model(x)):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, equal_nan=True)
            assert lm.torch_calls == calls + (lm is guarded)   # the guarded module ran x through torch
        y = x.nan_to_num(0.0, 0.0, 0.0)
        calls = guarded.torch_calls
        for got, want in zip(guarded(y), model(y)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert guarded.torch_calls == calls   # finite inputs: the fused kernels
    # nan_exact=False fuses them with no check (oneDNN's answer on NaN/Inf may then differ from eager's)
    _, fast = _compile(model, x.nan_to_num(), inference=InferenceOptions(nan_exact=False))
    assert {t.post for t in _targets(fast) if isinstance(t, PackedConv)} == {"relu", "hardsigmoid", "gelu"}
    assert fast._finite_inputs == ()
    with torch.no_grad():
        y = x.nan_to_num(0.0, 0.0, 0.0)
        for got, want in zip(fast(y), model(y)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@needs_onednn
def test_callers_graph_and_model_are_never_changed():
    torch.manual_seed(0)
    model = randomize_bn(Block()).eval()
    x = torch.randn(2, 8, 6, 6)
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    before = [(n.op, n.target) for n in gm.graph.nodes]
    mods = dict(gm.named_modules())
    state = {k: (v, v.detach().clone()) for k, v in model.state_dict(keep_vars=True).items()}
    lm = lower(gm, (x,))
    assert lm.pipeline_notes
    assert [(n.op, n.target) for n in gm.graph.nodes] == before
    assert dict(gm.named_modules()).keys() == mods.keys()
    for k, (obj, val) in state.items():
        assert model.state_dict(keep_vars=True)[k] is obj and torch.equal(obj, val)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))


def test_switched_off_and_training_mode_and_no_layers():
    torch.manual_seed(0)
    model = randomize_bn(Block()).eval()
    x = torch.randn(2, 8, 6, 6)
    _, lm = _compile(model, x, inference=False)
    assert lm.pipeline_notes == [] and not any(isinstance(t, PackedConv) for t in _targets(lm))
    with torch.no_grad():
        torch.testing.assert_close(lm(x), model(x), rtol=1e-4, atol=1e-5)
    model.train()
    _, lm = _compile(model, x)
    assert lm.pipeline_notes == []
    _, lm = _compile(lambda a: torch.relu(a) * 2, x)   # nothing to fold or pack
    assert lm.pipeline_notes == []
    with pytest.raises(TypeError, match="InferenceOptions"):
        _compile(model.eval(), x, inference="yes")


@needs_onednn
@pytest.mark.parametrize("change", ["in_place", "reassign", "buffer", "train"])
def test_changed_weights_run_through_torch(change):
    torch.manual_seed(0)
    model = randomize_bn(Block()).eval()
    x = torch.randn(2, 8, 6, 6)
    _, lm = _compile(model, x)
    with torch.no_grad():
        lm(x)
        if change == "in_place":
            model.conv1.weight.mul_(2)
        elif change == "reassign":
            model.conv2.weight = nn.Parameter(model.conv2.weight * 3)
        elif change == "buffer":
            model.bn1.running_mean.add_(1)
        else:
            model.bn2.train()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got = lm(x)
        want = model(x)
    assert any("changed since lowering" in str(i.message) for i in w)
    torch.testing.assert_close(got, want)


class _ReadsChildMode(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 1)
        self.bn = nn.BatchNorm2d(8)
        self.layers = nn.ModuleList([nn.ReLU()])

    def forward(self, x):
        y = self.bn(self.conv(x))
        y = y * 2 if self.conv.training else y   # a parent reading a mode-free child's mode
        y = self.layers[0](y)
        return y - 1 if self.layers[0].training else y   # (read through an index)


@needs_onednn
def test_the_state_check_skips_modes_no_result_depends_on():
    # the check runs before every call, touching each module and tensor it checks (cold): torch
    # layers that never read their mode (conv, activations, containers) and a batch norm's
    # num_batches_tracked are left out, unless the traced code read that mode
    torch.manual_seed(0)
    model = randomize_bn(Block()).eval()
    x = torch.randn(2, 8, 6, 6)
    _, lm = _compile(model, x)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")   # (no "changed since lowering" fallback)
        model.conv1.train()
        model.act.train()
        model.bn1.num_batches_tracked.add_(1)
        torch.testing.assert_close(lm(x), model.eval()(x), rtol=1e-4, atol=1e-5)
    assert lm._state_check()
    for child, text in (("conv", "root.conv.training"), ("layers.0", "training")):
        model = randomize_bn(_ReadsChildMode()).eval()
        _, lm = _compile(model, x)
        assert lm._state_check()
        model.get_submodule(child).train()   # its mode was read: the check sees it, the graph
        assert not lm._state_check()         # through torch refuses
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(symtrace.GuardError, match=text):
                lm(x)


@needs_onednn
def test_autograd_runs_the_original_graph():
    torch.manual_seed(0)
    model = Head().eval()
    x = torch.randn(2, 8, 5, 5)
    _, lm = _compile(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = lm(x)
    assert y.requires_grad
    y.sum().backward()
    assert model.fc1.weight.grad is not None and model.block.conv1.weight.grad is not None


def test_missing_onednn_ops_fall_back_to_torch(monkeypatch):
    """A torch build without the oneDNN ops: batch norms are still folded, the layers stay torch calls."""
    monkeypatch.setattr(onednn, "_op", lambda namespace, name: None)
    assert not onednn.available()
    torch.manual_seed(0)
    model = randomize_bn(Block()).eval()
    x = torch.randn(2, 8, 6, 6)
    _, lm = _compile(model, x)
    assert not any(isinstance(t, (PackedConv, PackedLinear)) for t in _targets(lm))
    assert any("batch norm" in n for n in lm.pipeline_notes)
    with torch.no_grad():
        torch.testing.assert_close(lm(x), model(x), rtol=1e-4, atol=1e-5)


@needs_onednn
def test_channels_last_output_and_kernels_between_convolutions():
    """Values between packed convolutions are channels-last; kernels store them so (loops in
    memory order) and a graph output keeps eager's layout."""
    torch.manual_seed(0)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(6, 6, 3, padding=1)

        def forward(self, x):
            y = self.a(x)
            z = torch.sigmoid(y) * y + 1.0
            return self.b(z), z

    model = M().eval()
    x = torch.randn(2, 3, 7, 5)
    _, lm = _compile(model, x)
    with torch.no_grad():
        got, want = lm(x), model(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
        assert g.stride() == w.stride()
    assert lm.kernels   # the sigmoid-mul-add chain is one of our kernels


def test_contiguous_memory_format_rule():
    def f(x):
        return x.contiguous(memory_format=torch.channels_last) * 2, (x + 1).contiguous(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 4, 5)
    gm = symtrace.symbolic_trace(f, example_inputs=(x,))
    lm = lower(gm, (x,))
    for g, w in zip(lm(x), f(x)):
        torch.testing.assert_close(g, w)
        assert g.stride() == w.stride()
    xc = x.contiguous(memory_format=torch.channels_last)
    for g, w in zip(lm(xc), f(xc)):
        torch.testing.assert_close(g, w)
        assert g.stride() == w.stride()


@needs_onednn
def test_addmm_with_constant_weight_is_a_packed_linear():
    """Hugging Face's Conv1D: ``torch.addmm(b, x.view(-1, n), W).view(...)``."""
    class Conv1D(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 12))
            self.bias = nn.Parameter(torch.randn(12))

        def forward(self, x):
            y = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
            return F.silu(y.view(x.shape[:-1] + (12,)))

    model = Conv1D().eval()
    x = torch.randn(2, 5, 8)
    _, lm = _compile(model, x)
    assert any(isinstance(t, PackedLinear) for t in _targets(lm))
    with torch.no_grad():
        torch.testing.assert_close(lm(x), model(x), rtol=1e-4, atol=1e-5)


@needs_onednn
def test_transformer_block_linears_are_packed():
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from examples import models
    m = models.build("transformer")
    x = models.example_inputs("transformer")[0]
    gm, lm = _compile(m, x)
    # erf-gelu: fused, its input being finite whenever the block's input is (checked per call)
    assert any(isinstance(t, PackedLinear) and t.post == "gelu" for t in _targets(lm))
    assert lm._finite_inputs == (0,)
    assert sum(isinstance(t, PackedLinear) for t in _targets(lm)) == 4
    _, exact = _compile(m, x, inference=InferenceOptions(nan_exact=True))   # exact: our kernel
    assert not any(isinstance(t, PackedLinear) and t.post == "gelu" for t in _targets(exact))
    assert "scaled_dot_product_attention" in lm.wrapper_code
    with torch.no_grad():
        torch.testing.assert_close(lm(x), m(x), rtol=1e-4, atol=1e-5)


@needs_onednn
def test_lowering_the_model_again_keeps_the_first_module_fast():
    """Recording runs the graph and restores the buffers it wrote; untouched buffers keep their
    version counter, so another lowering of the same model does not look like a weight change."""
    torch.manual_seed(0)
    model = randomize_bn(Block()).eval()
    x = torch.randn(2, 8, 6, 6)
    gm, lm = _compile(model, x)
    lower(gm, (x,), inference=False)
    lower(gm, (torch.randn(1, 8, 5, 5),))
    assert lm._state_check()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            torch.testing.assert_close(lm(x), model(x), rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- speed guard

def _fake_costs(monkeypatch, cost):
    """Samples cost ``cost(fn)`` seconds, so the guard's decision is fixed."""
    from symtrace.lower import speed_guard
    monkeypatch.setattr(speed_guard, "_sample", lambda fn, args, n, clock: (fn(*args), cost(fn))[1])
    monkeypatch.setattr(speed_guard, "MAX_CALL_S", 1e9)   # (a busy machine may take long for one call)


@pytest.mark.parametrize("lowered_cost, uses_torch", [(2e-3, True), (1e-3, False)])
def test_speed_guard_runs_a_losing_graph_through_torch(monkeypatch, lowered_cost, uses_torch):
    _fake_costs(monkeypatch, lambda fn: lowered_cost if isinstance(fn, symtrace.lower.LoweredModule) else 1e-3)
    f = lambda a: torch.relu(a) * 2 + 1   # noqa: E731
    x = torch.randn(64)
    lm = lower(symtrace.symbolic_trace(f, example_inputs=(x,)), (x,), speed_check=True)
    assert (lm.torch_reason is not None) == uses_torch
    assert ("not used: measured at compile time" in lm.report()) == uses_torch
    torch.testing.assert_close(lm(x), f(x))


def test_speed_guard_stops_after_two_rounds_of_a_clear_win(monkeypatch):
    from symtrace.lower import speed_guard
    calls, torch_cost = [], [2e-3]

    def cost(fn):
        lowered = isinstance(fn, symtrace.lower.LoweredModule)
        calls.append(lowered)
        return 1e-3 if lowered else torch_cost[0]
    _fake_costs(monkeypatch, cost)
    monkeypatch.setattr(speed_guard, "BUDGET_S", 1e9)
    f = lambda a: torch.relu(a) * 2 + 1   # noqa: E731
    x = torch.randn(64)
    lm = lower(symtrace.symbolic_trace(f, example_inputs=(x,)), (x,), speed_check=True)
    assert lm.torch_reason is None and len(calls) == 4   # (two rounds: lowered and torch's graph)
    calls.clear()   # a close race runs every round
    torch_cost[0] = 1.02e-3
    lm = lower(symtrace.symbolic_trace(lambda a: torch.relu(a) * 3 + 1, example_inputs=(x,)), (x,), speed_check=True)
    assert lm.torch_reason is None and len(calls) == 2 * speed_guard.ROUNDS


@needs_onednn
@pytest.mark.parametrize("pipeline_cost, rounds", [(1.01e-3, 2), (0.995e-3, None)])
def test_speed_guard_stops_early_only_when_the_pipeline_graph_is_no_faster(monkeypatch, pipeline_cost, rounds):
    from symtrace.lower import speed_guard
    torch.manual_seed(0)
    model = randomize_bn(Block()).eval()
    x = torch.randn(2, 8, 6, 6)
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    calls = []

    def cost(fn):
        calls.append(fn)
        return 1e-3 if isinstance(fn, symtrace.lower.LoweredModule) else 2e-3 if fn is gm else pipeline_cost
    _fake_costs(monkeypatch, cost)
    monkeypatch.setattr(speed_guard, "BUDGET_S", 1e9)
    lm = lower(gm, (x,), speed_check=True)
    assert lm.torch_reason is None   # (0.5% slower than the pipeline's graph is no loss)
    assert len(calls) == 3 * (rounds or speed_guard.ROUNDS)


def test_speed_guard_keeps_kernels_that_lost_only_to_one_lucky_sample(monkeypatch):
    # torch's graph: one fast sample, the others slower than every one of the lowered module's.
    # By the fastest samples the kernels lose, by the medians they win: they stay
    torch_samples = iter([0.9e-3, 2e-3, 2e-3, 2e-3, 2e-3])
    _fake_costs(monkeypatch, lambda fn: 1.2e-3 if isinstance(fn, symtrace.lower.LoweredModule)
                else next(torch_samples, 2e-3))
    f = lambda a: torch.relu(a) * 2 + 1   # noqa: E731
    x = torch.randn(64)
    lm = lower(symtrace.symbolic_trace(f, example_inputs=(x,)), (x,), speed_check=True)
    assert lm.torch_reason is None


@needs_onednn
def test_speed_guard_may_pick_the_pipeline_graph_through_torch(monkeypatch):
    torch.manual_seed(0)
    model = randomize_bn(Block()).eval()
    x = torch.randn(2, 8, 6, 6)
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    _fake_costs(monkeypatch, lambda fn: 3e-3 if isinstance(fn, symtrace.lower.LoweredModule) else
                2e-3 if fn is gm else 1e-3)
    lm = lower(gm, (x,), speed_check=True)
    assert "the inference pipeline's graph through torch" in lm.torch_reason
    assert lm._fast is lm.gm and "_fast.conv1.weight" not in lm.state_dict()
    with torch.no_grad():
        torch.testing.assert_close(lm(x), model(x), rtol=1e-4, atol=1e-5)
        model.conv1.weight.mul_(2)   # the weight check still guards that path
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.testing.assert_close(lm(x), model(x))


def test_speed_guard_spends_one_eager_call_on_a_large_graph(monkeypatch):
    # a graph whose eager call exceeds MAX_CALL_S is not measured: the compile pays that one
    # call (its code is generated outside the timed call) and never runs the lowered module
    from symtrace.lower import speed_guard
    x = torch.randn(64)
    gm = symtrace.symbolic_trace(lambda a: torch.relu(a) * 2 + 1, example_inputs=(x,))
    calls, now = [], [0.0]

    def eager_call(*_):   # each eager call "takes" twice the limit
        calls.append("eager")
        now[0] += 2 * speed_guard.MAX_CALL_S

    gm.register_forward_hook(eager_call)
    lowered = lambda *a: calls.append("lowered")   # noqa: E731
    assert speed_guard.slower_than_eager(lowered, gm, (x,), clock=lambda: now[0]) is None
    assert calls == ["eager"]


def test_speed_guard_leaves_graphs_with_effects_alone():
    from symtrace.lower.speed_guard import rerunnable

    def writes_input(a):
        a.add_(1)
        return a * 2

    def random(a):
        return a + torch.rand_like(a)

    x = torch.randn(4)
    assert "writes" in rerunnable(symtrace.symbolic_trace(writes_input, example_inputs=(x.clone(),)))
    assert "random" in rerunnable(symtrace.symbolic_trace(random, example_inputs=(x,)))
    assert rerunnable(symtrace.symbolic_trace(lambda a: torch.relu(a) + 1, example_inputs=(x,))) is None
    before = x.clone()
    lm = lower(symtrace.symbolic_trace(writes_input, example_inputs=(x.clone(),)), (x,), speed_check=True)
    assert torch.equal(x, before) and lm.torch_reason is None   # not run by the guard


class Attention(nn.Module):
    """q, k, v projections of one input, a gated MLP (gate and up of one input)."""

    def __init__(self, c=16, flat=False):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(c, c), nn.Linear(c, c, bias=False), nn.Linear(c, c // 2)
        self.gate, self.up = nn.Linear(c, 32, bias=False), nn.Linear(c, 32, bias=False)
        self.flat = flat

    def forward(self, x):
        b, t, c = x.shape
        q = self.q(x).view(b, t, 2, c // 2).transpose(1, 2)
        k = self.k(x).view(b, t, 2, c // 2).transpose(1, 2)
        v = self.v(x).view(b, t, 1, c // 2).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v.expand(b, 2, t, c // 2)).transpose(1, 2).reshape(b, t, c)
        if self.flat:   # a view that needs contiguous memory: not possible on a slice of a merged result
            a = a + self.q(x).view(-1).view(b, t, c)
        return F.silu(self.gate(a)) * self.up(a)


@needs_onednn
def test_sibling_linears_are_merged():
    torch.manual_seed(0)
    model = Attention().eval()
    x = torch.randn(2, 5, 16)
    _, lm = _compile(model, x)
    merged = [t for t in _targets(lm) if isinstance(t, PackedLinear) and t.__name__ == "onednn_linear_merged"]
    assert len(merged) == 2 and sum(1 for t in _targets(lm) if t is torch.split) == 2
    assert "one onednn_linear_merged" in " ".join(lm.pipeline_notes)
    with torch.no_grad():
        torch.testing.assert_close(lm(x), model(x), rtol=1e-4, atol=1e-5)


@needs_onednn
def test_merge_that_breaks_a_view_falls_back_to_unmerged():
    torch.manual_seed(0)
    model = Attention(flat=True).eval()
    x = torch.randn(2, 5, 16)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _, lm = _compile(model, x)
    assert lm.pipeline_notes and "merged" not in " ".join(lm.pipeline_notes)   # the pipeline ran, unmerged
    assert any("without merged linears" in str(i.message) for i in w)
    with torch.no_grad():
        torch.testing.assert_close(lm(x), model(x), rtol=1e-4, atol=1e-5)


def test_state_dict_lists_the_lowered_graph_once():
    torch.manual_seed(0)
    model = Head().eval()
    x = torch.randn(2, 8, 5, 5)
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    plain = lower(gm, (x,), inference=False)
    assert list(plain.state_dict()) == ["gm." + k for k in gm.state_dict()]
    piped = lower(gm, (x,))
    assert not any(k.startswith("_eager") for k in piped.state_dict())


def test_a_failing_pipeline_lowers_the_graph_as_written(monkeypatch):
    """A torch build whose oneDNN ops exist but take other arguments: a warning, no pipeline."""
    def broken(*args, **kwargs):
        raise RuntimeError("mkldnn::_reorder_convolution_weight() expected other arguments")
    monkeypatch.setattr(onednn, "available", lambda: True)
    monkeypatch.setattr(onednn.PackedConv, "__init__", broken)
    torch.manual_seed(0)
    model = randomize_bn(Block()).eval()
    x = torch.randn(2, 8, 6, 6)
    with pytest.warns(UserWarning, match="inference pipeline failed"):
        _, lm = _compile(model, x)
    assert lm.pipeline_notes == []
    with torch.no_grad():
        torch.testing.assert_close(lm(x), model(x), rtol=1e-4, atol=1e-5)


@needs_onednn
def test_layers_pack_their_weight_once_per_input_size():
    """oneDNN's convolution weight layout depends on the input size: another size is packed once
    and kept (the last few), and results stay eager's (linear layers keep one pack)."""
    torch.manual_seed(0)
    conv = PackedConv(torch.randn(16, 8, 1, 1), torch.randn(16), [1, 1], [0, 0], [1, 1], 1, (1, 8, 14, 14))
    lw = torch.randn(6, 8)
    lin = PackedLinear(lw, torch.randn(6), 4)
    sizes = [(1, 8, 14, 14), (2, 8, 7, 9), (1, 8, 5, 5), (3, 8, 2, 2), (1, 8, 3, 3), (2, 8, 7, 9), (1, 8, 30, 30)]
    with torch.no_grad():
        for shape in sizes:
            x = torch.randn(shape).contiguous(memory_format=torch.channels_last)
            torch.testing.assert_close(conv(x), F.conv2d(x, conv._dense, conv.bias), rtol=1e-4, atol=1e-5)
            first = conv.weight_for(x)
            assert conv.weight_for(x) is first            # packed once for this size
            y = torch.randn(shape[0], 5, 8)
            torch.testing.assert_close(lin(y), F.linear(y, lw, lin.bias), rtol=1e-4, atol=1e-5)
    assert conv.weight_for(torch.empty(1, 8, 14, 14)) is conv.packed   # the recorded size: the first pack
    assert len(conv._more._packs) == onednn._Packs.KEEP                 # bounded: the last few sizes


class _NormAct(nn.Module):
    """timm's BatchNormAct2d pattern: a rank assert between the conv and its norm, then an
    identity ``drop`` and the activation."""

    def __init__(self, c=8):
        super().__init__()
        self.conv = nn.Conv2d(3, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.drop = nn.Identity()
        self.act = nn.ReLU()
        self.out = nn.Dropout(0.5)

    def forward(self, x):
        y = self.conv(x)
        torch._assert(y.ndim == 4, "expected 4-D")
        return self.out(self.act(self.drop(self.bn(y))))


@needs_onednn
def test_rank_reads_and_no_op_modules_do_not_block_folding_and_fusion():
    torch.manual_seed(0)
    model = randomize_bn(_NormAct()).eval()
    x = torch.randn(2, 3, 9, 9)
    _, lm = _compile(model, x)
    notes = " ".join(lm.pipeline_notes)
    assert "1 batch norm(s) folded" in notes and "rank reads" in notes
    assert [t.post for t in _targets(lm) if isinstance(t, PackedConv)] == ["relu"]
    assert not any(n.op == "call_module" for n in lm.gm.graph.nodes)   # drop, act, out: gone or fused
    with torch.no_grad():
        torch.testing.assert_close(lm(x), model(x), rtol=1e-4, atol=1e-5)
    model.out.train()                                   # a dropout in training mode: no pipeline at all
    _, lm2 = _compile(model, x)
    assert lm2.pipeline_notes == []


def test_fold_batch_norm_ignores_metadata_reads_of_the_layer():
    from symtrace.passes.fold_bn import fold_batch_norm
    torch.manual_seed(0)
    model = randomize_bn(_NormAct()).eval()
    x = torch.randn(2, 3, 9, 9)
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    assert fold_batch_norm(gm) == 1
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1e-4, atol=1e-5)


class _Shuffle(nn.Module):
    """ShuffleNet's unit: chunk, a branch of convolutions, cat, channel shuffle."""

    def __init__(self, c=8, flatten_after=False, cat_used_twice=False):
        super().__init__()
        self.a = nn.Conv2d(c // 2, c // 2, 1)
        self.b = nn.Conv2d(c, c, 1)
        self.flatten_after = flatten_after
        self.cat_used_twice = cat_used_twice

    def forward(self, x):
        x1, x2 = x.chunk(2, dim=1)
        y = torch.cat((x1, F.relu(self.a(x2))), dim=1)
        b, c, h, w = y.size()
        joined = y
        y = y.view(b, 2, c // 2, h, w).transpose(1, 2).contiguous().view(b, -1, h, w)
        if self.flatten_after:
            return y.view(b, -1)       # needs eager's contiguous layout: no rewrite
        if self.cat_used_twice:
            return self.b(y), self.b(joined)
        return self.b(y)


@needs_onednn
def test_channel_shuffle_before_convolutions_keeps_channels_last():
    from symtrace.lower.layout_ops import ChannelShuffle, ShuffleCat
    torch.manual_seed(0)
    x = torch.randn(2, 8, 5, 5)
    model = _Shuffle().eval()
    _, lm = _compile(model, x)
    # the shuffle of the unit's cat: one ShuffleCat call (the cat and the shuffle both gone)
    targets = _targets(lm)
    assert any(isinstance(t, ShuffleCat) for t in targets) and torch.cat not in targets
    assert not any(isinstance(t, ChannelShuffle) for t in targets)
    assert any("channel shuffle" in n for n in lm.pipeline_notes)
    assert any("cat + channel shuffle" in n for n in lm.pipeline_notes)
    with torch.no_grad():
        torch.testing.assert_close(lm(x), model(x), rtol=1e-4, atol=1e-5)
    kept = _Shuffle(cat_used_twice=True).eval()   # the cat read by another op too: kept, shuffled
    _, lm3 = _compile(kept, x)
    assert any(isinstance(t, ChannelShuffle) for t in _targets(lm3))
    assert not any(isinstance(t, ShuffleCat) for t in _targets(lm3))
    with torch.no_grad():
        torch.testing.assert_close(lm3(x), kept(x), rtol=1e-4, atol=1e-5)
    flat = _Shuffle(flatten_after=True).eval()
    _, lm2 = _compile(flat, x)
    assert not any(isinstance(t, ChannelShuffle) for t in _targets(lm2))
    with torch.no_grad():
        torch.testing.assert_close(lm2(x), flat(x), rtol=1e-4, atol=1e-5)


def test_compile_pauses_the_garbage_collector_and_restores_it(monkeypatch):
    import gc

    seen = []

    class Recording(symtrace.lower.LoweredModule):
        def __init__(self, *args, **kwargs):
            seen.append(gc.isenabled())
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(symtrace.lower, "LoweredModule", Recording)
    x = torch.randn(8)
    gm = symtrace.symbolic_trace(lambda a: torch.relu(a) + 1, example_inputs=(x,))
    assert gc.isenabled()
    lm = lower(gm, (x,))
    assert seen == [False] and gc.isenabled()
    torch.testing.assert_close(lm(x), torch.relu(x) + 1)

    def fails(a):
        raise RuntimeError("user error")

    with pytest.raises(RuntimeError, match="user error"):
        lower(fails, (x,))
    assert gc.isenabled()


def _mkl_linears_on(monkeypatch):
    """Small linear layers on MKL's packed GEMM, untimed (skips where this torch has no MKL ops)."""
    from symtrace.lower import onednn
    if not onednn.mkl_available():
        pytest.skip("this torch build has no MKL linear ops")
    monkeypatch.setenv("SYMTRACE_MKL_LINEAR", "1")
    torch.manual_seed(0)


@needs_onednn
def test_small_linear_layers_can_run_mkls_packed_gemm_with_their_activation_left_to_the_kernels(monkeypatch):
    _mkl_linears_on(monkeypatch)
    model = Head().eval()
    x = torch.randn(3, 8, 6, 6)
    _, lm = _compile(model, x)
    lin = [t for t in _targets(lm) if isinstance(t, PackedLinear)]
    assert lin and all(t.mkl and t.post == "none" and t.__name__ == "mkl_linear" for t in lin)
    with torch.no_grad():
        torch.testing.assert_close(lm(x), model(x), rtol=1e-4, atol=1e-5)
        x5 = torch.randn(5, 8, 7, 7)                 # other rows than the pack's: MKL's unpacked GEMM
        torch.testing.assert_close(lm(x5), model(x5), rtol=1e-4, atol=1e-5)
    # MKL adds a bias in a pass of its own: fc1's joins the GELU kernel; fc2's result is the
    # output, stored by no kernel, so its bias goes back into its call
    code = lm.wrapper_code
    calls = [line for line in code.splitlines() if "mkl_linear" in line and " = _fn" in line]
    assert len(calls) == 2
    assert ", None)" in calls[0] and "bias fused into the next kernel" in calls[0]
    assert ", None)" not in calls[1] and "with its bias" in calls[1]


def test_the_mkl_choice_is_timed_once_per_shape_and_can_be_switched_off(monkeypatch):
    from symtrace.lower import onednn
    if not (onednn.available() and onednn.mkl_available()):
        pytest.skip("this torch build has no oneDNN or MKL linear ops")
    monkeypatch.setenv("SYMTRACE_MKL_LINEAR", "auto")
    monkeypatch.setattr(onednn, "_MKL_CHOICE", {})
    first = onednn.mkl_is_faster(16, 8, 12)
    assert list(onednn._MKL_CHOICE) == [(16, 8, 12, torch.get_num_threads())]
    assert onednn.mkl_is_faster(16, 8, 12) is first and len(onednn._MKL_CHOICE) == 1
    onednn.mkl_is_faster(1 << 13, 1 << 7, 1 << 6)                         # larger: timed too
    assert len(onednn._MKL_CHOICE) == 2
    assert onednn.mkl_is_faster(1 << 14, 1 << 9, 1 << 9) is False        # too large: oneDNN, untimed
    assert onednn.mkl_is_faster(1, 1 << 12, 1 << 13) is False            # too many weights: the same
    assert len(onednn._MKL_CHOICE) == 2
    monkeypatch.setenv("SYMTRACE_MKL_LINEAR", "1")
    assert onednn.mkl_is_faster(16, 8, 12) and not onednn.mkl_is_faster(1 << 13, 1 << 7, 1 << 6)   # (small ones only)
    monkeypatch.setenv("SYMTRACE_MKL_LINEAR", "0")
    assert onednn.mkl_is_faster(16, 8, 12) is False


class _RollsPlainState(nn.Module):
    """A plain tensor attribute (no buffer) the forward reads through a computation and
    reassigns from itself."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.state = torch.tensor([0., 1., 2., 3.])
        self.register_buffer("perm", torch.tensor([1, 2, 3, 0]), persistent=False)

    def forward(self, x):
        y = self.lin(x) + (self.state * 1)[0]
        self.state = self.state[self.perm]
        return y


def test_plain_tensor_attributes_the_graph_reads_are_in_the_state_check():
    """The pipeline folded ``self.state * 1`` from the value it saw; the state check, which
    looked at parameters and buffers only, never noticed the attribute reassigned (by the
    program, or by the user): the lowered module kept answering with the old value."""
    torch.manual_seed(0)
    model = _RollsPlainState().eval()
    x = torch.randn(2, 4)
    with torch.no_grad():
        gm = symtrace.symbolic_trace(model, example_inputs=(x,))
        lm = lower(gm, (x,), speed_check=False)
        gm.state = torch.tensor([0., 1., 2., 3.])   # (compile's recording run replayed the store)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = [round((lm(x) - model.lin(x))[0, 0].item(), 3) for _ in range(6)]
    assert got == [0.0, 1.0, 2.0, 3.0, 0.0, 1.0]


def test_a_returned_view_of_a_weight_value_is_fresh_memory_each_call():
    # eager's c = w * 2 is new at every call; the pipeline's constant folding must not hand out
    # views of one folded buffer (a caller's write to one result would reach the next call)
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.linspace(-1, 1, 16).reshape(4, 4))

        def forward(self, x):
            c = self.w * 2
            return x @ c, c[0]

    m, x = M().eval(), torch.randn(4)
    with torch.no_grad():
        low = lower(m, (x,), speed_check=False)
        low(x)[1].add_(100)
        with warnings.catch_warnings():
            warnings.simplefilter("error")     # (no "weights changed since lowering")
            for got, want in zip(low(x), m(x)):
                torch.testing.assert_close(got, want)


class _IndexCache(nn.Module):
    """timm's LeViT attention (cold): ``attention_biases[:, idxs]`` computed and cached in a dict
    on first use, then added to the scores. ``reads_back``: the program also reads a tensor it
    keeps in Python state (the graph then reads state at run time)."""

    def __init__(self, reads_back=False):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.biases = nn.Parameter(torch.randn(2, 5))
        self.register_buffer("idxs", torch.randint(0, 5, (6, 6)), persistent=False)
        self.cache = {}
        self.reads_back = reads_back
        self.seen = [torch.zeros(1)]

    def forward(self, x):
        if "cpu" not in self.cache:
            self.cache["cpu"] = self.biases[:, self.idxs]
        s = self.lin(x) @ self.lin(x).transpose(-1, -2) + self.cache["cpu"]
        if self.reads_back:
            s = s + self.seen[0]
        return s.softmax(-1)


def _index_nodes(lm):
    return [n for n in lm.gm.graph.nodes if n.op == "call_function" and n.target is operator.getitem
            and any(isinstance(a, tuple) for a in n.args)]


@pytest.mark.parametrize("reads_back", [False, True], ids=["levit", "reads state"])
def test_a_cache_filled_from_weights_is_computed_once(reads_back):
    # the replayed store keeps a reference and writes no data: the pipeline folds the value it
    # stores (the state check guards the folded tensor), unless the graph reads Python state,
    # where a stored value could come back and be written in place before that check
    torch.manual_seed(0)
    x = torch.randn(2, 6, 6)
    model = _IndexCache(reads_back).eval()
    eager = _IndexCache(reads_back).eval()
    eager.load_state_dict(model.state_dict())
    eager.idxs.copy_(model.idxs)
    with torch.no_grad():
        lm = lower(model, (x,), speed_check=False)
        for _ in range(3):
            torch.testing.assert_close(lm(x), eager(x))
    assert lm.torch_calls == 0
    assert bool(_index_nodes(lm)) == reads_back, lm.gm.graph


class _SplitHead(nn.Module):
    """One linear layer whose result leaves as three views, each read by a torch op (q, k, v)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return torch.cumsum(q, -1) + torch.cumsum(k, -1) * torch.cumsum(v, -1)


@needs_onednn
def test_views_of_a_packed_linear_read_by_torch_ops_are_not_copied(monkeypatch):
    _mkl_linears_on(monkeypatch)
    model = _SplitHead().eval()
    x = torch.randn(5, 8)
    _, lm = _compile(model, x)
    with torch.no_grad():
        torch.testing.assert_close(lm(x), model(x), rtol=1e-5, atol=1e-6)
    ks = lm._first.lowering.kernels
    # the bias goes back into the call: the three views read its result, no kernel copies them
    assert [k.nodes for k in ks if any(n.startswith(("chunk", "getitem")) for n in k.nodes)] == []
    assert "with its bias" in lm.wrapper_code
