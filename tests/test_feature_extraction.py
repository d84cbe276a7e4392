"""Feature extraction: torchvision's node names and train/eval graphs, values equal to what
forward hooks see on the same modules."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symtrace
from symtrace.passes.node_names import graph_node_names


class Block(nn.Module):
    """A torchvision BasicBlock: one ReLU module called twice, ``out += identity``."""

    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(Block(8), Block(8))
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer1(x)
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.fc(self.drop(x))


NET_NAMES = ["x", "conv1", "bn1", "relu", "layer1.0.conv1", "layer1.0.bn1", "layer1.0.relu", "layer1.0.conv2",
             "layer1.0.bn2", "layer1.0.add", "layer1.0.relu_1", "layer1.1.conv1", "layer1.1.bn1", "layer1.1.relu",
             "layer1.1.conv2", "layer1.1.bn2", "layer1.1.add", "layer1.1.relu_1", "adaptive_avg_pool2d", "flatten",
             "drop", "fc"]


def _net():
    torch.manual_seed(0)
    return Net()


def _x(n=2):
    return torch.randn(n, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def _hooked(model, paths, x, seed=0):
    """Run ``model`` eagerly; the output of each module in ``paths``, copied when it is made."""
    seen, handles = {}, []
    for p in paths:
        def hook(mod, args, out, p=p):
            seen[p] = out.clone()
        handles.append(model.get_submodule(p).register_forward_hook(hook))
    try:
        torch.manual_seed(seed)
        model(x)
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("example", [True, False], ids=["example_inputs", "symbolic"])
def test_names_follow_torchvision(example):
    model = _net()
    kw = {"example_inputs": (_x(),)} if example else {}
    train, eval_ = symtrace.get_graph_node_names(model, **kw)
    assert eval_ == NET_NAMES
    assert train == NET_NAMES


def window_op(x, k):
    """Marked with torch.fx.wrap, as torchvision marks Swin's attention: kept as one node."""
    return x.roll(k, -1) * 2


torch.fx.wrap("window_op")


class Repeats(nn.Module):
    """Function and method ops inside a submodule, repeated; a parameter read (named) and a
    buffer read (not: torch.fx makes it a constant, and computes what uses only constants,
    here flip, arange and their mul, while tracing); a module whose name ends in _<digits>
    (torchvision drops that suffix, then numbers repeats); a torch.fx.wrap'd function."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("offset", torch.zeros(4))
        self.conv_1 = nn.Linear(4, 4)
        self.conv = nn.Linear(4, 4)

    def forward(self, x):
        x = x + 1
        x = x + 1
        x = x.mean(-1, keepdim=True) * self.scale + self.offset.flip(0) * torch.arange(4.0)
        x = window_op(torch.abs(x), 1)
        return self.conv(self.conv_1(x))


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Repeats()

    def forward(self, x):
        x.device  # an attribute read nothing uses: not a node in torch.fx, so not named
        y = self.inner(x)
        a, b = y.chunk(2, dim=-1)
        return a.transpose(0, 1) + b.t()


def test_names_of_functions_methods_parameters_and_repeats():
    model = Outer()
    _, names = symtrace.get_graph_node_names(model, example_inputs=(torch.randn(2, 4),))
    assert names == ["x", "inner.add", "inner.add_1", "inner.mean", "inner.inner_scale", "inner.mul", "inner.add_2",
                     "inner.abs", "inner.window_op", "inner.conv", "inner.conv_1", "chunk", "getitem", "getitem_1",
                     "transpose", "t", "add"]
    assert window_op.__name__ == "window_op" and not hasattr(window_op, "__symtrace_leaf__")  # restored


def test_graph_node_names_skips_what_the_tracer_adds():
    """Data guards and the tuple unpacking's len() are symtrace's, not the model's."""
    class M(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # a data guard
                x = x * 2
            return x

    gm = symtrace.symbolic_trace(M(), example_inputs=(torch.ones(2),))
    names = graph_node_names(gm.graph)
    assert list(names.values()) == ["x", "sum", "gt", "mul"]
    assert any("guard" in n.name for n in gm.graph.nodes)


def test_values_equal_forward_hooks_in_both_modes():
    model = _net()
    x = _x()
    paths = ["conv1", "bn1", "layer1.0.bn1", "layer1.0.bn2", "layer1.1", "drop", "fc"]
    ext = symtrace.create_feature_extractor(model, paths, example_inputs=(x,))
    assert isinstance(ext, symtrace.GraphModule)
    for mode in (True, False):
        model.train(mode)
        ext.train(mode)
        want = _hooked(model, paths, x)
        torch.manual_seed(0)
        got = ext(x)
        assert list(got) == paths  # in graph order
        for p in paths:
            torch.testing.assert_close(got[p], want[p], rtol=0, atol=0, msg=p)


def test_prefix_selects_the_modules_last_node_and_dict_renames():
    model = _net().eval()
    x = _x()
    ext = symtrace.create_feature_extractor(model, {"layer1.1": "late", "layer1.0": "early", "relu": "stem"},
                                            example_inputs=(x,))
    got = ext(x)
    assert list(got) == ["stem", "early", "late"]
    want = _hooked(model, ["layer1.0", "layer1.1", "relu"], x)
    torch.testing.assert_close(got["early"], want["layer1.0"])
    torch.testing.assert_close(got["late"], want["layer1.1"])
    # the stem's ReLU runs once: its value, before layer1 runs
    torch.testing.assert_close(got["stem"], torch.relu(model.bn1(model.conv1(x))))


def test_graph_is_cut_after_the_last_needed_node():
    model = _net().eval()
    ext = symtrace.create_feature_extractor(model, ["layer1.0.conv2"], example_inputs=(_x(),))
    targets = [n.target for n in ext.graph.nodes if n.op == "call_module"]
    assert targets == ["conv1", "bn1", "relu", "layer1.0.conv1", "layer1.0.bn1", "layer1.0.relu",
                       "layer1.0.conv2"]
    assert not hasattr(ext, "fc")  # unused modules are not held either


def test_value_later_overwritten_in_place_is_copied():
    """``bn1`` is followed by ``nn.ReLU(inplace=True)``: asked for both, the extractor returns
    bn1's own value (torchvision's returns the ReLU'd tensor twice)."""
    model = _net().eval()
    x = _x()
    ext = symtrace.create_feature_extractor(model, ["bn1", "relu"], example_inputs=(x,))
    got = ext(x)
    want = _hooked(model, ["bn1", "relu"], x)
    assert (got["bn1"] < 0).any()
    torch.testing.assert_close(got["bn1"], want["bn1"], rtol=0, atol=0)
    torch.testing.assert_close(got["relu"], want["relu"], rtol=0, atol=0)
    # asked for bn1 alone, the in-place ReLU after it is not run at all
    only = symtrace.create_feature_extractor(model, ["bn1"], example_inputs=(x,))
    assert [n.target for n in only.graph.nodes if n.op == "call_module"] == ["conv1", "bn1"]
    torch.testing.assert_close(only(x)["bn1"], want["bn1"], rtol=0, atol=0)


class TwoWays(nn.Module):
    """Its train and eval graphs differ."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        x = self.lin(x)
        if self.training:
            x = self.drop(x) * 2
        else:
            x = x + 1
        return x.relu()


def test_train_and_eval_graphs_differ_and_switch():
    model = TwoWays().eval()
    x = torch.randn(5, 4)
    with pytest.warns(UserWarning, match="differs between training and eval"):
        train, eval_ = symtrace.get_graph_node_names(model, example_inputs=(x,))
    assert train == ["x", "lin", "drop", "mul", "relu"]
    assert eval_ == ["x", "lin", "add", "relu"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ext = symtrace.create_feature_extractor(model, train_return_nodes={"mul": "feat"},
                                                eval_return_nodes={"add": "feat"}, example_inputs=(x,),
                                                suppress_diff_warning=True)
    assert not ext.training and ext.graph is ext.eval_graph
    torch.testing.assert_close(ext(x)["feat"], model.lin(x) + 1)
    ext.train()
    assert ext.graph is ext.train_graph and model.drop.training  # the modules are shared, as in torchvision
    torch.manual_seed(3)
    got = ext(x)["feat"]
    torch.manual_seed(3)
    torch.testing.assert_close(got, model.drop(model.lin(x)) * 2)
    ext.eval()
    torch.testing.assert_close(ext(x)["feat"], model.lin(x) + 1)


def test_unknown_names_give_near_matches_and_the_other_mode():
    model = TwoWays()
    x = torch.randn(5, 4)
    with pytest.raises(ValueError, match=r"'linn' is not in the model's train-mode graph; did you mean 'lin'"):
        symtrace.create_feature_extractor(model, ["linn"], example_inputs=(x,), suppress_diff_warning=True)
    with pytest.raises(ValueError, match="'mul' is not in the model's eval-mode graph .it is in the training-mode"):
        symtrace.create_feature_extractor(model, ["mul"], example_inputs=(x,), suppress_diff_warning=True)
    with pytest.raises(ValueError, match="either return_nodes or"):
        symtrace.create_feature_extractor(model, ["lin"], train_return_nodes=["lin"], eval_return_nodes=["lin"])
    with pytest.raises(ValueError, match="give return_nodes"):
        symtrace.create_feature_extractor(model, train_return_nodes=["lin"])
    with pytest.raises(ValueError, match="output name 'a' to both"):
        symtrace.create_feature_extractor(model, {"lin": "a", "relu": "a"}, suppress_diff_warning=True)
    with pytest.raises(TypeError, match="autowrap_functions"):
        symtrace.create_feature_extractor(model, ["lin"], tracer_kwargs={"autowrap_functions": [len]})


def test_model_is_left_as_it_was():
    model = _net()
    model.layer1[0].train(False)  # mixed modes survive
    flags = {n: m.training for n, m in model.named_modules()}
    state = copy.deepcopy(model.state_dict())
    symtrace.create_feature_extractor(model, ["layer1"], example_inputs=(_x(),))
    assert flags == {n: m.training for n, m in model.named_modules()}
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=0)


class Scorer(nn.Module):
    def forward(self, x):
        return x.softmax(-1)


class WithLeaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.score = Scorer()

    def forward(self, x):
        return self.score(self.lin(x))


def test_leaf_modules():
    model = WithLeaf()
    assert symtrace.get_graph_node_names(model)[1] == ["x", "lin", "score.softmax"]
    assert symtrace.get_graph_node_names(model, leaf_modules=[Scorer])[1] == ["x", "lin", "score"]
    _, names = symtrace.get_graph_node_names(model, tracer_kwargs={"leaf_modules": [Scorer]})
    assert names == ["x", "lin", "score"]


def test_extractor_is_a_graph_module(tmp_path):
    model = _net().eval()
    x = _x()
    ext = symtrace.create_feature_extractor(model, {"layer1.0": "a", "flatten": "b"}, example_inputs=(x,))
    want = ext(x)
    assert "def forward" in ext.code and "return {'a'" in ext.code
    assert ext.graph.created_by == "create_feature_extractor"
    dup = copy.deepcopy(ext)
    for k, v in dup(x).items():
        torch.testing.assert_close(v, want[k])
    dup.train()
    assert dup.graph is dup.train_graph
    path = str(tmp_path / "ext.symtrace")
    symtrace.save(ext, path)
    loaded = symtrace.load(path)
    for k, v in loaded(x).items():
        torch.testing.assert_close(v, want[k])
    # edits apply to the mode's graph: make 'b' the flattened value doubled
    flat = next(n for n in ext.graph.nodes if n.target is torch.flatten)
    with ext.graph.inserting_after(flat):
        dbl = ext.graph.call_function(torch.mul, (flat, 2))
    ext.graph.output_node().args = ({"a": ext.graph.output_node().args[0]["a"], "b": dbl},)
    torch.testing.assert_close(ext(x)["b"], want["b"] * 2)


SHIFTS = {True: torch.full((4,), 10.0), False: torch.full((4,), -1.0)}


class ModeConstant(nn.Module):
    """Each mode's graph holds a different tensor constant under the same traced name."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) + SHIFTS[self.training]


def test_each_modes_constants_are_kept_apart():
    model = ModeConstant().eval()
    x = torch.randn(3, 4)
    ext = symtrace.create_feature_extractor(model, ["add"], example_inputs=(x,))
    targets = {g: [n.target for n in g.nodes if n.op == "get_attr"] for g in (ext.train_graph, ext.eval_graph)}
    assert len(targets[ext.train_graph]) == 1 and targets[ext.train_graph] != targets[ext.eval_graph]
    torch.testing.assert_close(ext(x)["add"], model.lin(x) - 1)
    ext.train()
    torch.testing.assert_close(ext(x)["add"], model.lin(x) + 10)


class Shared(nn.Module):
    """One block under two names: named by its first path, as torch.fx names it."""

    def __init__(self):
        super().__init__()
        self.first = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.second = self.first

    def forward(self, x):
        return self.second(self.first(x) * 2)


def test_a_shared_module_is_named_by_its_first_path():
    model = Shared()
    x = torch.randn(3, 4)
    _, names = symtrace.get_graph_node_names(model, example_inputs=(x,))
    assert names == ["x", "first.0", "first.1", "mul", "first.0_1", "first.1_1"]
    got = symtrace.create_feature_extractor(model, ["first.1_1", "mul"], example_inputs=(x,))(x)
    torch.testing.assert_close(got["first.1_1"], model(x))
    torch.testing.assert_close(got["mul"], model.first(x) * 2)
