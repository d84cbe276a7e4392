"""Damaged and hostile files: every mutation of a real saved file either loads or raises
SerializationError - never another exception, never a crash, never a call of something the
file names. Mutations: bit flips, truncation, byte insertion, and edits of the JSON header
(random values anywhere; call targets, module classes and guards naming dangerous code;
tensor records with huge shapes, negative offsets and strides that overrun their blob)."""
from __future__ import annotations

import builtins
import io
import json
import os
import zipfile

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

import symtrace
from symtrace.serialize import FORMAT_VERSION, SerializationError, load, save
from symtrace.serialize.allowlist import METHOD_NAMES

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                            HealthCheck.function_scoped_fixture])
CONST = torch.tensor([0.5, -1.0, 2.0])


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.bn = nn.BatchNorm1d(3).eval()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.scale = 2

    def forward(self, x):
        self.steps.add_(1)
        h = self.bn(self.lin(x)) * self.scale + CONST
        if x.shape[0] > 1:
            h = h.relu()
        if h.sum() > -1e9:  # a data guard
            h = h + 1
        return h.mul_(2)


def _saved() -> bytes:
    torch.manual_seed(0)
    gm = symtrace.symbolic_trace(Model(), example_inputs=(torch.randn(4, 3),))
    buf = io.BytesIO()
    save(gm, buf)
    return buf.getvalue()


DATA = _saved()
with zipfile.ZipFile(io.BytesIO(DATA)) as _zf:
    DOC = json.loads(_zf.read("symtrace.json"))
    BLOBS = {i.filename: _zf.read(i) for i in _zf.infolist() if i.filename != "symtrace.json"}
X = torch.randn(4, 3)


@pytest.fixture(autouse=True)
def no_shell(monkeypatch):
    """Fail loudly if anything tries os.system / os.popen / subprocess while loading."""
    import subprocess
    ran = []

    def record(*a, **k):
        ran.append(a)
        raise RuntimeError("blocked by the test")
    for mod, name in ((os, "system"), (os, "popen"), (subprocess, "Popen"), (subprocess, "run")):
        monkeypatch.setattr(mod, name, record)
    yield
    assert not ran, f"a loaded file ran commands: {ran}"


def _pack(doc=None, blobs=None) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        zf.writestr("symtrace.json", json.dumps(DOC if doc is None else doc))
        for name, body in (BLOBS if blobs is None else blobs).items():
            zf.writestr(name, body)
    return out.getvalue()


def _load_or_refuse(data: bytes):
    """Load ``data``: a GraphModule, or None when refused with SerializationError. Any other
    exception fails the test. A module that loads is called once (it may raise, but only as
    ordinary Python errors from running the graph)."""
    try:
        gm = load(io.BytesIO(data))
    except SerializationError as e:
        assert str(e).startswith("cannot load"), str(e)
        return None
    assert isinstance(gm, symtrace.GraphModule)
    try:
        gm(X.clone())
    except Exception:  # noqa: BLE001 - a mutated graph may compute something invalid; it must not crash
        pass
    return gm


def test_unmutated_file_loads():
    gm = _load_or_refuse(DATA)
    assert gm is not None and torch.equal(gm.lin.weight, gm.lin.weight)
    assert _load_or_refuse(_pack()) is not None  # re-zipping by hand keeps it loadable


# --- raw byte mutations -----------------------------------------------------------------------
@SETTINGS
@given(st.lists(st.tuples(st.integers(0, len(DATA) - 1), st.integers(0, 7)), min_size=1, max_size=4))
def test_bit_flips(flips):
    data = bytearray(DATA)
    for pos, bit in flips:
        data[pos] ^= 1 << bit
    _load_or_refuse(bytes(data))


@SETTINGS
@given(st.integers(0, len(DATA) - 1))
def test_truncation(n):
    assert _load_or_refuse(DATA[:n]) is None


@SETTINGS
@given(st.integers(0, len(DATA)), st.binary(min_size=1, max_size=16))
def test_byte_insertion(pos, extra):
    _load_or_refuse(DATA[:pos] + extra + DATA[pos:])


# --- header edits -----------------------------------------------------------------------------
def _slots(doc):
    """Every (container, key) in the JSON document, in a stable order."""
    out, stack = [], [doc]
    while stack:
        c = stack.pop()
        keys = list(c) if isinstance(c, dict) else range(len(c)) if isinstance(c, list) else ()
        for k in keys:
            out.append((c, k))
            stack.append(c[k])
    return out


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False)
                    | st.text(max_size=12) | st.sampled_from(["$node", "$ref", "os.system", "__import__", "x", "cpu"]),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(
                        st.text(max_size=6) | st.sampled_from(["$node", "$ref", "$tensor", "$tuple", "$guard"]),
                        c, max_size=2), max_leaves=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_header_edits(data):
    doc = json.loads(json.dumps(DOC))
    slots = _slots(doc)
    for _ in range(data.draw(st.integers(1, 3))):
        container, key = slots[data.draw(st.integers(0, len(slots) - 1))]
        if data.draw(st.booleans()) and isinstance(container, dict):
            container.pop(key, None)
        else:
            try:
                container[key] = data.draw(JSON)
            except (IndexError, KeyError):
                pass
    _load_or_refuse(_pack(doc))


DANGEROUS_TARGETS = ["os.system", "posix.system", "subprocess.Popen", "builtins.__import__", "__import__",
                     "eval", "exec", "compile", "open", "torch.load", "torch.hub.load", "torch.ops.load_library",
                     "torch.from_file", "torch.compile", "operator.attrgetter", "operator.methodcaller",
                     "importlib.import_module", "torch.nn.modules.conv.os.system", "torch._C._jit_pass_inline",
                     "pickle.loads", "torch.save", "sys.exit", "type", "setattr", "globals", "vars",
                     "torch.ops.aten.add.Tensor.__call__", "torch.Tensor.__reduce_ex__", "breakpoint"]
DANGEROUS_GUARDS = ["__import__('os').system('x')", "x.__class__", "x.__class__.__subclasses__()",
                    "(lambda: 0)()", "eval('1')", "[c for c in ()]", "sys.exit()", "sys.modules['os'].system('x')",
                    "getattr(x, '__class__')", "x.shape[0] > 1 # comment", "x.shape[0]\n> 1", "open('/etc/passwd')",
                    "x.apply_(print)", "root.__dict__", "torch.load('f')", "globals()", "x if x else x",
                    "(y := 1)", "f'{x}'", "torch.ops.load_library('x')"]


def _nodes(doc):
    return doc["modules"][doc["root"]]["graph"]["nodes"]


@SETTINGS
@given(st.sampled_from(DANGEROUS_TARGETS), st.sampled_from(["call_function", "call_method", "call_module",
                                                             "get_attr"]), st.data())
def test_dangerous_call_targets_are_refused(target, op, data):
    assume(not (op == "call_method" and target in METHOD_NAMES))  # e.g. Tensor.type(dtype) is a tensor method
    doc = json.loads(json.dumps(DOC))
    calls = [n for n in _nodes(doc) if n["op"] not in ("placeholder", "output")]
    node = calls[data.draw(st.integers(0, len(calls) - 1))]
    node["op"], node["target"] = op, target
    node.setdefault("args", [{"$node": 0}, "x"])
    assert _load_or_refuse(_pack(doc)) is None


@SETTINGS
@given(st.sampled_from(DANGEROUS_TARGETS), st.sampled_from(["ref", "class", "namedtuple", "object", "enum"]))
def test_dangerous_references_in_values_and_module_classes_are_refused(target, where):
    doc = json.loads(json.dumps(DOC))
    node = next(n for n in _nodes(doc) if n["op"] == "call_function")
    if where == "ref":
        node["args"] = [{"$ref": target}] + list(node.get("args", []))[1:]
    elif where == "class":
        doc["modules"][1]["class"] = target
    elif where == "namedtuple":
        node["args"] = [{"$namedtuple": [target, ["rm -rf /"]]}]
    elif where == "object":
        doc["modules"][0]["attributes"]["scale"] = {"$object": [target, {"x": 1}]}
    else:
        doc["modules"][0]["attributes"]["scale"] = {"$enum": [target, "x"]}
    assert _load_or_refuse(_pack(doc)) is None


@SETTINGS
@given(st.sampled_from(DANGEROUS_GUARDS) | st.text(max_size=30).map(lambda s: f"__import__('os') or {s}"),
       st.sampled_from(["eq", "is", "bool", "isinstance", "type"]), st.sampled_from([1, FORMAT_VERSION]))
def test_dangerous_guard_expressions_are_refused(expr, check, version):
    """As text (version 1 stored guards as text, converted on load) or in place of a tree."""
    doc = json.loads(json.dumps(DOC))
    doc["version"] = version
    guards = doc["modules"][doc["root"]]["graph"]["guards"]
    guards[0]["expr"] = expr
    guards[-1]["check"] = check
    assert _load_or_refuse(_pack(doc)) is None


def _tensor_records(doc):
    return [t for t in doc["tensors"]]


INTS = st.integers(-2 ** 63, 2 ** 63) | st.integers(-3, 40)


@SETTINGS
@given(st.data())
def test_tensor_records_cannot_reach_outside_their_blob(data):
    doc = json.loads(json.dumps(DOC))
    recs = _tensor_records(doc)
    rec = recs[data.draw(st.integers(0, len(recs) - 1))]
    field = data.draw(st.sampled_from(["shape", "stride", "offset", "storage", "dtype", "nbytes"]))
    if field in ("shape", "stride"):
        rec[field] = data.draw(st.lists(INTS, max_size=5))
    elif field == "offset":
        rec["offset"] = data.draw(INTS)
    elif field == "storage":
        rec["storage"] = data.draw(INTS)
    elif field == "dtype":
        rec["dtype"] = data.draw(st.sampled_from(["float64", "complex128", "int8", "bool", "object", "qint8", ""]))
    else:
        doc["storages"][rec["storage"]]["nbytes"] = data.draw(INTS)
    gm = _load_or_refuse(_pack(doc))
    if gm is not None:  # every tensor it holds lies inside its own storage
        for t in list(gm.parameters()) + list(gm.buffers()):
            if t.numel():
                end = t.storage_offset() + sum((s - 1) * st_ for s, st_ in zip(t.shape, t.stride())) + 1
                assert end * t.element_size() <= t.untyped_storage().nbytes()


@SETTINGS
@given(st.sampled_from(sorted(BLOBS)), st.integers(0, 64), st.booleans())
def test_blob_size_mismatches_are_refused(name, cut, grow):
    blobs = dict(BLOBS)
    body = blobs[name]
    assume(cut > 0 or grow)
    blobs[name] = body + b"\0" * (cut or 1) if grow else body[:max(0, len(body) - cut)]
    assert _load_or_refuse(_pack(blobs=blobs)) is None


def _pack_raw(text: str) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        zf.writestr("symtrace.json", text)
        for k, v in BLOBS.items():
            zf.writestr(k, v)
    return out.getvalue()


@pytest.mark.parametrize("depth", [150, 5000, 100_000])
def test_deep_nesting_is_refused_cleanly(depth):
    doc = json.loads(json.dumps(DOC))
    next(n for n in _nodes(doc) if n["op"] == "call_function")["args"] = ["DEEP"]
    for wrap in (("[", "]"), ('{"$tuple": [', "]}")):
        text = json.dumps(doc).replace('"DEEP"', wrap[0] * depth + "1" + wrap[1] * depth)
        assert _load_or_refuse(_pack_raw(text)) is None


def test_huge_numbers_are_refused_cleanly():
    assert f'"version": {FORMAT_VERSION}' in json.dumps(DOC)
    text = json.dumps(DOC).replace(f'"version": {FORMAT_VERSION}', '"version": ' + "9" * 5000)
    assert _load_or_refuse(_pack_raw(text)) is None
    text = json.dumps(DOC).replace('"offset": 0', '"offset": 1e400', 1)
    assert _load_or_refuse(_pack_raw(text)) is None


def test_builtins_untouched():
    """Loading hostile files must not have replaced anything in builtins."""
    before = dict(vars(builtins))
    for target in DANGEROUS_TARGETS:
        doc = json.loads(json.dumps(DOC))
        next(n for n in _nodes(doc) if n["op"] == "call_function")["target"] = target
        _load_or_refuse(_pack(doc))
    assert {k: v for k, v in vars(builtins).items() if k != "_"} == {k: v for k, v in before.items() if k != "_"}
