"""fold_batch_norm: conv/linear + batch norm folding, eval mode only, never touching shared state."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symtrace
from symtrace.passes.fold_bn import BatchNormFoldError, fold_batch_norm
from model_helpers import randomize_bn

from examples.models import build, example_inputs


def _snapshot(model):
    return {k: (v, v.detach().clone()) for k, v in model.state_dict(keep_vars=True).items()}


def _assert_untouched(model, snap):
    now = model.state_dict(keep_vars=True)
    assert now.keys() == snap.keys()
    for k, (obj, val) in snap.items():
        assert now[k] is obj, f"{k} was replaced"
        assert torch.equal(now[k], val), f"{k} was modified"


def _bn_nodes(gm):
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.modules.batchnorm._BatchNorm):
            out.append(n)
        if n.op == "call_function" and n.target in (F.batch_norm, torch.batch_norm):
            out.append(n)
    return out


@pytest.mark.parametrize("with_examples", [True, False])
def test_resnet_all_batch_norms_folded(with_examples):
    model = randomize_bn(build("resnet"))
    x = example_inputs("resnet")
    snap = _snapshot(model)
    with torch.no_grad():
        want = model(*x)
    gm = symtrace.symbolic_trace(model, example_inputs=x if with_examples else None)
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert fold_batch_norm(gm) == n_bn == 15
    gm.graph.lint()
    assert not _bn_nodes(gm)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in gm.modules())
    assert not any(k.endswith(("running_mean", "running_var")) for k in gm.state_dict())
    assert {n.target for n in gm.graph.nodes if n.op == "call_module" and "conv" in n.target} == {
        f"layer{i}.{j}.conv{k}_bn_folded" for i in (1, 2, 3) for j in (0, 1) for k in (1, 2)}
    with torch.no_grad():
        torch.testing.assert_close(gm(*x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(*x), want, rtol=0, atol=0)
    _assert_untouched(model, snap)
    # the user's modules are not re-parented or renamed either
    assert isinstance(model.layer1[0].bn1, nn.BatchNorm2d) and not hasattr(model.layer1[0], "conv1_bn_folded")
    assert fold_batch_norm(gm) == 0  # nothing left
    # the folded module copies and pickles like any GraphModule
    gm2 = copy.deepcopy(gm)
    with torch.no_grad():
        torch.testing.assert_close(gm2(*x), want, rtol=1e-5, atol=1e-5)


class SharedConv(nn.Module):
    """One conv module called twice: once followed by batch norm, once not."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        a = self.bn(self.conv(x))
        b = self.conv(x).relu()
        return a + b


def test_shared_conv_module_stays_correct():
    model = randomize_bn(SharedConv().eval())
    x = torch.randn(2, 3, 8, 8)
    snap = _snapshot(model)
    want = model(x)
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    assert fold_batch_norm(gm) == 1
    gm.graph.lint()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert targets == ["conv_bn_folded", "conv"]
    assert gm.conv is model.conv and gm.conv_bn_folded is not model.conv
    assert not hasattr(gm, "bn")
    torch.testing.assert_close(gm(x), want, rtol=1e-5, atol=1e-5)
    _assert_untouched(model, snap)


class Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 3, 3, 3))
        self.b = nn.Parameter(torch.randn(6))
        self.conv = nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(6)
        self.bn_plain = nn.BatchNorm2d(6, affine=False)
        self.register_buffer("mean", torch.randn(6))
        self.register_buffer("var", torch.rand(6) + 0.5)

    def forward(self, x):
        # F.conv2d with get_attr weights + F.batch_norm on plain buffers (no affine)
        a = F.batch_norm(F.conv2d(x, self.w, self.b, padding=1), self.mean, self.var, None, None,
                         False, 0.1, 1e-3)
        # conv module without bias + F.batch_norm reading a module's state
        b = F.batch_norm(self.conv(x), self.bn.running_mean, self.bn.running_var, self.bn.weight,
                         self.bn.bias, training=False, eps=self.bn.eps)
        # F.conv2d without bias + BatchNorm module without affine
        c = self.bn_plain(F.conv2d(x, self.w, None, 1, 1))
        # torch.batch_norm (other argument order)
        d = torch.batch_norm(F.conv2d(x, self.w, padding=1), self.bn.weight, self.bn.bias, self.mean,
                             self.var, False, 0.1, 1e-5, False)
        return a + b + c + d


def test_functional_batch_norm_forms():
    model = randomize_bn(Functional().eval())
    x = torch.randn(2, 3, 7, 7)
    snap = _snapshot(model)
    want = model(x)
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    assert len(_bn_nodes(gm)) == 4
    assert fold_batch_norm(gm) == 4
    gm.graph.lint()
    assert not _bn_nodes(gm)
    # the shared weight ``w`` feeds three convs: each gets its own folded copy
    folded = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    assert len(folded) == 6 and all("bn_folded" in t for t in folded), folded
    torch.testing.assert_close(gm(x), want, rtol=1e-5, atol=1e-5)
    _assert_untouched(model, snap)


class Variety(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(4, 6, 3, groups=2, bias=False)
        self.b1 = nn.BatchNorm1d(6)
        self.c3 = nn.Conv3d(2, 4, 3, dilation=1, padding=1, groups=2)
        self.b3 = nn.BatchNorm3d(4, affine=False)
        self.dw = nn.Conv2d(4, 4, 3, groups=4, padding=2, dilation=2, padding_mode="reflect")
        self.b2 = nn.BatchNorm2d(4)
        self.fc = nn.Linear(5, 7)
        self.bfc = nn.BatchNorm1d(7)
        self.fc3 = nn.Linear(5, 4)
        self.bfc3 = nn.BatchNorm1d(4)   # on a 3-D result: normalizes dim 1, not the features
        self.w = nn.Parameter(torch.randn(3, 5))
        self.bl = nn.BatchNorm1d(3)

    def forward(self, x1, x3, x2, v, v3):
        return (self.b1(self.c1(x1)).sum() + self.b3(self.c3(x3)).sum() + self.b2(self.dw(x2)).sum(),
                self.bfc(self.fc(v)), self.bfc3(self.fc3(v3)), self.bl(F.linear(v, self.w)))


def test_conv_kinds_grouped_no_affine_linear():
    model = randomize_bn(Variety().eval())
    inputs = (torch.randn(2, 4, 9), torch.randn(2, 2, 5, 5, 5), torch.randn(2, 4, 6, 6),
              torch.randn(8, 5), torch.randn(3, 4, 5))
    snap = _snapshot(model)
    want = model(*inputs)
    gm = symtrace.symbolic_trace(model, example_inputs=inputs)
    # everything but Linear + BatchNorm1d on a 3-D result
    assert fold_batch_norm(gm) == 5
    gm.graph.lint()
    assert [n.target for n in _bn_nodes(gm)] == ["bfc3"]
    for got, exp in zip(gm(*inputs), want):
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-4)
    _assert_untouched(model, snap)
    # without tensor metadata, Linear + BatchNorm1d is left alone (the rank is unknown)
    symbolic = symtrace.symbolic_trace(model)
    assert fold_batch_norm(symbolic) == 3
    assert sorted(n.target for n in _bn_nodes(symbolic)) == ["bfc", "bfc3", "bl"]
    for got, exp in zip(symbolic(*inputs), want):
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-4)


class ConvUsedTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.bn = nn.BatchNorm2d(4)
        self.bn_batch = nn.BatchNorm2d(4, track_running_stats=False)
        self.conv2 = nn.Conv2d(3, 4, 1)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y, self.bn_batch(self.conv2(x))


def test_not_folded_when_not_exact():
    model = randomize_bn(ConvUsedTwice().eval())
    x = torch.randn(2, 3, 4, 4)
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    before = str(gm.graph)
    assert fold_batch_norm(gm) == 0  # conv output also used directly; batch-statistics BN
    assert str(gm.graph) == before


class TrainBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x)).relu()


def test_training_mode_is_refused_with_source_line():
    model = TrainBN().train()
    x = torch.randn(2, 3, 6, 6)
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    before = str(gm.graph)
    with pytest.raises(BatchNormFoldError) as err:
        fold_batch_norm(gm)
    msg = str(err.value)
    assert "'bn'" in msg and "training mode" in msg
    assert "test_fold_bn.py:" in msg and "return self.bn(self.conv(x)).relu()" in msg
    assert "call model.eval() before tracing/folding" in msg.lower()
    assert str(gm.graph) == before  # nothing changed
    # after model.eval() the same GraphModule (which shares the modules) folds
    model.eval()
    assert fold_batch_norm(gm) == 1
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)


def test_functional_training_true_is_refused():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 3, 1, 1))
            self.register_buffer("m", torch.zeros(4))
            self.register_buffer("v", torch.ones(4))

        def forward(self, x):
            return F.batch_norm(F.conv2d(x, self.w), self.m, self.v, training=True)

    gm = symtrace.symbolic_trace(M(), example_inputs=(torch.randn(2, 3, 4, 4),))
    with pytest.raises(BatchNormFoldError, match=r"'batch_norm'.*test_fold_bn.py:\d+"):
        fold_batch_norm(gm)


def test_unused_training_batch_norm_is_kept():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("rm", torch.zeros(3))
            self.register_buffer("rv", torch.ones(3))

        def forward(self, x):
            F.batch_norm(x, self.rm, self.rv, training=True)  # called for its effect
            return x + 1

    x = torch.randn(4, 3)
    eager, traced = M(), M()
    gm = symtrace.symbolic_trace(traced, example_inputs=(x,))
    eager(x)
    gm(x)
    torch.testing.assert_close(traced.rm, eager.rm)


class LinearNormThroughView(nn.Module):
    """timm's LeViT ``LinearNorm`` (``bn(linear(x).flatten(0, 1)).reshape_as(x)``) and variants
    around it: reshape/functional forms fold; a view that moves the features out of the last
    dim, a flattened result read elsewhere and a reshape_as reading the view do not."""

    def __init__(self):
        super().__init__()
        self.l1, self.b1 = nn.Linear(6, 5), nn.BatchNorm1d(5)
        self.l2, self.b2 = nn.Linear(6, 5), nn.BatchNorm1d(5)
        self.w3 = nn.Parameter(torch.randn(4, 6))
        self.b3 = nn.BatchNorm1d(4)
        self.l4, self.b4 = nn.Linear(6, 4), nn.BatchNorm1d(8)   # (2, 4, 4) -> (4, 8): channels are not features
        self.l5, self.b5 = nn.Linear(6, 5), nn.BatchNorm1d(5)   # flattened result also read directly
        self.l6, self.b6 = nn.Linear(6, 5), nn.BatchNorm1d(5)   # the layer's result also read directly

    def forward(self, x):
        y1 = self.l1(x)
        a = self.b1(y1.flatten(0, 1)).reshape_as(y1)
        b = self.b2(torch.reshape(self.l2(x), (-1, 5)))
        c = self.b3(F.linear(x, self.w3).view(-1, 4))
        d = self.b4(self.l4(x).reshape(4, 8))
        f5 = self.l5(x).flatten(0, 1)
        e = self.b5(f5) + f5
        y6 = self.l6(x)
        g = self.b6(y6.flatten(0, 1)) + y6.sum()
        return a, b, c, d, e, g


def test_linear_norm_through_a_flattening_view():
    model = randomize_bn(LinearNormThroughView().eval())
    x = torch.randn(2, 4, 6)
    with torch.no_grad():
        want = model(x)
    snap = _snapshot(model)
    gm = symtrace.symbolic_trace(model, example_inputs=(x,))
    assert fold_batch_norm(gm) == 3
    gm.graph.lint()
    assert sorted(n.target for n in _bn_nodes(gm)) == ["b4", "b5", "b6"]
    with torch.no_grad():
        got = gm(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    _assert_untouched(model, snap)
    # without shapes, the view's effect on the channels is unknown: nothing through a view folds
    assert fold_batch_norm(symtrace.symbolic_trace(model)) == 0


@pytest.mark.parametrize("view", [lambda y: y.reshape(y.shape[0], -1), lambda y: y.flatten(1),
                                  lambda y: y.view(3, -1)])
def test_a_view_sized_by_the_example_is_not_folded(view):
    # these have C columns only for inputs like the example: at (3, 2, 6) eager's batch norm
    # raises, and a folded graph would have returned an un-normalized (3, 10) (found in review)
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l, self.bn = nn.Linear(6, 5), nn.BatchNorm1d(5)

        def forward(self, x):
            return self.bn(view(self.l(x)))

    m = randomize_bn(M().eval())
    gm = symtrace.symbolic_trace(m, example_inputs=(torch.randn(3, 1, 6),))
    assert fold_batch_norm(gm) == 0
