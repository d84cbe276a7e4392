"""symtrace.serialize: round trips (graph, meta, guards, in-place ops, module hierarchy) and the
refusals that keep loading from running anything a file names."""
from __future__ import annotations

import io
import json
import os
import sys
import warnings
import zipfile

import pytest
import torch
from torch import nn

import symtrace
from symtrace import GuardError, SymtraceError, TensorMeta
from symtrace.graph.source import SourceLocation
from symtrace.serialize import SerializationError, load, register_target, save

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import soundness_programs  # noqa: E402
from soundness_programs import PROGRAMS, _call, _example, assert_same  # noqa: E402

from examples.models import build, example_inputs  # noqa: E402


def roundtrip(gm, **load_kw):
    buf = io.BytesIO()
    save(gm, buf)
    buf.seek(0)
    return load(buf, **load_kw)


def header_of(data: bytes) -> dict:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return json.loads(zf.read("symtrace.json"))


def with_header(data: bytes, doc: dict) -> bytes:
    """The archive ``data`` with its JSON header replaced by ``doc`` (blobs kept)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            body = json.dumps(doc).encode() if info.filename == "symtrace.json" else src.read(info)
            dst.writestr(info.filename, body)
    return out.getvalue()


def assert_meta_equal(a, b):
    na, nb = list(a.graph.nodes), list(b.graph.nodes)
    assert [(n.name, n.op, str(n.target)) for n in na] == [(n.name, n.op, str(n.target)) for n in nb]
    for x, y in zip(na, nb):
        assert x.meta == y.meta, x.name
        assert x.args.__repr__() == y.args.__repr__() and x.kwargs.__repr__() == y.kwargs.__repr__(), x.name


def assert_guards_equal(a, b):
    ga, gb = a.graph.guards, b.graph.guards
    assert [g.__getstate__() for g in ga] == [g.__getstate__() for g in gb]


# ----------------------------------------------------------------------------------------------
# round trips
# ----------------------------------------------------------------------------------------------
def test_public_names_and_error_class():
    assert issubclass(SerializationError, SymtraceError)
    import symtrace.serialize as ser
    assert {"save", "load", "register_target", "SerializationError"} <= set(ser.__all__)


@pytest.mark.parametrize("name", ["resnet", "transformer"])
def test_example_models_round_trip(name, tmp_path):
    model = build(name)
    x = example_inputs(name)
    gm = symtrace.symbolic_trace(model, example_inputs=x)
    path = tmp_path / f"{name}.symtrace"
    save(gm, path)
    gm2 = load(path)
    assert type(gm2) is symtrace.GraphModule and gm2 is not gm
    torch.testing.assert_close(gm2(*x), gm(*x), rtol=0, atol=0)
    assert_meta_equal(gm, gm2)
    assert_guards_equal(gm, gm2)
    assert gm2.graph.created_by == gm.graph.created_by
    assert gm2._class_name == gm._class_name and gm2.training == gm.training
    sd, sd2 = gm.state_dict(), gm2.state_dict()
    assert list(sd) == list(sd2)
    for k in sd:
        assert torch.equal(sd[k], sd2[k]) and sd[k].dtype == sd2[k].dtype, k
    assert {n for n, _ in gm.named_modules()} == {n for n, _ in gm2.named_modules()}
    for (n1, m1), (n2, m2) in zip(gm.named_modules(), gm2.named_modules()):
        assert n1 == n2 and type(m1) is type(m2) and m1.training == m2.training, n1
    gm2.graph.lint()
    assert gm2.code == gm.code  # the same graph generates the same forward


def test_source_and_module_path_meta_survive():
    gm = symtrace.symbolic_trace(build("resnet"), example_inputs=example_inputs("resnet"))
    gm2 = roundtrip(gm)
    srcs = [n.meta["source"] for n in gm2.graph.nodes if "source" in n.meta]
    assert srcs and all(type(s) is SourceLocation for s in srcs)
    assert all(s.filename.endswith("models.py") and s.lineno > 0 and s.function for s in srcs)
    paths = {n.name: n.meta.get("module_path") for n in gm2.graph.nodes}
    assert paths["add"] == "layer1.0" and paths == {n.name: n.meta.get("module_path") for n in gm.graph.nodes}
    tms = [n.meta["tensor_meta"] for n in gm2.graph.nodes if "tensor_meta" in n.meta]
    assert tms and all(type(t) is TensorMeta for t in tms)
    assert gm2.graph.nodes.__iter__().__next__().meta["tensor_meta"].shape == (2, 3, 32, 32)


def _soundness_cases():
    hooks = {"leaf_hook", "leaf_pre_hook"}
    return [pytest.param(c, id=c.name) for c in PROGRAMS if c.name not in hooks]


register_target(soundness_programs.Pair)


@pytest.mark.parametrize("case", _soundness_cases())
def test_soundness_programs_round_trip(case):
    """Traced on the first input, saved and loaded: the loaded module answers every input as the
    original does (same values, same in-place effects on inputs and buffers, same GuardErrors)."""
    model = case.make()
    if case.random:
        torch.default_generator.manual_seed(100)
    gm = symtrace.symbolic_trace(model, example_inputs=_example(model, case.inputs[0]))
    gm2 = roundtrip(gm)
    assert_meta_equal(gm, gm2)
    assert_guards_equal(gm, gm2)
    for i, inp in enumerate(case.inputs):
        results = []
        for g in (gm, gm2):
            torch.default_generator.manual_seed(i)
            try:
                results.append(("ok",) + _call(g, inp))
            except GuardError:
                results.append(("guard",))
            except Exception as e:  # noqa: BLE001 - must then fail the same way
                results.append(("raised", type(e)))
        assert results[0][0] == results[1][0], f"{case.name} input {i}: {results[0][0]} vs {results[1][0]}"
        if results[0][0] == "ok":
            assert_same(results[1][1], results[0][1], f"{case.name} input {i}")
            assert_same(results[1][2], results[0][2], f"{case.name} input {i} (inputs after the call)")
        elif results[0][0] == "raised":
            assert results[0][1] is results[1][1]
        for (k, v), (k2, v2) in zip(gm.state_dict().items(), gm2.state_dict().items()):
            assert k == k2 and torch.equal(v, v2), f"{case.name} input {i}: buffer {k}"


def test_hooks_are_refused_on_save_unless_traced_inline():
    case = next(c for c in PROGRAMS if c.name == "leaf_hook")
    model = case.make()
    example = _example(model, case.inputs[0])
    # a module declared a leaf keeps its hooks, which a file cannot hold
    gm = symtrace.symbolic_trace(model, example_inputs=example, leaf_modules=(torch.nn.Linear,))
    with pytest.raises(SerializationError, match="hooks"):
        save(gm, io.BytesIO())
    # by default a torch layer's hooks are traced inline: their computation is part of the graph
    gm = symtrace.symbolic_trace(model, example_inputs=example)
    buf = io.BytesIO()
    save(gm, buf)
    buf.seek(0)
    assert torch.equal(load(buf)(*example), model(*example))


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps.add_(1)
        x.mul_(2)
        return x + self.steps


def test_in_place_ops_survive():
    gm = symtrace.symbolic_trace(InPlace(), example_inputs=(torch.ones(3),))
    gm2 = roundtrip(gm)
    assert [n.target for n in gm2.graph.nodes if n.op == "call_method"] == ["add_", "mul_"]
    gm2.graph.eliminate_dead_code(module=gm2)
    assert [n.target for n in gm2.graph.nodes if n.op == "call_method"] == ["add_", "mul_"]
    x = torch.ones(3)
    out = gm2(x)
    assert torch.equal(x, torch.full((3,), 2.0)), "x.mul_(2) must still write into the input"
    assert torch.equal(out, torch.full((3,), 3.0))
    gm2(torch.ones(3))
    assert gm2.steps.item() == 2.0 and gm.steps.item() == 0.0, "the loaded buffer is its own copy"


class ShapeBranch(nn.Module):
    def forward(self, x):
        if x.shape[0] > 2:
            return x * 2
        return x - 1


def test_guards_still_checked_after_load():
    gm = symtrace.symbolic_trace(ShapeBranch(), example_inputs=(torch.randn(4, 3),))
    gm2 = roundtrip(gm)
    assert torch.equal(gm2(torch.ones(5, 3)), torch.full((5, 3), 2.0))
    with pytest.raises(GuardError, match="x.shape\\[0\\] > 2"):
        gm2(torch.ones(2, 3))
    with pytest.raises(GuardError):
        gm2(torch.ones(4, 3, dtype=torch.float64))
    with pytest.raises(GuardError, match="test_serialize.py"):
        gm2(torch.ones(1, 3))


def test_data_guards_still_checked_after_load():
    gm = symtrace.symbolic_trace(soundness_programs.DataBranch(), example_inputs=(torch.ones(3),))
    gm2 = roundtrip(gm)
    assert any(n.target.__name__ == "check_data_guard" for n in gm2.graph.nodes if n.op == "call_function")
    assert torch.equal(gm2(torch.ones(3)), torch.full((3,), 2.0))
    with pytest.raises(GuardError):
        gm2(-torch.ones(3))


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = 3
        self.flag = True

    def forward(self, x):
        if self.flag:
            x = x * self.scale
        return x


def test_module_attribute_guards_survive():
    gm = symtrace.symbolic_trace(Scaled(), example_inputs=(torch.ones(2),))
    gm2 = roundtrip(gm)
    assert gm2.scale == 3 and gm2.flag is True
    assert torch.equal(gm2(torch.ones(2)), torch.full((2,), 3.0))
    gm2.flag = False
    with pytest.raises(GuardError, match="flag"):
        gm2(torch.ones(2))


class Leaves(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.ln = nn.LayerNorm(4)
        self.lin = nn.Linear(4, 8)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.emb = nn.Embedding(10, 8)
        self.enc = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x, ids):
        h = self.bn(self.conv(x))                      # (B, 4, H, W)
        h = h.flatten(2).transpose(1, 2)               # (B, HW, 4)
        h = self.act(self.lin(self.ln(h)))             # (B, HW, 8)
        a, _ = self.mha(h, h, h)
        o, _ = self.lstm(a)
        return self.enc(o + self.emb(ids))


def test_leaf_modules_rebuilt_compute_the_same():
    torch.manual_seed(0)
    model = Leaves().eval()
    x, ids = torch.randn(2, 3, 2, 2), torch.randint(0, 10, (2, 4))
    gm = symtrace.symbolic_trace(model, example_inputs=(x, ids))
    gm2 = roundtrip(gm)
    torch.testing.assert_close(gm2(x, ids), model(x, ids), rtol=0, atol=0)
    for name in ("conv", "bn", "ln", "lin", "mha", "lstm", "emb", "enc", "act"):
        a, b = getattr(model, name), getattr(gm2, name)
        assert type(a) is type(b), name
        plain = {k: v for k, v in vars(a).items()
                 if not k.startswith("_") and not isinstance(v, (nn.Module, torch.Tensor))}
        assert plain == {k: vars(b)[k] for k in plain}, name
    assert gm2.lstm._flat_weights[0] is gm2.lstm.weight_ih_l0  # RNN weight lists alias the parameters
    assert type(gm2.mha.out_proj).__name__ == "NonDynamicallyQuantizableLinear"
    x2, ids2 = torch.randn(2, 3, 2, 2), torch.randint(0, 10, (2, 4))
    torch.testing.assert_close(gm2.lstm(gm2.lin(torch.randn(2, 4, 4)))[0].shape, torch.Size([2, 4, 8]))
    torch.testing.assert_close(gm2(x2, ids2), model(x2, ids2), rtol=0, atol=0)
    gm2.train()  # training-mode batch norm updates the rebuilt module's own buffers
    before = gm2.bn.running_mean.clone()
    gm2.bn(torch.randn(2, 4, 2, 2))
    assert not torch.equal(before, gm2.bn.running_mean)
    assert gm2.bn.num_batches_tracked.item() == 1


OFFSETS = torch.tensor([1.0, 2.0, 3.0, 4.0])


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight
        self.register_buffer("evens", torch.arange(8.0)[::2])  # a strided view into a bigger storage
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x):
        return self.b(self.a(x)) + self.evens + OFFSETS  # a tensor constant


def test_tied_weights_views_constants_and_non_persistent_buffers():
    gm = symtrace.symbolic_trace(Tied(), example_inputs=(torch.randn(2, 4),))
    gm.register_buffer("scratch", torch.ones(2), persistent=False)
    gm2 = roundtrip(gm)
    assert gm2.a.weight is gm2.b.weight and isinstance(gm2.a.weight, nn.Parameter)
    assert gm2.a.weight.requires_grad
    assert gm2.evens.stride() == (2,) and gm2.evens.storage_offset() == 0
    assert torch.equal(gm2.evens, torch.tensor([0.0, 2.0, 4.0, 6.0]))
    assert "scratch" not in gm2.state_dict() and torch.equal(gm2.scratch, torch.ones(2))
    consts = [n.target for n in gm2.graph.nodes if n.op == "get_attr" and n.target.startswith("_tensor_constant")]
    assert consts and torch.equal(getattr(gm2, consts[0]), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    x = torch.randn(2, 4)
    torch.testing.assert_close(gm2(x), gm(x), rtol=0, atol=0)
    loss = gm2(x).sum()
    loss.backward()
    assert gm2.a.weight.grad is not None


def test_dtypes_round_trip():
    gm = symtrace.symbolic_trace(nn.Identity().__class__(), example_inputs=(torch.ones(1),))
    dtypes = [torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int32, torch.int64,
              torch.bool, torch.complex64]
    for i, dt in enumerate(dtypes):
        gm.register_buffer(f"b{i}", (torch.arange(6) % 2).to(dt).reshape(2, 3).t())
    gm.register_buffer("empty", torch.zeros(0, 3))
    gm2 = roundtrip(gm)
    for i, dt in enumerate(dtypes):
        a, b = getattr(gm, f"b{i}"), getattr(gm2, f"b{i}")
        assert b.dtype == dt and b.stride() == a.stride() and torch.equal(a, b), dt
    assert gm2.empty.shape == (0, 3)


def test_qparams_and_extra_meta_kept_unserialisable_meta_dropped_with_one_warning():
    gm = symtrace.symbolic_trace(ShapeBranch(), example_inputs=(torch.randn(4, 3),))
    nodes = list(gm.graph.nodes)
    tm = nodes[1].meta["tensor_meta"]
    scale = torch.tensor([0.1, 0.2, 0.3])
    nodes[1].meta["tensor_meta"] = TensorMeta(tm.shape, tm.dtype, tm.device, tm.stride, tm.requires_grad,
                                              {"scale": scale, "zero_point": 3, "axis": 1, "dtype": torch.qint8})
    nodes[1].meta["note"] = {"tags": ["a", "b"], "pair": (1, 2.5), "int_keys": {1: "x"}, "nan": float("nan")}
    nodes[1].meta["callback"] = lambda: None
    nodes[2].meta["callback"] = object()
    nodes[2].meta["lock"] = __import__("threading").Lock()
    gm.meta["opaque"] = object()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buf = io.BytesIO()
        save(gm, buf)
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 1, msgs
    assert "'callback' (2 nodes)" in msgs[0] and "'lock'" in msgs[0] and "opaque" in msgs[0]
    buf.seek(0)
    gm2 = load(buf)
    n1 = list(gm2.graph.nodes)[1]
    q = n1.meta["tensor_meta"].qparams
    assert torch.equal(q["scale"], scale) and q["zero_point"] == 3 and q["dtype"] is torch.qint8
    note = n1.meta["note"]
    assert note["tags"] == ["a", "b"] and note["pair"] == (1, 2.5) and note["int_keys"] == {1: "x"}
    assert note["nan"] != note["nan"]
    assert "callback" not in n1.meta and "lock" not in list(gm2.graph.nodes)[2].meta
    assert "opaque" not in gm2.meta and gm2.meta["trace_notes"] == gm.meta["trace_notes"]


def test_split_module_nested_graph_modules_round_trip():
    from symtrace.passes import split_module
    model = build("resnet")
    x = example_inputs("resnet")
    gm = symtrace.symbolic_trace(model, example_inputs=x)
    parts = split_module(gm, lambda n: 0 if (n.meta.get("module_path") or "").startswith(("stem", "layer1")) else 1)
    parts2 = roundtrip(parts)
    assert isinstance(parts2.submod_0, symtrace.GraphModule) and isinstance(parts2.submod_1, symtrace.GraphModule)
    torch.testing.assert_close(parts2(*x), gm(*x), rtol=0, atol=0)
    assert_meta_equal(parts.submod_1, parts2.submod_1)


def test_file_path_file_object_and_map_location(tmp_path):
    gm = symtrace.symbolic_trace(Tied(), example_inputs=(torch.randn(2, 4),))
    p = tmp_path / "m.st"
    save(gm, str(p))
    with open(p, "rb") as f:
        gm2 = load(f, map_location="cpu")
    assert gm2.a.weight.device.type == "cpu"
    with pytest.raises(SerializationError, match="map_location"):
        load(p, map_location="not a device")
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "missing.st")
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")], "no temporary files left behind"


# ----------------------------------------------------------------------------------------------
# registered targets
# ----------------------------------------------------------------------------------------------
@symtrace.leaf_function
def clamp_twice(x, lo):
    return x.clamp(lo, 2 * abs(lo) + 1)


@symtrace.leaf_function
def never_registered(x):
    return x.abs()


class UsesLeafFn(nn.Module):
    def forward(self, x):
        return clamp_twice(x, -0.5)


class UsesUnregistered(nn.Module):
    def forward(self, x):
        return never_registered(x)


class MyBlock(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n))
        self.mode = "scale"

    def forward(self, x):
        return x * self.w if self.mode == "scale" else x + self.w


class WithCustomLeaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = MyBlock(3)

    def forward(self, x):
        return self.block(x).relu()


class NeverRegisteredBlock(MyBlock):
    pass


def test_unregistered_function_and_module_class_are_refused_on_save_with_advice():
    gm = symtrace.symbolic_trace(UsesUnregistered(), example_inputs=(torch.randn(3),))
    with pytest.raises(SerializationError, match=r"node 'never_registered'.*never_registered.*register_target"):
        roundtrip(gm)
    model = WithCustomLeaf()
    model.block = NeverRegisteredBlock(3)
    gm = symtrace.symbolic_trace(model, example_inputs=(torch.randn(3),), leaf_modules=(MyBlock,))
    with pytest.raises(SerializationError, match=r"module 'block'.*NeverRegisteredBlock.*register_target"):
        roundtrip(gm)


def test_registered_function_and_module_class_round_trip():
    register_target(clamp_twice, name="tests.serialize.clamp_twice")
    gm = symtrace.symbolic_trace(UsesLeafFn(), example_inputs=(torch.randn(3),))
    x = torch.randn(5) * 3
    assert torch.equal(roundtrip(gm)(x), gm(x))

    gm = symtrace.symbolic_trace(WithCustomLeaf(), example_inputs=(torch.randn(3),), leaf_modules=(MyBlock,))
    register_target(MyBlock, name="tests.serialize.MyBlock")
    gm2 = roundtrip(gm)
    assert type(gm2.block) is MyBlock and gm2.block.mode == "scale"
    assert torch.equal(gm2(x[:3]), gm(x[:3]))


def test_register_target_rejects_bad_names_and_clashes():
    with pytest.raises(ValueError):
        register_target(lambda x: x, name="torch.relu")  # a built-in name for another object
    with pytest.raises(ValueError):
        register_target(lambda x: x)  # '<lambda>' is not a dotted name
    with pytest.raises(ValueError):
        register_target(len, name="os.__dict__")
    with pytest.raises(TypeError):
        register_target(3)
    register_target("my_method")
    with pytest.raises(ValueError):
        register_target("__reduce__")


class Holder:
    pass


class WithObjectAttr(nn.Module):
    def forward(self, x):
        return x + 1


def test_module_state_that_cannot_be_represented_is_refused():
    gm = symtrace.symbolic_trace(WithObjectAttr(), example_inputs=(torch.ones(2),))
    gm.holder = Opaque()
    with pytest.raises(SerializationError, match=r"attribute 'holder'.*Opaque.*register_target"):
        save(gm, io.BytesIO())
    del gm.holder
    gm.fn = lambda x: x
    with pytest.raises(SerializationError, match="attribute 'fn'"):
        save(gm, io.BytesIO())
    del gm.fn
    gm.register_buffer("meta_buf", torch.empty(3, device="meta"))
    with pytest.raises(SerializationError, match="meta tensor"):
        save(gm, io.BytesIO())
    with pytest.raises(SerializationError, match="GraphModule"):
        save(nn.Linear(2, 2), io.BytesIO())


class Opaque:
    pass


def test_identity_guard_on_an_opaque_input_is_refused_on_save():
    def f(x, cfg):
        return x + 1
    gm = symtrace.symbolic_trace(f, example_inputs=(torch.ones(2), Opaque()))
    with pytest.raises(SerializationError, match=r"guard.*Opaque"):
        save(gm, io.BytesIO())


def test_registered_plain_object_attribute_round_trips():
    gm = symtrace.symbolic_trace(WithObjectAttr(), example_inputs=(torch.ones(2),))
    h = Holder()
    h.size, h.names = 4, ("a", "b")
    gm.holder = h
    register_target(Holder, name="tests.serialize.Holder")
    gm2 = roundtrip(gm)
    assert type(gm2.holder) is Holder and gm2.holder.size == 4 and gm2.holder.names == ("a", "b")


# ----------------------------------------------------------------------------------------------
# refusals on load (hand-edited headers; random mutations are in test_serialize_fuzz.py)
# ----------------------------------------------------------------------------------------------
class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.randn(3))

    def forward(self, x):
        if x.shape[0] > 2:
            return x * 2 + self.w
        return x - 1


@pytest.fixture(scope="module")
def saved():
    torch.manual_seed(0)
    gm = symtrace.symbolic_trace(WithBuffer(), example_inputs=(torch.randn(4, 3),))
    buf = io.BytesIO()
    save(gm, buf)
    return buf.getvalue()


def _graph(doc):
    return doc["modules"][doc["root"]]["graph"]


def _first(doc, op):
    return next(n for n in _graph(doc)["nodes"] if n["op"] == op)


def _edit_and_load(data, edit):
    doc = header_of(data)
    edit(doc)
    return load(io.BytesIO(with_header(data, doc)))


HOSTILE = {
    "os.system target": (lambda d: _first(d, "call_function").update(target="os.system"), "os.system"),
    "__import__ target": (lambda d: _first(d, "call_function").update(target="__import__"), "__import__"),
    "eval target": (lambda d: _first(d, "call_function").update(target="eval"), "allow-list"),
    "torch.load target": (lambda d: _first(d, "call_function").update(target="torch.load"), "torch.load"),
    "dunder method": (lambda d: _first(d, "call_function").update(op="call_method", target="__reduce_ex__"),
                      "__reduce_ex__"),
    "getattr of a dunder": (lambda d: _first(d, "call_function").update(
        target="getattr", args=[{"$node": 0}, "__class__"]), "dunder"),
    # version-1 files stored guards as text, converted into trees on load (never evaluated)
    "guard calls __import__": (lambda d: _legacy_guard(d, "__import__('os').system('echo hi')"), "guard expression"),
    "guard reads a dunder": (lambda d: _legacy_guard(d, "x.__class__.__init__"), "start with '__'"),
    "guard lambda": (lambda d: _legacy_guard(d, "(lambda: 1) == x"), "Lambda is not allowed"),
    "guard comment": (lambda d: _legacy_guard(d, "x # comment"), "comment"),
    "guard sys.modules call": (lambda d: _legacy_guard(d, "sys.modules['os'].system('x')"), "system"),
    "guard sorted key": (lambda d: _legacy_guard(d, "sorted([x], key=sys.modules['os'].system)"), "keyword"),
    "guard text in a version-2 file": (lambda d: _graph(d)["guards"][0].update(expr="x.shape[0]"), "must be a list"),
    # version 2: trees, rebuilt through the checking constructors
    "guard tree reads a dunder": (lambda d: _graph(d)["guards"][0].update(expr=["attr", ["input", "x"], "__class__"]),
                                  "start with '__'"),
    "guard tree calls sorted": (lambda d: _graph(d)["guards"][0].update(
        expr=["call", "sorted", [["input", "x"]]]), "cannot call 'sorted'"),
    "guard tree calls a method": (lambda d: _graph(d)["guards"][0].update(
        expr=["method", ["input", "x"], "untyped_storage", []]), "cannot call the method"),
    "guard tree reads an unknown input": (lambda d: _graph(d)["guards"][0].update(expr=["input", "os"]),
                                          "not an input"),
    "guard tree const callable": (lambda d: _graph(d)["guards"][0].update(expr=["const", {"$ref": "print"}]),
                                  "constant"),
    "guard bad check": (lambda d: _graph(d)["guards"][0].update(check="exec"), "check"),
    "ref to os.system": (lambda d: _graph(d)["guards"][0].update(expected={"$ref": "os.system"}), "os.system"),
    "module class subprocess": (lambda d: d["modules"][0].update({"class": "subprocess.Popen"}), "subprocess.Popen"),
    "node name injection": (lambda d: _first(d, "call_function").update(name="x = __import__('os')"), "node name"),
    "kwarg name injection": (lambda d: _first(d, "call_function").update(kwargs={"a=1) or print('x'": 1}),
                             "keyword argument"),
    "placeholder injection": (lambda d: _first(d, "placeholder").update(target="x, y=print('hi')"), "input name"),
    "source with newline": (lambda d: _graph(d)["sources"].__setitem__(0, ["f.py\nimport os", 1, "f"]),
                            "line break"),
    "forward node reference": (lambda d: _first(d, "call_function").update(args=[{"$node": 10 ** 6}, 2]),
                               "earlier node"),
    "unknown tag": (lambda d: _first(d, "call_function").update(args=[{"$pickle": "gASV"}]), "tag"),
    "huge shape": (lambda d: d["tensors"][0].update(shape=[2 ** 40]), "storage holds"),
    "huge 2-d shape": (lambda d: d["tensors"][0].update(shape=[2 ** 40, 2 ** 20], stride=[1, 1]), "storage holds"),
    "rank mismatch": (lambda d: d["tensors"][0].update(shape=[3, 1]), "same length"),
    "negative offset": (lambda d: d["tensors"][0].update(offset=-4), "offset"),
    "blob overrun": (lambda d: d["tensors"][0].update(offset=2), "storage holds"),
    "stride overrun": (lambda d: d["tensors"][0].update(stride=[100]), "storage holds"),
    "nbytes mismatch": (lambda d: d["storages"][0].update(nbytes=10 ** 12), "bytes"),
    "unknown dtype": (lambda d: d["tensors"][0].update(dtype="object"), "dtype"),
    "bad device": (lambda d: d["storages"][0].update(device="cuda:0; rm -rf /"), "device"),
    "missing module target": (lambda d: d["modules"][0]["buffers"].clear(), "does not hold"),
    "newer version": (lambda d: d.update(version=99), "newer symtrace"),
    "not our format": (lambda d: d.update(format="something.else"), "not a symtrace file"),
    "module cycle": (lambda d: d["modules"][0]["modules"].update(loop=0), "cycle"),
    "output not last": (lambda d: _graph(d)["nodes"].append(dict(_first(d, "placeholder"), name="late")),
                        "output node must be the last"),
    "attribute overwrites internals": (lambda d: d["modules"][0]["attributes"].update(_parameters=1),
                                       "attribute name"),
}


def _legacy_guard(doc, text):
    doc["version"] = 1
    _graph(doc)["guards"][0]["expr"] = text


@pytest.mark.parametrize("edit,match", list(HOSTILE.values()), ids=list(HOSTILE))
def test_hostile_headers_are_refused(saved, edit, match, tmp_path, monkeypatch):
    called = []
    monkeypatch.setattr(os, "system", lambda *a: called.append(a) or 0)
    with pytest.raises(SerializationError, match=match):
        _edit_and_load(saved, edit)
    assert not called


def test_refusal_message_names_target_and_how_to_register(saved):
    def edit(doc):
        _first(doc, "call_function")["target"] = "mypkg.ops.fused"
    with pytest.raises(SerializationError) as info:
        _edit_and_load(saved, edit)
    msg = str(info.value)
    assert "mypkg.ops.fused" in msg and "register_target" in msg


def test_not_a_zip_and_compressed_headers_are_refused(saved):
    with pytest.raises(SerializationError, match="not a zip"):
        load(io.BytesIO(b"not a zip at all"))
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(saved)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    with pytest.raises(SerializationError, match="compressed"):
        load(io.BytesIO(out.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        dst.writestr("other.txt", "hi")
    with pytest.raises(SerializationError, match="no 'symtrace.json'"):
        load(io.BytesIO(out.getvalue()))


def test_load_path_has_no_pickle_eval_or_torch_load():
    import ast
    import pathlib
    root = pathlib.Path(symtrace.__file__).parent / "serialize"
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | {
            n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        torch_load = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "load"
                      and isinstance(n.value, ast.Name) and n.value.id == "torch"]
        assert not {"pickle", "marshal", "dill", "shelve"} & imported, path
        assert not {"eval", "exec", "compile", "__import__"} & calls, path
        assert not torch_load, path


class _HoldsTensorList(nn.Module):
    def __init__(self):
        super().__init__()
        self.kept = [torch.ones(3)]   # tensors in a plain list: read when the graph runs

    def forward(self, x):
        return x * self.kept[0]


def test_a_graph_reading_a_plain_list_of_tensors_is_refused_with_a_reason():
    # (describing the read_state node as a side effect raised IndexError instead)
    gm = symtrace.symbolic_trace(_HoldsTensorList(), example_inputs=(torch.randn(3),))
    with pytest.raises(SerializationError, match="reads Python state holding tensors at run time.*buffers"):
        save(gm, io.BytesIO())
