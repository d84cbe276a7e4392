"""merge_conv_branches: summed convolution branches of one input (RepVGG, MobileOne, a position
encoding's ``conv(x) + x``) become one convolution; everything else is left alone; shared
state is never changed; the lowering's pipeline merges only inputs it checks for NaN/Inf."""
from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

import symtrace
from symtrace.passes.fold_bn import fold_batch_norm
from symtrace.passes.merge_branches import merge_conv_branches
from model_helpers import randomize_bn


def _randomize_bn(model):
    return randomize_bn(model, seed=3).eval()


def _merge(model, *inputs, fold=True, inputs_finite=None):
    gm = symtrace.symbolic_trace(model, example_inputs=inputs)
    before = copy.deepcopy(model.state_dict())
    if fold:
        fold_batch_norm(gm)
    merged = merge_conv_branches(gm, inputs_finite)
    gm.graph.lint()
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
    for name, t in model.state_dict().items():   # the user's model is untouched
        assert torch.equal(t, before[name]), name
    return merged, gm


def _convs(gm):
    return [n for n in gm.graph.nodes if n.target is F.conv2d or
            n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Conv2d)]


def _adds(gm):
    return [n for n in gm.graph.nodes if n.target in (operator.add, operator.iadd, torch.add)]


class RepVggBlock(nn.Module):
    """timm's RepVggBlock in eval mode: 3x3 conv + BN, 1x1 conv + BN, identity BN, summed."""

    def __init__(self, c=8, stride=1, identity=True):
        super().__init__()
        self.kxk = nn.Sequential(nn.Conv2d(c, c, 3, stride, 1, bias=False), nn.BatchNorm2d(c))
        self.one = nn.Sequential(nn.Conv2d(c, c, 1, stride, 0, bias=False), nn.BatchNorm2d(c))
        self.identity = nn.BatchNorm2d(c) if identity else None
        self.act = nn.ReLU()

    def forward(self, x):
        y = self.one(x) + self.kxk(x)
        if self.identity is not None:
            y += self.identity(x)
        return self.act(y)


class MobileOneDw(nn.Module):
    """MobileOne's depthwise block: dw 3x3 + BN, dw 1x1 + BN, identity BN or the number 0."""

    def __init__(self, c=8, identity=True):
        super().__init__()
        self.identity = nn.BatchNorm2d(c) if identity else None
        self.scale = nn.Sequential(nn.Conv2d(c, c, 1, groups=c, bias=False), nn.BatchNorm2d(c))
        self.kxk = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        identity = self.identity(x) if self.identity is not None else 0
        out = self.scale(x) + identity
        out += self.kxk(x)
        return F.relu(out)


@pytest.mark.parametrize("identity", [True, False])
def test_repvgg_block_becomes_one_convolution(identity):
    torch.manual_seed(0)
    model = _randomize_bn(RepVggBlock(identity=identity))
    merged, gm = _merge(model, torch.randn(2, 8, 9, 9))
    assert len(merged) == 1
    assert len(_convs(gm)) == 1 and not _adds(gm)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in gm.modules())   # folded or merged, then dropped
    conv = _convs(gm)[0]
    assert conv.target is F.conv2d and conv.name.endswith("_merged")


@pytest.mark.parametrize("identity", [True, False])
def test_mobileone_depthwise_block_with_a_number_term(identity):
    torch.manual_seed(0)
    model = _randomize_bn(MobileOneDw(identity=identity))
    merged, gm = _merge(model, torch.randn(1, 8, 7, 7))
    assert len(merged) == 1 and len(_convs(gm)) == 1 and not _adds(gm)
    w = gm.get_parameter(_convs(gm)[0].args[1].target)
    assert tuple(w.shape) == (8, 1, 3, 3)


class PosEnc(nn.Module):
    """CoaT's / PVT's convolutional position encoding: ``dwconv(x) + x``."""

    def __init__(self, c=8):
        super().__init__()
        self.proj = nn.Conv2d(c, c, 3, 1, 1, groups=c)

    def forward(self, x):
        return self.proj(x) + x


def test_a_convolution_plus_its_input():
    torch.manual_seed(0)
    merged, gm = _merge(PosEnc().eval(), torch.randn(2, 8, 5, 6), fold=False)
    assert len(merged) == 1 and len(_convs(gm)) == 1 and not _adds(gm)
    assert not hasattr(gm, "proj")   # (the module nothing reads any more is dropped from the graph module)


class Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.w5 = nn.Parameter(torch.randn(6, 4, 5, 5) * 0.1)
        self.w3 = nn.Parameter(torch.randn(6, 4, 3, 3) * 0.1)
        self.b3 = nn.Parameter(torch.randn(6))
        self.w_other = nn.Parameter(torch.randn(6, 4, 1, 1))

    def forward(self, x, y):
        a = F.conv2d(x, self.w5, None, 1, "same", 2)          # taps -4..4 step 2
        b = torch.add(F.conv2d(x, self.w3, self.b3, padding=2, dilation=2), 1.5)
        return (a + b).add(F.conv2d(y, self.w_other))          # y: another input, left as it is


def test_functional_convolutions_dilated_with_numbers_and_other_terms():
    torch.manual_seed(0)
    merged, gm = _merge(Functional().eval(), torch.randn(1, 4, 11, 11), torch.randn(1, 4, 11, 11), fold=False)
    assert len(merged) == 1
    convs = _convs(gm)
    assert len(convs) == 2 and sum(n.name.endswith("_merged") for n in convs) == 1
    assert len(_adds(gm)) == 1


class NotMergeable(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(4, 4, 3, 1, 1)
        self.b = nn.Conv2d(4, 4, 3, 2, 1)                 # another stride
        self.c = nn.Conv2d(4, 4, 3, 1, 1, padding_mode="reflect")
        self.d = nn.Conv2d(4, 4, 1)
        self.e = nn.Conv2d(4, 4, 2, 1, 1, dilation=2)      # taps -1, 1: off g's grid (-2, 0, 2)
        self.f = nn.Conv2d(4, 4, 3, 1, 1)
        self.g = nn.Conv2d(4, 4, 3, 1, 2, dilation=2)
        self.h = nn.Conv2d(4, 1, 3, 1, 1)

    def forward(self, x):
        s1 = self.a(x)[:, :, ::2, ::2] + self.b(x)          # the convolution's result sliced first
        s2 = self.c(x) + self.d(x)
        d = self.d(x)
        s3 = self.a(x) + d                                   # d is read twice (below)
        s4 = self.f(x) + self.h(x)                           # broadcast over channels
        s5 = self.g(x) + self.e(x)
        return s1, s2, s3 + d, s4, s5


def test_what_does_not_merge_is_left_alone():
    torch.manual_seed(0)
    merged, gm = _merge(NotMergeable().eval(), torch.randn(1, 4, 8, 8), fold=False)
    assert merged == []
    assert len(_convs(gm)) == 10


class InPlaceIntoInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, 1, 1)

    def forward(self, x):
        x += self.conv(x)     # writes the caller's tensor: an effect the merge would drop
        return x


def test_an_in_place_add_into_the_input_is_left_alone():
    model = InPlaceIntoInput().eval()
    gm = symtrace.symbolic_trace(model, example_inputs=(torch.randn(1, 4, 5, 5),))
    assert merge_conv_branches(gm) == []


def test_inputs_finite_decides_per_input():
    torch.manual_seed(0)
    model = _randomize_bn(RepVggBlock())
    asked = []
    merged, gm = _merge(model, torch.randn(1, 8, 6, 6), inputs_finite=lambda x: asked.append(x.name) or False)
    assert merged == [] and asked == ["x"]
    assert len(_convs(gm)) == 2


@settings(max_examples=30, deadline=None)
@given(k1=st.sampled_from([1, 3, 5]), k2=st.sampled_from([1, 3]), dilation=st.sampled_from([1, 2]),
       stride=st.sampled_from([1, 2]), groups=st.sampled_from([1, 2, 4]), bias=st.booleans(),
       identity=st.booleans(), size=st.integers(3, 9), seed=st.integers(0, 2 ** 16))
def test_merged_convolution_matches_the_sum(k1, k2, dilation, stride, groups, bias, identity, size, seed):
    torch.manual_seed(seed)
    c = 4

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = nn.Conv2d(c, c, k1, stride, dilation * (k1 - 1) // 2, dilation, groups, bias)
            self.q = nn.Conv2d(c, c, k2, stride, dilation * (k2 - 1) // 2, dilation, groups, bias)
            self.bn = nn.BatchNorm2d(c)

        def forward(self, x):
            y = self.p(x) + self.q(x)
            return y + self.bn(x) if identity and stride == 1 else y

    model = _randomize_bn(M())
    merged, gm = _merge(model, torch.randn(2, c, size, size), fold=False)
    assert len(merged) == 1 and len(_convs(gm)) == 1


class ViewInPlace(nn.Module):
    """In-place adds into a view: the write must reach the tensor viewed (and the caller's
    input, in the second form)."""

    def __init__(self, into_input=False):
        super().__init__()
        self.into_input = into_input
        self.c0, self.c1, self.c2 = nn.Conv2d(8, 16, 1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1)

    def forward(self, x):
        if self.into_input:
            v = x.view(x.shape)
            v += self.c1(x)
            v += self.c2(x)
            return v
        big = self.c0(x)
        v = big[:, :8]
        v += self.c1(x)
        v += self.c2(x)
        return big


class WrittenBetween(nn.Module):
    """The branches' input is written between them: each must read it as it was then."""

    def __init__(self, itself=False, read_first=False):
        super().__init__()
        self.itself, self.read_first = itself, read_first
        self.c0, self.c1, self.c2 = nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1)

    def forward(self, x):
        h = self.c0(x)
        if self.read_first:   # (the sum's term h itself is read before the write)
            s = h + 1.0
            h.relu_()
            return s + self.c1(h)
        a = self.c1(h)
        if self.itself:
            h.mul_(2)
            return a + h
        h.relu_()
        return a + self.c2(h)


@pytest.mark.parametrize("model", [ViewInPlace(), ViewInPlace(True), WrittenBetween(), WrittenBetween(True),
                                   WrittenBetween(read_first=True)],
                         ids=["into-a-view", "into-the-input", "input-written", "input-itself-written",
                              "input-read-by-the-sum-first"])
def test_writes_are_never_dropped_or_moved(model):
    torch.manual_seed(0)
    model.eval()
    x = torch.randn(1, 8, 6, 6)
    gm = symtrace.symbolic_trace(model, example_inputs=(x.clone(),))
    assert merge_conv_branches(gm) == []
    with torch.no_grad():
        a, b = x.clone(), x.clone()
        torch.testing.assert_close(gm(a), model(b))
        torch.testing.assert_close(a, b)


class LongChain(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.c, self.n = nn.Conv2d(2, 2, 1), n

    def forward(self, x, y):
        acc = self.c(x)
        for _ in range(self.n):
            acc += y
        return acc


def test_a_long_chain_of_in_place_adds_does_not_recurse():
    x, y = torch.randn(1, 2, 3, 3), torch.randn(1, 2, 3, 3)
    model = LongChain(1500).eval()
    gm = symtrace.symbolic_trace(model, example_inputs=(x, y))
    assert merge_conv_branches(gm) == []
    from symtrace.lower import compile as lower
    lm = lower(model, (x, y), speed_check=False)
    torch.testing.assert_close(lm(x, y), model(x, y))
